"""The upload queue: one pending item per path, never two uploads of a path at once, retries
with backoff, timeouts, and the read-back that catches a lost or corrupted upload. Driven through
the sync engine (its public face) against a real folder; the helpers are in test_sync.py."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.config.model import SyncSection
from agent.sinks import Sink
from agent.sinks.digests import sha256_file
from agent.sinks.local import LocalSink
from agent.sync.engine import SyncEngine
from agent.sync.ledger import ItemKind, Ledger
from agent.sync.uploads import RETRY_AFTER_MAX_S, Item, Throttle, UploadQueue
from tests.test_sync import FaultySink, make_item, running, sync_cfg, until


class ScaledRng(random.Random):
    """Jitter at the low end, scaled down: backoff delays of milliseconds, same shape."""

    def __init__(self, scale: float) -> None:
        super().__init__(0)
        self.scale = scale

    def uniform(self, a: float, b: float) -> float:
        return a * self.scale


def make_queue(
    tmp_path: Path,
    sink: Sink,
    cfg: SyncSection,
    *,
    rng: random.Random | None = None,
    clock: Callable[[], float] = time.time,
) -> UploadQueue:
    """An upload queue alone, with the engine's defaults."""
    return UploadQueue(
        sink,
        cfg,
        Ledger(tmp_path / "state" / "sync-ledger.json"),
        throttle=Throttle(60.0),
        max_parallel=2,
        rng=rng or random.Random(),
        clock=clock,
        ledger_retry_s=5.0,
        stalled_after_s=120.0,
    )


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
    b = make_item(tmp_path / "snaps", "weights/best.pt", 1, kind=ItemKind.BEST)
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
    item = make_item(tmp_path / "snaps", "weights/best.pt", 7, kind=ItemKind.BEST)

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
        queue = make_queue(
            tmp_path,
            FaultySink(tmp_path / "remote"),
            sync_cfg(tmp_path / "remote", max_backoff_s=300.0),
            rng=random.Random(1),
        )
        try:
            return [queue.backoff(n) for n in range(1, 13)]
        finally:
            await queue.close()

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
    # The abandoned thread's upload landed in the end: the retry reads it back first and finds
    # it there, so it is verified without being sent again (on the Hub: no second commit).
    assert len(sink.calls) == 1
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


def test_a_rate_limit_retry_waits_at_least_what_the_target_asked(tmp_path: Path) -> None:
    # HTTP 429 with Retry-After: retrying sooner only earns another 429. The Hub's commit quota
    # asks for up to an hour: believed up to RETRY_AFTER_MAX_S, whatever max_backoff_s says, and
    # the final sync's retry_now() does not override it.
    async def scenario() -> tuple[float, float, float, float, float]:
        now = [1000.0]
        queue = make_queue(
            tmp_path,
            LocalSink(tmp_path / "remote"),
            sync_cfg(tmp_path / "remote", max_backoff_s=60.0),
            clock=lambda: now[0],
        )
        src = tmp_path / "f.txt"
        src.write_text("x")
        item = Item("f.txt", src, sha256_file(src), 1, 1, ItemKind.SMALL, attempts=1)
        queue._failed(item, "HTTP 429", retry_after_s=20.0)
        asked = item.not_before - now[0]
        queue._failed(item, "HTTP 429", retry_after_s=900.0)  # longer than max_backoff
        long = item.not_before - now[0]
        queue.retry_now()
        after_retry_now = item.not_before - now[0]
        queue._failed(item, "HTTP 429", retry_after_s=10 * RETRY_AFTER_MAX_S)
        absurd = item.not_before - now[0]
        now[0] += 2 * RETRY_AFTER_MAX_S
        queue._failed(item, "HTTP 503")
        plain = item.not_before - now[0]
        return asked, long, after_retry_now, absurd, plain

    asked, long, after_retry_now, absurd, plain = asyncio.run(scenario())
    assert asked >= 20.0
    assert long == 900.0
    assert after_retry_now == 900.0
    assert absurd == RETRY_AFTER_MAX_S
    assert plain <= 60.0
