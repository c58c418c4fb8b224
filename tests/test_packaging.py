"""The agent as a wheel (``pip install .``, not only the editable install the bootstrap makes):
it holds every file of ``agent/`` that git tracks (the folders per concern, the dashboard page,
the C NVML host's source), and the command runs from it, outside this checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_the_whole_agent_and_runs_from_it(tmp_path: Path) -> None:
    built = subprocess.run(
        [
            sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
            "--no-index", "-q", "-w", str(tmp_path / "dist"), str(ROOT),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("libreyolo_agent-*.whl")
    tracked = subprocess.run(
        ["git", "ls-files", "agent"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "agent/gpu/nvmlhost.c" in tracked and "agent/status/static/index.html" in tracked
    with zipfile.ZipFile(wheel) as z:
        held = {n for n in z.namelist() if n.startswith("agent/")}
        z.extractall(tmp_path / "site")
    assert sorted(set(tracked) - held) == []
    # Run from the unpacked wheel, away from the checkout: every module imports, the page and
    # the C source are found as the agent finds them.
    probe = (
        "import importlib, pkgutil, sys, agent, agent.gpu.nvmlhost as h\n"
        "from importlib.resources import files\n"
        "assert agent.__file__.startswith(sys.argv[1]), agent.__file__\n"
        "names = [m.name for m in pkgutil.walk_packages(agent.__path__, 'agent.')]\n"
        "for name in names:\n"
        "    if not name.endswith('__main__'):\n"
        "        importlib.import_module(name)\n"
        "assert h.C_SOURCE.is_file()\n"
        "assert files('agent.status').joinpath('static/index.html').is_file()\n"
        "print(len(names))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path / "site")
    out = subprocess.run(
        [sys.executable, "-P", "-c", probe, str(tmp_path / "site")], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) >= 100
    helped = subprocess.run(
        [sys.executable, "-P", "-m", "agent.cli", "--help"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert helped.returncode == 0 and "supervise" in helped.stdout, helped.stderr


def _backend() -> object:
    """buildsys/agent_build.py, the in-tree build backend pyproject.toml names."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "agent_build", ROOT / "buildsys" / "agent_build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_editable_wheel_finds_only_agent_in_the_checkout(tmp_path: Path) -> None:
    """The editable install's .pth puts a finder for the one name ``agent`` (not the checkout
    on sys.path: ``tests`` and ``bench`` stay unimportable), with the metadata and command."""
    backend: Any = _backend()
    name = backend.build_editable(str(tmp_path))
    site = tmp_path / "site"
    with zipfile.ZipFile(tmp_path / name) as z:
        names = set(z.namelist())
        z.extractall(site)
    info = "libreyolo_agent-0.1.0.dist-info"
    assert {f"{info}/METADATA", f"{info}/RECORD", f"{info}/entry_points.txt"} <= names
    assert "libreyolo-agent = agent.entry:main" in (site / info / "entry_points.txt").read_text()
    assert not any(n.startswith("agent/") for n in names)  # the sources stay in the checkout
    probe = (
        "import importlib.util as u, site, sys\n"
        "site.addsitedir(sys.argv[1])\n"
        "import agent, importlib.metadata as m\n"
        "print(agent.__file__)\n"
        "print(m.version('libreyolo-agent'))\n"
        "print(u.find_spec('tests'), u.find_spec('bench'), u.find_spec('buildsys'))\n"
    )
    # -S: none of this interpreter's own site-packages (where another install of the agent
    # may live); only the unpacked editable wheel's .pth.
    ran = subprocess.run(
        [sys.executable, "-S", "-P", "-c", probe, str(site)], cwd=tmp_path,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    file, version, others = ran.stdout.splitlines()
    assert file == str(ROOT / "agent" / "__init__.py") and version == "0.1.0"
    assert others == "None None None"


def test_the_sdist_builds_a_wheel_that_holds_the_whole_agent(tmp_path: Path) -> None:
    """The sdist carries the backend (backend-path), the metadata and every tracked file of
    agent/; pip builds a wheel from it, offline, with nothing installed first."""
    import tarfile

    backend: Any = _backend()
    name = backend.build_sdist(str(tmp_path))
    assert name == "libreyolo_agent-0.1.0.tar.gz"
    with tarfile.open(tmp_path / name) as tar:
        members = set(tar.getnames())
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4+; Debian 12's 3.11.2 has none
            tar.extractall(tmp_path / "src", filter="data")
        else:  # our own archive, just built
            tar.extractall(tmp_path / "src")
    base = "libreyolo_agent-0.1.0"
    assert {f"{base}/PKG-INFO", f"{base}/pyproject.toml", f"{base}/buildsys/agent_build.py"} <= (
        members
    )
    tracked = subprocess.run(
        ["git", "ls-files", "agent"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert sorted({f"{base}/{t}" for t in tracked} - members) == []
    built = subprocess.run(
        [
            sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "-q",
            "-w", str(tmp_path / "dist"), str(tmp_path / "src" / base),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("libreyolo_agent-*.whl")
    with zipfile.ZipFile(wheel) as z:
        held = set(z.namelist())
        metadata = z.read("libreyolo_agent-0.1.0.dist-info/METADATA").decode()
    assert sorted(set(tracked) - held) == []
    assert 'Requires-Dist: libreyolo==1.6.0; extra == "train"' in metadata
    assert "Requires-Python: >=3.11" in metadata
