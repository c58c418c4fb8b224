"""A bad job file on a rented box (agent/daemon/badjob.py): the real CLI (``supervise`` / ``run``)
in a subprocess, the fake Vast API and a webhook receiver on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.daemon.badjob import MARK, salvage, set_aside
from agent.state import Phase, Reason, RunState, StateStore, TrainerRecord
from tests.fakes.providers import FakeVast, run_fake_vast
from tests.test_notify import Receiver

KEY = "containerKEY-badjob-0123456789"
REPO = Path(__file__).resolve().parents[1]
SECRET_VARS = ("VAST_API_KEY", "RUNPOD_API_KEY", "LAMBDA_API_KEY", "CONTAINER_API_KEY", "HF_TOKEN")


@pytest.fixture
def vast() -> Iterator[FakeVast]:
    with run_fake_vast(keys=set(), instance_keys={KEY: "1234"}) as fake:
        fake.add_instance("1234")
        fake.add_instance("999")  # another box of the account: never touched
        yield fake


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


def write_job(tmp_path: Path, *, train: str, teardown: str, notify: str = "") -> Path:
    job = tmp_path / "job.toml"
    job.write_text(
        f"""
[job]
name = "badrun"
runs_dir = "{tmp_path / "runs"}"
[train]
model = "yolox-n"
data = "data.yaml"
{train}
[teardown]
{teardown}
{notify}
"""
    )
    return job


def cli(
    tmp_path: Path, *args: str, timeout: float = 120, **extra: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in SECRET_VARS}
    env.update(
        LIBREYOLO_AGENT_STATE_DIR=str(tmp_path / "state"),
        CONTAINER_ID="1234",
        CONTAINER_API_KEY=KEY,
        **extra,
    )
    env.pop("LIBREYOLO_AGENT_CRASHPOINT", None)
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def state_of(tmp_path: Path) -> RunState:
    state = StateStore(tmp_path / "state").load()
    assert state is not None
    return state


def status_text(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # --url at a port nothing listens on: status reads the state file, as with no agent.
    return cli(
        tmp_path, "status", "--state-dir", str(tmp_path / "state"), "--url", "http://127.0.0.1:9"
    )


def no_key_anywhere(tmp_path: Path, *texts: str) -> None:
    for text in texts:
        assert KEY not in text
    for path in (tmp_path / "state").rglob("*"):
        if path.is_file():
            assert KEY not in path.read_text(errors="replace"), path


def wait_for_kinds(receiver: Receiver, *kinds: str, deadline_s: float = 240.0) -> list[str]:
    """The kinds of notification ``receiver`` got, once ``kinds`` are among them; after
    ``deadline_s`` (a hang, not a slow machine) whatever came, for the caller's assertion."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and not set(kinds) <= set(receiver.kinds()):
        time.sleep(0.1)
    return receiver.kinds()


