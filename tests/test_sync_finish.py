"""The end of a run and what /status says on the way: the final sync next to an upload still in
flight, snapshot work kept off the event loop, stuck uploads made visible, and verification of
every checkpoint on disk against the target."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

from agent.sync.engine import SyncEngine
from agent.sync.ledger import ItemKind
from agent.trainer.rundir import read_status
from tests.fakes.scripted_trainer import write_checkpoint
from tests.test_sync import FaultySink, make_item, make_run, running, sync_cfg, until


def test_final_does_not_upload_again_a_last_pt_whose_identical_upload_is_in_flight(
    tmp_path: Path,
) -> None:
    # Seen on the H200: last.pt of the last epoch was uploaded and verified twice, because the
    # final sync counted the upload in flight as undelivered.
    remote = tmp_path / "remote"
    run_dir = tmp_path / "runs" / "run1"
    make_run(run_dir, epochs=2, save_period=0)
    sink = FaultySink(remote)
    gate = sink.gate("weights/last.pt")

    async def scenario() -> int:
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine, sink):
            st = read_status(run_dir)
            assert st is not None
            await engine.on_epoch(run_dir, st)
            await until(lambda: sink.active["weights/last.pt"] == 1)
            queued = await engine.final(run_dir, st, [])
            gate.set()
            assert await engine.drain(10)
            assert (await engine.verify_all(run_dir)).sync_verified
        return queued

    queued = asyncio.run(scenario())
    assert queued == 0
    assert len(sink.uploads_of("weights/last.pt")) == 1


def test_snapshots_are_taken_off_the_event_loop(tmp_path: Path) -> None:
    # A 512 MB checkpoint took about 1 s to copy and hash, with the loop (the status server,
    # the trainer watch, every upload watcher) blocked all that time.
    remote = tmp_path / "remote"
    run_dir = tmp_path / "runs" / "run1"
    make_run(run_dir, epochs=2, save_period=2)
    ticks = [0]
    #: Copies that saw the loop stand still (a copy on the loop blocks it: no tick comes).
    blocked: list[str] = []

    def slow_copy(src: Path, dst: Path) -> None:
        # A slow disk that ends only once the loop has ticked meanwhile: the verdict rests on
        # ticks seen during the copy, not on how long a tick may take on a loaded machine.
        seen, end = ticks[0], time.monotonic() + 30.0  # the cap: a blocked loop, not a slow one
        while ticks[0] < seen + 3:
            if time.monotonic() > end:
                blocked.append(src.name)
                break
            time.sleep(0.01)
        shutil.copyfile(src, dst)

    async def ticker(done: asyncio.Event) -> None:
        while not done.is_set():
            await asyncio.sleep(0.01)
            ticks[0] += 1

    async def scenario() -> tuple[int, int]:
        engine = SyncEngine(FaultySink(remote), sync_cfg(remote), state_dir=tmp_path / "state")
        engine.snapshots.copy = slow_copy
        done = asyncio.Event()
        tick = asyncio.create_task(ticker(done))
        try:
            st = read_status(run_dir)
            assert st is not None
            on_epoch = await engine.on_epoch(run_dir, st)
            (run_dir / "status.json").touch()
            with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
                f.write("{}\n")
            final = await engine.final(run_dir, st, [])
        finally:
            done.set()
            await tick
            await engine.close()
        return on_epoch, final

    on_epoch, final = asyncio.run(scenario())
    assert on_epoch >= 4 and final >= 1  # several slow copies ran...
    # ...and the loop kept ticking through each of them.
    assert not blocked, blocked


def _in_flight_for(engine: SyncEngine, path: str) -> float:
    started = [f["started_at"] for f in engine.status()["in_flight"] if f["path"] == path]
    return time.time() - started[0] if started else 0.0


def test_status_shows_a_stuck_upload_since_when_and_the_last_error(tmp_path: Path) -> None:
    # Seen in a Hub blackhole: "failures: 0, in_flight: 2" for the whole outage.
    remote = tmp_path / "remote"
    sink = FaultySink(remote)
    gate = sink.gate("weights/last.pt")
    sink.fail["weights/best.pt"] = 10_000
    stuck = make_item(tmp_path / "snaps", "weights/last.pt", 5)
    failing = make_item(tmp_path / "snaps", "weights/best.pt", 5, kind=ItemKind.BEST)

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], float]:
        engine = SyncEngine(
            sink,
            sync_cfg(remote, max_backoff_s=0.05),
            state_dir=tmp_path / "state",
            stalled_after_s=0.3,
        )
        async with running(engine, sink):
            submitted = time.time()
            engine.submit(stuck)
            engine.submit(failing)
            # Timed from when the worker took the file, not from submit: on a loaded CI box the
            # worker can start it 0.2 s late (seen: "seconds": 0.2 after 0.4 s from submit).
            await until(lambda: engine.failures and _in_flight_for(engine, "weights/last.pt") > 0.4)
            during = engine.status()
            sink.fail.clear()
            gate.set()
            engine.retry_now()
            assert await engine.drain(10)
            return during, engine.status(), submitted

    during, after, submitted = asyncio.run(scenario())
    flight = {f["path"]: f for f in during["in_flight"]}["weights/last.pt"]
    assert flight["attempt"] == 1 and flight["epoch"] == 5
    assert submitted <= flight["started_at"] <= submitted + 1.0
    assert flight["seconds"] >= 0.3
    assert during["stalled_since"] is not None and during["stalled_since"] >= submitted
    assert during["last_success_at"] is None
    assert during["last_error"]["path"] == "weights/best.pt"
    assert "injected failure" in during["last_error"]["error"]
    assert during["last_error"]["at"] >= submitted
    assert after["stalled_since"] is None and after["in_flight"] == []
    assert after["last_success_at"] is not None and after["last_success_at"] >= submitted


def test_verify_all_requires_every_completed_checkpoint_on_disk_to_be_on_the_target(
    tmp_path: Path,
) -> None:
    # "Verified" meant "the ledger's entries match": an epoch file the agent never queued
    # (trainer and agent both killed) was not looked at, and the box was destroyed with it.
    remote = tmp_path / "remote"
    run_dir = tmp_path / "runs" / "run1"
    weights = run_dir / "weights"
    make_run(run_dir, epochs=4, save_period=1)

    async def scenario() -> dict[str, Any]:
        sink = FaultySink(remote)
        engine = SyncEngine(sink, sync_cfg(remote), state_dir=tmp_path / "state")
        async with running(engine, sink):
            await engine.final(run_dir, read_status(run_dir), [])
            assert await engine.drain(10)
            results = {"all": await engine.verify_all(run_dir)}
            write_checkpoint(weights / "epoch_5.pt", 5)  # never queued
            results["by_ledger_only"] = await engine.verify_all()
            results["epoch_5"] = await engine.verify_all(run_dir, completed_epochs=5)
            results["up_to_4"] = await engine.verify_all(run_dir, completed_epochs=4)
            data = (weights / "epoch_5.pt").read_bytes()
            (weights / "epoch_6.pt").write_bytes(data[:-200])  # torn at exit
            results["torn"] = await engine.verify_all(run_dir)
            (remote / "weights" / "epoch_2.pt").unlink()
            engine.ledger.entries.pop("weights/epoch_2.pt")  # the ledger never knew it
            results["lost"] = await engine.verify_all(run_dir, completed_epochs=4)
        return results

    r = asyncio.run(scenario())
    assert r["all"].sync_verified
    assert r["by_ledger_only"].sync_verified  # what the old check saw
    assert not r["epoch_5"].sync_verified
    assert r["epoch_5"].missing == [
        {"path": "weights/epoch_5.pt", "problem": "on disk but not on the target"}
    ]
    assert r["up_to_4"].sync_verified  # epoch 5 was not completed yet
    assert [m["path"] for m in r["torn"].missing] == ["weights/epoch_5.pt"]
    assert [s["path"] for s in r["torn"].skipped] == ["weights/epoch_6.pt"]
    assert "not a valid zip" in r["torn"].skipped[0]["note"]
    assert r["lost"].missing == [
        {"path": "weights/epoch_2.pt", "problem": "on disk but not on the target"}
    ]
    assert not r["lost"].sync_verified
