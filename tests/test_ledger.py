"""The sync ledger: what the target must hold, persisted as ``sync-ledger.json``. Its file format
is read by the next agent after a restart, so it is pinned here: plain strings, not enum names."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from agent.sync.engine import SyncEngine
from agent.sync.ledger import ItemKind, Ledger, LedgerEntry, LedgerStatus
from agent.sync.uploads import Item
from tests.test_sync import FaultySink, make_item, running, sync_cfg, until


def test_ledger_is_persisted_and_reloaded(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    sink.fail["weights/best.pt"] = 10_000
    good = make_item(tmp_path / "snaps", "weights/last.pt", 6)
    failing = make_item(tmp_path / "snaps", "weights/best.pt", 6, kind=ItemKind.BEST)

    async def scenario() -> dict[str, LedgerEntry]:
        engine = SyncEngine(
            sink, sync_cfg(remote, max_backoff_s=0.02), state_dir=tmp_path / "state"
        )
        async with running(engine, sink):
            engine.submit(good)
            engine.submit(failing)
            await until(lambda: engine.ledger.entries["weights/last.pt"].status == "verified")
            await until(lambda: engine.ledger.entries["weights/best.pt"].attempts >= 2)
        return dict(engine.ledger.entries)

    in_memory = asyncio.run(scenario())
    reloaded = Ledger(tmp_path / "state" / "sync-ledger.json").entries
    assert set(reloaded) == {"weights/last.pt", "weights/best.pt"}
    assert reloaded["weights/last.pt"] == in_memory["weights/last.pt"]
    assert reloaded["weights/last.pt"].status == "verified"
    assert reloaded["weights/best.pt"].status == "pending"
    assert reloaded["weights/best.pt"].error == "injected failure"
    assert reloaded["weights/best.pt"].sha256 == failing.sha256


def test_ledger_ignores_results_for_an_older_snapshot(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.json")
    old = make_item(tmp_path / "snaps", "weights/last.pt", 1)
    new = make_item(tmp_path / "snaps", "weights/last.pt", 2)
    ledger.expect(old)
    ledger.expect(new)
    ledger.note_attempt("weights/last.pt", old.sha256, attempts=3, error="timed out")
    ledger.mark_verified(
        "weights/last.pt", old.sha256, sha256=old.sha256, size=old.size, at=1.0, attempts=3
    )
    entry = Ledger(tmp_path / "ledger.json").entries["weights/last.pt"]
    assert (entry.sha256, entry.status, entry.attempts, entry.error) == (
        new.sha256,
        "pending",
        0,
        None,
    )


def test_last_verified_checkpoint_is_the_newest_verified_pt(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.json")
    items = {
        "weights/last.pt": make_item(tmp_path / "s", "weights/last.pt", 3),
        "weights/epoch_2.pt": make_item(tmp_path / "s", "weights/epoch_2.pt", 2, ItemKind.EPOCH),
        "status.json": make_item(tmp_path / "s", "status.json", 3, ItemKind.SMALL),
    }
    assert ledger.last_verified_checkpoint() is None
    for item in items.values():
        ledger.expect(item)
    # Verified in this order: the status file last, but it is not a checkpoint.
    for path, at in (
        ("weights/epoch_2.pt", 10.0),
        ("weights/last.pt", 20.0),
        ("status.json", 30.0),
    ):
        item = items[path]
        ledger.mark_verified(
            path, item.sha256, sha256=item.sha256, size=item.size, at=at, attempts=1
        )
    last = ledger.last_verified_checkpoint()
    assert last is not None and last.remote_path == "weights/last.pt"


def test_ledger_file_holds_plain_strings_and_reads_back_as_enums(tmp_path: Path) -> None:
    path = tmp_path / "sync-ledger.json"
    ledger = Ledger(path)
    snap = tmp_path / "snap"
    ledger.expect(Item("weights/last.pt", snap, "a" * 64, 10, 3, ItemKind.LAST, created_at=1.0))
    ledger.expect(
        Item("agent/state.json", snap, "b" * 64, 11, None, ItemKind.AGENT, created_at=2.0)
    )
    ledger.mark_verified("weights/last.pt", "a" * 64, sha256="c" * 64, size=12, at=5.0, attempts=2)
    written = path.read_text(encoding="utf-8")
    assert json.loads(written) == {
        "entries": [
            {
                "remote_path": "agent/state.json",
                "sha256": "b" * 64,
                "size": 11,
                "epoch": None,
                "kind": "agent",
                "status": "pending",
                "queued_at": 2.0,
                "uploaded_at": None,
                "verified_at": None,
                "attempts": 0,
                "error": None,
            },
            {
                "remote_path": "weights/last.pt",
                "sha256": "c" * 64,
                "size": 12,
                "epoch": 3,
                "kind": "last",
                "status": "verified",
                "queued_at": 1.0,
                "uploaded_at": 5.0,
                "verified_at": 5.0,
                "attempts": 2,
                "error": None,
            },
        ]
    }
    reloaded = Ledger(path)
    entry = reloaded.entries["weights/last.pt"]
    assert entry.kind is ItemKind.LAST and entry.status is LedgerStatus.VERIFIED
    reloaded.save()
    assert path.read_text(encoding="utf-8") == written


def test_a_ledger_with_an_unknown_status_is_moved_aside_not_half_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Only "pending" and "verified" are ever written; anything else is a hand edit or damage.
    caplog.set_level(logging.INFO, logger="agent.sync")
    path = tmp_path / "sync-ledger.json"
    ledger = Ledger(path)
    ledger.expect(make_item(tmp_path / "snaps", "weights/last.pt", 1))
    data = json.loads(path.read_text(encoding="utf-8"))
    data["entries"][0]["status"] = "done"
    path.write_text(json.dumps(data), encoding="utf-8")
    assert Ledger(path).entries == {}
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("sync-ledger.json.corrupt-")]
    assert len(aside) == 1 and not path.exists()
    assert json.loads(aside[0].read_text(encoding="utf-8")) == data  # kept for a person
    assert any("unreadable" in r.getMessage() for r in caplog.records)
