"""The daemon syncing a real ``libreyolo train`` run to the fake Hugging Face Hub (issue 3).

Real tiny training (``yolox-n``, 64x64, CPU, ``save_period = 1``), the real ``huggingface_hub``
client, and the fake Hub of ``tests/fakes/hub.py`` on 127.0.0.1 with faults injected: the Hub
failing for part of the run, down for the whole run, and refusing the token.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent import demo
from agent.config.model import Env, Job
from agent.daemon.spine import Daemon
from agent.state import Phase, StateStore
from agent.trainer.rundir import SMALL_FILES
from tests.fakes.hub import FakeHub, Fault, overlaps, run_fake_hub
from tests.support import tiny_job, wait_for

pytestmark = pytest.mark.training

requires_libreyolo = pytest.mark.skipif(
    shutil.which("libreyolo", path=str(Path(sys.executable).parent)) is None
    and shutil.which("libreyolo") is None,
    reason="the training stack (libreyolo) is not installed: run ./install.sh",
)

REPO = "test-org/run1"
GOOD_TOKEN = "hf_good_token"


def is_report(remote_path: str) -> bool:
    """The post-mortem (agent/report.json, report.md), uploaded after FINISHING's verification."""
    return remote_path in ("agent/report.json", "agent/report.md")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.make_dataset(tmp_path_factory.mktemp("data") / "ds")


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    before = set(threading.enumerate())
    with run_fake_hub(tokens={GOOD_TOKEN}) as h:
        yield h
        # Upload threads the engine stopped waiting for end before the Hub goes away.
        join_sync_threads(before)


def join_sync_threads(before: set[threading.Thread], timeout: float = 60.0) -> None:
    """Wait for the sync engine's upload threads started since ``before``."""
    end = time.monotonic() + timeout
    for t in set(threading.enumerate()) - before:
        if t.name.startswith("sync-"):
            # Daemon threads: a hung upload must never keep a finished agent from exiting.
            assert t.daemon, t.name
            t.join(max(0.0, end - time.monotonic()))
            assert not t.is_alive(), f"upload thread {t.name} still running"


def make_job(tmp: Path, data: Path, *, epochs: int, sync: str) -> Job:
    sections = f'[sync]\ntarget = "hf://{REPO}"\nevery_epochs = 1\n{sync}\n'
    return tiny_job(tmp, data, epochs=epochs, train="save_period = 1", sections=sections)


class Probe:
    """Beside the daemon in its loop: every sync failure /status showed while the job ran."""

    def __init__(self) -> None:
        self.base: str | None = None
        self.failures: dict[tuple[str, float, int], dict[str, Any]] = {}
        self.polls = 0
        self.texts: list[str] = []

    def ready(self, daemon: Daemon) -> None:
        assert daemon.state.server is not None
        self.base = f"http://127.0.0.1:{daemon.state.server['port']}"

    def record(self, status: dict[str, Any]) -> None:
        self.polls += 1
        for f in (status.get("sync") or {}).get("failures") or []:
            self.failures[(f["path"], f["at"], f["attempt"])] = f

    def errors(self, path: str | None = None) -> list[str]:
        return [f["error"] for f in self.failures.values() if path is None or f["path"] == path]


Side = Callable[[Daemon], Coroutine[Any, Any, None]]


