"""The trainer's exit is noticed at once, pidfd or not (agent/trainer/exitwait.py).

Where the kernel refuses ``pidfd_open`` (a container's seccomp filter, an old kernel) the agent
used to poll the pid once a second: the exit was seen 0.5 s late on average, every second of it
billed before the teardown call (bench/exit_teardown.py --no-pidfd: 0.70 s before, 0.002 s
now). Here ``pidfd_open`` is refused by patching it (a fault nothing else can produce on this
box); the processes, their exits and the waits are real.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.trainer import exitwait
from agent.trainer.process import Trainer
from agent.trainer.rundir import pid_alive
from tests.support import wait_for
from tests.test_trainer import spawn_orphan

#: Exits with code 7 once the file named by its argument exists.
WAITS_FOR_FILE = (
    "import os, sys, time\n"
    "while not os.path.exists(sys.argv[1]):\n"
    "    time.sleep(0.01)\n"
    "sys.exit(7)\n"
)


@pytest.fixture
def no_pidfd(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``pidfd_open`` refused, as a seccomp filter does; every pid_alive look counted, and any
    poll made an hour long (a test that polled would hit its deadline instead of passing)."""
    looks: list[int] = []

    def refused(pid: int, flags: int = 0) -> int:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    def counted(pid: int | None, create_time: float | None = None) -> bool:
        looks.append(pid or 0)
        return pid_alive(pid, create_time)

    monkeypatch.setattr(os, "pidfd_open", refused)
    monkeypatch.setattr(exitwait, "pid_alive", counted)
    monkeypatch.setattr(exitwait, "EXIT_POLL_S", 3600.0)
    return looks


@pytest.fixture
def children() -> Iterator[list[int]]:
    """Child pids a test started: killed and collected at the end, pass or fail."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


async def launch(tmp: Path, children: list[int]) -> Trainer:
    trainer = await Trainer.launch(
        [sys.executable, "-c", WAITS_FOR_FILE, str(tmp / "go")],
        log_path=tmp / "trainer.log",
        result_path=tmp / "trainer-result.json",
        cwd=tmp,
    )
    children.append(trainer.pid)
    return trainer


def test_without_a_pidfd_our_childs_exit_wakes_the_wait_and_keeps_its_exit_code(
    tmp_path: Path, no_pidfd: list[int], children: list[int]
) -> None:
    async def scenario() -> int | None:
        trainer = await launch(tmp_path, children)
        waiter = asyncio.ensure_future(trainer.wait())
        await asyncio.sleep(0.2)
        assert not waiter.done()  # it runs: the wait waits
        (tmp_path / "go").touch()
        return await asyncio.wait_for(waiter, 60)

    assert asyncio.run(scenario()) == 7  # collected by the agent's waitpid, not lost
    assert no_pidfd == []  # woken by the exit itself: the pid was never polled


def test_without_a_pidfd_a_reattached_trainer_is_polled_until_it_is_gone(
    no_pidfd: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not our child: waitid cannot wait for it, so the short poll is the way (here 10 ms).
    monkeypatch.setattr(exitwait, "EXIT_POLL_S", 0.01)
    record = spawn_orphan(sys.executable, "-c", "import time; time.sleep(60)")
    try:

        async def scenario() -> tuple[bool, int | None]:
            ours = await asyncio.wait_for(exitwait.child_exited(record.pid), 60)
            trainer = Trainer.attach(record)
            assert trainer is not None
            waiter = asyncio.ensure_future(trainer.wait())
            await wait_for(lambda: len(no_pidfd) >= 2, timeout=60)  # polled: still alive
            assert not waiter.done()
            os.kill(record.pid, signal.SIGTERM)
            return ours, await asyncio.wait_for(waiter, 60)

        ours, code = asyncio.run(scenario())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, signal.SIGKILL)
    assert ours is False
    assert code is None  # not our child: no exit code


def test_a_trainer_left_running_holds_neither_the_agents_exit_nor_its_exit_code(
    tmp_path: Path,
    no_pidfd: list[int],
    children: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The agent exits with its trainer running (stop_trainer_on_exit = false): the thread that
    # waits for the trainer must not keep the agent's interpreter alive, nor reap the trainer.
    errors: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", errors.append)

    async def scenario() -> int:
        trainer = await launch(tmp_path, children)
        waiter = asyncio.ensure_future(trainer.wait())
        await asyncio.sleep(0.2)
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        return trainer.pid

    pid = asyncio.run(scenario())  # returns: its loop is closed, the trainer still runs
    thread = next(t for t in threading.enumerate() if t.name == f"wait-trainer-{pid}")
    assert thread.daemon and thread.is_alive()
    (tmp_path / "go").touch()
    thread.join(60)
    assert not thread.is_alive()
    assert errors == []  # the closed loop was not an error
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 7  # still ours to collect
