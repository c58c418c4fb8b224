"""Snapshots on a full disk and the snapshots a killed agent leaves behind.

A full disk is a real 64 KiB tmpfs mounted on the snapshot folder where this machine allows it
(root with CAP_SYS_ADMIN), and otherwise the one call that writes snapshots (the injected
``Snapshotter.copy``) failing with ENOSPC after writing half a file."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.sinks.digests import sha256_file
from agent.sync.engine import SyncEngine
from agent.sync.ledger import ItemKind, Ledger
from agent.trainer.rundir import read_status
from tests.fakes.scripted_trainer import write_checkpoint
from tests.test_sync import FaultySink, make_item, make_run, running, sync_cfg, until, write_epoch


def full_disk_copy(src: Path, dst: Path) -> None:
    """shutil.copyfile on a disk that fills up half way through."""
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) // 2])
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "state" / "snapshots"
    mount.mkdir(parents=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def disk_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("disk full")]


def test_a_full_disk_uploads_straight_from_the_checkpoint_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.sync")
    remote = tmp_path / "remote"
    run_dir = tmp_path / "runs" / "run1"
    weights = run_dir / "weights"

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], list[Path]]:
        engine = SyncEngine(FaultySink(remote), sync_cfg(remote), state_dir=tmp_path / "state")
        engine.snapshots.copy = full_disk_copy
        async with running(engine):
            for epoch in (1, 2):
                write_epoch(run_dir, epoch, total=3, best_epoch=epoch, save_period=1)
                st = read_status(run_dir)
                assert st is not None
                assert await engine.on_epoch(run_dir, st) > 0
                assert await engine.drain(10)
                for name in ("last.pt", "best.pt", f"epoch_{epoch}.pt"):
                    assert sha256_file(remote / "weights" / name) == sha256_file(weights / name)
            full = engine.status()
            left = engine.snapshots.files()
            # Room again: snapshots are back, and status says so.
            engine.snapshots.copy = shutil.copyfile
            write_epoch(run_dir, 3, total=3, best_epoch=3, save_period=1)
            st = read_status(run_dir)
            assert st is not None
            await engine.on_epoch(run_dir, st)
            assert await engine.drain(10)
            return full, engine.status(), left

    full, after, left = asyncio.run(scenario())
    assert left == []  # the partial copies were deleted, nothing keeps the disk full
    assert full["disk_full"] is not None and "ENOSPC" in full["disk_full"]["message"]
    assert after["disk_full"] is None
    assert len(disk_lines(caplog)) == 1  # once, not every epoch
    # The live checkpoints were uploaded, never deleted.
    for name in ("last.pt", "best.pt", "epoch_1.pt", "epoch_2.pt", "epoch_3.pt"):
        assert (weights / name).is_file()
        assert sha256_file(remote / "weights" / name) == sha256_file(weights / name)
    entries = Ledger(tmp_path / "state" / "sync-ledger.json").entries
    assert {e.status for e in entries.values()} == {"verified"}


def test_a_really_full_tmpfs_neither_crashes_the_milestone_nor_keeps_partial_files(
    tmp_path: Path, tiny_tmpfs: Path
) -> None:
    # Seen: the first snapshot copy hit ENOSPC, only FileNotFoundError was caught, the agent
    # crashed in TRAINING, and the partial snapshot kept the disk full for every restart.
    remote = tmp_path / "remote"
    run_dir = tmp_path / "runs" / "run1"
    run_dir.mkdir(parents=True)
    write_checkpoint(run_dir / "weights" / "last.pt", 1, payload_kb=256)
    (run_dir / "status.json").write_text(
        json.dumps({"state": "running", "completed_epochs": 1, "total_epochs": 5}),
        encoding="utf-8",
    )

    async def scenario() -> dict[str, Any]:
        engine = SyncEngine(FaultySink(remote), sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine):
            st = read_status(run_dir)
            assert st is not None
            assert await engine.on_epoch(run_dir, st) >= 1
            assert await engine.drain(10)
            return engine.status()

    status = asyncio.run(scenario())
    assert status["disk_full"] is not None and "ENOSPC" in status["disk_full"]["message"]
    assert sha256_file(remote / "weights" / "last.pt") == sha256_file(
        run_dir / "weights" / "last.pt"
    )
    assert not any(p.name.endswith("last.pt.tmp") for p in tiny_tmpfs.iterdir())


def test_a_live_checkpoint_rewritten_during_its_upload_is_retried_with_a_fresh_hash(
    tmp_path: Path,
) -> None:
    remote = tmp_path / "remote"
    run_dir = tmp_path / "runs" / "run1"
    live = run_dir / "weights" / "last.pt"
    sink = FaultySink(remote)
    gate = sink.gate("weights/last.pt")

    async def scenario() -> SyncEngine:
        engine = SyncEngine(
            sink, sync_cfg(remote, max_backoff_s=0.02), state_dir=tmp_path / "state"
        )
        engine.snapshots.copy = full_disk_copy
        async with running(engine, sink):
            write_epoch(run_dir, 1, total=5, best_epoch=1, save_period=0)
            st = read_status(run_dir)
            assert st is not None
            await engine.on_epoch(run_dir, st)
            await until(lambda: sink.active["weights/last.pt"] == 1)
            write_checkpoint(live, 2)  # the trainer moves on while the live file is sent
            gate.set()
            assert await engine.drain(10)
        return engine

    engine = asyncio.run(scenario())
    assert "read back as" in engine.failures[0]["error"]
    assert sha256_file(remote / "weights" / "last.pt") == sha256_file(live)
    entry = engine.ledger.entries["weights/last.pt"]
    assert (entry.status, entry.sha256) == ("verified", sha256_file(live))
    assert live.is_file()


def test_recover_requeues_what_a_killed_agent_left_and_removes_stale_snapshots(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.sync")
    remote = tmp_path / "remote"
    state = tmp_path / "state"
    run_dir = tmp_path / "runs" / "run1"
    weights = run_dir / "weights"
    make_run(run_dir, epochs=4, save_period=2)
    state.mkdir()
    (state / "state.json").write_text('{"phase": "TRAINING"}', encoding="utf-8")
    snapshots = state / "snapshots"

    async def killed_agent() -> dict[str, Path]:
        # Snapshots taken and queued, then SIGKILL before any upload.
        engine = SyncEngine(FaultySink(remote), sync_cfg(remote), state_dir=state)
        st = read_status(run_dir)
        assert st is not None
        assert await engine.on_epoch(run_dir, st, extra_files=[state / "state.json"]) == 7
        return {i["path"]: engine.uploads._pending[i["path"]].local for i in engine.queue}

    left = asyncio.run(killed_agent())
    # What happened to the box meanwhile:
    left["weights/epoch_2.pt"].unlink()  # snapshot gone, source still there: snapshot again
    left["agent/state.json"].unlink()
    left["weights/epoch_4.pt"].unlink()  # snapshot and source both gone
    (weights / "epoch_4.pt").unlink()
    left["metrics.jsonl"].unlink()  # source changed since: the newer version goes up
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"epoch": 5}\n')
    (snapshots / "000050-last.pt.tmp").write_bytes(b"partial copy")
    (snapshots / "000040-best.pt").write_bytes(b"an old agent's snapshot")
    kept = {left[p] for p in ("weights/last.pt", "weights/best.pt", "status.json")}

    async def restarted_agent() -> tuple[int, set[Path], SyncEngine, Any]:
        sink = FaultySink(remote)
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=state)
        queued = await engine.recover(run_dir)
        after_recover = set(engine.snapshots.files())
        async with running(engine, sink):
            assert await engine.drain(10)
            result = await engine.verify_all(run_dir)
        return queued, after_recover, engine, result

    queued, after_recover, engine, result = asyncio.run(restarted_agent())
    assert queued == 6
    assert engine.sources_gone == ["weights/epoch_4.pt"]
    assert engine.status()["sources_gone"] == ["weights/epoch_4.pt"]
    # The leftovers with the promised content were reused; strays are gone; new snapshots
    # are numbered after the leftovers.
    assert kept <= after_recover
    assert not any(p.name in ("000050-last.pt.tmp", "000040-best.pt") for p in after_recover)
    new = after_recover - kept
    assert len(new) == 3 and all(int(p.name.split("-")[0]) > 50 for p in new)
    for name in ("last.pt", "best.pt", "epoch_2.pt"):
        assert sha256_file(remote / "weights" / name) == sha256_file(weights / name)
    assert sha256_file(remote / "metrics.jsonl") == sha256_file(run_dir / "metrics.jsonl")
    assert sha256_file(remote / "agent" / "state.json") == sha256_file(state / "state.json")
    # Never silently forgotten: still pending, and verification says so.
    assert engine.ledger.entries["weights/epoch_4.pt"].status == "pending"
    assert not result.sync_verified
    assert [m["path"] for m in result.missing] == ["weights/epoch_4.pt"]
    assert engine.snapshots.files() == []
    assert any("neither its snapshot nor its source" in r.getMessage() for r in caplog.records)


def test_cleanup_at_done_empties_the_snapshot_folder_but_keeps_what_is_still_owed(
    tmp_path: Path,
) -> None:
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    sink.fail["weights/best.pt"] = 10_000

    async def scenario() -> tuple[int, list[str], int, list[str]]:
        engine = SyncEngine(
            sink, sync_cfg(remote, max_backoff_s=0.02), state_dir=tmp_path / "state"
        )
        snapshots = engine.snapshots.root
        snapshots.mkdir(parents=True)
        good = make_item(snapshots, "weights/last.pt", 3)
        owed = make_item(snapshots, "weights/best.pt", 3, kind=ItemKind.BEST)
        (snapshots / "000003-last.pt.tmp").write_bytes(b"partial")
        async with running(engine, sink):
            engine.submit(good)
            engine.submit(owed)
            await until(lambda: engine.ledger.entries["weights/last.pt"].status == "verified")
            await until(lambda: engine.ledger.entries["weights/best.pt"].attempts >= 2)
            first = await engine.cleanup()
            kept = [p.name for p in engine.snapshots.files()]
            sink.fail.clear()
            engine.retry_now()
            assert await engine.drain(10)
            second = await engine.cleanup()
        return first, kept, second, [p.name for p in engine.snapshots.files()]

    first, kept, second, finally_left = asyncio.run(scenario())
    assert first == 1 and kept == ["weights_best.pt.v3"]
    assert second == 0 and finally_left == []