async def run_daemon(job: Job, env: Env, side: Side | None = None) -> tuple[int, Daemon, Probe]:
    """Run the daemon to its end; meanwhile poll /status over HTTP and run ``side``."""
    probe = Probe()
    daemon = Daemon(job, env, on_ready=probe.ready, poll_interval_s=0.5)
    main = asyncio.create_task(daemon.run())

    async def poll(session: aiohttp.ClientSession) -> None:
        # /status shows the last 5 failures: poll often enough to see each of them.
        while not main.done():
            if probe.base is not None:
                try:
                    async with session.get(f"{probe.base}/status") as r:
                        assert r.status == 200
                        text = await r.text()
                except aiohttp.ClientError:
                    if daemon.state.phase == Phase.DONE:
                        return  # the server stops last, after DONE
                    raise
                probe.texts.append(text)
                probe.record(json.loads(text))
            await asyncio.sleep(0.05)

    async with aiohttp.ClientSession() as session:
        poller = asyncio.create_task(poll(session))
        helper = asyncio.create_task(side(daemon)) if side else None
        try:
            code = await main
        finally:
            for task in (poller, helper):
                if task is not None and not task.done():
                    task.cancel()
            await asyncio.gather(poller, return_exceptions=True)
        if not poller.cancelled():
            poller.result()  # re-raise a failed /status answer
        if helper is not None:
            await asyncio.gather(helper, return_exceptions=True)
            if not helper.cancelled():
                helper.result()  # re-raise a failed side assertion
    assert daemon.sync is not None
    for f in daemon.sync.failures:  # the engine itself keeps the last 20
        probe.failures[(f["path"], f["at"], f["attempt"])] = f
    return code, daemon, probe


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def phase_times(state_dir: Path) -> dict[str, float]:
    st = StateStore(state_dir).load()
    assert st is not None
    return {h["to"]: h["at"] for h in st.history if "to" in h}


@requires_libreyolo
def test_hub_failing_for_part_of_the_run_ends_with_every_milestone_verified_on_the_hub(
    tmp_path: Path, dataset: Path, hub: FakeHub
) -> None:
    epochs = 4
    job = make_job(
        tmp_path,
        dataset,
        epochs=epochs,
        sync='max_backoff = "2s"\nupload_timeout = "5s"\nfinish_timeout = "90s"',
    )
    env = Env(state_dir=tmp_path / "state", hf_endpoint=hub.url, hf_token=GOOD_TOKEN)
    faults: dict[str, Fault] = {}
    # The Hub rejects every commit (503) until two epochs are trained.
    faults["outage"] = hub.fail("commit", 503, times=None)

    async def side(daemon: Daemon) -> None:
        await wait_for(
            lambda: (
                faults["outage"].hits >= 2
                and daemon.status is not None
                and daemon.status.completed_epochs >= 2
            )
        )
        hub.clear_faults()
        # Then one rate limit, one connection reset, and two commits that answer success
        # but lose the checkpoint: one dropped, one stored corrupted.
        faults["rate"] = hub.fail("commit", 429, times=1, retry_after=1)
        faults["reset"] = hub.reset("commit", times=1)
        faults["drop"] = hub.lose("drop", path="weights/epoch_3.pt")
        faults["corrupt"] = hub.lose("corrupt", path=f"weights/epoch_{epochs}.pt")
        await wait_for(lambda: all(faults[k].hits for k in ("rate", "reset", "drop", "corrupt")))
        # Last, one commit hangs past upload_timeout: the thread still sending keeps its path
        # "in flight", so the retry must not start before that commit ended.
        faults["slow"] = hub.delay("commit", 7.0, times=1)

    code, daemon, probe = asyncio.run(run_daemon(job, env, side))

    assert code == 0
    assert daemon.state.reason is not None and daemon.state.reason.value == "completed"
    assert daemon.state.phase == Phase.DONE
    assert {k: f.hits for k, f in faults.items()} == {
        "outage": faults["outage"].hits,
        "rate": 1,
        "reset": 1,
        "drop": 1,
        "corrupt": 1,
        "slow": 1,
    }
    assert faults["outage"].hits >= 2

    # Every milestone is on the Hub, byte for byte the run directory's final files.
    run_dir = daemon.run_dir
    assert run_dir is not None
    assert hub.is_private("model", REPO)
    remote = hub.files("model", REPO)
    expected = ["weights/last.pt", "weights/best.pt"]
    expected += [f"weights/epoch_{n}.pt" for n in range(1, epochs + 1)]
    expected += [name for name in SMALL_FILES if (run_dir / name).exists()]
    assert {"status.json", "metrics.jsonl", "train.log"} <= set(expected)
    for path in expected:
        assert path in remote, f"{path} is not on the Hub"
        assert sha256(remote[path]) == sha256((run_dir / path).read_bytes()), path
    assert sorted(p.name for p in (run_dir / "weights").glob("epoch_*.pt")) == sorted(
        f"epoch_{n}.pt" for n in range(1, epochs + 1)
    )
    assert read_json(run_dir / "status.json")["state"] == "completed"

    # The ledger promised exactly what the Hub holds, and says so.
    ledger = read_json(env.state_dir / "sync-ledger.json")["entries"]
    assert {e["remote_path"] for e in ledger} >= set(expected)
    assert {e["remote_path"] for e in ledger if e["kind"] == "agent"} >= {"agent/state.json"}
    for e in ledger:
        assert e["status"] == "verified", e
        assert sha256(remote[e["remote_path"]]) == e["sha256"], e["remote_path"]
    result = read_json(env.state_dir / "sync-result.json")
    assert result["sync_verified"] is True
    assert result["missing"] == []
    # The post-mortem report goes up after the verification (it records the teardown decision).
    assert result["checked"] == len([e for e in ledger if not is_report(e["remote_path"])])
    status = daemon.status_dict()
    assert status["sync"]["verified"]["sync_verified"] is True
    assert status["sync"]["queue"] == [] and status["sync"]["in_flight"] == []
    assert status["last_synced_epoch"] == epochs
    # A verified sync lets the teardown destroy the box (provider "none" only records it).
    td = daemon.state.teardown
    assert td is not None and td["action"] == "destroy", td

    # /status recorded the injected failures.
    errors = probe.errors()
    assert any("HTTP 503" in e and "transient" in e for e in errors), errors
    assert any("HTTP 429" in e and "rate limited" in e for e in errors), errors
    assert any("cannot reach" in e for e in errors), errors
    assert any("timed out after 5s" in e for e in errors), errors
    # The dropped and the corrupted checkpoint were caught by the read-back, and uploaded again.
    dropped = probe.errors("weights/epoch_3.pt")
    assert any("accepted but is not on the target" in e for e in dropped), dropped
    assert any("read back as" in e for e in probe.errors(f"weights/epoch_{epochs}.pt"))
    for lost in ("weights/epoch_3.pt", f"weights/epoch_{epochs}.pt"):
        commits = [c for c in hub.commits("model", REPO) if lost in c.paths]
        assert len(commits) >= 2, f"{lost} was not uploaded again"
    assert not any(GOOD_TOKEN in e for e in errors)

    # No two requests carrying the same path overlapped, the timed-out commit included.
    carrying = [r for r in hub.requests if r.route in ("preupload", "commit") and r.files]
    for path in {p for r in carrying for p in r.files}:
        same = [r for r in carrying if path in r.files]
        assert overlaps(same) == [], f"uploads of {path} overlapped"
    slow = [r for r in carrying if r.route == "commit" and r.end - r.start >= 6.5]
    assert len(slow) == 1
    # The timed-out commit landed in the end: its files (one milestone, one commit) are read
    # back before any retry and found there, or sent again only after it ended.
    for slow_path in slow[0].files:
        later = [r for r in carrying if slow_path in r.files and r.start > slow[0].start]
        assert all(r.start >= slow[0].end for r in later), slow_path
    log = (env.state_dir / "agent.log").read_text()
    assert "sync verified" in log


