"""The guard as a thread of the supervisor: one Python process less on a supervised box.

On a rented box the agent runs under ``libreyolo-agent supervise`` (agent/supervisor.py), a
process that already lives as long as the job, outlives every agent and waits on nothing but a
pidfd. The guard (agent/guard/run.py) is another such process: it waits on a clock and a
heartbeat file. Each is a whole Python interpreter (4.5-9 MiB PSS before any import on an
H200 image, issue 26), so the supervisor hosts the guard in a thread of its own:
:class:`HostedGuard` holds the state directory's ``guard.lock`` with the supervisor's pid in it,
and the agent's :func:`~agent.guard.plan.ensure_running` (called at every heartbeat) finds the
lock held and starts no guard process.

What stays as it was: the same :class:`~agent.guard.run.Guard` loop decides and acts (the agent
dead past the hard deadline, a lapsed hold, an unconfirmed teardown); its lines go to
``guard.log``; it acts in its own thread, so a provider call that hangs never stops the
supervisor from restarting the agent, and the supervisor's signals never interrupt a teardown
half-sent (Python runs signal handlers in the main thread only).

What a thread cannot do is outlive its process, and the guard must outlive the agent, whoever
stops. So whenever the supervisor exits with the guard's work not over (SIGTERM/SIGINT, it gave
up on a crash-looping agent, an agent that exited 0 without the job ending), :meth:`close` hands
the watch over: it ends the thread after its current step, lets go of ``guard.lock``, and starts
the standalone guard (``python -m agent.guard``, its own session) through ``ensure_running``,
which carries on from ``guard.json``. A supervisor killed outright (SIGKILL, the OOM killer)
releases the lock with its process; the agent's next heartbeat starts the standalone guard.
Until the agent has written ``guard-plan.json`` there is nothing to guard: the thread holds the
lock and looks for the plan every ``poll_s``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from agent.guard.plan import LOCK_FILE, LOG_FILE, ensure_running, read_plan
from agent.guard.run import Guard
from agent.state import lock_with_pid
from agent.util import logutil

log = logging.getLogger(__name__)

#: The thread's name: guard.log takes the records logged from it, supervisor.log the others.
THREAD_NAME = "guard"
#: Seconds between looks for the plan (and for a guard.lock that another guard let go).
POLL_S = 2.0
#: How long :meth:`HostedGuard.close` waits for the guard's current step before it hands over.
JOIN_S = 30.0


class _Held(Exception):
    """guard.lock is held by another guard (a standalone one, from an agent run before)."""


def from_guard_thread(record: logging.LogRecord) -> bool:
    return record.threadName == THREAD_NAME


def not_from_guard_thread(record: logging.LogRecord) -> bool:
    return record.threadName != THREAD_NAME


class HostedGuard:
    """The guard of ``state_dir`` in a thread of this process (see the module's text)."""

    def __init__(
        self,
        state_dir: Path,
        *,
        poll_s: float = POLL_S,
        hand_over: Callable[[Path], int | None] = ensure_running,
    ) -> None:
        self.state_dir = state_dir.absolute()
        self.poll_s = poll_s
        self._hand_over = hand_over
        self.stop = threading.Event()
        #: The guard's work ended by itself (the job ended, or it acted and the provider
        #: confirmed): nothing to hand over.
        self.over = False
        self._fd: int | None = None
        self._thread: threading.Thread | None = None
        self._handler: logging.Handler | None = None

    def start(self) -> None:
        """Start the thread (daemon: an exiting process never waits on a hung provider call)."""
        handler = logging.FileHandler(self.state_dir / LOG_FILE)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler.addFilter(from_guard_thread)
        logging.getLogger("agent").addHandler(handler)
        logutil.install(handler)
        self._handler = handler
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def close(self, *, join_s: float = JOIN_S) -> int | None:
        """End the thread after its current step and let go of ``guard.lock``; when the work
        is not over, start the standalone guard and return its pid."""
        self.stop.set()
        if self._thread is not None:
            self._thread.join(join_s)
            if self._thread.is_alive():
                log.warning(
                    "guard: its current step did not end in %.0fs; handing over anyway", join_s
                )
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # the flock goes with it
        pid = None
        if not self.over and fd is not None and self._plan_exists() and not self._job_over():
            pid = self._hand_over(self.state_dir)
            log.info("guard: handed over to a guard process (pid %s)", pid)
        if self._handler is not None:
            logutil.uninstall(self._handler)
            logging.getLogger("agent").removeHandler(self._handler)
            self._handler.close()
            self._handler = None
        return pid

    # ------------------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                if self._fd is None:
                    self._fd = lock_with_pid(self.state_dir / LOCK_FILE, held=_Held)
                    log.info("guard: hosted in the supervisor (pid %d)", os.getpid())
                if self._plan_exists():
                    Guard(self.state_dir, stop=self.stop, lock_fd=self._fd).run()
                    if not self.stop.is_set():
                        self.over = True
                        return
            except _Held:
                pass  # a standalone guard watches; look again later (it may end)
            except Exception:  # one bad look must not end the safety net
                log.exception("guard: the hosted guard failed a look; trying again")
            self.stop.wait(self.poll_s)

    def _job_over(self) -> bool:
        """The job ended since the thread's last look (the agent exits 0 at DONE, and the
        supervisor with it, before the next look): nothing to hand over."""
        try:
            return Guard(self.state_dir).job_over()
        except Exception:  # unreadable: hand over, the guard process looks for itself
            log.exception("guard: cannot read the job's state; handing over")
            return False

    def _plan_exists(self) -> bool:
        with contextlib.suppress(ValueError):  # unreadable: the guard says so when it reads it
            return read_plan(self.state_dir) is not None
        return True
