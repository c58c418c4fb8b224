"""What the daemon is asked to do, as events: stop the job, the agent exiting, forcing.

Signal handlers only set these events; the run loop does the work (hypercorn, uvicorn). SIGINT
and SIGTERM to the agent stop the *agent* (the trainer keeps running); a second one forces.
Stopping the *job* is a different request (``libreyolo-agent stop`` / POST /stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class Flags:
    #: ``libreyolo-agent stop`` / POST /stop: the trainer gets SIGINT, then the final sync.
    stop_job: asyncio.Event = field(default_factory=asyncio.Event)
    #: The agent exits (SIGINT/SIGTERM, or a test's shutdown trigger); the trainer goes on.
    shutdown: asyncio.Event = field(default_factory=asyncio.Event)
    #: A second signal: skip the grace periods.
    force: asyncio.Event = field(default_factory=asyncio.Event)
    #: A preemption notice (cloud metadata, or a SIGTERM the job declared one): save last.pt at
    #: once and stop the trainer cleanly; the next boot resumes.
    preempt: asyncio.Event = field(default_factory=asyncio.Event)
    #: ``libreyolo-agent release`` (or a stop in HELD): a HELD box goes on to its teardown.
    release: asyncio.Event = field(default_factory=asyncio.Event)


def install(flags: Flags, *, on_preempt: Callable[[], None] | None = None) -> None:
    """SIGINT/SIGTERM set ``flags.shutdown`` (a second one also ``flags.force``). With
    ``on_preempt`` (``[preemption] sigterm = true``) the first SIGTERM calls it instead."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if sig == signal.SIGTERM and on_preempt is not None and not flags.preempt.is_set():
            on_preempt()
            return
        if flags.shutdown.is_set():
            flags.force.set()
        flags.shutdown.set()

    # Signals can only be listened to from the main thread.
    with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
        for sig in _SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)


def remove() -> None:
    with contextlib.suppress(Exception):
        loop = asyncio.get_running_loop()
        for sig in _SIGNALS:
            loop.remove_signal_handler(sig)
