"""Launch, attach to, wait for and stop the training process tree (how it ended is classified
in :mod:`agent.trainer.outcome`).

The trainer runs in its own session with its output in files, so it outlives the agent, SSH and
any terminal. It is identified by pid AND create time. Stopping walks the whole tree with psutil:
LibreYOLO's multi-GPU coordinator starts its ranks in a session of their own, so a process-group
kill alone would leave ranks holding GPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import psutil

from agent.config.model import Job, TrainValue
from agent.install.libreyolo import find_libreyolo
from agent.state import TrainerRecord
from agent.trainer.exitwait import wait_exit
from agent.trainer.logged_entry import logged_argv
from agent.trainer.rundir import pid_alive
from agent.trainer.spawn import LAUNCH_ENV, spawn_detached, trainer_env
from agent.trainer.spawn import TrainerError as TrainerError  # re-exported: launching raises it
from agent.util.crashpoints import crashpoint

if TYPE_CHECKING:
    from agent.staterecords import LaunchIntent

log = logging.getLogger(__name__)


def libreyolo_executable() -> str:
    """The ``libreyolo`` next to this Python (the venv), else the one on PATH
    (:func:`agent.install.libreyolo.find_libreyolo`); :class:`TrainerError` when there is
    neither."""
    found = find_libreyolo()
    if found:
        return found
    raise TrainerError(
        "the `libreyolo` command was not found next to this Python or on PATH; "
        "install the training stack (./install.sh, or pip install libreyolo)"
    )


def _fmt(value: TrainValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def uses_python_api(job: Job) -> bool:
    """LibreYOLO 1.6.0's CLI rejects device lists (``device=0,1``); those go through its Python
    API (``agent.trainer.train_entry``), whose coordinator spawns one rank per GPU."""
    device = job.train.get("device")
    return isinstance(device, str) and "," in device


#: ``[train]`` keys a resume replaces: it goes on from the run's own last.pt, in its own dir.
_RESUME_REPLACES = frozenset({"model", "pretrained", "resume", "epochs", "exist_ok", "name"})


def build_argv(
    job: Job,
    *,
    python: str = sys.executable,
    resume_dir: Path | None = None,
    total_epochs: int | None = None,
) -> list[str]:
    """The command line that starts this job's training. With ``resume_dir``: the command that
    resumes that run from its ``weights/last.pt`` in the same directory (LibreYOLO 1.6.0:
    ``model=RUN/weights/last.pt resume=true epochs=TOTAL`` plus ``exist_ok=true`` so the run
    dir is reused instead of becoming ``run12``; ``pretrained=false`` is refused with resume)."""
    args = [f"{k}={_fmt(v)}" for k, v in job.train.args]
    fixed = [f"project={job.job.runs_dir}", f"name={job.job.name}", "json=true"]
    if resume_dir is not None:
        epochs = total_epochs or job.train.epochs
        args = [f"{k}={_fmt(v)}" for k, v in job.train.args if k not in _RESUME_REPLACES]
        args = [f"model={resume_dir / 'weights' / 'last.pt'}", "resume=true", *args]
        if epochs is not None:
            args.append(f"epochs={epochs}")
        fixed = [
            f"project={resume_dir.parent}",
            f"name={resume_dir.name}",
            "exist_ok=true",
            "json=true",
        ]
    if job.train.loggers:  # LibreYOLO takes loggers= in its Python API only
        libreyolo_executable()
        return logged_argv(job, python, [*args, *fixed])
    if uses_python_api(job):
        libreyolo_executable()  # the same clear error when the training stack is missing
        return [python, "-m", "agent.trainer.train_entry", *args, *fixed]
    return [libreyolo_executable(), "train", *args, *fixed]


def find_launched(launch_id: str) -> psutil.Process | None:
    """The live process started with ``LAUNCH_ENV=launch_id`` (the trainer, or the tiny shell
    about to become it); None when there is none. The id is unique per launch, so a pid reused
    by an unrelated process never matches."""
    found: list[psutil.Process] = []
    for proc in psutil.process_iter(["pid", "create_time"]):
        with contextlib.suppress(psutil.Error, OSError):
            if proc.pid == os.getpid():
                continue
            if (
                proc.environ().get(LAUNCH_ENV) == launch_id
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(proc)
    if not found:
        return None
    # The root of the launch: DataLoader workers and DDP ranks inherit the environment too.
    pids = {p.pid for p in found}
    roots = [p for p in found if p.ppid() not in pids]
    return min(roots or found, key=lambda p: p.info.get("create_time") or 0.0)


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants (across sessions: parent links are followed)."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    descendants = _descendants(pid)
    if descendants is None:  # no /proc/PID/task/TID/children on this kernel
        try:
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return [root]
    procs = [root]
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            procs.append(psutil.Process(child))
    return procs


def _descendants(pid: int) -> list[int] | None:
    """The descendants of ``pid`` from ``/proc/PID/task/TID/children``: a read per process of
    the tree, where psutil reads the stat file of every process on the machine (and the
    supervision loop asks several times a turn). None where the kernel lacks the file."""
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        return None
    out: list[int] = []
    todo = [pid]
    seen = {pid}
    while todo:
        current = todo.pop()
        try:
            tids = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue  # exited meanwhile
        for tid in tids:
            try:
                with open(f"/proc/{current}/task/{tid}/children") as f:
                    words = f.read().split()
            except OSError:
                continue
            for child in map(int, words):
                if child not in seen:
                    seen.add(child)
                    out.append(child)
                    todo.append(child)
    return out


def tree_cpu_seconds(pids: Collection[int]) -> dict[tuple[int, float], float]:
    """CPU seconds (user + system) of every process in the trees of ``pids``, keyed by pid and
    create time, so that a caller can count per process: one that exits (a dataloader worker)
    must not make a sum go down. ``pids`` may hold a tree's members as well as its root: each
    process is read once. Blocking (psutil)."""
    current: dict[tuple[int, float], float] = {}
    covered: set[int] = set()
    for pid in sorted(pids):
        if pid in covered:
            continue  # in the tree of a pid already walked
        for proc in process_tree(pid):
            if proc.pid in covered:
                continue
            covered.add(proc.pid)
            try:
                key = (proc.pid, proc.create_time())
                t = proc.cpu_times()
            except psutil.Error:
                continue  # gone since the listing, or a zombie
            current[key] = t.user + t.system
    return current


def _signal_all(procs: dict[tuple[int, float], psutil.Process], sig: int) -> int:
    sent = 0
    for proc in procs.values():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            proc.send_signal(sig)
            sent += 1
    return sent


class Trainer:
    """One training process: launched by us (a child) or re-attached (someone else's child)."""

    def __init__(self, record: TrainerRecord, *, is_child: bool) -> None:
        self.record = record
        self.is_child = is_child
        self.exit_code: int | None = None
        self._exited = asyncio.Event()
        self._waiter: asyncio.Future[None] | None = None

    @classmethod
    async def launch(
        cls,
        argv: list[str],
        *,
        log_path: Path,
        result_path: Path,
        cwd: Path,
        launch_id: str | None = None,
    ) -> Trainer:
        """Start ``argv`` detached: own session, stdout (the json result) and stderr in files.

        ``launch_id`` goes into the trainer's environment (``LAUNCH_ENV``): an agent killed
        between this spawn and recording the pid finds the orphan by it (:func:`find_launched`).
        """
        pid = spawn_detached(
            argv,
            trainer_env(argv, launch_id),
            log_path=log_path,
            result_path=result_path,
            cwd=cwd,
            header=" ".join(argv),
        )
        create_time = psutil.Process(pid).create_time()
        record = TrainerRecord(pid=pid, create_time=create_time, started_at=time.time(), argv=argv)
        log.info("trainer started pid=%d", pid)
        return cls(record, is_child=True)

    @classmethod
    def adopt(cls, proc: psutil.Process, argv: list[str]) -> Trainer:
        """Take over a trainer found by :func:`find_launched` (launched, never recorded)."""
        record = TrainerRecord(
            pid=proc.pid, create_time=proc.create_time(), started_at=proc.create_time(), argv=argv
        )
        log.info("adopted trainer pid=%d launched by a previous agent", proc.pid)
        return cls(record, is_child=False)

    @classmethod
    def attach(cls, record: TrainerRecord) -> Trainer | None:
        """Re-attach to a trainer from a previous agent; None when it is gone (or pid reused)."""
        if not pid_alive(record.pid, record.create_time):
            return None
        log.info("re-attached to trainer pid=%d", record.pid)
        return cls(record, is_child=False)

    @property
    def pid(self) -> int:
        return self.record.pid

    def alive(self) -> bool:
        if self._exited.is_set():
            return False
        return pid_alive(self.record.pid, self.record.create_time)

    def pids(self) -> set[int]:
        """The pids of the live tree (status.json's pid may be a rank's, not ours)."""
        return {p.pid for p in process_tree(self.pid)} | {self.pid}

    async def wait(self) -> int | None:
        """Wait for the trainer to exit; its exit code, or None for a re-attached trainer."""
        # One waiter however many callers: a second waitpid() would lose the exit code.
        if self._waiter is None:
            self._waiter = asyncio.ensure_future(self._wait_once())
        await asyncio.shield(self._waiter)
        return self.exit_code

    async def _wait_once(self) -> None:
        await self._wait_exit()
        if self.is_child:
            self.exit_code = self._reap()
        self._exited.set()
        log.info("trainer pid=%d exited code=%s", self.pid, self.exit_code)

    def _reap(self) -> int | None:
        """Collect our child's exit status (negative: killed by that signal)."""
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:
            return None
        return os.waitstatus_to_exitcode(status)

    async def _wait_exit(self) -> None:
        await wait_exit(self.pid, self.record.create_time, is_child=self.is_child)

    async def stop(self, *, stop_grace_s: float, kill_grace_s: float) -> str:
        """SIGINT (LibreYOLO's clean stop), then SIGTERM, then SIGKILL to the whole tree, each
        after a grace period. Returns the last signal that was needed."""
        tree: dict[tuple[int, float], psutil.Process] = {}

        def refresh() -> None:
            for p in process_tree(self.pid):
                with contextlib.suppress(psutil.NoSuchProcess):
                    tree.setdefault((p.pid, p.create_time()), p)

        refresh()
        if not self.alive():
            return "none"
        log.info("stopping trainer pid=%d: SIGINT, grace %.0fs", self.pid, stop_grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signal.SIGINT)
        if await self._exit_within(stop_grace_s, refresh):
            await self._reap_tree(tree, kill_grace_s)
            return "SIGINT"
        refresh()
        log.warning("trainer pid=%d ignored SIGINT; SIGTERM to %d processes", self.pid, len(tree))
        _signal_all(tree, signal.SIGTERM)
        if await self._exit_within(kill_grace_s, refresh):
            await self._reap_tree(tree, kill_grace_s)
            return "SIGTERM"
        refresh()
        log.warning("trainer pid=%d survived SIGTERM; SIGKILL to %d processes", self.pid, len(tree))
        _signal_all(tree, signal.SIGKILL)
        await self._exit_within(kill_grace_s, refresh)
        await self._reap_tree(tree, kill_grace_s)
        return "SIGKILL"

    async def _exit_within(self, seconds: float, refresh: Any) -> bool:
        waiter = asyncio.ensure_future(self.wait())
        deadline = time.monotonic() + seconds
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # Short slices so ranks spawned during the grace period join the tree.
                done, _ = await asyncio.wait({waiter}, timeout=min(remaining, 0.5))
                if done:
                    return True
                refresh()
        finally:
            if not waiter.done():
                waiter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiter

    async def _reap_tree(self, tree: dict[tuple[int, float], psutil.Process], grace: float) -> None:
        """The main process is gone; make sure none of its descendants (DDP ranks, DataLoader
        workers) outlive it holding a GPU."""
        left = [p for p in tree.values() if p.is_running() and p.pid != self.pid]
        if not left:
            return
        _, alive = await asyncio.to_thread(psutil.wait_procs, left, timeout=min(grace, 5.0))
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                log.warning("killing leftover trainer process pid=%d", p.pid)
                p.kill()
        if alive:
            await asyncio.to_thread(psutil.wait_procs, alive, timeout=grace)


class TrainerProcess(Protocol):
    """What the daemon needs of a trainer: the real :class:`Trainer`, or a test's fake."""

    record: TrainerRecord
    is_child: bool
    exit_code: int | None

    @property
    def pid(self) -> int: ...

    def pids(self) -> set[int]: ...

    async def wait(self) -> int | None: ...

    async def stop(self, *, stop_grace_s: float, kill_grace_s: float) -> str: ...


class Launcher(Protocol):
    """How the daemon starts and finds trainers: its one seam to the operating system's
    processes (supervisor's ``options``), so the training loop is testable with fakes."""

    def argv(self, job: Job) -> list[str]:
        """The command line that starts ``job``'s training (raises TrainerError)."""

    async def launch(
        self, argv: list[str], *, log_path: Path, result_path: Path, cwd: Path, launch_id: str
    ) -> TrainerProcess:
        """Start a detached trainer marked with ``launch_id`` (raises TrainerError, OSError)."""

    def attach(self, record: TrainerRecord) -> TrainerProcess | None:
        """The trainer a previous agent recorded, if it still runs (pid and create time)."""

    def find_launched(self, launch_id: str, argv: list[str]) -> TrainerProcess | None:
        """The trainer a killed agent spawned but never recorded (blocking: a process scan)."""


class WarmTrainer(Protocol):
    """A trainer process started before the launch, waiting for its command line
    (:class:`agent.trainer.warmstart.WarmStart`)."""

    @property
    def launch_id(self) -> str | None: ...

    async def go(
        self, argv: list[str], *, log_path: Path, result_path: Path, cwd: Path, launch_id: str
    ) -> Trainer | None: ...

    async def abort(self) -> int | None: ...


class ProcessLauncher:
    """The real launcher: ``libreyolo train`` (or ``agent.trainer.train_entry``) as a detached
    process.

    ``warm``: a trainer that ran preflight's probe in its own process and waits for its command
    line (``agent/trainer/warm_entry.py``); the first launch hands it the command line instead of
    starting a new process, when it can."""

    #: Whether the daemon may start this launcher's first trainer warm (a subclass that runs
    #: another trainer than ``libreyolo train`` says no).
    warm_start = True
    warm: WarmTrainer | None = None

    @property
    def reserved_launch_id(self) -> str | None:
        """The launch id the warm trainer was started with, for the next launch's intent."""
        return self.warm.launch_id if self.warm is not None else None

    def argv(self, job: Job) -> list[str]:
        return build_argv(job)

    async def launch(
        self, argv: list[str], *, log_path: Path, result_path: Path, cwd: Path, launch_id: str
    ) -> TrainerProcess:
        warm, self.warm = self.warm, None
        if warm is not None:
            started = await warm.go(
                argv, log_path=log_path, result_path=result_path, cwd=cwd, launch_id=launch_id
            )
            if started is not None:
                return started
        return await Trainer.launch(
            argv, log_path=log_path, result_path=result_path, cwd=cwd, launch_id=launch_id
        )

    def attach(self, record: TrainerRecord) -> TrainerProcess | None:
        return Trainer.attach(record)

    def find_launched(self, launch_id: str, argv: list[str]) -> TrainerProcess | None:
        proc = find_launched(launch_id)
        return Trainer.adopt(proc, argv) if proc is not None else None


async def start_once(
    launcher: Launcher,
    job: Job,
    *,
    intent: LaunchIntent | None,
    record_intent: Callable[[LaunchIntent], None],
    log_path: Path,
    result_path: Path,
    now: float,
    argv: list[str] | None = None,
) -> TrainerProcess:
    """Start ``job``'s trainer, safe against the agent being killed at any instant: the launch
    id is recorded (``record_intent``, a durable save) before the spawn, and the caller records
    the pid right after. A restarted agent that finds an ``intent`` without a pid adopts the
    process carrying that id instead of launching a second trainer. Raises TrainerError or
    OSError when nothing could be started."""
    if intent is not None:
        orphan = await asyncio.to_thread(
            launcher.find_launched, str(intent["id"]), list(intent["argv"])
        )
        if orphan is not None:
            return orphan
        log.warning(
            "a previous agent started a launch (id %s) but no such trainer runs; launching",
            intent["id"],
        )
    argv = argv or launcher.argv(job)
    # A warm trainer already carries its id (in its environment, from its start).
    launch_id = getattr(launcher, "reserved_launch_id", None) or uuid.uuid4().hex
    record_intent({"id": launch_id, "argv": argv, "at": now})
    trainer = await launcher.launch(
        argv,
        log_path=log_path,
        result_path=result_path,
        cwd=job.job.runs_dir,
        launch_id=launch_id,
    )
    crashpoint("after-launch")
    return trainer
