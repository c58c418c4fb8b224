"""The agent's side of the warm start (``agent/trainer/warm_entry.py``): one process probes, then
trains.

:class:`WarmStart` starts the trainer's Python as soon as the agent knows the job runs preflight
(:meth:`WarmStart.start`, before the agent's own start-up is done), exactly as a trainer is
started (own session, the launch's log and result files, ``LAUNCH_ENV``), with two pipes:
it reads the probe's stages and document from one (:meth:`WarmStart.probe`, a drop-in for
preflight's child probe) and holds the other, the gate, until the launch. Then
:meth:`WarmStart.go` writes the command line through the gate and the waiting process becomes
the trainer; :meth:`WarmStart.abort` closes the gate and kills the process group instead.

Safety, whatever happens to the agent:

* Before the go, the process lives only as long as the gate's writing end, which only this
  process holds (close-on-exec): an agent that dies, however it dies, closes it, and the
  waiting process ends with nothing trained.
* The go comes through :func:`agent.trainer.process.start_once`, which records the launch id in
  state.json first. The process carries that id from its start, so an agent killed between the
  go and recording the pid finds and adopts it, as it would a cold launch.
* Anything unexpected at the launch (another command line than ``libreyolo train``, other
  files, the process gone) abandons the warm process and launches cold.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from agent.config.model import Job
from agent.install.libreyolo import find_libreyolo
from agent.preflight.cuda import warm_probe_config
from agent.preflight.plan import plan_for
from agent.preflight.runner import (
    KILL_GRACE_S,
    PROBE_SCHEMA,
    STAGE_PREFIX,
    ProbeResult,
    kill_group,
    warn_hung,
)
from agent.state import TrainerRecord
from agent.trainer.process import ProcessLauncher, Trainer
from agent.trainer.rundir import pid_alive
from agent.trainer.spawn import TrainerError, spawn_detached, trainer_env
from agent.trainer.warm_entry import DOC_PREFIX, GATE_FD, REPORT_FD, SAFEPATH_ADDED

log = logging.getLogger(__name__)

_LOG_TAIL = 4000
#: Longest report line read (the document is a few kB).
_REPORT_MAX = 1 << 22
#: Seconds a called-off process gets to leave by itself before its group is killed.
_CALL_OFF_S = 2.0
#: Seconds the report of a process started long before preflight asked is waited for at least.
_READ_AT_LEAST_S = 5.0


def trainer_python(command: str | None = None) -> str | None:
    """The Python that this box's ``libreyolo`` command (or ``command``) runs under (its ``#!``
    line): the warm process runs there, so that training in-process is what the command would
    do. None when the command is missing or not a plain Python script (then the start is cold)."""
    found = command or find_libreyolo()
    if found is None:
        return None
    try:
        with open(found, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    words = first[2:].decode("utf-8", "replace").split() if first.startswith(b"#!") else []
    if len(words) >= 2 and Path(words[0]).name == "env":
        words = [shutil.which(words[1]) or ""]
    python = words[0] if len(words) == 1 else ""
    if not (os.path.isabs(python) and "python" in Path(python).name and os.access(python, os.X_OK)):
        return None
    return python


def for_job(
    job: Job, launcher: ProcessLauncher, *, log_path: Path, result_path: Path
) -> WarmStart | None:
    """The warm start of ``job``'s first trainer (not yet started), or None when it starts
    cold: ``[preflight] warm_start`` off, a launcher of another trainer, ``[profile]`` on (the
    profiler measures the card: nothing may hold it), several GPUs, or a ``libreyolo`` command
    that is not a plain Python script. ``log_path`` and ``result_path`` are the launch's."""
    if not (job.preflight.warm_start and launcher.warm_start and not job.profile.enabled):
        return None
    config = warm_probe_config(plan_for(job))
    python = trainer_python() if config is not None else None
    if config is None or python is None:
        return None
    return WarmStart(
        config, python=python, log_path=log_path, result_path=result_path, cwd=job.job.runs_dir
    )


def _high_fd(fd: int) -> int:
    """A close-on-exec duplicate numbered above the child's 3 and 4 (posix_spawn's dup2 onto
    the same number would leave close-on-exec set), and close ``fd``."""
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    finally:
        os.close(fd)


