"""agent/util/watch.py: the daemon's watchdog watcher (an asyncio.Event set when the run
directory changes, once per whole file, not per write) and the raw inotify descriptor the
checkpoint follower reads (every write, the close, in order, read when the reader chooses)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agent.util.watch import (
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_MODIFY,
    Inotify,
    RunWatcher,
)


def test_run_watcher_sets_event_on_status_change(tmp_path: Path) -> None:
    runs = tmp_path / "runs"

    async def scenario() -> bool:
        changed = asyncio.Event()
        watcher = RunWatcher(asyncio.get_running_loop(), changed)
        try:
            watcher.watch(runs)
            watcher.watch(runs)  # twice is harmless
            changed.clear()
            (runs / "run1").mkdir(parents=True)
            (runs / "run1" / "status.json").write_text('{"state": "starting"}')
            await asyncio.wait_for(changed.wait(), 10)
            return changed.is_set()
        finally:
            watcher.stop()

    assert asyncio.run(scenario())
    assert runs.is_dir()


class CountingEvent(asyncio.Event):
    """An asyncio.Event that counts how often it was set (the loop's wake-ups)."""

    sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


def test_run_watcher_wakes_once_for_a_big_write_not_per_write_call(tmp_path: Path) -> None:
    """torch.save writes a checkpoint in thousands of write() calls: the loop must wake when
    the file is whole (closed), not for each call (IN_MODIFY is not in the mask)."""
    runs = tmp_path / "runs"
    (runs / "run1" / "weights").mkdir(parents=True)

    async def scenario() -> int:
        changed = CountingEvent()
        watcher = RunWatcher(asyncio.get_running_loop(), changed)
        try:
            watcher.watch(runs)
            await asyncio.sleep(0.2)
            changed.clear()
            before = changed.sets
            with open(runs / "run1" / "weights" / "last.pt", "wb", buffering=0) as f:
                for _ in range(2000):
                    f.write(b"\0" * 4096)
                    await asyncio.sleep(0)  # let the loop take events as they come
            await asyncio.wait_for(changed.wait(), 10)
            await asyncio.sleep(0.5)  # anything still in flight
            return changed.sets - before
        finally:
            watcher.stop()

    wakes = asyncio.run(scenario())
    assert 1 <= wakes <= 3, wakes  # created, closed: not 2000


def test_inotify_reports_each_write_and_the_close_in_order_when_read(tmp_path: Path) -> None:
    """What watchdog does not give the follower: every write (IN_MODIFY) and then the close
    (IN_CLOSE_WRITE), queued by the kernel within the write itself, so a read right after a
    write has it (the kernel merges identical events nobody read yet); nothing waiting reads
    as []."""
    ino = Inotify()
    try:
        wd = ino.add(tmp_path, IN_CREATE | IN_MODIFY | IN_CLOSE_WRITE)
        assert ino.read() == []
        seen: list[int] = []
        with open(tmp_path / "last.pt", "wb", buffering=0) as f:
            for _ in range(3):
                f.write(b"x" * 10)
                events = ino.read()
                assert events and all(w == wd and n == "last.pt" for w, _, n in events)
                assert events[-1][1] & IN_MODIFY
                seen += [mask for _, mask, _ in events]
        closed = ino.read()
        assert [mask & IN_CLOSE_WRITE for _, mask, _ in closed] == [IN_CLOSE_WRITE]
        assert seen[0] & IN_CREATE and sum(1 for m in seen if m & IN_MODIFY) == 3
        assert ino.read() == []
    finally:
        ino.close()


def test_inotify_refuses_a_missing_folder_with_oserror(tmp_path: Path) -> None:
    ino = Inotify()
    try:
        try:
            ino.add(tmp_path / "gone", IN_CREATE)
        except OSError as exc:
            assert "gone" in str(exc)
        else:
            raise AssertionError("a missing folder was watched")
    finally:
        ino.close()
