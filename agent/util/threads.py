"""Running blocking calls (an upload, NVML, the Hub client) without ever blocking the agent.

Not a ``ThreadPoolExecutor`` nor ``asyncio.to_thread``: their threads are joined at interpreter
exit (and the default executor at ``asyncio.run``'s shutdown), so one call that never returns (an
upload hung on a dead Hub, a broken driver blocking NVML) would keep the finished agent, and the
box's bill, alive. A daemon thread is simply abandoned; callers keep nothing in it they cannot
lose.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


def in_daemon_thread(fn: Callable[..., _T], *args: Any, name: str) -> concurrent.futures.Future[_T]:
    """Run ``fn(*args)`` in a new daemon thread called ``name``; its future holds the result or
    the exception. A future cancelled before the thread got to it never runs ``fn``."""
    fut: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def target() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:
            fut.set_exception(exc)

    threading.Thread(target=target, name=name, daemon=True).start()
    return fut


async def in_thread(fn: Callable[[], _T], timeout_s: float, name: str) -> _T:
    """Await ``fn()`` run in a daemon thread called ``name``; TimeoutError after ``timeout_s``
    (the thread is abandoned)."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[_T] = loop.create_future()

    def settle(done: concurrent.futures.Future[_T]) -> None:
        if waiter.done():
            return
        exc = done.exception()
        if exc is None:
            waiter.set_result(done.result())
        else:
            waiter.set_exception(exc)

    def on_done(done: concurrent.futures.Future[_T]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting
            loop.call_soon_threadsafe(settle, done)

    in_daemon_thread(fn, name=name).add_done_callback(on_done)
    return await asyncio.wait_for(waiter, timeout_s)
