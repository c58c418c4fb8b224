"""What the sync engine does NOT do at a milestone (issue 15, the agent's CPU while training):
copy a file that did not change since its version was hashed, or send the agent's own logs,
which only grow, at every epoch."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from agent.sinks.digests import copy_hashing, sha256_file
from agent.sync.engine import SyncEngine
from agent.sync.snapshots import Snapshotter
from agent.trainer.rundir import read_status
from tests.test_sync import FaultySink, running, sync_cfg, write_epoch


class Copies:
    """The snapshotter's copy function, counted by file name."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __call__(self, src: Path, dst: Path) -> str:
        self.names.append(src.name)
        return copy_hashing(src, dst)


def engine_with_counted_copies(
    tmp_path: Path, remote: Path, **kw: float
) -> tuple[SyncEngine, FaultySink, Copies]:
    sink = FaultySink(remote)
    engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state", **kw)  # type: ignore[arg-type]
    copies = Copies()
    engine.snapshots = Snapshotter(tmp_path / "state" / "snapshots", copy=copies)
    return engine, sink, copies


def test_a_file_unchanged_since_its_hashed_version_is_not_copied_again(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    run_dir = tmp_path / "runs" / "run1"
    extra = tmp_path / "notes.txt"
    extra.write_text("written once\n")

    async def scenario() -> tuple[list[str], list[str], list[str], FaultySink]:
        engine, sink, copies = engine_with_counted_copies(tmp_path, remote, agent_files_every_s=0.0)

        async def milestone(epoch: int) -> list[str]:
            """One epoch written and synced; the names of the files copied for it."""
            copies.names.clear()
            write_epoch(run_dir, epoch, total=3, best_epoch=1, save_period=0)
            st = read_status(run_dir)
            assert st is not None
            await engine.on_epoch(run_dir, st, extra_files=[extra])
            assert await engine.drain(10)
            return list(copies.names)

        async with running(engine, sink):
            first = await milestone(1)
            # Epoch 2 rewrites last.pt, status.json and metrics.jsonl; best.pt and the extra
            # file are untouched.
            second = await milestone(2)
            # Same bytes, same size, even the mtime put back: the ctime still moved, so the
            # file is copied and hashed anew (and found unchanged by its hash).
            stat = extra.stat()
            extra.write_text("written once\n")
            os.utime(extra, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            third = await milestone(3)
        return first, second, third, sink

    first, second, third, sink = asyncio.run(scenario())
    assert {"last.pt", "best.pt", "status.json", "metrics.jsonl", "notes.txt"} <= set(first)
    assert "notes.txt" not in second and "best.pt" not in second
    assert {"last.pt", "status.json", "metrics.jsonl"} <= set(second)
    assert "notes.txt" in third
    assert len(sink.uploads_of("agent/notes.txt")) == 1  # its content never changed
    assert sha256_file(remote / "agent" / "notes.txt") == sha256_file(extra)


def test_the_agents_own_files_go_at_the_first_milestone_then_at_most_every_interval(
    tmp_path: Path,
) -> None:
    remote = tmp_path / "remote"
    run_dir = tmp_path / "runs" / "run1"
    log = tmp_path / "agent.log"
    now = [1000.0]

    async def scenario() -> tuple[list[int], FaultySink, int]:
        sink = FaultySink(remote)
        engine = SyncEngine(
            sink,
            sync_cfg(remote),
            state_dir=tmp_path / "state",
            clock=lambda: now[0],
            agent_files_every_s=300.0,
        )
        sent: list[int] = []
        async with running(engine, sink):
            for epoch, at in ((1, 1000.0), (2, 1030.0), (3, 1299.0), (4, 1301.0), (5, 1330.0)):
                now[0] = at
                log.write_text(f"log up to epoch {epoch}\n" * epoch)
                write_epoch(run_dir, epoch, total=6, best_epoch=1, save_period=0)
                st = read_status(run_dir)
                assert st is not None
                await engine.on_epoch(run_dir, st, extra_files=[log])
                assert await engine.drain(10)
                sent.append(len(sink.uploads_of("agent/agent.log")))
            # The final sync sends them whatever the time.
            log.write_text("the last line\n")
            final_queued = await engine.final(run_dir, read_status(run_dir), [log])
            assert await engine.drain(10)
        return sent, sink, final_queued

    sent, sink, final_queued = asyncio.run(scenario())
    # Epoch 1 sends it; 2 and 3 are within 300 s of that; 4 is past (1301); 5 within again.
    assert sent == [1, 1, 1, 2, 2]
    assert final_queued >= 1
    assert len(sink.uploads_of("agent/agent.log")) == 3
    assert (remote / "agent" / "agent.log").read_text() == "the last line\n"
    # Checkpoints and the run's small files went at every milestone all along.
    assert len(sink.uploads_of("status.json")) >= 5
