"""install.sh on an H200-like box, for real and offline (issue 24 item 1).

The image's ``python3`` is itself a venv (uv-made GPU images) holding a torch; its base
interpreter holds none. nvidia-smi says driver 580 and an H200, so the decision is "keep the
image's torch". pip runs with ``PIP_NO_INDEX=1`` and a local wheel folder made here from this
interpreter's own installed packages (tests/fakes/wheels.py) that holds no torch and no
torchvision: were pip ever to want one, the install would fail. It must:

- build a venv that imports exactly the image's torch (its stand-in), checked before pip runs;
- install the agent and its dependencies into the venv, whose own packages win over the image's
  (the image holds an old psutil the agent does not accept: pip installs its own, and that one
  is what the venv imports);
- change nothing when run again, and still see the image's torch;
- never import torch to decide or to check (the stand-in logs every import);
- not run pip at all the second time (the stamp of the last install matches; pip's own log,
  ``PIP_LOG``, stays as it was), and run it again once pyproject.toml changed.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.fakes import wheels
from tests.fakes.image_torch import image_venv, write_dist, write_torch

#: One worker builds this file's fixture (a real install) and runs every test using it (the
#: fixture is the session's, so tests of other files that the worker runs in between do not
#: make it build again, as a module's fixture would);
#: the README's test command distributes with `--dist loadfile`.
pytestmark = pytest.mark.xdist_group("install_image")

REPO_ROOT = Path(__file__).resolve().parent.parent
INSTALL = REPO_ROOT / "install.sh"
AGENT_REQUIREMENTS = [
    r
    for r in md.requires("libreyolo-agent") or ()
    if Requirement(r).marker is None  # the base ones, not [dev] or [train]
]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def offline_env(bin_dir: Path, image_python: Path, venv: Path, wheels_dir: Path) -> dict[str, str]:
    """install.sh's environment on the box: no index, the local wheels, the fake nvidia-smi
    first on PATH, PyTorch's index unreachable, none of this machine's pip settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PIP_", "TORCH_", "LIBREYOLO_", "VIRTUAL_ENV", "PYTHON"))
    }
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        PYTHON=str(image_python),
        VENV=str(venv),
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(wheels_dir),
        PIP_NO_CACHE_DIR="1",
        PIP_CONFIG_FILE=os.devnull,
        TORCH_INDEX_BASE=f"http://127.0.0.1:{closed_port()}/whl",
    )
    return env


def h200_bin(bin_dir: Path) -> Path:
    """A folder holding an nvidia-smi that answers as driver 580 on an H200."""
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(
        '#!/bin/sh\necho "580.82.07, NVIDIA H200, 9.0"\n', encoding="utf-8"
    )
    (bin_dir / "nvidia-smi").chmod(0o755)
    return bin_dir


