"""One commit per milestone on the Hub, and the Hub's commit limit (issue 29, item 2).

The sync engine sends to :class:`~agent.sinks.hf.HubSink` through the real ``huggingface_hub``
client, against the fake Hub of ``tests/fakes/hub.py`` on 127.0.0.1, which enforces a commit
limit per repo per window and answers past it as the Hub does (429, ``Retry-After``). Commits are
counted on the fake; every file is still read back on its own (``paths-info``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent import hub as agent_hub
from agent.config.model import Env
from agent.sinks.hf import HubSink
from agent.sync.commits import RESERVE_COMMITS, WINDOW_S, CommitWindow
from agent.sync.engine import SyncEngine
from agent.trainer.rundir import read_status
from tests.fakes.hub import FakeHub, run_fake_hub
from tests.test_sync import complete, running, sync_cfg, until, write_epoch

TOKEN = "hf_write_token_commits"
REPO = "org/run1"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _configured() -> None:
    """The daemon sets the Hub client up at start-up, before it builds a sink."""
    agent_hub.configure()


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with run_fake_hub(tokens={TOKEN}) as h:
        yield h


def hub_sink(hub: FakeHub, *, commits_per_hour: int | None = None) -> HubSink:
    sink = HubSink(REPO, env=Env(hf_endpoint=hub.url, hf_token=TOKEN), private=True)
    if commits_per_hour is not None:
        sink.commits_per_hour = commits_per_hour
    return sink


def engine_for(sink: HubSink, tmp_path: Path, **kw: Any) -> SyncEngine:
    cfg = sync_cfg(tmp_path, target=f"hf://{REPO}", upload_timeout_s=60.0)
    return SyncEngine(sink, cfg, state_dir=tmp_path / "state", **kw)


def agent_commits(hub: FakeHub) -> list[tuple[str, ...]]:
    """The paths of each commit the agent made (not the repo's initial commit)."""
    return [c.paths for c in hub.commits("model", REPO) if c.summary.startswith("libreyolo-agent")]


def read_backs(hub: FakeHub) -> int:
    return sum(1 for r in hub.requests if r.route == "paths_info" and r.status == 200)


async def train_epochs(
    engine: SyncEngine, run_dir: Path, epochs: range, *, total: int, extra: list[Path]
) -> list[int]:
    """Epochs as LibreYOLO writes them (best every epoch, epoch_N.pt every epoch), each
    milestone sent and drained before the next epoch."""
    queued = []
    for epoch in epochs:
        write_epoch(run_dir, epoch, total=total, best_epoch=epoch, save_period=1)
        st = read_status(run_dir)
        assert st is not None
        queued.append(await engine.on_epoch(run_dir, st, extra_files=extra))
        assert await engine.drain(30)
    return queued


def test_each_milestone_is_one_commit_and_every_file_is_read_back(
    hub: FakeHub, tmp_path: Path
) -> None:
    run_dir = tmp_path / "runs" / "run1"
    run_dir.mkdir(parents=True)
    state_file = tmp_path / "state" / "state.json"
    state_file.parent.mkdir(parents=True)
    state_file.write_text("{}", encoding="utf-8")

    async def scenario() -> tuple[list[int], int, int, Any, dict[str, Any]]:
        engine = engine_for(hub_sink(hub), tmp_path, agent_files_every_s=0.0)
        async with running(engine):
            queued = await train_epochs(engine, run_dir, range(1, 4), total=3, extra=[state_file])
            complete(run_dir, 3, 3)
            state_file.write_text('{"phase": "FINISHING"}', encoding="utf-8")
            final = await engine.final(run_dir, read_status(run_dir), [state_file])
            assert await engine.drain(30)
            read = read_backs(hub)
            result = await engine.verify_all(run_dir, changed_only=True)
            return queued, final, read, result, engine.status()

    queued, final, read, result, status = asyncio.run(scenario())
    commits = agent_commits(hub)
    print(f"\ncommits to {REPO}: {len(commits)} for {sum(queued) + final} files")
    # Epoch 1: last.pt, best.pt, epoch_1.pt, status.json, metrics.jsonl, agent/state.json.
    assert queued == [6, 5, 5] and final == 2
    assert len(commits) == 4  # one per milestone, one for the final sync
    assert set(commits[0]) == {
        "weights/last.pt",
        "weights/best.pt",
        "weights/epoch_1.pt",
        "status.json",
        "metrics.jsonl",
        "agent/state.json",
    }
    assert set(commits[3]) == {"status.json", "agent/state.json"}
    # Each file read back on its own after its commit (18 files); the end's check trusts what
    # the ledger verified at its present content (8 paths) and reads nothing again.
    assert read == sum(queued) + final
    assert result.sync_verified and result.trusted == 8 and result.read_back == 0
    assert status["uploads_done"] == 18 and status["uploads_failed"] == 0
    assert status["cadence"]["commits_last_hour"] == 4
    assert status["cadence"]["adapted"] is False
    files = hub.files("model", REPO)
    for name in ("last.pt", "best.pt", "epoch_3.pt"):
        assert files[f"weights/{name}"] == (run_dir / "weights" / name).read_bytes()
    # The count survives the agent: a restarted one knows this hour's commits.
    assert json.loads((tmp_path / "state" / "sync-commits.json").read_text())["commits"]


@pytest.mark.parametrize("as_date", [False, True], ids=["seconds", "http-date"])
def test_a_429_from_the_hub_is_retried_no_sooner_than_its_retry_after(
    hub: FakeHub, tmp_path: Path, as_date: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # Someone else commits to the repo too: the Hub refuses a commit the agent thought it had.
    caplog.set_level(logging.INFO, logger="agent.sync")
    hub.limit_commits(1, window_s=3.0, as_date=as_date)
    run_dir = tmp_path / "runs" / "run1"
    run_dir.mkdir(parents=True)

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], int]:
        engine = engine_for(hub_sink(hub), tmp_path)
        async with running(engine):
            await train_epochs(engine, run_dir, range(1, 2), total=3, extra=[])
            write_epoch(run_dir, 2, total=3, best_epoch=2, save_period=1)
            st = read_status(run_dir)
            assert st is not None
            await engine.on_epoch(run_dir, st)
            await until(lambda: engine.failures)
            during = engine.status()
            # While the Hub asks to wait, the next milestone is deferred, not sent into a 429.
            write_epoch(run_dir, 3, total=3, best_epoch=3, save_period=1)
            st = read_status(run_dir)
            assert st is not None
            deferred = await engine.on_epoch(run_dir, st)
            assert await engine.drain(30)
            return during, engine.status(), deferred

    during, after, deferred = asyncio.run(scenario())
    assert hub.commits_refused[("model", REPO)] == 1
    refusal = next(r for r in hub.requests if r.route == "commit" and r.status == 429)
    retry = next(r for r in hub.requests if r.route == "commit" and r.start > refusal.end)
    # The fake asked for the rest of its 3 s window (at least 1 s; an HTTP date has whole
    # seconds): the retry came no sooner.
    assert retry.start - refusal.end >= 0.9
    assert "exceeded our hourly quotas for action: commit" in during["failures"][0]["error"]
    assert "rate limited by the Hub; the Hub asks to wait" in during["failures"][0]["error"]
    assert during["cadence"]["asked_until"] is not None
    assert deferred == 0
    assert any("sync cadence adapted" in r.getMessage() for r in caplog.records)
    # The refused commit's files went up together in the retry: one commit, nothing lost.
    commits = agent_commits(hub)
    assert len(commits) == 2
    assert {"weights/last.pt", "weights/best.pt", "weights/epoch_2.pt"} <= set(commits[1])
    assert after["queue"] == [] and after["in_flight"] == []


