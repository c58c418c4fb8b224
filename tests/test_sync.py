"""The sync engine: the milestone policy on a run directory shaped like LibreYOLO's and the
verification of the target. The target is a real folder (LocalSink); faults are injected by a
LocalSink subclass that fails, hangs, loses or corrupts uploads on request. The helpers here are
shared by the other sync tests (test_uploads.py, test_ledger.py, test_sync_*.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from agent.config.model import SyncSection
from agent.sinks import RemoteFile, SinkError
from agent.sinks.digests import sha256_file
from agent.sinks.local import LocalSink
from agent.sync.engine import SyncEngine
from agent.sync.ledger import ItemKind
from agent.sync.uploads import Item
from agent.trainer.rundir import read_status
from tests.fakes.scripted_trainer import read_checkpoint_epoch, write_checkpoint

# --------------------------------------------------------------------------------------------
# Fault injection


class FaultySink(LocalSink):
    """A LocalSink that records every upload (and how many of one path ran at once) and, on
    request, fails, hangs, accepts-then-loses or corrupts the next uploads of a path."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.lock = threading.Lock()
        #: (remote path, sha256 of what was sent, monotonic time the upload started)
        self.calls: list[tuple[str, str, float]] = []
        self.active: Counter[str] = Counter()
        self.max_active: Counter[str] = Counter()
        self.fail: Counter[str] = Counter()
        self.fail_retryable = True
        self.lose: Counter[str] = Counter()
        self.corrupt: Counter[str] = Counter()
        self.stat_error: str | None = None
        #: The next upload of the path waits for this event.
        self.hold: dict[str, threading.Event] = {}
        self.entered = threading.Event()
        self._gates: list[threading.Event] = []

    def gate(self, remote_path: str) -> threading.Event:
        event = threading.Event()
        self.hold[remote_path] = event
        self._gates.append(event)
        return event

    def release_all(self) -> None:
        for event in self._gates:
            event.set()

    def uploads_of(self, remote_path: str) -> list[str]:
        return [sha for path, sha, _ in self.calls if path == remote_path]

    def upload(self, local: Path, remote_path: str) -> None:
        try:
            sha = sha256_file(local)
        except OSError:
            sha = "<gone>"
        with self.lock:
            self.calls.append((remote_path, sha, time.monotonic()))
            self.active[remote_path] += 1
            self.max_active[remote_path] = max(
                self.max_active[remote_path], self.active[remote_path]
            )
            gate = self.hold.pop(remote_path, None)
            fail = self._take(self.fail, remote_path)
            lose = self._take(self.lose, remote_path)
            corrupt = self._take(self.corrupt, remote_path)
        self.entered.set()
        try:
            if gate is not None:
                gate.wait(30)
            if fail:
                raise SinkError("injected failure", retryable=self.fail_retryable)
            if lose:
                return  # accepted, then lost
            if corrupt:
                target = self._target(remote_path)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(b"garbage")
                return
            super().upload(local, remote_path)
        finally:
            with self.lock:
                self.active[remote_path] -= 1

    def stat(self, remote_path: str) -> RemoteFile | None:
        if self.stat_error:
            raise SinkError(self.stat_error)
        return super().stat(remote_path)

    @staticmethod
    def _take(counter: Counter[str], key: str) -> bool:
        if counter[key] > 0:
            counter[key] -= 1
            return True
        return False


def sync_cfg(root: Path, **overrides: Any) -> SyncSection:
    values: dict[str, Any] = {
        "target": f"file://{root}",
        "upload_timeout_s": 10.0,
        "max_backoff_s": 0.05,
        "finish_timeout_s": 10.0,
    }
    values.update(overrides)
    return SyncSection(**values)


def make_item(folder: Path, remote_path: str, version: int, kind: ItemKind = ItemKind.LAST) -> Item:
    folder.mkdir(parents=True, exist_ok=True)
    local = folder / f"{remote_path.replace('/', '_')}.v{version}"
    local.write_bytes(f"{remote_path} version {version}\n".encode() * 64)
    return Item(remote_path, local, sha256_file(local), local.stat().st_size, version, kind)


@contextlib.asynccontextmanager
async def running(engine: SyncEngine, sink: FaultySink | None = None) -> AsyncIterator[SyncEngine]:
    task = asyncio.create_task(engine.run())
    try:
        yield engine
    finally:
        if sink is not None:
            sink.release_all()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await engine.close()