def test_supervise_a_broken_train_section_tears_the_box_down_as_a_preflight_failure(
    tmp_path: Path, vast: FakeVast, receiver: Receiver
) -> None:
    job = write_job(
        tmp_path,
        train="epochs = 0\nimgsz = -3.5e999",  # two mistakes; -inf is no number either
        teardown=f'provider = "vast"\napi_url = "{vast.url}"',
        notify=f'[notify]\nwebhook = "{receiver.url()}"',
    )
    got = cli(tmp_path, "supervise", str(job))
    assert got.returncode == 2, got.stderr[-3000:]  # the supervisor's "do not restart"
    assert "train.epochs" in got.stderr
    # Nothing was trained: the job's on_preflight_failure (default destroy) goes through.
    assert vast.mutations() == [("DELETE", "/api/v0/instances/1234/", {})]
    assert vast.instance("1234") is None and vast.instance("999") is not None
    state = state_of(tmp_path)
    assert state.phase == Phase.DONE and state.reason == Reason.PREFLIGHT_FAILED
    assert state.cause is not None and state.cause.startswith("bad job file: train.")
    assert "+1 more" in state.cause
    td = state.teardown
    assert td is not None and td["action"] == "destroy" and td["confirmed"] is True
    assert td["instance_id"] == "1234"
    assert any(h.get("event") == MARK for h in state.history)
    log = (tmp_path / "state" / "agent.log").read_text()
    assert "train.epochs" in log and "train.imgsz" in log
    shown = status_text(tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "bad job file: train." in shown.stdout and "preflight_failed" in shown.stdout
    kinds = wait_for_kinds(receiver, "teardown", "failure")
    assert {"teardown", "teardown_confirmed", "failure"} <= set(kinds), kinds
    texts = " ".join(b["text"] for b in receiver.received)
    assert "bad job file" in texts
    no_key_anywhere(tmp_path, got.stdout, got.stderr, json.dumps(receiver.received))


def test_run_with_a_provider_takes_the_jobs_on_preflight_failure_action(
    tmp_path: Path, vast: FakeVast
) -> None:
    job = write_job(
        tmp_path,
        train="epochs = 0",
        teardown=f'provider = "vast"\napi_url = "{vast.url}"\non_preflight_failure = "stop"',
    )
    got = cli(tmp_path, "run", str(job))
    assert got.returncode == 2, got.stderr[-3000:]
    assert vast.mutations() == [("PUT", "/api/v0/instances/1234/", {"state": "stopped"})]
    state = state_of(tmp_path)
    assert state.phase == Phase.DONE
    assert state.teardown is not None and state.teardown["action"] == "stop"

    # The box was stopped for this very file; someone started it again (to mend the file):
    # the same file is not torn down a second time, it keeps the box and says so.
    again = cli(tmp_path, "run", str(job))
    assert again.returncode == 2
    assert len(vast.mutations()) == 1
    state = state_of(tmp_path)
    assert state.phase == Phase.FAILED and state.teardown is not None
    assert state.teardown["action"] == "keep"
    assert "judged bad" in (state.cause or "") and "KEPT" in (state.cause or "")
    third = cli(tmp_path, "run", str(job))  # and at every later start with this very file
    assert third.returncode == 2 and len(vast.mutations()) == 1
    assert state_of(tmp_path).teardown["action"] == "keep"  # type: ignore[index]

    # A mended file that is still bad is judged afresh: the box is stopped again.
    job.write_text(job.read_text().replace("epochs = 0", "epochs = -1"))
    fourth = cli(tmp_path, "run", str(job))
    assert fourth.returncode == 2
    assert [m for m, _, _ in vast.mutations()] == ["PUT", "PUT"]


def test_an_unreadable_teardown_keeps_the_box_and_says_so_everywhere(
    tmp_path: Path, vast: FakeVast, receiver: Receiver
) -> None:
    job = write_job(
        tmp_path,
        train="epochs = 3",
        teardown=f'provider = "vsat"\napi_url = "{vast.url}"',
        notify=f'[notify]\nwebhook = "{receiver.url()}"',
    )
    got = cli(tmp_path, "supervise", str(job))
    assert got.returncode == 2
    assert "teardown.provider" in got.stderr
    assert vast.requests == []  # no provider call of any kind
    state = state_of(tmp_path)
    assert state.phase == Phase.FAILED and state.reason == Reason.PREFLIGHT_FAILED
    assert state.cause is not None and "KEPT" in state.cause
    assert "[teardown] cannot be read" in state.cause
    assert state.teardown is not None and state.teardown["action"] == "keep"
    assert "KEPT" in got.stderr
    assert "KEPT" in (tmp_path / "state" / "agent.log").read_text()
    shown = status_text(tmp_path)
    assert "KEPT" in shown.stdout, shown.stdout + shown.stderr
    assert shown.returncode == 3  # status's "the box may still bill"
    wait_for_kinds(receiver, "teardown", "failure")
    texts = [b["text"] for b in receiver.received]
    assert any("KEPT" in t for t in texts), texts


def test_a_toml_that_does_not_parse_keeps_the_box(tmp_path: Path, vast: FakeVast) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[teardown]\nprovider = "vast"\n[train\n')
    got = cli(tmp_path, "supervise", str(job))
    assert got.returncode == 2
    assert vast.requests == []
    state = state_of(tmp_path)
    assert state.phase == Phase.FAILED and "not valid TOML" in (state.cause or "")


def test_run_on_a_laptop_without_a_provider_only_lists_the_mistakes(
    tmp_path: Path, vast: FakeVast
) -> None:
    job = write_job(tmp_path, train="epochs = 0", teardown='provider = "none"')
    got = cli(tmp_path, "run", str(job))
    assert got.returncode == 2 and "train.epochs" in got.stderr
    assert not (tmp_path / "state" / "state.json").exists()
    assert vast.requests == []


def test_a_run_under_way_is_never_torn_down_for_a_job_file_gone_bad(
    tmp_path: Path, vast: FakeVast
) -> None:
    store = StateStore(tmp_path / "state")
    store.ensure()
    running = RunState(job_name="badrun", job_source="job.toml", phase=Phase.TRAINING)
    running.trainer = TrainerRecord(pid=1, create_time=0.0, started_at=0.0, argv=["x"])
    store.save(running)
    before = store.state_path.read_text()
    job = write_job(
        tmp_path, train="epochs = 0", teardown=f'provider = "vast"\napi_url = "{vast.url}"'
    )
    got = cli(tmp_path, "supervise", str(job))
    assert got.returncode == 2
    assert vast.mutations() == []
    assert "under way" in got.stderr and "KEPT" in got.stderr
    assert store.state_path.read_text() == before


def test_salvage_reads_teardown_and_notify_of_a_file_broken_elsewhere(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        train="epochs = 0\nbogus = [1, 2]",
        teardown='provider = "vast"\non_failure = "keep"\ninstance_id = "77"',
        notify='[notify]\nwebhook = "http://127.0.0.1:9/hook"\nevents = ["failure"]',
    )
    got = salvage(job)
    assert got.name == "badrun"
    assert got.teardown is not None and got.teardown.provider == "vast"
    assert got.teardown.instance_id == "77" and got.teardown.on_failure == "keep"
    assert got.notify is not None and got.notify.events == ("failure",)
    assert got.job is not None and got.job.runs_dir == tmp_path / "runs"
    broken = write_job(tmp_path, train="", teardown='provider = "vast"\non_failure = "explode"')
    bad = salvage(broken)
    assert bad.teardown is None and bad.teardown_problem is not None
    assert "teardown.on_failure" in bad.teardown_problem


def test_a_fixed_job_file_moves_the_bad_jobs_record_aside(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    store.ensure()
    ended = RunState(job_name="x", job_source="job.toml", phase=Phase.DONE)
    store.save(ended)
    assert set_aside(store) is None  # a real job's record: never moved
    ended.history.append({"at": 1.0, "event": MARK})
    store.save(ended)
    moved = set_aside(store)
    assert moved is not None and moved.exists() and not store.state_path.exists()
    data: dict[str, Any] = json.loads(moved.read_text())
    assert data["phase"] == "DONE"


def test_a_teardown_the_provider_refuses_once_stays_open_and_is_tried_again(
    tmp_path: Path, vast: FakeVast
) -> None:
    vast.fail("destroy", 403, times=1)
    job = write_job(
        tmp_path, train="epochs = 0", teardown=f'provider = "vast"\napi_url = "{vast.url}"'
    )
    # The open teardown's pauses shrunk (the agent's own variable for it: agent/policy/teardown.py).
    got = cli(tmp_path, "supervise", str(job), LIBREYOLO_AGENT_TEARDOWN_TIMING="open_first_s=0.5")
    assert got.returncode == 2, got.stderr[-3000:]
    assert "NOT confirmed" in got.stderr
    deletes = [c for c in vast.requests if c.method == "DELETE"]
    assert [c.status for c in deletes] == [403, 200]
    assert vast.instance("1234") is None
    state = state_of(tmp_path)
    assert state.phase == Phase.DONE
    td = state.teardown
    assert td is not None and td["confirmed"] is True and td["attempts"] == 1
    assert td["open"] is False


def test_an_open_teardown_left_by_a_stopped_process_is_carried_on_by_the_next_start(
    tmp_path: Path, vast: FakeVast
) -> None:
    vast.fail("destroy", 503, times=None)  # the API is down for as long as it takes
    job = write_job(
        tmp_path, train="epochs = 0", teardown=f'provider = "vast"\napi_url = "{vast.url}"'
    )
    timing = "retry_s=1,backoff_first_s=0.1,open_first_s=60"
    env = {k: v for k, v in os.environ.items() if k not in SECRET_VARS}
    env.update(
        LIBREYOLO_AGENT_STATE_DIR=str(tmp_path / "state"),
        CONTAINER_ID="1234",
        CONTAINER_API_KEY=KEY,
        LIBREYOLO_AGENT_TEARDOWN_TIMING=timing,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "supervise", str(job)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        store = StateStore(tmp_path / "state")
        end = time.monotonic() + 240  # a cap for a hang: the loop ends on the state
        while time.monotonic() < end:
            try:
                state = store.load()
            except ValueError:
                state = None
            if state is not None and (state.teardown or {}).get("open"):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the teardown never went open")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    state = state_of(tmp_path)
    assert state.phase == Phase.TEARDOWN and state.teardown is not None
    assert state.teardown["open"] is True and state.teardown["confirmed"] is False
    assert "NOT confirmed" in (state.cause or "")
    assert vast.instance("1234") is not None
    shown = status_text(tmp_path)
    assert shown.returncode == 3 and "NOT confirmed" in shown.stderr, shown.stderr

    vast.clear_faults()  # the API is back: the next start (bootstrap at boot) carries on
    again = cli(tmp_path, "supervise", str(job), LIBREYOLO_AGENT_TEARDOWN_TIMING=timing)
    assert again.returncode == 2, again.stderr[-3000:]
    state = state_of(tmp_path)
    assert state.phase == Phase.DONE and state.teardown is not None
    assert state.teardown["confirmed"] is True
    assert vast.instance("1234") is None
    assert [c.status for c in vast.requests if c.method == "DELETE"][-1] == 200
