"""install.sh and scripts/bootstrap.sh.

- ``install.sh --dry-run`` on PATHs of our choosing: which pip call gets the custom index, the
  torch decision with a fake ``nvidia-smi`` (the base Python's real torch is what it reads),
  PyTorch's CPU index answering on 127.0.0.1 or not (tests/test_install_image.py: the kept
  torch, for real).
- install.sh for real into a temporary venv (the CPU path), twice: the second run changes
  nothing; then the demo job from that install.
- bootstrap.sh with a stand-in ``libreyolo-agent supervise`` (container mode, started once), a
  fake ``systemctl`` (systemd mode) and a job fetched from the fake Hub.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.hub import run_fake_hub
from tests.fakes.torch_index import CPU_PAGES, cpu_index

#: One worker builds this file's fixture (a real install) and runs every test using it (the
#: fixture is the session's, so tests of other files that the worker runs in between do not
#: make it build again, as a module's fixture would);
#: the README's test command distributes with `--dist loadfile`.
pytestmark = pytest.mark.xdist_group("install")

REPO_ROOT = Path(__file__).resolve().parent.parent
INSTALL = REPO_ROOT / "install.sh"
BOOTSTRAP = REPO_ROOT / "scripts" / "bootstrap.sh"
CUDA_INDEX = "--index-url http://127.0.0.1:9/whl/cu128"
TOKEN = "hf_bootstrap_secret_789"


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed: connecting is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fake_smi(bin_dir: Path, query: str) -> Path:
    """An ``nvidia-smi`` answering the ``--query-gpu`` CSV, logging each call (returns the log)."""
    (bin_dir / "smi-query.txt").write_text(query, encoding="utf-8")
    log = bin_dir / "smi-calls.txt"
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        f'#!/bin/sh\necho "$*" >>"{log}"\n'
        f'case "$*" in *--query-gpu=*) /bin/cat "{bin_dir}/smi-query.txt" ;; '
        "*) echo 'the header table is not what install.sh reads'; exit 3 ;; esac\n",
        encoding="utf-8",
    )
    smi.chmod(0o755)
    return log


def dry_run(
    tmp_path: Path,
    *args: str,
    smi: str | None = None,
    pip_args: str = "",
    index_base: str | None = None,
) -> tuple[list[str], str]:
    """The pip command lines ``install.sh --dry-run`` would run, and all it printed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("dirname", "sed"):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    if smi is not None:
        fake_smi(bin_dir, smi)
    env = {
        "PATH": str(bin_dir),
        "PYTHON": sys.executable,
        "VENV": str(tmp_path / "venv"),
        "TORCH_INDEX_BASE": index_base or f"http://127.0.0.1:{closed_port()}/whl",
    }
    if pip_args:
        env["PIP_ARGS"] = pip_args
    proc = subprocess.run(
        ["/bin/bash", str(INSTALL), "--dry-run", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "venv").exists()  # a dry run creates nothing
    return [line for line in proc.stdout.splitlines() if " -m pip " in line], proc.stdout


def test_a_custom_index_applies_to_torch_only(tmp_path: Path) -> None:
    (torch, agent), out = dry_run(tmp_path, pip_args=CUDA_INDEX)
    assert CUDA_INDEX in torch and "torch==2.14.1 torchvision==0.29.1" in torch
    assert "--index-url" not in agent and "-e " in agent
    assert "TORCH_SPEC/PIP_ARGS are set" in out


@pytest.mark.parametrize(("args", "extras"), [((), r"\[train\]"), (("--dev",), r"\[train\,dev\]")])
def test_cpu_machine_gets_the_default_torch_then_the_agent(
    tmp_path: Path, args: tuple[str, ...], extras: str
) -> None:
    (torch, agent), out = dry_run(tmp_path, *args)
    assert agent.endswith(extras), agent  # printf %q escapes the brackets and commas
    assert torch.endswith("install --no-compile torch==2.14.1 torchvision==0.29.1")
    assert "no nvidia-smi: a CPU machine" in out
    assert "gpu" not in agent  # NVML is our own ctypes binding (agent/gpu/nvml.py): no gpu extra
    # PyTorch's CPU index (a closed port here) refused at once: the default, saying what it costs.
    assert "PyTorch's CPU wheel index did not answer" in out and "Connection refused" in out
    assert "which is the CUDA build (about 3 GB to download, a 6 GB venv" in out


def test_cpu_machine_takes_the_cpu_wheels_where_the_index_answers(tmp_path: Path) -> None:
    with cpu_index(CPU_PAGES) as base:
        (torch, agent), out = dry_run(tmp_path, index_base=base)
    assert torch.endswith(
        f"install --no-compile --index-url {base}/cpu torch==2.14.1 torchvision==0.29.1"
    )
    assert "--index-url" not in agent  # the CPU index holds torch, not the agent's dependencies
    assert f"PyTorch's CPU wheels from {base}/cpu" in out


def test_job_extras_go_with_the_agent_install(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[train]\nmodel = "rfdetr-s"\nlora = true\n', encoding="utf-8")
    (_, agent), out = dry_run(tmp_path, "--job", str(job), "--extras", "onnx")
    assert agent.endswith(r"libreyolo\[lora\,onnx\,rfdetr\]"), agent
    assert "rfdetr: train.model = 'rfdetr-s'" in out


def test_driver_550_box_installs_a_cu124_torch_before_libreyolo(tmp_path: Path) -> None:
    # The base Python's torch (CUDA 13.0 build) is too new for a 12.4 driver.
    base = "http://127.0.0.1:9/whl"
    (torch, agent), out = dry_run(tmp_path, smi="550.127.05, NVIDIA L4, 8.9\n", index_base=base)
    assert "torch==2.6.0 torchvision==0.21.0" in torch and torch.split(" install ")[1].startswith(
        f"--no-compile --index-url {base}/cu124"
    )
    assert "--index-url" not in agent
    assert "the driver runs CUDA <= 12.4" in out
    # One nvidia-smi call, the query (no header table, no second call).
    calls = (tmp_path / "bin" / "smi-calls.txt").read_text(encoding="utf-8").splitlines()
    assert calls == ["--query-gpu=driver_version,name,compute_cap --format=csv,noheader"]


def test_driver_580_box_keeps_the_image_torch(tmp_path: Path) -> None:
    pips, out = dry_run(tmp_path, smi="580.82.07, NVIDIA H100 80GB HBM3, 9.0\n")
    assert len(pips) == 1 and "-e " in pips[0]  # no torch install at all
    assert "--system-site-packages" not in out
    assert "_libreyolo_image_torch.pth" in out and "check the venv imports the torch" in out
    assert "keeping the image's torch" in out and "no download" in out
    assert "(read from libtorch_cuda.so)" in out  # this venv's real torch: its cubins were read


def test_install_sh_is_valid_bash() -> None:
    for script in (INSTALL, BOOTSTRAP):
        proc = subprocess.run(["/bin/bash", "-n", str(script)], capture_output=True)
        assert proc.returncode == 0, proc.stderr


# ---- the real install (CPU path), twice, then the demo job


def snapshot(venv: Path) -> dict[str, tuple[int, int]]:
    """Every file of the venv (pyc caches aside) with its size and mtime."""
    found = {}
    for path in venv.rglob("*"):
        if path.is_file() and not path.is_symlink() and "__pycache__" not in path.parts:
            st = path.stat()
            found[str(path.relative_to(venv))] = (st.st_size, st.st_mtime_ns)
    return found


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    """A venv made by install.sh (pip's own configuration and cache), run twice."""
    root = tmp_path_factory.mktemp("install")
    venv = root / "venv"
    env = dict(os.environ, VENV=str(venv), PYTHON=shutil.which("python3.11") or sys.executable)
    # As on this project's machines and CI (they reach only PyPI): PyTorch's CPU index does not
    # answer, so this is the fallback, for real (the default build from the usual index).
    env["TORCH_INDEX_BASE"] = f"http://127.0.0.1:{closed_port()}/whl"
    for name in ("TORCH_SPEC", "PIP_ARGS", "LIBREYOLO_EXTRAS", "VIRTUAL_ENV"):
        env.pop(name, None)
    outputs, snapshots = [], []
    for _ in range(2):
        proc = subprocess.run(
            [str(INSTALL)], capture_output=True, text=True, env=env, cwd=root, timeout=1500
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        outputs.append(proc.stdout + proc.stderr)
        snapshots.append(snapshot(venv))
    assert snapshots[0] == snapshots[1], "the second install changed the venv"
    yield venv, outputs
    shutil.rmtree(venv, ignore_errors=True)  # about 6 GB


@pytest.mark.timeout(3000)
@pytest.mark.long
def test_a_second_install_changes_nothing(installed: tuple[Path, list[str]]) -> None:
    venv, (first, second) = installed
    assert "Successfully installed" in first and "no nvidia-smi: a CPU machine" in first
    assert "PyTorch's CPU wheel index did not answer" in first
    assert "the venv sees torch 2.14.1" not in first  # no kept torch: nothing to see before pip
    assert "Successfully installed" not in second and "Downloading" not in second
    # The stamp of the first install matches: pip is not run at all, not even for torch.
    assert "Requirement already satisfied" not in second and "installing torch" not in second
    assert "already installed, nothing to change (as recorded in" in second
    assert (venv / "bin" / "libreyolo-agent").exists()


@pytest.mark.timeout(3000)
@pytest.mark.training
@pytest.mark.long
def test_the_demo_job_runs_from_the_install(
    installed: tuple[Path, list[str]], tmp_path: Path
) -> None:
    venv, _ = installed
    proc = subprocess.run(
        [str(venv / "bin" / "libreyolo-agent"), "run", "--demo-dir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reason:     completed" in proc.stdout


# ---- bootstrap.sh


def fake_venv(root: Path) -> Path:
    """A venv whose python is this one and whose ``libreyolo-agent`` is the real CLI, except
    ``supervise``: it records the start, writes ``supervisor.pid`` and waits."""
    bin_dir = root / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n', encoding="utf-8")
    agent = bin_dir / "libreyolo-agent"
    agent.write_text(
        "#!/bin/bash\n"
        'if [ "$1" = supervise ]; then\n'
        '  log="$LIBREYOLO_AGENT_STATE_DIR/starts"\n'
        '  echo "$$ $* HF_HOME=$HF_HOME token=${HF_TOKEN:+set}" >>"$log"\n'
        '  echo $$ >"$LIBREYOLO_AGENT_STATE_DIR/supervisor.pid"\n'
        "  while :; do sleep 1; done\n"
        "fi\n"
        # The job check, in a container: it records whether the supervisor was started before
        # it (waiting up to 30 s for that start, which bootstrap does not wait for).
        'if [ "$1" = check ] && [ "$LIBREYOLO_AGENT_INIT" = container ]; then\n'
        '  started="$LIBREYOLO_AGENT_STATE_DIR/starts"\n'
        '  for _ in $(seq 1 600); do [ -s "$started" ] && break; sleep 0.05; done\n'
        '  if [ -s "$started" ]; then when=after; else when=before; fi\n'
        '  echo "check $when the supervisor" >>"$LIBREYOLO_AGENT_STATE_DIR/checks"\n'
        "fi\n"
        f'PYTHONPATH="{REPO_ROOT}" exec "{sys.executable}" -m agent.cli "$@"\n',
        encoding="utf-8",
    )
    for exe in (python, agent):
        exe.chmod(0o755)
    return root / "venv"


def boot_env(root: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LIBREYOLO_AGENT_", "HF_", "VAST", "RUNPOD", "CONTAINER_"))
    }
    env.update(
        VENV=str(fake_venv(root) if not (root / "venv").exists() else root / "venv"),
        LIBREYOLO_AGENT_CONFIG_DIR=str(root / "etc"),
        LIBREYOLO_AGENT_STATE_DIR=str(root / "state"),
        LIBREYOLO_AGENT_VOLUME=str(root / "volume"),
        LIBREYOLO_AGENT_SYSTEMD_DIR=str(root / "units"),
        LIBREYOLO_AGENT_INIT="container",
        HF_TOKEN=TOKEN,
    )
    (root / "volume").mkdir(exist_ok=True)
    env.update(extra)
    return env


def bootstrap(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/bash", str(BOOTSTRAP), "--no-install", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


JOB = """[job]
name = "boot"
runs_dir = "{root}/runs"
[train]
model = "yolox-n"
data = "{root}/data.yaml"
epochs = 1
[teardown]
provider = "none"
"""


@pytest.fixture
def supervisors(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    pid_file = tmp_path / "state" / "supervisor.pid"
    if pid_file.exists():  # stop the stand-in this test started, by its pid
        os.kill(int(pid_file.read_text()), signal.SIGTERM)


def test_bootstrap_in_a_container_starts_one_supervisor(supervisors: Path) -> None:
    root = supervisors
    job_text = JOB.format(root=root)
    env = boot_env(root, LIBREYOLO_AGENT_JOB_TOML=job_text)
    first = bootstrap(env)
    assert first.returncode == 0, first.stdout + first.stderr
    job = root / "etc" / "job.toml"
    assert job.read_text(encoding="utf-8") == job_text + "\n"
    assert stat.S_IMODE(job.stat().st_mode) == 0o600
    assert "started the supervisor" in first.stdout and "ssh -p <port>" in first.stdout
    assert f"HF_HOME={root}/volume/.cache/huggingface" in first.stdout
    for _ in range(200):  # the stand-in writes its pid file as soon as it runs
        if (root / "state" / "supervisor.pid").exists():
            break
        subprocess.run(["sleep", "0.05"], check=True)
    second = bootstrap(env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "the supervisor runs already" in second.stdout and f"unchanged: {job}" in second.stdout
    starts = (root / "state" / "starts").read_text(encoding="utf-8").splitlines()
    assert len(starts) == 1 and f"supervise {job}" in starts[0]
    assert f"HF_HOME={root}/volume/.cache/huggingface token=set" in starts[0]
    assert TOKEN not in first.stdout + first.stderr + second.stdout + second.stderr
    assert not list((root / "etc").glob("env"))  # no secrets on disk without systemd
    # The job check comes after the start: the agent's preflight does not wait for it.
    checks = (root / "state" / "checks").read_text(encoding="utf-8").splitlines()
    assert checks == ["check after the supervisor"] * 2


def test_bootstrap_without_a_job_says_how_to_give_one(tmp_path: Path) -> None:
    proc = bootstrap(boot_env(tmp_path))
    assert proc.returncode == 2 and "LIBREYOLO_AGENT_JOB_TOML" in proc.stderr


# A job that fails the check: bootstrap reports it and starts the agent all the same, which
# takes the gated failure decision (issue 24, item 5): tests/test_bootstrap.py.


def test_bootstrap_with_systemd_installs_the_unit_and_env(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    systemctl = bin_dir / "systemctl"
    systemctl.write_text(
        f'#!/bin/sh\necho "$*" >>"{tmp_path}/systemctl.calls"\n'
        '[ "$1" = is-active ] && exit 3\nexit 0\n',
        encoding="utf-8",
    )
    systemctl.chmod(0o755)
    job_file = tmp_path / "given.toml"
    job_file.write_text(JOB.format(root=tmp_path), encoding="utf-8")
    env = boot_env(
        tmp_path,
        LIBREYOLO_AGENT_INIT="systemd",
        LIBREYOLO_AGENT_JOB=str(job_file),
        VAST_API_KEY='k"ey\\1',
        PATH=f"{bin_dir}:{os.environ['PATH']}",
    )
    for _ in range(2):
        proc = bootstrap(env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    unit = tmp_path / "units" / "libreyolo-agent.service"
    assert unit.read_bytes() == (REPO_ROOT / "systemd" / "libreyolo-agent.service").read_bytes()
    dropin = (tmp_path / "units" / "libreyolo-agent.service.d" / "10-bootstrap.conf").read_text()
    assert (
        f"ExecStart=\nExecStart={tmp_path}/venv/bin/libreyolo-agent run {tmp_path}/etc/job.toml"
        in dropin
    )
    env_file = tmp_path / "etc" / "env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    lines = env_file.read_text(encoding="utf-8").splitlines()
    assert f'HF_TOKEN="{TOKEN}"' in lines and 'VAST_API_KEY="k\\"ey\\\\1"' in lines
    calls = (tmp_path / "systemctl.calls").read_text(encoding="utf-8").splitlines()
    # The unit changed on the first run only: one daemon-reload; enable --now is idempotent.
    assert calls.count("daemon-reload") == 1
    assert calls.count("enable --now libreyolo-agent") == 2
    assert TOKEN not in proc.stdout + proc.stderr


def test_bootstrap_fetches_the_job_from_the_hub(supervisors: Path) -> None:
    root = supervisors
    job_text = JOB.format(root=root).encode()
    with run_fake_hub(tokens={TOKEN}) as hub:
        hub.add_file("model", "org/jobs", "boxes/job.toml", job_text, private=True)
        env = boot_env(
            root, LIBREYOLO_AGENT_JOB="hf://org/jobs/boxes/job.toml", HF_ENDPOINT=hub.url
        )
        proc = bootstrap(env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert (root / "etc" / "job.toml").read_bytes() == job_text
        missing = bootstrap(dict(env, LIBREYOLO_AGENT_JOB="hf://org/jobs/nope.toml"))
    assert missing.returncode == 1 and "cannot fetch hf://org/jobs/nope.toml" in missing.stderr
    assert TOKEN not in proc.stdout + proc.stderr + missing.stderr


def test_bootstrap_prefetches_the_dataset_the_agent_then_finds_in_the_cache(
    supervisors: Path,
) -> None:
    """A job naming a dataset: bootstrap downloads its archive into HF_HOME's Hub cache in the
    background (the venv's huggingface_hub, the token from the environment); the agent's own
    download (agent.data.dataset) then asks the Hub only for the file's metadata, no second GET."""
    from agent.config.model import DatasetSection, Env
    from agent.data.dataset import _download

    root = supervisors
    archive = b"boxes archive " * 1000
    job_text = JOB.format(root=root) + '[dataset]\nrepo = "org/boxes"\nfile = "boxes.tar"\n'
    with run_fake_hub(tokens={TOKEN}) as hub:
        hub.add_file("dataset", "org/boxes", "boxes.tar", archive, private=True)
        ds = DatasetSection(repo="org/boxes", file="boxes.tar")

        def gets() -> list[str]:
            return [r.path for r in hub.requests if r.method == "GET" and "boxes.tar" in r.path]

        # Control: with an empty cache, the agent's download GETs the archive.
        control = Env.from_environ(
            {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HOME": str(root / "empty-cache")}
        )
        assert _download(ds, control).read_bytes() == archive and len(gets()) == 1
        hub.clear_requests()

        env = boot_env(root, LIBREYOLO_AGENT_JOB_TOML=job_text, HF_ENDPOINT=hub.url)
        proc = bootstrap(env)
        assert proc.returncode in (0, 3), proc.stdout + proc.stderr
        assert "prefetch: the job's dataset archive goes into the Hub cache" in proc.stdout
        log = root / "state" / "prefetch.log"
        for _ in range(2400):  # the background download ends (generous: a loaded machine)
            if log.exists() and "prefetch: done" in log.read_text(encoding="utf-8"):
                break
            subprocess.run(["sleep", "0.05"], check=True)
        text = log.read_text(encoding="utf-8")
        assert "prefetch: done" in text, text
        hf_home = root / "volume" / ".cache" / "huggingface"
        cached = list((hf_home / "hub").glob("datasets--org--boxes/snapshots/*/boxes.tar"))
        assert len(cached) == 1 and cached[0].read_bytes() == archive
        assert len(gets()) == 1  # the prefetch's download
        hub.clear_requests()

        agent_env = Env.from_environ(
            {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HOME": str(hf_home)}
        )
        assert _download(ds, agent_env).read_bytes() == archive
        assert gets() == []  # found in the cache: not downloaded again
        assert any(r.method == "HEAD" for r in hub.requests)  # it did ask the Hub
    assert TOKEN not in text + proc.stdout + proc.stderr


def test_bootstrap_starts_no_prefetch_for_a_job_without_a_dataset(supervisors: Path) -> None:
    root = supervisors
    proc = bootstrap(boot_env(root, LIBREYOLO_AGENT_JOB_TOML=JOB.format(root=root)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "prefetch" not in proc.stdout and not (root / "state" / "prefetch.log").exists()


def test_a_jobs_loggers_get_their_clients_with_the_agent_install(tmp_path: Path) -> None:
    # [train] loggers names the tracking clients the launcher imports (agent/trainer/trackers.py):
    # the start line's install.sh --job installs those, not all three, so check passes on the box.
    job = tmp_path / "job.toml"
    job.write_text('[train]\nloggers = ["wandb", "mlflow"]\n', encoding="utf-8")
    (_, agent), out = dry_run(tmp_path, "--job", str(job))
    assert agent.endswith(r"\[train\,mlflow\,wandb\]"), agent
    assert "tensorboard" not in agent
    assert "mlflow: train.loggers names 'mlflow'" in out
    plain = tmp_path / "plain"
    plain.mkdir()
    job.write_text("[train]\nepochs = 3\n", encoding="utf-8")
    (_, agent), _ = dry_run(plain, "--job", str(job))
    assert agent.endswith(r"\[train\]"), agent
