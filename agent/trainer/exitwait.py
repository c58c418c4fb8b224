"""Waiting for a trainer process to exit: woken by the exit itself, never by a slow poll.

The trainer's exit starts the billed path to the teardown call, so it is noticed at once: a pidfd
(readable when the process exits, watched by the event loop) where the kernel gives one; where it
does not (a kernel before 5.3, a container's seccomp filter, gVisor), ``waitid`` in a thread for
our own child (a trainer this agent launched), and only for someone else's child (a trainer
re-attached after an agent restart) a short poll.

And nothing the supervision loop observes in a turn holds the exit (:func:`unless_exited`): an
NVML read through its host, the progress sample or the sizing sample that is under way when the
trainer exits cleanly is not waited for (a hung NVML call is answered after 30 s); after any
other exit it is (a GPU fault read may say why the trainer died; a resume follows).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Awaitable
from typing import Any, TypeVar

from agent.trainer.rundir import pid_alive

log = logging.getLogger(__name__)
T = TypeVar("T")
U = TypeVar("U")

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


async def unless_exited(
    work: Awaitable[T], exit_task: asyncio.Future[Any] | None, gone: U
) -> T | U:
    """``work`` (an observation of the supervision loop's turn: a blocking call in a thread), or
    ``gone`` when ``exit_task`` (the wait for the trainer's exit) ends first with a clean exit
    (code 0). A slow or hung call (the NVML host waits 30 s for an answer) must not hold a
    completed run's way to its teardown: the observation is moot, and it ends on its own. Any
    other exit still waits for it: a GPU fault read may say why the trainer died, and a resume
    must not start while the last sample is still being taken in its thread."""
    task = asyncio.ensure_future(work)
    if exit_task is None or task.done():
        return await task
    await asyncio.wait({task, exit_task}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    if _exit_code(exit_task) != 0:
        return await task
    task.add_done_callback(_quiet)
    log.debug("the trainer exited during an observation of the turn: not waiting for it")
    return gone


def _exit_code(exit_task: asyncio.Future[Any]) -> int | None:
    if exit_task.cancelled() or exit_task.exception() is not None:
        return None
    code = exit_task.result()
    return code if isinstance(code, int) else None


def _quiet(task: asyncio.Future[Any]) -> None:
    """An observation nobody waits for any more: its error, if any, is retrieved, not logged as
    never retrieved."""
    if not task.cancelled():
        task.exception()
