"""The sync queue when the machine itself fails: no file descriptors left (the ledger cannot be
written, the sink cannot open files), a ledger path that cannot be replaced, and an outage long
enough to flood the log. The descriptor table is really exhausted (a lowered RLIMIT_NOFILE,
filled up), as a connection flood does it; nothing is patched."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.sinks.digests import sha256_file
from agent.sinks.local import LocalSink
from agent.sync.engine import SyncEngine
from agent.sync.ledger import ItemKind, Ledger
from tests.test_sync import FaultySink, make_item, running, sync_cfg, until


class PassThroughSink(LocalSink):
    """A LocalSink whose OSErrors are not wrapped in SinkError, like a client library that lets
    EMFILE from ``open()`` through."""

    def upload(self, local: Path, remote_path: str) -> None:
        target = self._target(remote_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, target)


@contextlib.contextmanager
def descriptors_exhausted() -> Iterator[Callable[[], None]]:
    """Every descriptor this process may open is in use: the next ``open()`` anywhere fails
    with EMFILE. Yields a function that ends the flood (also called on exit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []

    def release() -> None:
        while held:
            os.close(held.pop())
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 16, hard))
    try:
        while True:
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
                break
        yield release
    finally:
        release()


def messages(caplog: pytest.LogCaptureFixture, start: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]


def test_failed_upload_is_requeued_although_its_ledger_write_fails_with_emfile(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The incident: every final upload failed with EMFILE, _failed wrote the ledger first, that
    # write failed too and the item was dropped; FINISHING then saw an empty queue.
    caplog.set_level(logging.INFO, logger="agent.sync")
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    gate = sink.gate("weights/best.pt")
    item = make_item(tmp_path / "snaps", "weights/best.pt", 11, kind=ItemKind.BEST)

    async def scenario() -> dict[str, Any]:
        engine = SyncEngine(
            sink,
            sync_cfg(remote, max_backoff_s=0.02),
            state_dir=tmp_path / "state",
            ledger_retry_s=0.05,
        )
        async with running(engine, sink):
            engine.submit(item)  # recorded while descriptors were still free
            await until(lambda: sink.active["weights/best.pt"] == 1)
            with descriptors_exhausted() as release:
                gate.set()  # the upload now opens its files: EMFILE, and so does the ledger
                await until(lambda: len(engine.failures) >= 3)
                during = engine.status()
                release()
            assert await engine.drain(10)
        return during

    during = asyncio.run(scenario())
    assert "Too many open files" in during["failures"][0]["error"]
    assert "EMFILE" in during["ledger_error"]
    assert "weights/best.pt" in {q["path"] for q in during["queue"]} | {
        f["path"] for f in during["in_flight"]
    }
    assert sha256_file(remote / "weights" / "best.pt") == item.sha256
    entry = Ledger(tmp_path / "state" / "sync-ledger.json").entries["weights/best.pt"]
    assert (entry.status, entry.sha256) == ("verified", item.sha256)
    # One line for the failing ledger, however many writes failed; one when it recovered.
    assert len(messages(caplog, "sync ledger not saved")) == 1
    assert len(messages(caplog, "sync ledger saved again")) == 1


def test_submit_and_a_sink_raising_bare_emfile_lose_nothing(tmp_path: Path) -> None:
    # submit() during the flood used to raise out of on_epoch; a sink that lets OSError through
    # (not SinkError) must be retried like any other failure.
    remote = tmp_path / "remote"
    items = [
        make_item(tmp_path / "snaps", "weights/last.pt", 3),
        make_item(tmp_path / "snaps", "weights/epoch_3.pt", 3, kind=ItemKind.EPOCH),
    ]

    async def scenario() -> SyncEngine:
        engine = SyncEngine(
            PassThroughSink(remote),
            sync_cfg(remote, max_backoff_s=0.02),
            state_dir=tmp_path / "state",
            ledger_retry_s=0.05,
        )
        async with running(engine):
            with descriptors_exhausted() as release:
                for item in items:
                    engine.submit(item)
                await until(lambda: len(engine.failures) >= 4)
                release()
            assert await engine.drain(10)
        return engine

    engine = asyncio.run(scenario())
    assert all("EMFILE" in f["error"] for f in engine.failures)
    on_disk = Ledger(tmp_path / "state" / "sync-ledger.json").entries
    for item in items:
        assert sha256_file(remote / item.remote_path) == item.sha256
        assert on_disk[item.remote_path].status == "verified"
    assert engine.ledger.dirty is False and engine.ledger.save_error is None


def test_a_verified_upload_survives_a_ledger_that_cannot_be_written(tmp_path: Path) -> None:
    # Success path: the upload is verified while the ledger file cannot be replaced (a folder
    # is in its way). The result is kept in memory and written by the periodic retry.
    remote = tmp_path / "remote"
    ledger_path = tmp_path / "state" / "sync-ledger.json"
    item = make_item(tmp_path / "snaps", "weights/last.pt", 2)

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        engine = SyncEngine(
            FaultySink(remote), sync_cfg(remote), state_dir=tmp_path / "state", ledger_retry_s=0.05
        )
        ledger_path.mkdir(parents=True)
        async with running(engine):
            engine.submit(item)
            assert await engine.drain(10)
            during = engine.status()
            ledger_path.rmdir()
            await until(lambda: ledger_path.is_file())
            await until(lambda: not engine.ledger.dirty)
            return during, engine.status()

    during, after = asyncio.run(scenario())
    assert during["uploads_done"] == 1 and during["queue"] == []
    assert during["ledger_error"] is not None and "EISDIR" in during["ledger_error"]
    assert after["ledger_error"] is None
    entry = Ledger(ledger_path).entries["weights/last.pt"]
    assert (entry.status, entry.sha256) == ("verified", item.sha256)


def test_a_long_outage_logs_one_warning_per_path_and_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.sync")
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    sink.fail["weights/last.pt"] = 10_000
    item = make_item(tmp_path / "snaps", "weights/last.pt", 1)

    async def scenario() -> None:
        engine = SyncEngine(
            sink, sync_cfg(remote, max_backoff_s=0.005), state_dir=tmp_path / "state"
        )
        async with running(engine, sink):
            engine.submit(item)
            await until(lambda: len(sink.calls) >= 15)

    asyncio.run(scenario())
    assert len(messages(caplog, "upload of weights/last.pt failed")) == 1


def test_a_repeated_warning_comes_back_with_the_count_it_held_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.sync")
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    sink.fail["weights/last.pt"] = 10_000
    item = make_item(tmp_path / "snaps", "weights/last.pt", 1)
    interval = 0.3

    async def scenario() -> float:
        engine = SyncEngine(
            sink,
            sync_cfg(remote, max_backoff_s=0.005),
            state_dir=tmp_path / "state",
            log_every_s=interval,
        )
        async with running(engine, sink):
            started = time.monotonic()
            engine.submit(item)
            await until(lambda: len(messages(caplog, "upload of weights/last.pt failed")) >= 2)
            return time.monotonic() - started

    elapsed = asyncio.run(scenario())
    lines = messages(caplog, "upload of weights/last.pt failed")
    assert elapsed >= interval
    assert len(lines) <= elapsed / interval + 1
    assert "more like this not logged" in lines[1]
    assert len(sink.calls) > len(lines)