@requires_libreyolo
def test_hub_down_for_the_whole_run_never_blocks_training_and_blocks_destroy(
    tmp_path: Path, dataset: Path, hub: FakeHub
) -> None:
    epochs = 2
    job = make_job(
        tmp_path,
        dataset,
        epochs=epochs,
        sync='max_backoff = "2s"\nupload_timeout = "20s"\nfinish_timeout = "3s"',
    )
    env = Env(state_dir=tmp_path / "state", hf_endpoint=hub.url, hf_token=GOOD_TOKEN)
    down: dict[str, Fault] = {"commit": hub.fail("commit", 503, times=None)}

    async def side(daemon: Daemon) -> None:
        # Through FINISHING it stays down, worse: commits hang for 8 s (past finish_timeout,
        # so uploads are still in flight when the agent ends) before their 503, and read-backs
        # lose the connection.
        await wait_for(lambda: daemon.state.phase == Phase.FINISHING)
        down["hang"] = hub.delay("commit", 8.0, times=None)
        down["read"] = hub.reset("paths_info", times=None)

    threads = set(threading.enumerate())
    code, daemon, probe = asyncio.run(run_daemon(job, env, side))

    assert code == 0
    assert daemon.state.phase == Phase.DONE
    # Training went on and completed despite the outage.
    assert daemon.state.reason is not None and daemon.state.reason.value == "completed"
    assert daemon.state.outcome is not None and daemon.state.outcome["kind"] == "completed"
    assert daemon.run_dir is not None
    run_status = read_json(daemon.run_dir / "status.json")
    assert run_status["state"] == "completed"
    assert daemon.status is not None and daemon.status.completed_epochs == epochs
    # FINISHING waited finish_timeout (3 s) for the sync, verified, and moved on, without
    # waiting for the uploads that hung for 8 s.
    times = phase_times(env.state_dir)
    assert 3.0 <= times["TEARDOWN"] - times["FINISHING"] < 7.0, times
    assert down["hang"].hits >= 1 and down["read"].hits >= 1

    # Nothing is verified, and sync-result.json says what is missing.
    assert [p for p in hub.files("model", REPO) if p != ".gitattributes"] == []
    result = read_json(env.state_dir / "sync-result.json")
    assert result["sync_verified"] is False
    ledger = read_json(env.state_dir / "sync-ledger.json")["entries"]
    assert ledger and all(e["status"] != "verified" for e in ledger)
    missing = {m["path"]: m["problem"] for m in result["missing"]}
    assert set(missing) == {e["remote_path"] for e in ledger if not is_report(e["remote_path"])}
    wanted = {"weights/last.pt", "weights/best.pt", "status.json", "metrics.jsonl"}
    wanted |= {f"weights/epoch_{n}.pt" for n in range(1, epochs + 1)}
    assert wanted <= set(missing), sorted(missing)
    assert all("read-back failed" in p for p in missing.values()), missing
    assert any("cannot reach" in p for p in missing.values()), missing
    errors = probe.errors()
    assert errors and all("HTTP 503" in e for e in errors), errors

    # Uploads were still hanging when the agent ended, and no upload started after that:
    # closing the sync engine stops its worker. Usually both slots hang; on a loaded machine
    # one may still be in its backoff (up to 2 s) when the 3 s of FINISHING end, so at least
    # one. (Up to 2 more hung commits: the post-mortem's report.json and report.md are sent,
    # bounded, before the teardown call.)
    join_sync_threads(threads)
    hung = [r for r in hub.requests if r.route == "commit" and r.end - r.start >= 7.5]
    assert 1 <= len(hung) <= 4, hung
    late = [
        r for r in hub.requests if r.route == "preupload" and r.start > max(h.start for h in hung)
    ]
    assert late == [], late

    # The teardown never destroys unverified checkpoints.
    td = daemon.state.teardown
    assert td is not None and td["action"] == "stop", td
    assert "not verified" in td["why"]
    assert daemon.status_dict()["sync"]["verified"]["sync_verified"] is False
    log = (env.state_dir / "agent.log").read_text()
    assert "final sync did not finish within 3s" in log
    assert "sync NOT verified" in log


