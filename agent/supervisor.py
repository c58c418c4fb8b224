"""The container supervisor: ``libreyolo-agent supervise JOB`` restarts the agent when it fails,
where no systemd is PID 1 to do it (most rented GPU boxes are containers).

It runs ``libreyolo-agent run JOB`` as its child and, when the agent exits, decides
(:meth:`Policy.after_exit`):

- exit 0, the job ended as planned (or the agent was asked to exit): done, the supervisor exits 0;
- exit 2, a bad job file (or bad guard settings): a restart cannot fix it, exits 2;
- any other exit, or killed by a signal (OOM killer, SIGKILL): start it again after a backoff
  doubling from ``first_backoff_s`` (5 s) to ``max_backoff_s`` (5 min). An agent that stayed
  up ``min_uptime_s`` (60 s) resets the count; ``max_restarts`` (10) restarts in a row, each
  agent dying sooner than that, and the supervisor gives up (exit 1). The restarted agent
  re-attaches to the trainer, which outlives it (agent/policy/restart.py says where it carries on).

It does not fight the agent's own safety nets: the agent ends its own crash loop with a gated
teardown (agent/policy/restart.py; that start exits 0, so it is not restarted), and the guard
(agent/guard/run.py) stops the box if the agent stays dead past the hard deadline. The guard runs
in a thread of this process (agent/guard/hosted.py: one Python less on the box), holding
``guard.lock``, so the agent starts no guard process; the supervising loop never touches
``agent.lock`` or the heartbeat, and an agent that finds the guard acting exits 1 and is
restarted, with backoff, into its verdict (DONE: exit 0). A supervisor that exits with the
guard's work not over (stopped, gave up) hands the watch to a guard process of its own session
before it goes; one killed outright lets go of the lock, and the agent's next heartbeat starts
that process.

SIGTERM or SIGINT to the supervisor is forwarded to the agent (which exits, leaving the trainer
running; a second signal forces it, as the agent's own rule says); the supervisor waits for it,
does not restart it, and exits 0. The agent runs in its own process group, so a signal to the
supervisor's group (Ctrl-C in a terminal) reaches the agent once, forwarded.

Files, in the state directory (``LIBREYOLO_AGENT_STATE_DIR``):

- ``supervisor.pid``: the supervisor's pid, under an exclusive flock held for its life; a second
  supervisor of the same state directory exits at once naming the first.
- ``supervisor.json``: ``state`` (running, waiting, finished, bad_job, gave_up, stopped),
  ``agent_pid``, ``restarts`` (agents started again so far), ``restarts_in_a_row`` (counting the
  one ``waiting`` for), ``last_exit`` (code or signal, uptime), ``next_restart_at`` (while
  waiting), and the latest ``exits``.
- ``supervisor.log`` (or ``--log FILE``): the agent's stdout and stderr, appended, with the
  supervisor's own lines (``supervisor: ...``) in between.

On a container, the bootstrap starts it in its own session, and the same line in the
provider's on-start field brings everything back after a container restart (the agent
re-attaches to a live trainer, or resumes from ``last.pt`` after a reboot)::

    setsid -f /opt/libreyolo-agent/.venv/bin/libreyolo-agent supervise /root/job.toml \\
        </dev/null >/dev/null 2>&1

Running it again while a supervisor lives is harmless: the second one exits at once.

It lives as long as the job, so it is kept small (issue 26: every process of ours together under
80 MiB PSS): ``libreyolo-agent supervise`` enters here before the rest of the CLI is imported
(:func:`agent.supervise.main`, dispatched from the top of agent/cli.py and by agent/entry.py,
reads a plain command line without argparse); the job file is checked in a forked child that
exits (the job parser, and a bad job's teardown, never stay in this process); the loop waits on
the agent's pidfd and a signal pipe with ``select`` instead of asyncio. It imports the standard
library's ``subprocess`` and ``logging``, not ``typing``, ``argparse`` or ``dataclasses``,
and of the agent :mod:`agent.util.logutil` (with :mod:`agent.util.redact`), :mod:`agent.state`,
:mod:`agent.util.backoff`, :mod:`agent.util.childenv` and the waiting guard's modules
(tests/test_supervisor.py checks what a running supervisor holds).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from agent.state import atomic_write_json, lock_with_pid
from agent.util import logutil
from agent.util.backoff import doubling_s
from agent.util.childenv import child_env

#: ``typing.TYPE_CHECKING`` without importing typing (0.5 MiB the supervisor does not hold);
#: the standard library's dataclasses for mypy, agent.util.record's at run time (1.0 MiB less).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from dataclasses import dataclass as record
    from typing import Any, Literal

    SupervisorState = Literal[
        "running",  #: the agent runs
        "waiting",  #: the agent failed; it starts again at next_restart_at
        "finished",  #: the agent exited 0: the job ended (or the agent was asked to exit)
        "bad_job",  #: the agent exited 2: a restart cannot fix it
        "gave_up",  #: too many restarts in a row
        "stopped",  #: the supervisor was asked to exit (SIGTERM/SIGINT), the agent with it
    ]
else:
    from agent.util.record import record

log = logging.getLogger(__name__)

PID_FILE = "supervisor.pid"
STATE_FILE = "supervisor.json"
LOG_FILE = "supervisor.log"

#: agent.config.model.DEFAULT_STATE_DIR, without importing the job's configuration for it.
DEFAULT_STATE_DIR = "/var/lib/libreyolo-agent"
#: The agent's exit code for a bad job file: a restart cannot fix it.
EXIT_BAD_JOB = 2
#: How many of the latest exits supervisor.json keeps.
EXITS_KEPT = 20


class AlreadySupervised(Exception):
    """Another supervisor holds this state directory's ``supervisor.pid`` (its pid in
    ``holder``)."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