async def until(check: Callable[[], object], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------------------------
# Verification


async def upload_all(engine: SyncEngine, items: list[Item]) -> None:
    for item in items:
        engine.submit(item)
    assert await engine.drain(10)


def test_verify_all_detects_a_missing_and_a_corrupted_file(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    snaps = tmp_path / "snaps"
    items = [
        make_item(snaps, "weights/last.pt", 5),
        make_item(snaps, "weights/best.pt", 4, kind=ItemKind.BEST),
        make_item(snaps, "status.json", 5, kind=ItemKind.SMALL),
    ]

    async def scenario() -> tuple[Any, Any]:
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine, sink):
            await upload_all(engine, items)
            good = await engine.verify_all()
            (remote / "weights" / "best.pt").unlink()
            (remote / "status.json").write_text("{}", encoding="utf-8")
            bad = await engine.verify_all()
        return good, bad

    good, bad = asyncio.run(scenario())
    assert good.sync_verified and good.checked == 3 and good.missing == []
    assert not bad.sync_verified and bad.checked == 3
    problems = {m["path"]: m["problem"] for m in bad.missing}
    assert set(problems) == {"weights/best.pt", "status.json"}
    assert problems["weights/best.pt"] == "not on the target"
    assert problems["status.json"].startswith("hash mismatch")
    saved = json.loads((tmp_path / "state" / "sync-result.json").read_text(encoding="utf-8"))
    assert saved["sync_verified"] is False
    assert {m["path"] for m in saved["missing"]} == set(problems)


def test_verify_all_reports_a_failing_read_back(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    item = make_item(tmp_path / "snaps", "weights/last.pt", 1)

    async def scenario() -> Any:
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine, sink):
            await upload_all(engine, [item])
            sink.stat_error = "401 Unauthorized"
            return await engine.verify_all()

    result = asyncio.run(scenario())
    assert not result.sync_verified
    assert "read-back failed" in result.missing[0]["problem"]
    assert "401" in result.missing[0]["problem"]


def test_verify_all_with_nothing_synced_is_not_verified(tmp_path: Path) -> None:
    # Teardown is gated on this: "nothing expected, nothing missing" must not count as synced.
    async def scenario() -> Any:
        engine = SyncEngine(
            FaultySink(tmp_path / "remote"), sync_cfg(tmp_path / "remote"), state_dir=tmp_path
        )
        try:
            return await engine.verify_all()
        finally:
            await engine.close()

    result = asyncio.run(scenario())
    assert result.sync_verified is False and result.checked == 0


def test_restarted_engine_does_not_reupload_verified_files(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    run_dir = tmp_path / "runs" / "run1"
    make_run(run_dir, epochs=2, save_period=0)
    st = read_status(run_dir)
    assert st is not None

    async def first_agent() -> int:
        sink = FaultySink(remote)
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine, sink):
            queued = await engine.final(run_dir, st, [])
            assert await engine.drain(10)
        return queued

    async def second_agent() -> tuple[int, FaultySink]:
        sink = FaultySink(remote)
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine, sink):
            queued = await engine.final(run_dir, st, [])
            assert await engine.drain(10)
            assert (await engine.verify_all()).sync_verified
        return queued, sink

    assert asyncio.run(first_agent()) > 0
    queued, sink = asyncio.run(second_agent())
    assert queued == 0
    assert sink.calls == []


# --------------------------------------------------------------------------------------------
# Snapshots


# --------------------------------------------------------------------------------------------
# The milestone policy on a run directory shaped like LibreYOLO's


def write_epoch(
    run_dir: Path, epoch: int, *, total: int, best_epoch: int, save_period: int
) -> None:
    """One epoch as LibreYOLO writes it: weights in place first, then metrics, then status."""
    weights = run_dir / "weights"
    write_checkpoint(weights / "last.pt", epoch)
    if best_epoch == epoch:
        write_checkpoint(weights / "best.pt", epoch)
    if save_period and epoch % save_period == 0:
        write_checkpoint(weights / f"epoch_{epoch}.pt", epoch)
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"epoch": epoch, "best_epoch": best_epoch}) + "\n")
    status = {
        "state": "running",
        "pid": os.getpid(),
        "save_dir": str(run_dir),
        "completed_epochs": epoch,
        "current_epoch": epoch,
        "total_epochs": total,
        "best_epoch": best_epoch,
    }
    (run_dir / "status.json").write_text(json.dumps(status), encoding="utf-8")


