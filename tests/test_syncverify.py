"""The end-of-training check reads back only what changed since its last verification
(``changed_only``): a path the ledger holds verified at its present content is not read again;
a pending entry and a checkpoint on disk that differs from what was verified are."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

from agent.sinks import RemoteFile
from agent.sinks.digests import sha256_file
from agent.sync.engine import SyncEngine
from agent.sync.ledger import ItemKind
from agent.sync.uploads import Item
from tests.fakes.scripted_trainer import write_checkpoint
from tests.test_sync import FaultySink, make_item, running, sync_cfg, until, upload_all


class CountingSink(FaultySink):
    """Counts every read-back (``stat``) by path."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.stats: list[str] = []

    def stat(self, remote_path: str) -> RemoteFile | None:
        with self.lock:
            self.stats.append(remote_path)
        return super().stat(remote_path)


def checkpoint_item(run_dir: Path, snaps: Path, name: str, epoch: int) -> Item:
    """``run_dir/weights/NAME`` written for ``epoch`` and a snapshot of it to upload."""
    src = run_dir / "weights" / name
    write_checkpoint(src, epoch)
    snaps.mkdir(parents=True, exist_ok=True)
    snap = snaps / f"{name}.{epoch}"
    shutil.copyfile(src, snap)
    kind = ItemKind.BEST if name == "best.pt" else ItemKind.LAST
    return Item(f"weights/{name}", snap, sha256_file(snap), snap.stat().st_size, epoch, kind)


def test_changed_only_reads_back_nothing_verified_and_unchanged(tmp_path: Path) -> None:
    remote, run_dir, snaps = tmp_path / "remote", tmp_path / "run", tmp_path / "snaps"
    sink = CountingSink(remote)
    items = [
        checkpoint_item(run_dir, snaps, "last.pt", 3),
        checkpoint_item(run_dir, snaps, "best.pt", 2),
        make_item(snaps, "status.json", 3, kind=ItemKind.SMALL),
    ]

    async def scenario() -> tuple[Any, list[str], Any, list[str]]:
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine, sink):
            await upload_all(engine, items)
            sink.stats.clear()
            quick = await engine.verify_all(run_dir, completed_epochs=3, changed_only=True)
            quick_stats = list(sink.stats)
            sink.stats.clear()
            full = await engine.verify_all(run_dir, completed_epochs=3)
            return quick, quick_stats, full, list(sink.stats)

    quick, quick_stats, full, full_stats = asyncio.run(scenario())
    assert quick.sync_verified and quick.checked == 3 and quick.missing == []
    assert quick_stats == [] and quick.read_back == 0 and quick.trusted == 3
    # Without changed_only every path is read again (the full check stays available).
    assert full.sync_verified and full.read_back == 3 and full.trusted == 0
    assert set(full_stats) == {"weights/last.pt", "weights/best.pt", "status.json"}


def test_changed_only_reads_back_a_checkpoint_that_changed_since_its_verification(
    tmp_path: Path,
) -> None:
    remote, run_dir, snaps = tmp_path / "remote", tmp_path / "run", tmp_path / "snaps"
    sink = CountingSink(remote)
    items = [checkpoint_item(run_dir, snaps, "last.pt", 3)]

    async def scenario() -> tuple[Any, list[str]]:
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine, sink):
            await upload_all(engine, items)
            # The trainer wrote epoch 4 after the last verified upload: not trusted.
            write_checkpoint(run_dir / "weights" / "last.pt", 4)
            sink.stats.clear()
            result = await engine.verify_all(run_dir, completed_epochs=4, changed_only=True)
            return result, list(sink.stats)

    result, stats = asyncio.run(scenario())
    assert not result.sync_verified
    assert [m["path"] for m in result.missing] == ["weights/last.pt"]
    assert result.missing[0]["problem"] == "on disk but not on the target"
    assert "weights/last.pt" in stats and result.read_back >= 1


def test_changed_only_reads_back_a_pending_entry(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    sink = CountingSink(remote)
    item = make_item(tmp_path / "snaps", "weights/last.pt", 1)

    async def scenario() -> tuple[Any, list[str]]:
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine, sink):
            sink.fail["weights/last.pt"] = 10_000
            sink.fail_retryable = False
            engine.submit(item)
            await until(lambda: engine.failures)  # its upload was tried and failed
            sink.stats.clear()
            result = await engine.verify_all(changed_only=True)
            return result, list(sink.stats)

    result, stats = asyncio.run(scenario())
    assert not result.sync_verified and result.trusted == 0
    assert stats == ["weights/last.pt"]
    assert result.missing[0]["path"] == "weights/last.pt"