class WarmStart:
    """One warm trainer process, from its start to its go or its abort."""

    def __init__(
        self,
        config: dict[str, Any],
        *,
        log_path: Path,
        result_path: Path,
        cwd: Path,
        python: str,
        extra_pythonpath: list[str] | None = None,
    ) -> None:
        self.config = config
        self.log_path = log_path
        self.result_path = result_path
        self.cwd = cwd
        self.python = python
        self.extra_pythonpath = list(extra_pythonpath or [])
        self.pid: int | None = None
        self.create_time: float | None = None
        self._id = uuid.uuid4().hex
        self._gate: int | None = None
        #: The report pipe's reading end, from :meth:`start` until :meth:`probe` reads it.
        self._report: int | None = None
        #: When :meth:`start` ran (monotonic), and why the process could not start.
        self._started: float | None = None
        self._start_error: str | None = None
        self._reported = False
        self._log_offset = 0

    @property
    def launch_id(self) -> str | None:
        """The id in the process's environment; None once it cannot be handed a launch."""
        return self._id if self._gate is not None and self._reported else None

    def argv(self) -> list[str]:
        return [self.python, "-m", "agent.trainer.warm_entry", json.dumps(self.config)]

    # ------------------------------------------------------------------ the probe

    def start(self) -> None:
        """Start the process (its probe runs at once); :meth:`probe` reads its report. Called
        as early as the agent knows the job will run preflight: the probe (torch's import and
        CUDA's start-up) is the longest step before the first epoch. Never raises: a process
        that could not start is what :meth:`probe` reports."""
        if self._started is not None:
            return
        self._started = time.monotonic()
        argv = self.argv()
        env = trainer_env(argv, self._id)
        paths = [*self.extra_pythonpath, *filter(None, env["PYTHONPATH"].split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        if "PYTHONSAFEPATH" not in env:
            # The runs dir (its cwd) stays off its import path; the process drops the variable
            # again before it trains, so that what LibreYOLO starts sees the environment bare.
            env["PYTHONSAFEPATH"] = "1"
            env[SAFEPATH_ADDED] = "1"
        report_r, report_w = os.pipe()
        gate_r, gate_w = os.pipe()
        report_r, report_w = _high_fd(report_r), _high_fd(report_w)
        gate_r, gate_w = _high_fd(gate_r), _high_fd(gate_w)
        try:
            with contextlib.suppress(OSError):
                self._log_offset = self.log_path.stat().st_size
            self.pid = spawn_detached(
                argv,
                env,
                log_path=self.log_path,
                result_path=self.result_path,
                cwd=self.cwd,
                header="warm start: the trainer's Python runs the GPU probe, then waits",
                keep_fds={report_w: REPORT_FD, gate_r: GATE_FD},
            )
        except TrainerError as exc:
            os.close(report_r)
            os.close(gate_w)
            self._start_error = str(exc)
            return
        finally:
            os.close(report_w)  # the child has its own copies (3 and 4), or there is none
            os.close(gate_r)
        self._gate, self._report = gate_w, report_r
        with contextlib.suppress(psutil.Error):
            self.create_time = psutil.Process(self.pid).create_time()
        log.info("warm start: trainer pid=%d runs the GPU probe", self.pid)

    async def probe(self, timeout_s: float) -> ProbeResult:
        """Start the process (unless :meth:`start` did) and read its probe's report, within
        ``timeout_s`` of its start; never raises for a problem of the process (as
        :func:`agent.preflight.runner.run_probe`)."""
        self.start()
        assert self._started is not None
        t0 = self._started
        if self._start_error is not None:
            return ProbeResult(None, 0.0, None, error=self._start_error)
        report_r, self._report = self._report, None
        if report_r is None:
            return ProbeResult(None, 0.0, None, error="the warm start's report was read already")
        # From its start; a report already waiting in the pipe still gets a moment to be read.
        timeout_s = max(_READ_AT_LEAST_S, timeout_s - (time.monotonic() - t0))
        stages: list[str] = []
        doc: Any = None
        timed_out = False
        try:
            doc = await asyncio.wait_for(self._read_report(report_r, stages), timeout_s)
        except TimeoutError:
            timed_out = True
            warn_hung(stages, timeout_s)
        finally:
            os.close(report_r)
        seconds = time.monotonic() - t0
        result = ProbeResult(
            None, seconds, None, timed_out=timed_out, last_stage=stages[-1] if stages else None
        )
        if isinstance(doc, dict) and doc.get("schema") == PROBE_SCHEMA:
            self._reported = True
            return ProbeResult(doc, seconds, None, last_stage=result.last_stage)
        code = await self.abort()
        what = "no report" if doc is None else "an unreadable report"
        return ProbeResult(
            None,
            seconds,
            code,
            timed_out=timed_out,
            last_stage=result.last_stage,
            error=None if timed_out else f"{what} (exit code {code})",
            stderr_tail=self._log_tail(),
        )

    async def _read_report(self, fd: int, stages: list[str]) -> Any:
        """Stage lines until the document (parsed; a string when unreadable) or end of file."""
        os.set_blocking(fd, False)
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        loop.add_reader(fd, readable.set)
        pending = b""
        try:
            while True:
                await readable.wait()
                readable.clear()
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    return None
                *lines, pending = (pending + chunk).split(b"\n")
                for raw in lines:
                    line = raw.decode("utf-8", "replace")
                    if line.startswith(STAGE_PREFIX):
                        stages.append(line[len(STAGE_PREFIX) :].strip())
                    elif line.startswith(DOC_PREFIX):
                        try:
                            return json.loads(line[len(DOC_PREFIX) :])
                        except ValueError:
                            return line
                if len(pending) > _REPORT_MAX:
                    return pending[:200].decode("utf-8", "replace")
        finally:
            loop.remove_reader(fd)

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(self._log_offset, f.seek(0, os.SEEK_END) - _LOG_TAIL))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    # ------------------------------------------------------------------ go or abort

    async def go(
        self, argv: list[str], *, log_path: Path, result_path: Path, cwd: Path, launch_id: str
    ) -> Trainer | None:
        """Hand ``argv`` to the waiting process: it becomes the trainer. None (the process
        called off) when it cannot: the caller then launches cold."""
        why = self._unfit(argv, log_path, result_path, cwd, launch_id)
        if why is None:
            assert self.pid is not None and self._gate is not None
            message = (json.dumps({"argv": [argv[0], *argv[1:]]}) + "\n").encode()
            gate, self._gate = self._gate, None
            try:
                os.write(gate, message)
            except OSError as exc:
                why = f"its gate is closed ({exc.strerror})"
            finally:
                os.close(gate)
        if why is not None:
            log.warning("warm start: not used (%s); starting the trainer cold", why)
            await self.abort()
            return None
        assert self.pid is not None and self.create_time is not None
        record = TrainerRecord(
            pid=self.pid, create_time=self.create_time, started_at=time.time(), argv=argv
        )
        log.info("trainer started pid=%d (warm: its Python ran the probe)", self.pid)
        return Trainer(record, is_child=True)

    def _unfit(
        self, argv: list[str], log_path: Path, result_path: Path, cwd: Path, launch_id: str
    ) -> str | None:
        if self._gate is None or not self._reported or self.pid is None:
            return "it has not reported"
        if launch_id != self._id:
            return "another launch id"
        if (log_path, result_path, cwd) != (self.log_path, self.result_path, self.cwd):
            return "other log or result files"
        libreyolo = find_libreyolo()
        if len(argv) < 2 or libreyolo is None or argv[0] != libreyolo or argv[1] != "train":
            return "the command is not `libreyolo train`"
        if self.create_time is None or not pid_alive(self.pid, self.create_time):
            return "it is gone"
        return None

    async def abort(self) -> int | None:
        """Call the process off: close its gate, give it a moment, kill its group, reap it.
        Returns its exit code when it was collected. Safe to call more than once."""
        gate, self._gate = self._gate, None
        if gate is not None:
            os.close(gate)
        report, self._report = self._report, None
        if report is not None:  # started early, never probed
            os.close(report)
        pid, self.pid = self.pid, None
        if pid is None:
            return None
        code = await self._reaped(pid, _CALL_OFF_S if self._reported else 0.0)
        kill_group(pid)  # also whatever it started in its session
        if code is None:
            code = await self._reaped(pid, KILL_GRACE_S)
        if code is None:
            log.warning("warm start: pid=%d does not go away (stuck in the driver?)", pid)
        return code

    @staticmethod
    async def _reaped(pid: int, seconds: float) -> int | None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 (returns at once)
            except ChildProcessError:
                return None
            if done:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.05)
