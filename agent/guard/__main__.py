"""``python -m agent.guard STATE_DIR``: the guard process, as the agent starts it
(:func:`agent.guard.plan.ensure_running`): its command line, its log (stderr, which is
guard.log), the state directory's ``guard.lock`` (one guard per directory) and its signals.
What it watches and does is :class:`agent.guard.run.Guard`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from agent.guard.plan import LOCK_FILE
from agent.guard.run import Guard
from agent.state import lock_with_pid
from agent.util import logutil

# Named, not __name__: run as ``-m`` this module is ``__main__``, outside the ``agent``
# loggers that guard.log gets.
log = logging.getLogger("agent.guard")

#: A guard that finds guard.lock taken tries again this many times, 50 ms apart, before it
#: concludes another guard holds it (:func:`agent.guard.plan.guard_pid` takes the lock for a
#: moment to probe).
_LOCK_TRIES = 10


class GuardRunning(Exception):
    """Another guard holds the state directory's ``guard.lock`` (its pid in ``holder``)."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def _configure_logging() -> logging.Handler:
    """``agent`` loggers (the providers' too) to stderr, which is guard.log, dated lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("agent")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False
    logutil.install(handler)
    return handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agent.guard",
        description="Watch the agent's heartbeat in STATE_DIR and stop the box when the agent "
        "is dead past the job's hard deadline. Started by `libreyolo-agent run`.",
    )
    parser.add_argument("state_dir", type=Path, help="the agent's state directory")
    args = parser.parse_args(argv)
    _configure_logging()
    state_dir: Path = args.state_dir.absolute()
    try:
        lock_fd = lock_with_pid(state_dir / LOCK_FILE, tries=_LOCK_TRIES, held=GuardRunning)
    except GuardRunning as exc:
        log.info("guard: another guard (pid %s) watches %s; exiting", exc.holder, state_dir)
        return 0
    except OSError as exc:
        log.error("guard: cannot lock %s: %s", state_dir / LOCK_FILE, exc.strerror or exc)
        return 1
    # Hold no directory that someone may want to unmount or remove.
    with contextlib.suppress(OSError):
        os.chdir("/")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Only set the event: the current step (a teardown call) finishes first.
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    log.info("guard: watching %s (pid %d)", state_dir, os.getpid())
    try:
        return Guard(state_dir, stop=stop, lock_fd=lock_fd).run()
    finally:
        os.close(lock_fd)


if __name__ == "__main__":
    sys.exit(main())