def complete(run_dir: Path, epochs: int, best_epoch: int) -> None:
    status = {
        "state": "completed",
        "pid": os.getpid(),
        "save_dir": str(run_dir),
        "completed_epochs": epochs,
        "total_epochs": epochs,
        "best_epoch": best_epoch,
    }
    (run_dir / "status.json").write_text(json.dumps(status), encoding="utf-8")


def make_run(run_dir: Path, *, epochs: int, save_period: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for epoch in range(1, epochs + 1):
        write_epoch(run_dir, epoch, total=epochs, best_epoch=epoch, save_period=save_period)
    complete(run_dir, epochs, epochs)


def test_milestones_follow_every_epochs_and_best_changes(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    run_dir = tmp_path / "runs" / "run1"
    run_dir.mkdir(parents=True)
    state_file = tmp_path / "state" / "state.json"
    best_by_epoch = {1: 1, 2: 1, 3: 3, 4: 3}

    async def scenario() -> tuple[list[int], list[set[str]], int, Any, dict[int, str]]:
        sink = FaultySink(remote)
        engine = SyncEngine(sink, sync_cfg(remote, every_epochs=2), state_dir=tmp_path / "state")
        queued: list[int] = []
        uploaded: list[set[str]] = []
        last_sha: dict[int, str] = {}
        async with running(engine, sink):
            for epoch in range(1, 5):
                write_epoch(run_dir, epoch, total=4, best_epoch=best_by_epoch[epoch], save_period=2)
                last_sha[epoch] = sha256_file(run_dir / "weights" / "last.pt")
                st = read_status(run_dir)
                assert st is not None
                queued.append(await engine.on_epoch(run_dir, st))
                assert await engine.on_epoch(run_dir, st) == 0  # the same epoch twice: nothing new
                assert await engine.drain(10)
                uploaded.append({path for path, _, _ in sink.calls})
            complete(run_dir, 4, 3)
            state_file.parent.mkdir(parents=True, exist_ok=True)
            state_file.write_text("{}", encoding="utf-8")
            final_queued = await engine.final(run_dir, read_status(run_dir), [state_file])
            assert await engine.drain(10)
            result = await engine.verify_all()
        return queued, uploaded, final_queued, result, last_sha

    queued, uploaded, final_queued, result, last_sha = asyncio.run(scenario())
    # epoch 1: best.pt + status.json + metrics.jsonl (last.pt waits for every_epochs=2)
    # epoch 2: last.pt + epoch_2.pt + small files (best is still epoch 1)
    # epoch 3: best.pt + small files; epoch 4: last.pt + epoch_4.pt + small files
    assert queued == [3, 4, 3, 4]
    assert "weights/last.pt" not in uploaded[0]
    assert {"weights/best.pt", "status.json", "metrics.jsonl"} <= uploaded[0]
    assert {"weights/last.pt", "weights/epoch_2.pt"} <= uploaded[1]
    assert "weights/epoch_4.pt" in uploaded[3]
    # final: the completed status.json and the agent's state file; the rest is unchanged.
    assert final_queued == 2
    assert result.sync_verified
    assert result.checked == 7
    assert sha256_file(remote / "weights" / "last.pt") == last_sha[4]
    assert sha256_file(remote / "agent" / "state.json") == sha256_file(state_file)
    for name in ("best.pt", "epoch_2.pt", "epoch_4.pt"):
        assert sha256_file(remote / "weights" / name) == sha256_file(run_dir / "weights" / name)


def test_a_status_read_one_epoch_late_labels_the_checkpoint_with_the_epoch_it_holds(
    tmp_path: Path,
) -> None:
    # Under load the agent read status.json saying epoch 4 when the trainer had already written
    # epoch 5's last.pt: the epoch-4 milestone sent epoch 5's bytes labelled 4. At the epoch-5
    # milestone the file is unchanged, so nothing goes again, but the label must say 5: before,
    # last_synced_epoch stayed at 4 for good while the target held epoch 5 (a new box then
    # trusted the target and the status page under-reported; tests/test_new_box.py waited).
    remote = tmp_path / "remote"
    run_dir = tmp_path / "runs" / "run1"
    run_dir.mkdir(parents=True)

    async def scenario() -> tuple[int | None, int | None, int, dict[str, Any]]:
        sink = FaultySink(remote)
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine, sink):
            for epoch in (1, 2, 3, 4):
                write_epoch(run_dir, epoch, total=30, best_epoch=epoch, save_period=0)
            late = read_status(run_dir)  # says 4 ...
            write_epoch(run_dir, 5, total=30, best_epoch=5, save_period=0)  # ... 5 is written
            assert late is not None and late.completed_epochs == 4
            await engine.on_epoch(run_dir, late)
            assert await engine.drain(10)
            before = engine.last_synced_epoch
            now = read_status(run_dir)
            assert now is not None and now.completed_epochs == 5
            sent = len(sink.calls)
            await engine.on_epoch(run_dir, now)
            assert await engine.drain(10)
            again = len(sink.calls) - sent
            entries = {p: e.epoch for p, e in engine.ledger.entries.items()}
            return before, engine.last_synced_epoch, again, entries

    before, after, again, entries = asyncio.run(scenario())
    assert read_checkpoint_epoch(remote / "weights" / "last.pt") == 5
    assert before == 4  # the label the late status gave
    assert after == 5  # what the target holds
    assert entries["weights/last.pt"] == 5 and entries["weights/best.pt"] == 5
    # Nothing was sent a second time: every file of epoch 5 had gone up with the late milestone.
    assert again == 0


def test_final_uploads_epoch_snapshots_never_seen_by_on_epoch(tmp_path: Path) -> None:
    # A restarted agent (or one whose watcher missed the last epochs) goes straight to the
    # final sync: "everything, whatever the policy skipped" must include epoch_N.pt.
    remote = tmp_path / "remote"
    run_dir = tmp_path / "runs" / "run1"
    make_run(run_dir, epochs=4, save_period=2)

    async def scenario() -> Any:
        sink = FaultySink(remote)
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine, sink):
            await engine.final(run_dir, read_status(run_dir), [])
            assert await engine.drain(10)
            return await engine.verify_all(run_dir)

    result = asyncio.run(scenario())
    assert result.sync_verified
    for name in ("last.pt", "best.pt", "epoch_2.pt", "epoch_4.pt"):
        assert (remote / "weights" / name).exists(), name


