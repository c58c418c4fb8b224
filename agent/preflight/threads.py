"""Running blocking calls (NVML, the Hub client) without ever blocking the agent."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


async def in_thread(fn: Callable[[], _T], timeout_s: float, name: str) -> _T:
    """Run ``fn`` in a daemon thread; TimeoutError after ``timeout_s``.

    Not ``asyncio.to_thread``: a call that never returns (the Hub client has no read timeout, a
    broken driver can block NVML) would keep the default executor, and with it
    ``asyncio.run``'s shutdown, waiting forever. A daemon thread is simply abandoned.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[_T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def target() -> None:
        try:
            result: Any = fn()
            ok = True
        except BaseException as exc:
            result, ok = exc, False
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting
            loop.call_soon_threadsafe(settle, ok, result)

    threading.Thread(target=target, name=name, daemon=True).start()
    return await asyncio.wait_for(fut, timeout_s)
