"""Blocking calls in daemon threads: results and errors come back, a hung call is abandoned."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agent.util.threads import in_daemon_thread, in_thread


def test_in_daemon_thread_returns_result_and_error_in_a_named_daemon_thread() -> None:
    seen: list[threading.Thread] = []

    def work(a: int, b: int) -> int:
        seen.append(threading.current_thread())
        return a + b

    assert in_daemon_thread(work, 2, 3, name="sync-test").result(timeout=10) == 5
    assert seen[0].daemon and seen[0].name == "sync-test"
    with pytest.raises(ZeroDivisionError):
        in_daemon_thread(lambda: 1 // 0, name="sync-test").result(timeout=10)


def test_in_thread_gives_the_result_and_times_out_on_a_hung_call() -> None:
    release = threading.Event()

    async def scenario() -> int:
        with pytest.raises(TimeoutError):
            await in_thread(lambda: release.wait(30), 0.05, "test-hung")
        with pytest.raises(ValueError, match="bad"):
            await in_thread(lambda: int("bad"), 10, "test-error")
        return await in_thread(lambda: 42, 10, "test-ok")

    try:
        assert asyncio.run(scenario()) == 42  # the hung thread did not hold asyncio.run up
    finally:
        release.set()