@record(frozen=True)
class Verdict:
    """What to do after the agent exited."""

    #: Start the agent again (after ``delay_s``).
    restart: bool
    #: Seconds to wait before that start.
    delay_s: float
    #: The restarts in a row, counting this one, of agents that did not stay up.
    in_a_row: int
    #: Why, for the log.
    why: str
    #: The state the supervisor is in now.
    state: SupervisorState


@record(frozen=True)
class Policy:
    """When to restart the agent, and how long to wait first."""

    #: Restarts in a row (each agent up less than ``min_uptime_s``) before giving up.
    max_restarts: int = 10
    #: Seconds before the first restart; doubles for each further one in a row.
    first_backoff_s: float = 5.0
    #: The longest wait before a restart, seconds.
    max_backoff_s: float = 300.0
    #: An agent up at least this long (seconds) was not crash-looping: the count starts over.
    min_uptime_s: float = 60.0

    @classmethod
    def from_options(
        cls, max_restarts: int, first_backoff_s: float, max_backoff_s: float, min_uptime_s: float
    ) -> Policy:
        """From the command line's values; raises :class:`~agent.config.model.ConfigError` naming
        each option out of range."""
        wrong = [
            (option, f"must be {what}, not {value:g}")
            for option, value, what, ok in (
                ("--max-restarts", max_restarts, "0 or more", max_restarts >= 0),
                ("--first-backoff", first_backoff_s, "more than 0", first_backoff_s > 0),
                ("--max-backoff", max_backoff_s, "more than 0", max_backoff_s > 0),
                ("--min-uptime", min_uptime_s, "0 or more", min_uptime_s >= 0),
            )
            if not ok  # NaN is never ok
        ]
        if wrong:  # the job's error types, imported on this path only
            from agent.config.jobvalues import ConfigError, ConfigErrors

            raise ConfigErrors([ConfigError(option, why) for option, why in wrong])
        return cls(max_restarts, first_backoff_s, max_backoff_s, min_uptime_s)

    def backoff_s(self, in_a_row: int) -> float:
        """The wait before restart number ``in_a_row`` (1 for the first)."""
        return doubling_s(in_a_row, first_s=self.first_backoff_s, cap_s=self.max_backoff_s)

    def after_exit(self, returncode: int, uptime_s: float, in_a_row: int) -> Verdict:
        """The verdict on an agent that exited with ``returncode`` (negative: killed by that
        signal) after ``uptime_s`` seconds, ``in_a_row`` restarts having come before it."""
        if returncode == 0:
            return Verdict(False, 0.0, 0, "the job ended (exit 0)", "finished")
        if returncode == EXIT_BAD_JOB:
            return Verdict(
                False, 0.0, in_a_row, "bad job file (exit 2): a restart cannot fix it", "bad_job"
            )
        if uptime_s >= self.min_uptime_s:
            in_a_row = 0
        if in_a_row >= self.max_restarts:
            return Verdict(
                False,
                0.0,
                in_a_row,
                f"{in_a_row} restarts in a row, none up {self.min_uptime_s:g}s: giving up",
                "gave_up",
            )
        n = in_a_row + 1
        return Verdict(True, self.backoff_s(n), n, f"restart {n} in a row", "waiting")


