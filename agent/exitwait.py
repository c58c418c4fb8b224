"""Waiting for a trainer process to exit: woken by the exit itself, never by a slow poll.

The trainer's exit starts the billed path to the teardown call, so it is noticed at once: a pidfd
(readable when the process exits, watched by the event loop) where the kernel gives one; where it
does not (a kernel before 5.3, a container's seccomp filter, gVisor), ``waitid`` in a thread for
our own child (a trainer this agent launched), and only for someone else's child (a trainer
re-attached after an agent restart) a short poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

from .rundir import pid_alive

#: Without a pidfd, how often a trainer that is not our child (re-attached) is looked at,
#: seconds (a 1 s poll noticed an exit 0.5 s late on average, each second of it billed).
EXIT_POLL_S = 0.1


async def wait_exit(pid: int, create_time: float | None, *, is_child: bool) -> None:
    """Return once ``pid`` (created at ``create_time``) has exited. Our child is not reaped
    here (its exit code is collected by the caller's ``waitpid``)."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        # No pidfd (or the pid is already gone).
        if is_child and await child_exited(pid):
            return
        while pid_alive(pid, create_time):  # noqa: ASYNC110
            await asyncio.sleep(EXIT_POLL_S)
        return
    if not pid_alive(pid, create_time):
        os.close(fd)
        return
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def on_exit() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, on_exit)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def child_exited(pid: int) -> bool:
    """Wait until our child ``pid`` has exited, without reaping it (``waitid`` with
    ``WNOWAIT``, in a daemon thread: a trainer left running when the agent exits must not hold
    the interpreter's exit). False at once when ``pid`` is not our child after all."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[bool] = loop.create_future()

    def settle(waited: bool) -> None:
        if not done.done():
            done.set_result(waited)

    def block() -> None:
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            waited = True
        except OSError:  # ChildProcessError: not our child (or already reaped)
            waited = False
        with contextlib.suppress(RuntimeError):  # the loop is closed: the agent has exited
            loop.call_soon_threadsafe(settle, waited)

    threading.Thread(target=block, name=f"wait-trainer-{pid}", daemon=True).start()
    return await done
