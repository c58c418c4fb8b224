"""Getting checkpoints off the box: snapshots, the coalescing upload queue, retries, timeouts,
the ledger and verification. The target is a real folder (LocalSink); faults are injected by a
LocalSink subclass that fails, hangs, loses or corrupts uploads on request."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path, PosixPath
from typing import Any

import pytest

from agent.config import SyncSection
from agent.rundir import read_status
from agent.sinks import RemoteFile, SinkError, sha256_file
from agent.sinks.local import LocalSink
from agent.sync import Item, Ledger, LedgerEntry, Snapshotter, SyncEngine
from tests.fakes.scripted_trainer import write_checkpoint

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


class ScaledRng(random.Random):
    """Jitter at the low end, scaled down: backoff delays of milliseconds, same shape."""

    def __init__(self, scale: float) -> None:
        super().__init__(0)
        self.scale = scale

    def uniform(self, a: float, b: float) -> float:
        return a * self.scale


def sync_cfg(root: Path, **overrides: Any) -> SyncSection:
    values: dict[str, Any] = {
        "target": f"file://{root}",
        "upload_timeout_s": 10.0,
        "max_backoff_s": 0.05,
        "finish_timeout_s": 10.0,
    }
    values.update(overrides)
    return SyncSection(**values)


def make_item(folder: Path, remote_path: str, version: int, kind: str = "last") -> Item:
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


async def until(check: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------------------------
# The queue


def test_upload_is_verified_and_recorded(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    item = make_item(tmp_path / "snaps", "weights/last.pt", 3)

    async def scenario() -> dict[str, Any]:
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine, sink):
            engine.submit(item)
            assert await engine.drain(10)
            return engine.status()

    status = asyncio.run(scenario())
    assert sha256_file(remote / "weights" / "last.pt") == item.sha256
    assert not item.local.exists()  # the snapshot is dropped once verified
    assert status["uploads_done"] == 1
    assert status["last_synced_epoch"] == 3
    assert status["last_verified_checkpoint"]["path"] == "weights/last.pt"
    assert status["queue"] == [] and status["in_flight"] == []
    ledger = Ledger(tmp_path / "state" / "sync-ledger.json")
    entry = ledger.entries["weights/last.pt"]
    assert (entry.status, entry.sha256, entry.attempts) == ("verified", item.sha256, 1)


def test_coalescing_uploads_only_first_and_last_and_never_two_of_a_path_at_once(
    tmp_path: Path,
) -> None:
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    items = [make_item(tmp_path / "snaps", "weights/last.pt", v) for v in range(1, 6)]
    gate = sink.gate("weights/last.pt")

    async def scenario() -> list[dict[str, Any]]:
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state", max_parallel=2)
        async with running(engine, sink):
            engine.submit(items[0])
            assert await asyncio.to_thread(sink.entered.wait, 10)
            for item in items[1:]:
                engine.submit(item)
            queue = engine.queue
            gate.set()
            assert await engine.drain(10)
        return queue

    queue = asyncio.run(scenario())
    assert [q["epoch"] for q in queue] == [5]  # one pending item per path: the newest
    assert sink.uploads_of("weights/last.pt") == [items[0].sha256, items[4].sha256]
    assert sink.max_active["weights/last.pt"] == 1
    assert sha256_file(remote / "weights" / "last.pt") == items[4].sha256
    assert not any(item.local.exists() for item in items)  # superseded snapshots are deleted
    entry = Ledger(tmp_path / "state" / "sync-ledger.json").entries["weights/last.pt"]
    assert (entry.sha256, entry.status, entry.epoch) == (items[4].sha256, "verified", 5)


def test_different_paths_upload_in_parallel(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    a = make_item(tmp_path / "snaps", "weights/last.pt", 1)
    b = make_item(tmp_path / "snaps", "weights/best.pt", 1, kind="best")
    gate = sink.gate("weights/last.pt")

    async def scenario() -> None:
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state", max_parallel=2)
        async with running(engine, sink):
            engine.submit(a)
            engine.submit(b)
            # best.pt goes up while last.pt is stuck.
            await until(lambda: (remote / "weights" / "best.pt").exists())
            assert not (remote / "weights" / "last.pt").exists()
            gate.set()
            assert await engine.drain(10)

    asyncio.run(scenario())
    assert sha256_file(remote / "weights" / "last.pt") == a.sha256


def test_failing_upload_is_retried_with_growing_backoff_until_it_succeeds(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    sink.fail["weights/best.pt"] = 3
    item = make_item(tmp_path / "snaps", "weights/best.pt", 7, kind="best")

    async def scenario() -> SyncEngine:
        engine = SyncEngine(
            sink,
            sync_cfg(remote, max_backoff_s=300.0),
            state_dir=tmp_path / "state",
            rng=ScaledRng(0.1),  # delays 0.05 s, 0.1 s, 0.2 s
        )
        async with running(engine, sink):
            engine.submit(item)
            assert await engine.drain(10)
        return engine

    engine = asyncio.run(scenario())
    times = [t for path, _, t in sink.calls if path == "weights/best.pt"]
    assert len(times) == 4
    gaps = [b - a for a, b in itertools.pairwise(times)]
    for gap, delay in zip(gaps, (0.05, 0.1, 0.2), strict=True):
        assert gap >= delay - 0.005, gaps
    assert [f["attempt"] for f in engine.failures] == [1, 2, 3]
    assert all("injected failure" in f["error"] for f in engine.failures)
    entry = engine.ledger.entries["weights/best.pt"]
    assert (entry.status, entry.attempts, entry.error) == ("verified", 4, None)
    assert sha256_file(remote / "weights" / "best.pt") == item.sha256


def test_non_retryable_error_waits_the_longest_backoff(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    sink.fail["weights/last.pt"] = 1
    sink.fail_retryable = False
    item = make_item(tmp_path / "snaps", "weights/last.pt", 1)

    async def scenario() -> None:
        engine = SyncEngine(
            sink,
            sync_cfg(remote, max_backoff_s=0.4),
            state_dir=tmp_path / "state",
            rng=ScaledRng(0.1),  # a retryable error would wait 0.05 s
        )
        async with running(engine, sink):
            engine.submit(item)
            assert await engine.drain(10)

    asyncio.run(scenario())
    first, second = (t for _, _, t in sink.calls)
    assert second - first >= 0.39


def test_backoff_is_exponential_with_jitter_and_capped(tmp_path: Path) -> None:
    async def scenario() -> list[float]:
        engine = SyncEngine(
            FaultySink(tmp_path / "remote"),
            sync_cfg(tmp_path / "remote", max_backoff_s=300.0),
            state_dir=tmp_path / "state",
            rng=random.Random(1),
        )
        try:
            return [engine.backoff(n) for n in range(1, 13)]
        finally:
            await engine.close()

    delays = asyncio.run(scenario())
    for n, delay in enumerate(delays[:8], start=1):
        base = 2.0 ** (n - 1)
        assert base * 0.5 <= delay <= base, (n, delay)
    for delay in delays[9:]:
        assert 150.0 <= delay <= 300.0


def test_timed_out_upload_stays_in_flight_until_its_thread_ends(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    path = "weights/last.pt"
    gate = sink.gate(path)
    item = make_item(tmp_path / "snaps", path, 2)

    async def scenario() -> tuple[SyncEngine, dict[str, Any]]:
        engine = SyncEngine(
            sink,
            sync_cfg(remote, upload_timeout_s=0.2, max_backoff_s=0.02),
            state_dir=tmp_path / "state",
        )
        async with running(engine, sink):
            engine.submit(item)
            await until(lambda: engine.failures)
            # Several backoff periods later the first thread still hangs: no second upload.
            await asyncio.sleep(0.3)
            during = engine.status()
            assert len(sink.calls) == 1
            gate.set()
            assert await engine.drain(10)
        return engine, during

    engine, during = asyncio.run(scenario())
    assert "timed out" in engine.failures[0]["error"]
    assert [f["path"] for f in during["in_flight"]] == [path]
    assert during["in_flight"][0]["attempt"] == 1
    assert during["queue"][0]["path"] == path and "timed out" in during["queue"][0]["error"]
    assert len(sink.calls) == 2
    assert sink.max_active[path] == 1
    assert engine.ledger.entries[path].status == "verified"


def test_upload_accepted_then_lost_is_retried(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    sink.lose["weights/last.pt"] = 1
    item = make_item(tmp_path / "snaps", "weights/last.pt", 4)

    async def scenario() -> SyncEngine:
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine, sink):
            engine.submit(item)
            assert await engine.drain(10)
        return engine

    engine = asyncio.run(scenario())
    assert len(sink.calls) == 2
    assert "not on the target" in engine.failures[0]["error"]
    assert engine.ledger.entries["weights/last.pt"].status == "verified"
    assert sha256_file(remote / "weights" / "last.pt") == item.sha256


def test_upload_that_reads_back_different_bytes_is_retried(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    sink.corrupt["weights/last.pt"] = 1
    item = make_item(tmp_path / "snaps", "weights/last.pt", 4)

    async def scenario() -> SyncEngine:
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine, sink):
            engine.submit(item)
            assert await engine.drain(10)
        return engine

    engine = asyncio.run(scenario())
    assert "read back as" in engine.failures[0]["error"]
    assert sha256_file(remote / "weights" / "last.pt") == item.sha256


def test_drain_times_out_while_uploads_keep_failing(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    sink.fail["weights/last.pt"] = 10_000
    item = make_item(tmp_path / "snaps", "weights/last.pt", 1)

    async def scenario() -> tuple[bool, dict[str, Any]]:
        engine = SyncEngine(
            sink, sync_cfg(remote, max_backoff_s=0.02), state_dir=tmp_path / "state"
        )
        async with running(engine, sink):
            engine.submit(item)
            return await engine.drain(0.3), engine.status()

    drained, status = asyncio.run(scenario())
    assert drained is False
    # Still owed: waiting out its backoff, or on its next attempt.
    assert "weights/last.pt" in {q["path"] for q in status["queue"]} | {
        f["path"] for f in status["in_flight"]
    }
    assert status["uploads_done"] == 0
    assert 1 <= len(status["failures"]) <= 5  # /status shows the last few, not all


# --------------------------------------------------------------------------------------------
# Verification and the ledger


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
        make_item(snaps, "weights/best.pt", 4, kind="best"),
        make_item(snaps, "status.json", 5, kind="small"),
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


def test_ledger_is_persisted_and_reloaded(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    sink.fail["weights/best.pt"] = 10_000
    good = make_item(tmp_path / "snaps", "weights/last.pt", 6)
    failing = make_item(tmp_path / "snaps", "weights/best.pt", 6, kind="best")

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
    ledger.update("weights/last.pt", old.sha256, status="verified", verified_at=1.0)
    entry = Ledger(tmp_path / "ledger.json").entries["weights/last.pt"]
    assert (entry.sha256, entry.status) == (new.sha256, "pending")


def test_last_verified_checkpoint_is_the_newest_verified_pt(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.json")
    items = {
        "weights/last.pt": make_item(tmp_path / "s", "weights/last.pt", 3),
        "weights/epoch_2.pt": make_item(tmp_path / "s", "weights/epoch_2.pt", 2, "epoch"),
        "status.json": make_item(tmp_path / "s", "status.json", 3, "small"),
    }
    assert ledger.last_verified_checkpoint() is None
    for item in items.values():
        ledger.expect(item)
    ledger.update(
        "weights/epoch_2.pt",
        items["weights/epoch_2.pt"].sha256,
        status="verified",
        verified_at=10.0,
    )
    ledger.update(
        "weights/last.pt", items["weights/last.pt"].sha256, status="verified", verified_at=20.0
    )
    ledger.update("status.json", items["status.json"].sha256, status="verified", verified_at=30.0)
    last = ledger.last_verified_checkpoint()
    assert last is not None and last.remote_path == "weights/last.pt"


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


def test_snapshot_of_a_valid_checkpoint(tmp_path: Path) -> None:
    src = tmp_path / "weights" / "last.pt"
    write_checkpoint(src, 3)
    snaps = Snapshotter(tmp_path / "snapshots")
    taken = snaps.take(src, checkpoint=True)
    assert taken is not None
    dst, digest, size = taken.path, taken.sha256, taken.size
    assert not taken.live
    assert dst.parent == tmp_path / "snapshots"
    assert dst.read_bytes() == src.read_bytes()
    assert (digest, size) == (sha256_file(src), src.stat().st_size)
    again = snaps.take(src, checkpoint=True)
    assert again is not None and again.path != dst  # every snapshot has its own file


def test_snapshot_rejects_a_torn_checkpoint(tmp_path: Path) -> None:
    src = tmp_path / "last.pt"
    write_checkpoint(src, 3, payload_kb=32)
    data = src.read_bytes()
    src.write_bytes(data[: len(data) - 100])  # the trainer was still writing it
    snaps = Snapshotter(tmp_path / "snapshots")
    assert snaps.take(src, checkpoint=True) is None
    assert list((tmp_path / "snapshots").iterdir()) == []


def test_snapshot_does_not_zip_check_small_files(tmp_path: Path) -> None:
    src = tmp_path / "status.json"
    src.write_text('{"state": "running"}', encoding="utf-8")
    taken = Snapshotter(tmp_path / "snapshots").take(src, checkpoint=False)
    assert taken is not None and taken.path.read_bytes() == src.read_bytes()


def test_snapshot_of_a_missing_file_is_none(tmp_path: Path) -> None:
    assert Snapshotter(tmp_path / "snapshots").take(tmp_path / "nope.pt", checkpoint=True) is None


class TouchedDuringCopy(PosixPath):
    """A real file whose mtime moves between the snapshotter's before- and after-copy stat(),
    as when the trainer rewrites it in place while it is being copied."""

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        result = super().stat(follow_symlinks=follow_symlinks)
        if not getattr(self, "touched", False):
            self.touched = True
            os.utime(self, ns=(result.st_atime_ns, result.st_mtime_ns + 1_000_000_000))
        return result


def test_snapshot_rejects_a_file_modified_during_copy(tmp_path: Path) -> None:
    plain = tmp_path / "last.pt"
    write_checkpoint(plain, 3)
    src = TouchedDuringCopy(plain)
    assert Snapshotter(tmp_path / "snapshots").take(src, checkpoint=True) is None
    assert list((tmp_path / "snapshots").iterdir()) == []
    # The same file, left alone, is fine.
    assert Snapshotter(tmp_path / "snapshots").take(plain, checkpoint=True) is not None


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


def test_a_rate_limit_retry_waits_at_least_what_the_target_asked(tmp_path: Path) -> None:
    # HTTP 429 with Retry-After: retrying sooner only earns another 429.
    async def scenario() -> tuple[float, float, float]:
        now = [1000.0]
        engine = SyncEngine(
            LocalSink(tmp_path / "remote"),
            sync_cfg(tmp_path / "remote", max_backoff_s=60.0),
            state_dir=tmp_path / "state",
            clock=lambda: now[0],
        )
        src = tmp_path / "f.txt"
        src.write_text("x")
        item = Item("f.txt", src, sha256_file(src), 1, 1, "small", attempts=1)
        engine._failed(item, "HTTP 429", retry_after_s=20.0)
        asked = item.not_before - now[0]
        engine._failed(item, "HTTP 429", retry_after_s=900.0)  # capped by max_backoff
        capped = item.not_before - now[0]
        engine._failed(item, "HTTP 503")
        plain = item.not_before - now[0]
        return asked, capped, plain

    asked, capped, plain = asyncio.run(scenario())
    assert asked >= 20.0
    assert capped == 60.0
    assert plain < 20.0
