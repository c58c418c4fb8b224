"""Stopping a child's whole process group (agent/util/procs.py), with real processes: the
signal asked for first, SIGKILL for a group that ignores it, what the child left behind in its
session killed too, everything reaped, and pipe readers never left hanging."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from agent.util.procs import finish_readers, kill_group, stop_group
from tests.support import wait_for

#: A child that starts a grandchild in its session (writing its pid to argv[1]), then says
#: "ready" and waits; with argv[2] == "ignore" it ignores SIGTERM, grandchild included.
FAMILY = """
import signal, subprocess, sys, time
if sys.argv[2] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
print("ready", flush=True)
if sys.argv[3] == "wait":
    time.sleep(600)
"""


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie whose parent is gone is as good as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def start(
    tmp_path: Path, mode: str, end: str = "wait"
) -> tuple[asyncio.subprocess.Process, int]:
    pid_file = tmp_path / "grandchild.pid"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        FAMILY,
        str(pid_file),
        mode,
        end,
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    assert await proc.stdout.readline() == b"ready\n"
    return proc, int(pid_file.read_text())


async def closed(proc: asyncio.subprocess.Process) -> None:
    """Read the child's stdout to its end: the pipe, once its last writer is gone, closes."""
    assert proc.stdout is not None
    await proc.stdout.read()


def test_a_group_that_goes_on_sigterm_is_not_sigkilled(tmp_path: Path) -> None:
    async def main() -> int | None:
        proc, grandchild = await start(tmp_path, "obey")
        code = await stop_group(proc, grace_s=30.0)
        await wait_for(lambda: gone(grandchild))
        await closed(proc)
        return code

    assert asyncio.run(main()) == -signal.SIGTERM


def test_a_group_already_gone_is_no_error() -> None:
    async def main() -> tuple[bool, int | None]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "", start_new_session=True
        )
        await proc.wait()  # reaped: its group is empty
        return kill_group(proc.pid), await stop_group(proc, grace_s=0.1)

    assert asyncio.run(main()) == (False, 0)


def test_a_group_that_ignores_sigterm_is_sigkilled_and_reaped(tmp_path: Path) -> None:
    async def main() -> tuple[int | None, int | None]:
        proc, grandchild = await start(tmp_path, "ignore")
        code = await stop_group(proc, grace_s=0.5)
        await wait_for(lambda: gone(grandchild))
        await closed(proc)
        return code, proc.returncode

    code, returncode = asyncio.run(main())
    assert code == returncode == -signal.SIGKILL


def test_what_an_exited_child_left_in_its_session_is_killed(tmp_path: Path) -> None:
    # The probe's case: it exited by itself, its NCCL workers did not.
    async def main() -> int | None:
        proc, grandchild = await start(tmp_path, "obey", end="exit")
        # Not proc.wait(): asyncio's also waits for the pipes, which the grandchild holds.
        await wait_for(lambda: proc.returncode is not None)
        assert not gone(grandchild)
        code = await stop_group(proc, sig=signal.SIGKILL)
        await wait_for(lambda: gone(grandchild))
        await closed(proc)
        return code

    assert asyncio.run(main()) == 0


def test_readers_held_open_by_a_grandchild_are_cancelled_and_collected(tmp_path: Path) -> None:
    async def main() -> tuple[bool, bool]:
        pid_file = tmp_path / "grandchild.pid"
        # The child exits at once; the grandchild it leaves holds the pipe open.
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            FAMILY,
            str(pid_file),
            "obey",
            "exit",
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdout is not None
        reader = asyncio.create_task(proc.stdout.read())
        await wait_for(lambda: proc.returncode is not None)
        await finish_readers(reader, grace_s=0.2)
        cancelled = reader.cancelled()
        kill_group(proc.pid)
        await closed(proc)
        return cancelled, reader.done()

    cancelled, done = asyncio.run(main())
    assert cancelled and done