def signal_name(returncode: int) -> str | None:
    """``SIGKILL`` for an exit code of -9; None for a normal exit."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def describe_exit(returncode: int) -> str:
    """``exit 1``, ``killed by SIGKILL``."""
    name = signal_name(returncode)
    return f"exit {returncode}" if name is None else f"killed by {name}"


def agent_argv(job: Path, *, verbose: bool = False) -> list[str]:
    """``libreyolo-agent run JOB`` with this very interpreter (and package: ``-P`` keeps the
    working directory from putting another ``agent`` first)."""
    return [sys.executable, "-P", "-m", "agent.cli", "run", str(job), *(["-v"] if verbose else [])]


class Supervisor:
    def __init__(
        self,
        argv: Sequence[str],
        state_dir: Path,
        *,
        log_path: Path | None = None,
        policy: Policy | None = None,
        env: dict[str, str] | None = None,
        clock: Callable[[], float] = time.time,
        host_guard: bool = False,
    ) -> None:
        """Supervise the agent started by ``argv`` (:func:`agent_argv`; tests pass a stand-in)
        on ``state_dir``; its output is appended to ``log_path`` (default
        ``STATE_DIR/supervisor.log``). ``env``: the agent's environment (default: this one,
        with the state directory set). ``host_guard``: run the guard in a thread of this
        process (agent/guard/hosted.py), as ``libreyolo-agent supervise`` does."""
        self.argv = list(argv)
        self.state_dir = state_dir.absolute()
        self.log_path = (log_path or self.state_dir / LOG_FILE).absolute()
        self.policy = policy or Policy()
        self.env = dict(env if env is not None else child_env())
        self.env["LIBREYOLO_AGENT_STATE_DIR"] = str(self.state_dir)
        self.clock = clock
        self.host_guard = host_guard
        self.record: dict[str, Any] = {
            "pid": os.getpid(),
            "argv": self.argv,
            "log": str(self.log_path),
            "started_at": clock(),
            "state": "running",
            "agent_pid": None,
            "agent_started_at": None,
            "restarts": 0,
            "restarts_in_a_row": 0,
            "last_exit": None,
            "next_restart_at": None,
            "exits": [],
        }
        #: Signals received and not yet passed on; set by the handler, read by the loop.
        self._pending: list[signal.Signals] = []
        self._stopped = False
        self._wake_r = -1

    def lock(self) -> int:
        """Create the state directory and take ``supervisor.pid``; raises
        :class:`AlreadySupervised` naming the holder, OSError when it cannot."""
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return lock_with_pid(self.state_dir / PID_FILE, held=AlreadySupervised)

    def run(self) -> int:
        """Hold the pid file and supervise until the agent is done; the exit code: 0 finished
        or stopped, 1 gave up, 2 bad job. Raises :class:`AlreadySupervised`. Call it from the
        main thread (it handles SIGTERM and SIGINT)."""
        lock = self.lock()
        try:
            log_fd = os.open(
                self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
            )
            try:
                handler = logging.FileHandler(self.log_path)
                handler.setFormatter(
                    logging.Formatter("%(asctime)s supervisor: %(message)s", "%Y-%m-%d %H:%M:%S")
                )
                with logutil.to_file(handler), self._signal_pipe(), self._guard(handler):
                    return self._supervise(log_fd)
            finally:
                os.close(log_fd)
        finally:
            os.close(lock)  # the flock goes with it; the file stays, naming the last holder

    @contextlib.contextmanager
    def _guard(self, handler: logging.Handler) -> Any:
        """The guard in a thread for the supervision's life, handed over to a guard process at
        its end if its work is not over (agent/guard/hosted.py; imported here only)."""
        if not self.host_guard:
            yield
            return
        from agent.guard.hosted import HostedGuard, not_from_guard_thread

        handler.addFilter(not_from_guard_thread)  # its lines go to guard.log
        hosted = HostedGuard(self.state_dir)
        hosted.start()
        try:
            yield
        finally:
            hosted.close()

    # ------------------------------------------------------------------------------ the loop

    @contextlib.contextmanager
    def _signal_pipe(self) -> Any:
        """SIGTERM and SIGINT noted by a handler and written to a pipe, which wakes ``select``
        in the loop; the previous handlers and wake-up fd come back afterwards."""
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        old = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        self._wake_r = r
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(old_fd)
            os.close(r)
            os.close(w)
            self._wake_r = -1

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stopped = True
        self._pending.append(signal.Signals(signum))

    def _wait(self, fds: list[int], timeout: float | None) -> None:
        """Until one of ``fds`` or the signal pipe is readable, a signal came, or ``timeout``."""
        if self._pending:
            return
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select([self._wake_r, *fds], [], [], timeout)
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 512)

    def _supervise(self, log_fd: int) -> int:
        log.info(
            "supervising %s (pid %d; state in %s)", " ".join(self.argv), os.getpid(), self.state_dir
        )
        while True:
            started = self.clock()
            code = self._run_agent(log_fd)
            uptime = self.clock() - started
            self._note_exit(code, uptime)
            if self._stopped:
                log.info("agent %s; stopped as asked, not restarting", describe_exit(code))
                self._save(state="stopped")
                return 0
            verdict = self.policy.after_exit(code, uptime, int(self.record["restarts_in_a_row"]))
            self.record["restarts_in_a_row"] = verdict.in_a_row
            if not verdict.restart:
                log.info("agent %s after %.0fs: %s", describe_exit(code), uptime, verdict.why)
                self._save(state=verdict.state)
                return {"finished": 0, "bad_job": EXIT_BAD_JOB}.get(verdict.state, 1)
            self._save(state="waiting", next_restart_at=self.clock() + verdict.delay_s)
            log.warning(
                "agent %s after %.0fs; %s, in %.1fs",
                describe_exit(code),
                uptime,
                verdict.why,
                verdict.delay_s,
            )
            until = time.monotonic() + verdict.delay_s
            while not self._stopped and (left := until - time.monotonic()) > 0:
                self._wait([], left)
            self._pending.clear()  # nothing runs to pass them on to
            if self._stopped:
                log.info("stopped as asked while waiting; not restarting")
                self._save(state="stopped", next_restart_at=None)
                return 0
            self.record["restarts"] += 1

    def _run_agent(self, log_fd: int) -> int:
        """Start the agent, forward every signal the supervisor gets to it, return its exit
        code (negative: the signal that killed it)."""
        proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            env=self.env,
            process_group=0,  # signals reach it from here only, once each
        )
        self._save(state="running", agent_pid=proc.pid, agent_started_at=self.clock())
        log.info("agent started (pid %d)", proc.pid)
        try:
            exited: list[int] = [os.pidfd_open(proc.pid)]
        except (AttributeError, OSError):  # no pidfd (old kernel, a seccomp filter): poll
            exited = []
        try:
            while True:
                while self._pending:
                    sig = self._pending.pop(0)
                    log.info("%s received: passing it on to the agent (pid %d)", sig.name, proc.pid)
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(sig)
                code = proc.poll()
                if code is not None:
                    return code
                self._wait(exited, None if exited else 0.2)
        finally:
            for fd in exited:
                os.close(fd)

    # ------------------------------------------------------------------------------ the record

    def _note_exit(self, code: int, uptime_s: float) -> None:
        entry: dict[str, Any] = {
            "at": self.clock(),
            "pid": self.record["agent_pid"],
            "code": code if code >= 0 else None,
            "signal": signal_name(code),
            "uptime_s": round(uptime_s, 3),
        }
        self.record["last_exit"] = entry
        self.record["exits"] = [*self.record["exits"], entry][-EXITS_KEPT:]
        self.record["agent_pid"] = None

    def _save(self, **changes: Any) -> None:
        self.record.update(changes)
        if self.record["state"] != "waiting":
            self.record["next_restart_at"] = None
        try:
            atomic_write_json(self.state_dir / STATE_FILE, self.record)
        except OSError as exc:  # a full disk must not stop the supervision
            log.error("cannot write %s: %s", STATE_FILE, exc.strerror or exc)


def read_record(state_dir: Path) -> dict[str, Any] | None:
    """``supervisor.json`` of ``state_dir``, or None when there is none (or it is unreadable)."""
    try:
        data = json.loads((state_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