@requires_libreyolo
def test_a_bad_token_is_a_non_retryable_failure_that_names_hf_token_and_never_leaks(
    tmp_path: Path, dataset: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A token refused from the start is found before training (the canary write: see
    # tests/test_preflight_canary.py); here it works for the canary and is revoked as training
    # starts (an expired or revoked token), so every upload meets 401.
    secret = "hf_Bad_SeCrEt_0123456789abcdef"
    with run_fake_hub(tokens={secret}) as hub:
        _bad_token_run(tmp_path, dataset, caplog, hub, secret)


def _bad_token_run(
    tmp_path: Path,
    dataset: Path,
    caplog: pytest.LogCaptureFixture,
    hub: FakeHub,
    secret: str,
) -> None:
    job = make_job(
        tmp_path,
        dataset,
        epochs=1,
        sync='max_backoff = "3s"\nupload_timeout = "20s"\nfinish_timeout = "2s"',
    )
    env = Env(state_dir=tmp_path / "state", hf_endpoint=hub.url, hf_token=secret)
    revoked_at: list[int] = []

    def revoke_now() -> None:
        if not revoked_at:
            hub.revoke(secret)
            revoked_at.append(len(hub.requests))

    async def revoke(daemon: Daemon) -> None:
        # The moment the job leaves BOOTING (the canary passed), before any checkpoint exists.
        daemon.events.listen(
            lambda e: revoke_now() if e.kind == "phase" and e.data.get("to") == "STAGING" else None
        )
        if daemon.state.phase != Phase.BOOTING:
            revoke_now()

    code, daemon, probe = asyncio.run(run_daemon(job, env, revoke))

    assert code == 0
    assert daemon.state.reason is not None and daemon.state.reason.value == "completed"
    # Only the canary went up (and was deleted): no checkpoint reached the repo.
    assert [p for p in hub.files("model", REPO) if p != ".gitattributes"] == []
    # After the revocation, the token was sent, and refused.
    after = hub.requests[revoked_at[0] :]
    assert after and all(r.auth == "invalid" for r in after)
    assert all(r.status == 401 for r in after)

    failures = list(probe.failures.values())
    assert failures
    for f in failures:
        assert "HTTP 401" in f["error"], f
        assert "set HF_TOKEN" in f["error"], f
        assert f["retryable"] is False, f
    # Not retryable: every next attempt waits max_backoff (3 s), not a short jittered backoff.
    log = (env.state_dir / "agent.log").read_text()
    retries = re.findall(r"failed \(attempt (\d+)\): .*; retry in ([0-9.]+)s$", log, re.M)
    assert retries and {delay for _, delay in retries} == {"3.0"}, retries
    assert "1" in {attempt for attempt, _ in retries}
    result = read_json(env.state_dir / "sync-result.json")
    assert result["sync_verified"] is False
    td = daemon.state.teardown
    assert td is not None and td["action"] == "stop" and "not verified" in td["why"]

    # The token appears nowhere: not in /status, agent.log, the state files or the snapshots.
    assert probe.texts and not any(secret in t for t in probe.texts)
    assert secret not in json.dumps(daemon.status_dict())
    assert caplog.text and secret not in caplog.text
    scanned = 0
    for path in tmp_path.rglob("*"):
        if path.is_file():
            scanned += 1
            assert secret.encode() not in path.read_bytes(), path
    assert scanned > 10


@requires_libreyolo
def test_agent_stopped_during_the_final_sync_leaves_it_to_the_next_agent(
    tmp_path: Path, dataset: Path, hub: FakeHub
) -> None:
    # systemd stops the agent while the Hub is down at the end: the job is not over, and the
    # restarted agent (Hub back) finishes the sync, verifies it, and only then tears down.
    job = make_job(tmp_path, dataset, epochs=2, sync='max_backoff = "1s"')
    env = Env(state_dir=tmp_path / "state", hf_endpoint=hub.url, hf_token=GOOD_TOKEN)
    down = hub.fail("commit", 503, times=None)

    async def first() -> tuple[int, Daemon]:
        shutdown = asyncio.Event()
        daemon = Daemon(job, env, poll_interval_s=0.5)
        task = asyncio.create_task(daemon.run(shutdown_trigger=shutdown))
        while daemon.state.phase != Phase.FINISHING:
            assert not task.done(), "the first agent ended before FINISHING"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        shutdown.set()  # what SIGTERM to the agent does
        return await asyncio.wait_for(task, 30), daemon

    code, daemon = asyncio.run(first())
    assert code == 0
    assert daemon.state.phase == Phase.FINISHING  # not over: nothing verified, no teardown
    assert daemon.state.teardown is None
    assert down.hits >= 1
    hub.clear_faults()

    second = Daemon(job, env, poll_interval_s=0.5)
    code = asyncio.run(second.run())
    assert code == 0
    assert second.state.phase == Phase.DONE and second.state.reason is not None
    assert second.state.reason.value == "completed"
    assert second.sync is not None and second.sync.verify_result is not None
    assert second.sync.verify_result.sync_verified
    files = hub.files("model", REPO)
    assert second.run_dir is not None
    for name in ("last.pt", "best.pt", "epoch_1.pt", "epoch_2.pt"):
        local = (second.run_dir / "weights" / name).read_bytes()
        assert hashlib.sha256(files[f"weights/{name}"]).digest() == hashlib.sha256(local).digest()
    assert second.state.teardown is not None and second.state.teardown["action"] == "destroy"