def test_checkpoint_rewritten_at_an_unclean_exit_never_replaces_the_verified_one(
    tmp_path: Path,
) -> None:
    # Seen on an H200: a SIGINT during torch.save left a 665-byte last.pt that is a valid zip;
    # the final sync must not overwrite the verified epoch checkpoint with it.
    remote = tmp_path / "remote"
    run_dir = tmp_path / "runs" / "run1"
    make_run(run_dir, epochs=2, save_period=0)
    weights = run_dir / "weights"

    async def scenario() -> Any:
        sink = FaultySink(remote)
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine, sink):
            await engine.final(run_dir, read_status(run_dir), [])
            assert await engine.drain(10)
            good = (remote / "weights" / "last.pt").read_bytes()
            write_checkpoint(weights / "last.pt", epoch=99, payload_kb=1)  # the unsafe rewrite
            await engine.final(run_dir, read_status(run_dir), [], clean_exit=False)
            assert await engine.drain(10)
            # What is on disk is on the target: last.pt as last.at-exit.pt.
            return good, await engine.verify_all(run_dir)

    good, result = asyncio.run(scenario())
    assert result.sync_verified
    assert (remote / "weights" / "last.pt").read_bytes() == good
    assert (remote / "weights" / "last.at-exit.pt").read_bytes() == (
        weights / "last.pt"
    ).read_bytes()


# --------------------------------------------------------------------------------------------
# LocalSink


def test_local_sink_round_trip_leaves_no_partial_files(tmp_path: Path) -> None:
    sink = LocalSink(tmp_path / "remote")
    sink.prepare()
    src = tmp_path / "f.bin"
    src.write_bytes(b"x" * 1000)
    sink.upload(src, "a/b/f.bin")
    stat = sink.stat("a/b/f.bin")
    assert stat == RemoteFile("a/b/f.bin", 1000, sha256_file(src))
    assert sink.stat("a/missing.bin") is None
    assert [p.name for p in (tmp_path / "remote" / "a" / "b").iterdir()] == ["f.bin"]
    assert sink.description == f"file://{tmp_path / 'remote'}"


@pytest.mark.parametrize("bad", ["../escape.pt", "a/../../escape.pt", "/etc/passwd"])
def test_local_sink_refuses_paths_outside_its_folder(tmp_path: Path, bad: str) -> None:
    sink = LocalSink(tmp_path / "remote")
    src = tmp_path / "f.bin"
    src.write_bytes(b"x")
    with pytest.raises(SinkError) as info:
        sink.upload(src, bad)
    assert info.value.retryable is False
    assert not (tmp_path / "escape.pt").exists()