def install(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """install.sh run once, as the box runs it."""
    return subprocess.run(
        ["/bin/bash", str(INSTALL)], capture_output=True, text=True, env=env, timeout=1200
    )


def install_twice(env: dict[str, str]) -> list[subprocess.CompletedProcess[str]]:
    """install.sh run twice (the second boot), each run passing."""
    runs = []
    for _ in range(2):
        runs.append(install(env))
        assert runs[-1].returncode == 0, out(runs[-1])[-4000:]
    return runs


def snapshot(venv: Path) -> dict[str, tuple[int, int]]:
    found = {}
    for path in venv.rglob("*"):
        if path.is_file() and not path.is_symlink() and "__pycache__" not in path.parts:
            st = path.stat()
            found[str(path.relative_to(venv))] = (st.st_size, st.st_mtime_ns)
    return found


def site_of(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def wheel_folder(found: Path) -> Path:
    """The box's wheel folder: the agent's dependencies (this interpreter's, repacked) and a
    stand-in libreyolo requiring the torch it does (no torch in it). No setuptools: the agent's
    build backend is in its own tree (buildsys/)."""
    found.mkdir()
    for name in wheels.closure(AGENT_REQUIREMENTS):
        wheels.repack(name, found)
    torch_reqs = [
        r for r in md.requires("libreyolo") or () if Requirement(r).name in ("torch", "torchvision")
    ]
    assert len(torch_reqs) == 2, torch_reqs
    wheels.standin("libreyolo", md.version("libreyolo"), torch_reqs, found)
    return found


@pytest.fixture(scope="session")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """The image venv, the wheel folder, a fake nvidia-smi, and install.sh run twice."""
    root = tmp_path_factory.mktemp("h200")
    imports = root / "torch-imports.log"
    image_python = image_venv(root / "image", import_log=imports)
    image_site = site_of(image_python)
    # An old psutil in the image: the agent needs >= 5.9, so pip installs its own in the venv.
    write_dist(image_site, "psutil", "5.0.0", {"psutil/__init__.py": "__version__ = '5.0.0'\n"})

    found = wheel_folder(root / "wheels")
    assert not list(found.glob("torch*")), "the wheel folder must hold no torch"

    bin_dir = root / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(  # answers as a real one does: the header table, or the query's CSV
        f'#!/bin/sh\necho "$*" >>"{root}/smi-calls"\n'
        'case "$*" in\n'
        '  *--query-gpu=*) echo "580.82.07, NVIDIA H200, 9.0" ;;\n'
        '  *) echo "| NVIDIA-SMI 580.82.07   Driver Version: 580.82.07   CUDA Version: 13.0 |"\n'
        "     echo '| GPU  Name  Persistence-M |' ;;\n"
        "esac\n",
        encoding="utf-8",
    )
    smi.chmod(0o755)
    venv = root / "venv"
    # A copy of the project: the third run changes its pyproject.toml.
    project = root / "project"
    project.mkdir()
    for name in ("install.sh", "pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, project / name)
    for folder in ("agent", "buildsys"):
        shutil.copytree(
            REPO_ROOT / folder, project / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    pip_log = root / "pip.log"
    env = offline_env(bin_dir, image_python, venv, found)
    env["PIP_LOG"] = str(pip_log)  # pip appends to it at every run
    runs, snaps, logged = [], [], []
    for n in range(3):
        if n == 2:
            with open(project / "pyproject.toml", "a", encoding="utf-8") as f:
                f.write("# changed since the last install\n")
        proc = subprocess.run(
            ["/bin/bash", str(project / "install.sh")],
            capture_output=True,
            text=True,
            env=env,
            cwd=root,
            timeout=1200,
        )
        runs.append(proc)
        logged.append(pip_log.read_text(encoding="utf-8") if pip_log.exists() else "")
        if proc.returncode != 0:
            break
        snaps.append(snapshot(venv))
    imported = imports.read_text(encoding="utf-8") if imports.exists() else ""
    yield {
        "imported": imported,
        "root": root,
        "image_site": image_site,
        "venv": venv,
        "runs": runs,
        "snaps": snaps,
        "logged": logged,
        "env": env,
    }
    shutil.rmtree(root, ignore_errors=True)


def out(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


@pytest.mark.timeout(2400)
def test_the_image_torch_is_kept_and_seen_from_the_new_venv(box: dict[str, object]) -> None:
    runs = box["runs"]
    assert isinstance(runs, list)
    first = runs[0]
    assert first.returncode == 0, out(first)[-4000:]
    image_site = box["image_site"]
    text = out(first)
    assert "keeping the image's torch - the image's torch 2.11.0+cu130 (CUDA 13.0)" in text
    # Seen before pip ran, from the image venv's own site-packages (not its base's).
    assert f"the venv sees torch 2.11.0+cu130 (CUDA 13.0) in {image_site}" in text
    assert text.index("the venv sees torch") < text.index("installing libreyolo-agent")
    assert "Downloading" not in text and "installing torch" not in text
    venv = box["venv"]
    assert isinstance(venv, Path)
    venv_site = site_of(venv / "bin" / "python")
    assert not (venv_site / "torch").exists() and not list(venv_site.glob("torch-*"))
    assert (venv_site / "_libreyolo_image_torch.pth").read_text() == f"{image_site}\n"
    probe = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import torch, torchvision, psutil; "
            "print(torch.__file__); print(torch.version.cuda); print(psutil.__file__)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    torch_file, cuda, psutil_file = probe.stdout.splitlines()
    assert (Path(str(box["root"])) / "torch-imports.log").exists()  # the stand-in logs imports
    assert Path(torch_file).parent == Path(str(image_site)) / "torch" and cuda == "13.0"
    # The venv's own packages come first: pip's psutil, not the image's old one.
    assert Path(psutil_file).is_relative_to(venv_site), psutil_file
    version = subprocess.run(
        [str(venv / "bin" / "libreyolo-agent"), "--version"], capture_output=True, text=True
    )
    assert version.returncode == 0 and "libreyolo-agent" in version.stdout
    # Neither the decision nor the closing check imported torch (in either run).
    assert box["imported"] == "", box["imported"]
    calls = (Path(str(box["root"])) / "smi-calls").read_text().splitlines()
    query = "--query-gpu=driver_version,name,compute_cap --format=csv,noheader"
    assert calls == [query] * len(runs)  # one nvidia-smi call per install.sh run


@pytest.mark.timeout(2400)
def test_a_second_run_changes_nothing_and_still_sees_the_torch(box: dict[str, object]) -> None:
    runs, snaps = box["runs"], box["snaps"]
    assert isinstance(runs, list) and isinstance(snaps, list)
    assert len(runs) >= 2 and runs[1].returncode == 0, out(runs[1])[-4000:]
    second = out(runs[1])
    assert (
        "keeping the image's torch" in second and "already installed, nothing to change" in second
    )
    assert f"torch 2.11.0+cu130 (CUDA 13.0) in {box['image_site']}" in second
    assert snaps[0] == snaps[1], "the second install changed the venv"
    # The stamp matched: pip never ran (its log is as the first run left it).
    assert "(as recorded in " in second
    logged = box["logged"]
    assert isinstance(logged, list) and logged[0] and logged[1] == logged[0]
    # The first run built the agent with its in-tree backend: no build dependencies, and no
    # setuptools anywhere (the wheel folder holds none, the venv and the image neither).
    assert "Successfully installed" in logged[0] and "libreyolo-agent" in logged[0]
    assert "Installing build dependencies" not in logged[0]


@pytest.mark.timeout(2400)
def test_a_changed_pyproject_runs_pip_again(box: dict[str, object]) -> None:
    runs, logged = box["runs"], box["logged"]
    assert isinstance(runs, list) and isinstance(logged, list)
    assert len(runs) == 3 and runs[2].returncode == 0, out(runs[-1])[-4000:]
    third = out(runs[2])
    assert len(logged[2]) > len(logged[1])  # pip ran
    # It found nothing to install (a comment changed), and said so without the stamp.
    assert "already installed, nothing to change" in third and "as recorded in" not in third
    assert (Path(str(box["venv"])) / ".libreyolo-agent-install").is_file()


def install_borrowing_pip(tmp_path: Path, image_python: Path) -> tuple[Path, str, str]:
    """install.sh run twice on an image whose site-packages hold a pip new enough to borrow:
    the venv's site-packages and the two runs' output (the second a recorded no-op)."""
    env = offline_env(
        h200_bin(tmp_path / "bin"), image_python, tmp_path / "venv", wheel_folder(tmp_path / "w")
    )
    first, second = (out(run) for run in install_twice(env))
    image_site = site_of(image_python)
    assert f"(no pip of its own: the image's, in {image_site}, installs into it)" in first
    venv_site = site_of(tmp_path / "venv" / "bin" / "python")
    assert list(venv_site.glob("libreyolo_agent-*.dist-info")), sorted(venv_site.iterdir())
    assert "(as recorded in " in second
    return venv_site, first, second


def pip_version(venv_site: Path) -> str:
    """What the venv's bin/pip says of itself (it names the folder it runs from)."""
    pip = venv_site.parents[2] / "bin" / "pip"
    shown = subprocess.run([str(pip), "--version"], capture_output=True, text=True)
    assert shown.returncode == 0, shown
    return shown.stdout


@pytest.mark.timeout(2400)
def test_an_image_with_pip_lends_it_to_the_venv(tmp_path: Path) -> None:
    """The image's site-packages hold a pip (many GPU images do): the venv is made without one
    of its own (ensurepip's ~3 s saved), the image's installs into it through the .pth, and
    the venv's bin/pip runs that one. A second run changes nothing."""
    image_python = image_venv(tmp_path / "image")
    subprocess.run(  # offline: ensurepip's own wheel
        [str(image_python), "-m", "ensurepip", "--default-pip"],
        check=True,
        capture_output=True,
    )
    image_site = site_of(image_python)
    assert (image_site / "pip" / "__init__.py").is_file()
    venv_site, first, second = install_borrowing_pip(tmp_path, image_python)
    assert "installing pip into the venv" not in first
    assert not (venv_site / "pip").exists()
    # bin/pip runs the image's pip, installing into this venv.
    assert str(image_site / "pip") in pip_version(venv_site)
    # pip installed without compiling; install.sh compiled what it installed on every core.
    assert "compiling what pip installed" in first
    assert list((venv_site / "psutil" / "__pycache__").glob("*.pyc")), "not compiled"
    assert "creating the virtual environment" not in second


@pytest.mark.timeout(2400)
def test_a_broken_image_pip_gives_the_venv_its_own(tmp_path: Path) -> None:
    """The image's site-packages hold a pip that reads as new enough but cannot run (a damaged
    or patched one: here its package is there and nothing else): the install does not end on
    its failure; the venv gets its own pip from ensurepip and pip runs again."""
    image_python = image_venv(tmp_path / "image")
    image_site = site_of(image_python)
    (image_site / "pip").mkdir()
    (image_site / "pip" / "__init__.py").write_text('__version__ = "24.0"\n', encoding="utf-8")
    venv_site, first, second = install_borrowing_pip(tmp_path, image_python)
    assert f"the image's pip (in {image_site}) does not start in this venv" in first
    assert (venv_site / "pip" / "__init__.py").is_file()
    assert str(venv_site / "pip") in pip_version(venv_site)
    assert "does not start" not in second


def test_a_pip_that_refuses_the_install_is_not_replaced(tmp_path: Path) -> None:
    """A pip that runs and fails (here: a dependency no wheel folder holds) is pip's answer:
    install.sh stops with it and does not install another pip to try again."""
    image_python = image_venv(tmp_path / "image")
    subprocess.run(
        [str(image_python), "-m", "ensurepip", "--default-pip"], check=True, capture_output=True
    )
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    bin_dir = h200_bin(tmp_path / "bin")
    venv = tmp_path / "venv"
    env = offline_env(bin_dir, image_python, venv, empty)
    run = install(env)
    assert run.returncode == 1, out(run)[-4000:]
    assert "install.sh: pip could not install libreyolo-agent into" in run.stderr
    assert "does not start in this venv" not in out(run)
    assert not (site_of(venv / "bin" / "python") / "pip").exists()


def test_a_venv_that_imports_another_torch_stops_the_install(tmp_path: Path) -> None:
    """The venv exists, made to see the image, but a torch was pip-installed into it since: it
    would import that one, not the kept one. install.sh says so and stops before pip (exit 1)."""
    image_python = image_venv(tmp_path / "image")
    image_site = site_of(image_python)
    venv = tmp_path / "venv"
    subprocess.run([str(image_python), "-m", "venv", "--without-pip", str(venv)], check=True)
    venv_site = site_of(venv / "bin" / "python")
    (venv_site / "_libreyolo_image_torch.pth").write_text(f"{image_site}\n", encoding="utf-8")
    write_torch(venv_site, version="2.14.1", cuda="12.8")
    bin_dir = h200_bin(tmp_path / "bin")
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHON": str(image_python),
        "VENV": str(venv),
        "PIP_NO_INDEX": "1",
        "PIP_CONFIG_FILE": os.devnull,
        "HOME": str(tmp_path),
    }
    proc = subprocess.run(
        ["/bin/bash", str(INSTALL)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 1, out(proc)
    assert "keeping the image's torch - the image's torch 2.11.0+cu130" in proc.stdout
    assert f"the venv's torch is {venv_site / 'torch'}, not the image's" in proc.stderr
    assert (
        "does not import the image's torch" in proc.stderr
        and "nothing was installed" in proc.stderr
    )
    assert "installing libreyolo-agent" not in proc.stdout and "Traceback" not in proc.stderr


def test_an_image_that_holds_libreyolo_gets_the_command_in_the_venv(tmp_path: Path) -> None:
    # The image holds the very libreyolo the agent pins: pip installs nothing for it and writes
    # no `libreyolo` into the venv, where the agent looks for the command that starts the
    # trainer. install.sh writes it, run by the venv's Python (which sees the image's package).
    image_python = image_venv(tmp_path / "image")
    image_site = site_of(image_python)
    write_dist(
        image_site,
        "libreyolo",
        md.version("libreyolo"),
        {
            "libreyolo/__init__.py": "",
            "libreyolo/cli.py": (
                "import sys\n\n\ndef entrypoint():\n"
                "    print('image libreyolo', sys.executable, ' '.join(sys.argv[1:]))\n"
                "    return 0\n"
            ),
        },
    )
    found = tmp_path / "wheels"
    found.mkdir()
    for name in wheels.closure(AGENT_REQUIREMENTS):
        wheels.repack(name, found)
    assert not list(found.glob("libreyolo-*")), "the wheel folder must hold no libreyolo"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\ncase "$*" in\n'
        '  *--query-gpu=*) echo "580.82.07, NVIDIA H200, 9.0" ;;\n'
        '  *) echo "| NVIDIA-SMI 580.82.07   Driver Version: 580.82.07   CUDA Version: 13.0 |" ;;\n'
        "esac\n",
        encoding="utf-8",
    )
    smi.chmod(0o755)
    venv = tmp_path / "venv"
    env = offline_env(bin_dir, image_python, venv, found)
    proc = subprocess.run(
        ["/bin/bash", str(INSTALL)], capture_output=True, text=True, env=env, timeout=1200
    )
    assert proc.returncode == 0, out(proc)[-3000:]
    command = venv / "bin" / "libreyolo"
    assert command.is_file() and os.access(command, os.X_OK), out(proc)[-2000:]
    assert "wrote" in proc.stdout and "libreyolo" in proc.stdout
    ran = subprocess.run([str(command), "train", "x=1"], capture_output=True, text=True, env=env)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split()[:2] == ["image", "libreyolo"]
    assert ran.stdout.split()[2] == str(venv / "bin" / "python")
    assert ran.stdout.split()[3:] == ["train", "x=1"]
