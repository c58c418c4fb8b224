"""Stopping a child the agent started in its own session: its whole process group is signalled,
given a grace period, SIGKILLed when it does not go, and reaped. The one home of the rule: the
preflight probe (agent/preflight/runner.py), the profiler's children (agent/watch/profiling.py)
and the teardown command (agent/providers/command.py) all stop their child here; the checking
children (agent/trainer/finite.py's NaN scan, agent/trainer/loadcheck.py's restore drill) run
through :func:`run_check_child`.

The group, not the pid: what a child starts (dataloader workers, NCCL workers, a cloud tool's
helpers) shares its session and outlives it otherwise. Every child stopped here was started with
``start_new_session=True``, so its pid is its group's id.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from agent.util.childenv import child_env

#: Seconds a signalled group is given to go before SIGKILL (and a SIGKILLed one before the
#: wait is given up: a process stuck in the driver, state D, may never go).
KILL_GRACE_S = 5.0
#: Seconds the readers of a stopped child's pipes get to reach the end of what it wrote.
READERS_GRACE_S = 1.0


def kill_group(pgid: int, sig: signal.Signals = signal.SIGKILL) -> bool:
    """Send ``sig`` to the process group ``pgid``, which may already be gone. Whether it was
    sent."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


async def stop_group(
    proc: asyncio.subprocess.Process,
    *,
    sig: signal.Signals = signal.SIGTERM,
    grace_s: float = KILL_GRACE_S,
) -> int | None:
    """Send ``sig`` to ``proc``'s process group and wait up to ``grace_s`` for ``proc`` to be
    reaped; when it is still there (and ``sig`` was not already SIGKILL), SIGKILL the group and
    wait ``grace_s`` again. The group is signalled even when ``proc`` has exited: what it left
    behind in its session goes too. Returns the exit status, or None when ``proc`` never went.
    """
    for s in (sig,) if sig == signal.SIGKILL else (sig, signal.SIGKILL):
        kill_group(proc.pid, s)
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(proc.wait(), grace_s)
    return proc.returncode


async def finish_readers(*readers: asyncio.Task[object], grace_s: float = READERS_GRACE_S) -> None:
    """Let the tasks reading a stopped child's pipes reach the end, for up to ``grace_s``, then
    cancel what is left (a grandchild that keeps the pipe open) and collect every outcome, the
    readers' own errors included, so that none is left "never retrieved"."""
    _, pending = await asyncio.wait(readers, timeout=grace_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*readers, return_exceptions=True)


@dataclass(frozen=True)
class ChildRun:
    """What :func:`run_check_child` saw: the child's output and exit, or why there is none."""

    stdout: bytes
    stderr: bytes
    returncode: int | None
    elapsed_s: float
    #: None: the child ran to its exit; "start": it could not be started; "timeout": killed.
    failure: Literal["start", "timeout"] | None = None
    #: The reason for ``failure`` (the OSError's words, or the timeout).
    why: str = ""


async def run_check_child(
    argv: Sequence[str], *, timeout_s: float, grace_s: float = KILL_GRACE_S
) -> ChildRun:
    """Run a checking child (a checkpoint's NaN scan, a restore drill's load) on the CPU in its
    own session, its output collected; killed with its group past ``timeout_s``, and when the
    caller is cancelled (re-raised then: no orphan holding a mapped checkpoint)."""
    env = child_env()
    env["CUDA_VISIBLE_DEVICES"] = ""  # a check never takes GPU memory from the trainer
    env.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        return ChildRun(
            b"", b"", None, time.monotonic() - started, "start", exc.strerror or str(exc)
        )
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        await stop_group(proc, grace_s=grace_s)
        why = f"took over {timeout_s:.0f}s and was killed"
        return ChildRun(b"", b"", None, time.monotonic() - started, "timeout", why)
    except asyncio.CancelledError:
        await stop_group(proc, grace_s=grace_s)
        raise
    return ChildRun(stdout, stderr, proc.returncode, time.monotonic() - started)
