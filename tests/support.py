"""Shared pieces of the daemon tests: a tiny CPU job, waiting on a condition, a slow stage."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent.config.jobfile import parse_job
from agent.config.model import Job
from agent.guard.plan import guard_pid

#: tests/fakes/pause_trainer: a ``sitecustomize`` that makes a real trainer stop itself after
#: an epoch (its docstring says how and why).
PAUSE_TRAINER_DIR = Path(__file__).resolve().parent / "fakes" / "pause_trainer"
PAUSE_ENV = "LIBREYOLO_TEST_PAUSE_AFTER_EPOCH"


def tiny_job(
    tmp: Path,
    data: Path,
    *,
    epochs: int = 3,
    train: str = "",
    sections: str = "",
    doctor: bool = False,
    checks: bool = False,
) -> Job:
    """yolox-n from scratch at 64x64 on the CPU, preflight off, HTTP on a free port.

    ``train`` adds lines to [train]; ``sections`` adds whole sections (e.g. a [sync] table).
    The dataset doctor (on by default for users, about 5 s of LibreYOLO start-up) is off
    unless ``doctor``: the tests of the doctor itself turn it on. So is the restore drill
    before a destroy unless ``checks`` (on for users; ``teardown.require_restore_drill``: a
    child that imports torch and LibreYOLO, 6-7 s here): the tests of the drill turn it on, and
    the demo job's tests run with the users' defaults. The NaN/inf read of each epoch's last.pt
    (``train.check_weights``) stays on as for users: it reads the bytes without torch, in
    milliseconds."""
    text = tiny_job_text(
        tmp, data, epochs=epochs, train=train, sections=sections, doctor=doctor, checks=checks
    )
    return parse_job(text, source="test", base_dir=tmp)


def tiny_job_text(
    tmp: Path,
    data: Path,
    *,
    epochs: int = 3,
    train: str = "",
    sections: str = "",
    doctor: bool = False,
    checks: bool = False,
) -> str:
    """The TOML of :func:`tiny_job`, for tests that hand the agent a job file."""
    if "[dataset]" not in sections:
        sections += f"\n[dataset]\ndoctor = {'true' if doctor else 'false'}\n"
    if not checks and "require_restore_drill" not in sections:
        if "[teardown]\n" in sections:
            sections = sections.replace(
                "[teardown]\n", "[teardown]\nrequire_restore_drill = false\n", 1
            )
        else:
            sections += "\n[teardown]\nrequire_restore_drill = false\n"
    text = f"""
[job]
name = "run1"
runs_dir = "{tmp / "runs"}"
[train]
model = "yolox-n"
pretrained = false
data = "{data}"
epochs = {epochs}
imgsz = 64
batch = 4
workers = 0
device = "cpu"
stop_grace = "30s"
kill_grace = "5s"
{train}
[preflight]
enabled = false
[server]
listen = "127.0.0.1:0"
{sections}
"""
    return text


#: How long a wait on a state may take before it counts as a hang: far beyond what a loaded
#: 2-core machine needs (a first epoch of the real trainer there: a minute or two), so only a
#: state that never comes fails it; the test's own timeout (tests/conftest.py) is the backstop.
HANG_S = 600.0


async def wait_for(pred: Callable[[], Any], timeout: float = HANG_S) -> None:
    """Poll ``pred`` in the daemon's loop until it is true; fail after ``timeout`` seconds (a
    hang: the default is no guess at the machine's speed)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


class HeldStage:
    """A STAGING hook that holds the agent in STAGING until the test calls :meth:`release`:
    a window in which the agent is up (HTTP, token) but no trainer runs, for as long as the
    test needs it. (A staging of a fixed few seconds ended, under load, while the test's
    commands were still starting: they saw the job past STAGING.) ``started`` is set once the
    agent is in the hook. Release it in a ``finally``: a held agent never ends."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self._released = threading.Event()

    def __call__(self) -> None:
        self.started.set()
        self._released.wait(HANG_S)

    def release(self) -> None:
        self._released.set()


def pause_after_epoch(monkeypatch: pytest.MonkeyPatch, epoch: int) -> None:
    """Real trainers started from now on (they inherit this environment) stop themselves with
    SIGSTOP once ``epoch``'s checkpoints and ``status.json`` are written (tests/fakes/
    pause_trainer): a test stops a run at a known epoch whatever the machine's speed, where a
    SIGSTOP sent after the agent saw the epoch raced the trainer. Undo with
    ``monkeypatch.delenv(PAUSE_ENV)`` before a trainer that must run through starts."""
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(PAUSE_TRAINER_DIR), path) if p)
    )
    monkeypatch.setenv(PAUSE_ENV, str(epoch))


def end_guard(state_dir: Path) -> None:
    """End the guard an agent run as a process started for ``state_dir``: it outlives the
    agent by design, and leaves by itself only at its next look (a test's finalizer ends it
    rather than leave it to the leftover check, which would warn)."""
    with contextlib.suppress(OSError):
        pid = guard_pid(state_dir)
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def is_stopped(pid: int) -> bool:
    """The process ``pid`` is stopped (SIGSTOP): a paused trainer has paused."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False


async def post_stop(base: str, state_dir: Path) -> None:
    """``POST /stop`` to the agent at ``base`` with its state directory's token, as the
    ``stop`` command does; the agent must accept it."""
    import aiohttp

    token = (state_dir / "token").read_text().strip()
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{base}/stop", headers={"Authorization": f"Bearer {token}"}) as r,
    ):
        assert r.status == 200


def built_once(factory: pytest.TempPathFactory, key: str, build: Callable[[Path], None]) -> Path:
    """A folder ``build`` fills once per test session, shared by every xdist worker (a file
    lock in the session's shared temp root): what several test modules need and takes a real
    training or install to make. Read it, never change it: other tests read it too."""
    base = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's root, above each worker's own
    target = base / f"once-{key}"
    with open(base / f"once-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / ".built").exists():
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            build(target)
            (target / ".built").touch()
    return target


def tiny_trained_checkpoint(factory: pytest.TempPathFactory) -> Path:
    """The ``last.pt`` of one epoch of the real ``libreyolo train`` (yolox-n from scratch, 64
    px, the demo dataset, CPU), made once per session (:func:`built_once`)."""

    def train(root: Path) -> None:
        from agent import demo

        exe = shutil.which("libreyolo", path=str(Path(sys.executable).parent))
        assert exe is not None, "the training stack (libreyolo) is not installed"
        data = demo.make_dataset(root / "ds")
        argv = [exe, "train", "model=yolox-n", "pretrained=false", f"data={data}"]
        argv += ["epochs=1", "imgsz=64", "batch=4", "workers=0", "device=cpu"]
        argv += [f"project={root / 'runs'}", "name=t1", "json=true"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1200, cwd=root)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        shutil.copyfile(result["last_weights"], root / "last.pt")

    return built_once(factory, "yolox-n-1-epoch", train) / "last.pt"