def test_near_the_limit_milestones_are_deferred_and_the_final_sync_carries_them(
    hub: FakeHub, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.sync")
    limit = RESERVE_COMMITS + 4  # four milestones, then only what must go
    hub.limit_commits(limit)
    run_dir = tmp_path / "runs" / "run1"
    run_dir.mkdir(parents=True)

    async def scenario() -> tuple[list[int], dict[str, Any], Any]:
        engine = engine_for(hub_sink(hub, commits_per_hour=limit), tmp_path)
        async with running(engine):
            queued = await train_epochs(engine, run_dir, range(1, 9), total=8, extra=[])
            during = engine.status()
            complete(run_dir, 8, 8)
            await engine.final(run_dir, read_status(run_dir), [])
            assert await engine.drain(30)
            result = await engine.verify_all(run_dir)
        return queued, during, result

    queued, during, result = asyncio.run(scenario())
    assert [n > 0 for n in queued] == [True] * 4 + [False] * 4
    cadence = during["cadence"]
    assert cadence["adapted"] is True and cadence["deferred_epochs"] == [5, 6, 7, 8]
    assert cadence["commits_last_hour"] == 4 and cadence["limit_per_hour"] == limit
    assert f"{RESERVE_COMMITS} of the {limit} are kept for the final sync" in cadence["reason"]
    warned = [r.getMessage() for r in caplog.records if "sync cadence adapted" in r.getMessage()]
    assert len(warned) == 1 and "milestone epoch=5 deferred" in warned[0]
    commits = agent_commits(hub)
    assert len(commits) == 5 and hub.commits_refused.get(("model", REPO), 0) == 0
    # The final sync carried what the deferred milestones held: the newest last.pt and best.pt,
    # and every epoch_N.pt (a resume needs last.pt; nothing skipped is lost).
    assert {f"weights/epoch_{n}.pt" for n in range(5, 9)} | {
        "weights/last.pt",
        "weights/best.pt",
    } <= set(commits[4])
    files = hub.files("model", REPO)
    assert files["weights/last.pt"] == (run_dir / "weights" / "last.pt").read_bytes()
    assert result.sync_verified


def test_the_commit_window_paces_milestones_and_survives_a_restart(tmp_path: Path) -> None:
    now = [10_000.0]
    path = tmp_path / "sync-commits.json"
    window = CommitWindow(path, 128, clock=lambda: now[0])
    for _ in range(63):
        assert window.decide().allowed
        window.record()
        now[0] += 10.0
    # Half the limit reached: the room left (120 - 64 = 56... spread to the hour's end).
    window.record()
    paced = window.decide()
    assert not paced.allowed and paced.used == 64 and paced.next_at is not None
    gap = paced.next_at - (now[0])
    assert 0 < gap < WINDOW_S / (128 - RESERVE_COMMITS - 64) + 1
    now[0] = paced.next_at
    assert window.decide().allowed
    # A restarted agent reads the count; an hour later it has aged out.
    again = CommitWindow(path, 128, clock=lambda: now[0])
    assert again.used() == 64
    now[0] += WINDOW_S
    assert again.used() == 0 and again.decide().allowed
    # No limit (a folder): nothing counted, everything allowed.
    free = CommitWindow(tmp_path / "none.json", None, clock=lambda: now[0])
    free.record()
    assert free.used() == 0 and free.decide().allowed and not (tmp_path / "none.json").exists()


CHILD = """
import asyncio, sys
from pathlib import Path
from agent import hub
from agent.config.model import Env, SyncSection
from agent.sinks.hf import HubSink
from agent.sync.engine import SyncEngine
from agent.trainer.rundir import read_status

url, tmp = sys.argv[1], Path(sys.argv[2])
hub.configure()
sink = HubSink("org/run1", env=Env(hf_endpoint=url, hf_token=sys.argv[3]), private=True)
cfg = SyncSection(target="hf://org/run1", max_backoff_s=0.05)

async def main():
    engine = SyncEngine(sink, cfg, state_dir=tmp / "state")
    task = asyncio.create_task(engine.run())
    run_dir = tmp / "runs" / "run1"
    await engine.on_epoch(run_dir, read_status(run_dir))
    await engine.drain(600)

asyncio.run(main())
"""


@pytest.mark.parametrize("landed", [True, False], ids=["commit-landed", "commit-refused"])
def test_an_agent_killed_mid_commit_loses_nothing_and_commits_nothing_twice(
    hub: FakeHub, tmp_path: Path, landed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.sync")
    run_dir = tmp_path / "runs" / "run1"
    run_dir.mkdir(parents=True)
    write_epoch(run_dir, 1, total=2, best_epoch=1, save_period=1)
    # The same huggingface_hub as this process (the old-client run puts its tree first).
    path = [p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    if landed:
        # Killed (SIGKILL) right after the commit landed, before any read-back.
        env["LIBREYOLO_AGENT_CRASHPOINT"] = "upload-sent"
    else:
        # The Hub refuses every commit; the agent is killed while retrying.
        hub.fail("commit", 503, times=None)
    log_path = tmp_path / "child.log"
    with open(log_path, "w", encoding="utf-8") as out:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, hub.url, str(tmp_path), TOKEN],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        if landed:
            assert child.wait(120) == -signal.SIGKILL, log_path.read_text()
        else:
            deadline = time.monotonic() + 120
            while not any(r.route == "commit" and r.status == 503 for r in hub.requests):
                assert time.monotonic() < deadline and child.poll() is None, log_path.read_text()
                time.sleep(0.02)
            child.send_signal(signal.SIGKILL)
            child.wait(30)
            hub.clear_faults()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    before = agent_commits(hub)
    assert len(before) == (1 if landed else 0)
    ledger = json.loads((tmp_path / "state" / "sync-ledger.json").read_text())
    assert {e["status"] for e in ledger["entries"]} == {"pending"}

    async def restarted() -> tuple[int, Any]:
        engine = engine_for(hub_sink(hub), tmp_path)
        async with running(engine):
            queued = await engine.recover(run_dir)
            assert await engine.drain(30)
            return queued, await engine.verify_all(run_dir, completed_epochs=1)

    queued, result = asyncio.run(restarted())
    assert queued == 5  # last.pt, best.pt, epoch_1.pt, status.json, metrics.jsonl
    assert result.sync_verified
    # Landed: every file is found on the Hub and verified, no second commit. Refused: one commit.
    assert len(agent_commits(hub)) == 1
    already = [r.getMessage() for r in caplog.records if "already on the target" in r.getMessage()]
    assert len(already) == (5 if landed else 0)
    files = hub.files("model", REPO)
    for name in ("last.pt", "best.pt", "epoch_1.pt"):
        assert files[f"weights/{name}"] == (run_dir / "weights" / name).read_bytes()
