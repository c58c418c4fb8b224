"""The guard (agent/guard/run.py, agent/guard/save.py) when it acts: in every phase, HELD included;
the trainer stopped (SIGINT, then escalation) and the newest ``last.pt`` uploaded and read back
before the box is stopped; what it could not save said; the agent's notices sent.

Real guard processes on a real state directory, a real trainer stand-in process (signals,
pid + create time), the sink code the agent uses on a ``file://`` target, the fake Vast API and
a webhook receiver on 127.0.0.1.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent.guard.plan import PLAN_FILE, beat
from agent.sinks.digests import sha256_file
from agent.state import Phase, Reason, TrainerRecord
from tests import test_guardplan
from tests.fakes.providers import run_fake_vast
from tests.test_guard import (
    VAST_KEY,
    eventually,
    guard_log,
    load_state,
    record,
    save_state,
    stale_heartbeat,
    start,
    wait_exit,
)
from tests.test_guardplan import make_plan, running

state_dir = test_guardplan.state_dir
guards = test_guardplan.guards

STOPS = [("PUT", "/api/v0/instances/1234/", {"state": "stopped"})]


@pytest.fixture
def vast_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTAINER_ID", "1234")
    monkeypatch.setenv("VAST_API_KEY", VAST_KEY)
    monkeypatch.delenv("CONTAINER_API_KEY", raising=False)


# ------------------------------------------------------------------------------- HELD


def test_held_with_its_hold_expired_and_past_the_deadline_the_guard_stops_the_box(
    state_dir: Path, guards: list[int], vast_env: None
) -> None:
    # The case: agent dead, a hold that expired 165 s ago, a deadline 90 s past.
    with run_fake_vast(keys={VAST_KEY}) as vast:
        vast.add_instance("1234")
        make_plan(state_dir, deadline_in=-90, provider="vast", api_url=vast.url)
        stale_heartbeat(state_dir)
        now = time.time()
        hold = {"at": now - 3600, "until": now - 165, "released_at": None}
        save_state(state_dir, Phase.HELD, reason=Reason.COMPLETED, hold=hold)
        assert wait_exit(start(state_dir, guards)) == 0
        assert vast.mutations() == STOPS
    state = load_state(state_dir)
    assert state.phase == Phase.DONE and state.reason == Reason.AGENT_FAILED
    assert state.teardown is not None and state.teardown["confirmed"] is True
    assert "hold ended" in (state.cause or "")


def test_held_the_guard_waits_for_the_holds_own_end_then_acts(
    state_dir: Path, guards: list[int], vast_env: None
) -> None:
    with run_fake_vast(keys={VAST_KEY}) as vast:
        vast.add_instance("1234")
        make_plan(state_dir, deadline_in=3600, provider="vast", api_url=vast.url)
        stale_heartbeat(state_dir)
        # The hold's end an hour ahead until the guard has seen it (a hold of a few seconds
        # could end before a slow guard's first look), then moved to now, as a person would.
        hold = {"at": time.time(), "until": time.time() + 3600, "released_at": None}
        save_state(state_dir, Phase.HELD, reason=Reason.COMPLETED, hold=hold)
        pid = start(state_dir, guards)
        eventually(lambda: "HELD by a person until" in guard_log(state_dir))
        assert vast.mutations() == [] and running(pid)
        until = time.time()
        save_state(state_dir, Phase.HELD, reason=Reason.COMPLETED, hold={**hold, "until": until})
        assert wait_exit(pid) == 0
        assert vast.mutations() == STOPS
    td = load_state(state_dir).teardown
    assert td is not None and td["started_at"] >= until


# ------------------------------------------------------------------- saving before the stop


def pt(data: bytes) -> bytes:
    """A checkpoint as torch.save writes one: a zip (a fixed date: the same bytes each time)."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(zipfile.ZipInfo("archive/data.pkl", (2026, 1, 1, 0, 0, 0)), data)
    return buf.getvalue()


TRAINER = inspect.getsource(pt) + textwrap.dedent(
    """
    import os, signal, sys, time, pathlib
    weights = pathlib.Path(sys.argv[1]) / "weights"
    weights.mkdir(parents=True, exist_ok=True)
    for name, data in (("last.pt", b"epoch-2" * 5000), ("epoch_1.pt", b"epoch-1" * 100),
                       ("best.pt", b"best" * 100)):
        (weights / name).write_bytes(pt(data))
    mode = sys.argv[2]
    def clean(signum, frame):
        tmp = weights / "last.pt.tmp"
        tmp.write_bytes(pt(b"epoch-7-final" * 5000))
        os.replace(tmp, weights / "last.pt")
        sys.exit(130)
    def torn(signum, frame):
        # LibreYOLO rewrites last.pt in place: a stop in the middle leaves the zip's first bytes.
        (weights / "last.pt").write_bytes(pt(b"epoch-7-final" * 5000)[:665])
        sys.exit(130)
    if mode == "torn":
        clean = torn
    signal.signal(signal.SIGINT, clean if mode in ("clean", "torn") else signal.SIG_IGN)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
    """
)


class Hooks(BaseHTTPRequestHandler):
    bodies: list[dict[str, Any]] = []

    def do_POST(self) -> None:
        data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).bodies.append(json.loads(data))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    bodies: list[dict[str, Any]] = []
    handler = type("H", (Hooks,), {"bodies": bodies})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", bodies
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def trainers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def start_trainer(
    tmp_path: Path, mode: str, trainers: list[subprocess.Popen[bytes]]
) -> tuple[subprocess.Popen[bytes], Path]:
    run_dir = tmp_path / "runs" / "run1"
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(run_dir), mode],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    trainers.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc, run_dir


def write_job(tmp_path: Path, target: Path, hook: str | None, stop_grace: str = "20s") -> Path:
    job = tmp_path / "job.toml"
    notify = f'[notify]\nwebhook = "{hook}"\n' if hook else ""
    job.write_text(
        f"""
[job]
name = "run1"
runs_dir = "{tmp_path / "runs"}"
[train]
data = "{tmp_path / "data.yaml"}"
stop_grace = "{stop_grace}"
kill_grace = "1s"
[sync]
target = "file://{target}"
{notify}"""
    )
    return job


def plan_with_job(state_dir: Path, job: Path, **teardown: Any) -> None:
    make_plan(state_dir, deadline_in=-30, **teardown)
    doc = json.loads((state_dir / PLAN_FILE).read_text())
    doc["job_file"] = str(job)
    (state_dir / PLAN_FILE).write_text(json.dumps(doc))


def trainer_record(proc: subprocess.Popen[bytes], run_dir: Path, *, create_time: float) -> Any:
    return TrainerRecord(
        pid=proc.pid,
        create_time=create_time,
        started_at=create_time,
        argv=["libreyolo", "train"],
        run_dir=str(run_dir),
    )


def guard_stops_a_vast_box(
    tmp_path: Path,
    state_dir: Path,
    guards: list[int],
    trainers: list[subprocess.Popen[bytes]],
    mode: str,
    job: Path,
) -> tuple[subprocess.Popen[bytes], Path]:
    """A trainer stand-in (``mode``) in TRAINING, its agent silent past the hard deadline: the
    guard runs to its end and stops the (fake) Vast box."""
    proc, run_dir = start_trainer(tmp_path, mode, trainers)
    with run_fake_vast(keys={VAST_KEY}) as vast:
        vast.add_instance("1234")
        plan_with_job(state_dir, job, provider="vast", api_url=vast.url)
        stale_heartbeat(state_dir)
        created = psutil.Process(proc.pid).create_time()
        save_state(
            state_dir, Phase.TRAINING, trainer=trainer_record(proc, run_dir, create_time=created)
        )
        assert wait_exit(start(state_dir, guards), timeout=120) == 0
        assert vast.mutations() == STOPS
    return proc, run_dir


def test_the_guard_stops_the_trainer_and_verifies_last_pt_off_the_box_before_the_stop(
    tmp_path: Path,
    state_dir: Path,
    guards: list[int],
    trainers: list[subprocess.Popen[bytes]],
    vast_env: None,
    webhook: tuple[str, list[dict[str, Any]]],
) -> None:
    hook, bodies = webhook
    target = tmp_path / "synced"
    proc, run_dir = guard_stops_a_vast_box(
        tmp_path, state_dir, guards, trainers, "clean", write_job(tmp_path, target, hook)
    )
    # The trainer got SIGINT and saved its final last.pt; that very version is on the target.
    assert proc.wait(10) == 130
    local = run_dir / "weights" / "last.pt"
    assert local.read_bytes() == pt(b"epoch-7-final" * 5000)
    stored = target / "weights" / "last.pt"
    assert stored.read_bytes() == local.read_bytes()
    td = record(state_dir)["teardown"]
    rescue = td["rescue"]
    assert rescue["trainer"]["stopped"] is True and rescue["trainer"]["signal"] == "SIGINT"
    assert rescue["last_pt"]["saved"] is True and rescue["last_pt"]["sha256"] == sha256_file(local)
    assert rescue["finished_at"] <= td["sent_at"]  # saved before the provider call
    # best.pt too, read back, with what was left of the save's time.
    best = run_dir / "weights" / "best.pt"
    assert rescue["best_pt"]["saved"] is True and rescue["best_pt"]["sha256"] == sha256_file(best)
    assert (target / "weights" / "best.pt").read_bytes() == best.read_bytes()
    # What it could not save is recorded and said: the epoch checkpoint never left the box.
    assert rescue["unsaved"] == ["weights/epoch_1.pt"]
    assert load_state(state_dir).teardown == td
    text = guard_log(state_dir)
    assert "best.pt verified on the target" in text
    assert "1 file(s) NOT off the box" in text
    # The lines a script measures from, in order: last.pt verified, then the provider call.
    verified = text.index("guard: timing: newest last.pt verified at ")
    called = text.index("guard: timing: provider call at ")
    assert verified < called and "after the hard deadline" in text[verified:]
    script = Path(__file__).resolve().parents[1] / "bench" / "guard_timing.py"
    measured = subprocess.run(
        [sys.executable, str(script), str(state_dir)], capture_output=True, text=True, timeout=60
    )
    assert measured.returncode == 0, measured.stderr
    figures = json.loads(measured.stdout)
    assert (
        0
        < figures["last_pt_verified_after_deadline_s"]
        <= figures["provider_call_after_deadline_s"]
    )
    # The agent's notices, from the guard: decision, what was not saved, confirmation, failure.
    kinds = [b["event"]["kind"] for b in bodies]
    assert kinds == ["teardown", "warning", "teardown_confirmed", "failure"], kinds
    assert all(b["event"]["data"]["by"] == "guard" for b in bodies)
    assert "NOT off the box" in bodies[1]["text"]
    assert all(hook not in json.dumps(b) for b in bodies)


def test_a_last_pt_torn_by_the_stop_is_never_uploaded_over_the_targets_copy(
    tmp_path: Path,
    state_dir: Path,
    guards: list[int],
    trainers: list[subprocess.Popen[bytes]],
    vast_env: None,
) -> None:
    """Seen on an H200 (docs/gpu-validation.md 10): the guard's SIGINT landed while LibreYOLO
    rewrote last.pt in place; the 665 bytes left were uploaded over the verified copy."""
    target = tmp_path / "synced"
    good = pt(b"epoch-5" * 5000)  # what the agent synced and verified before it died
    (target / "weights").mkdir(parents=True)
    (target / "weights" / "last.pt").write_bytes(good)
    proc, run_dir = guard_stops_a_vast_box(
        tmp_path, state_dir, guards, trainers, "torn", write_job(tmp_path, target, None)
    )  # the box is still stopped when last.pt is torn: saving is best effort
    assert proc.wait(10) == 130
    assert (run_dir / "weights" / "last.pt").stat().st_size == 665
    assert (target / "weights" / "last.pt").read_bytes() == good
    rescue = record(state_dir)["teardown"]["rescue"]
    assert rescue["last_pt"]["saved"] is False and rescue["last_pt"]["torn"] is True
    assert "not a complete checkpoint (665 bytes" in rescue["last_pt"]["why"]
    assert "weights/last.pt" in rescue["unsaved"]
    # best.pt is whole: it is saved.
    assert rescue["best_pt"]["saved"] is True
    assert "not a complete checkpoint" in guard_log(state_dir)


def test_a_trainer_that_ignores_sigint_and_sigterm_is_killed_and_its_last_pt_saved(
    tmp_path: Path,
    state_dir: Path,
    guards: list[int],
    trainers: list[subprocess.Popen[bytes]],
) -> None:
    target = tmp_path / "synced"
    proc, run_dir = start_trainer(tmp_path, "stubborn", trainers)
    job = write_job(tmp_path, target, None, stop_grace="1s")
    plan_with_job(state_dir, job)  # provider none: the record says what it would do
    stale_heartbeat(state_dir)
    created = psutil.Process(proc.pid).create_time()
    save_state(
        state_dir, Phase.TRAINING, trainer=trainer_record(proc, run_dir, create_time=created)
    )
    assert wait_exit(start(state_dir, guards), timeout=120) == 0
    assert proc.wait(10) == -signal.SIGKILL
    rescue = record(state_dir)["teardown"]["rescue"]
    assert rescue["trainer"]["signal"] == "SIGKILL"
    assert (target / "weights" / "last.pt").read_bytes() == pt(b"epoch-2" * 5000)
    assert rescue["last_pt"]["saved"] is True


def test_a_pid_reused_by_another_process_is_never_signalled_and_unsaved_work_is_said(
    tmp_path: Path,
    state_dir: Path,
    guards: list[int],
    trainers: list[subprocess.Popen[bytes]],
) -> None:
    proc, run_dir = start_trainer(tmp_path, "stubborn", trainers)
    # The job's target cannot be written (its folder is a file): last.pt cannot be saved.
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    job = write_job(tmp_path, blocker / "sub", None)
    plan_with_job(state_dir, job)
    stale_heartbeat(state_dir)
    created = psutil.Process(proc.pid).create_time()
    # The record's create time is another process's: same pid, not the trainer it recorded.
    save_state(
        state_dir, Phase.TRAINING, trainer=trainer_record(proc, run_dir, create_time=created - 5)
    )
    assert wait_exit(start(state_dir, guards), timeout=120) == 0
    assert proc.poll() is None  # never signalled
    rescue = record(state_dir)["teardown"]["rescue"]
    assert rescue["trainer"]["stopped"] is False and "not running" in rescue["trainer"]["why"]
    assert rescue["last_pt"]["saved"] is False
    assert "weights/last.pt" in rescue["unsaved"]
    assert "last.pt NOT saved" in guard_log(state_dir)
    assert "last.pt NOT saved" in (load_state(state_dir).teardown or {})["rescue"]["words"]


def test_the_waiting_guard_imports_no_sink_no_notifier_and_no_psutil() -> None:
    # Nor asyncio, the providers, the teardown or restart modules (issue 26: memory): imported
    # when it acts.
    code = (
        "import sys, agent.guard.__main__\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('psutil', 'aiohttp', "
        "'huggingface_hub', 'asyncio') or m in ('agent.guard.save', 'agent.sinks', "
        "'agent.status.notify', 'agent.config.jobfile', 'agent.trainer', 'agent.policy.teardown', "
        "'agent.providers', 'agent.policy.restart')]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------- an open teardown


def test_a_dead_agents_open_teardown_is_carried_on_by_the_guard_before_the_deadline(
    state_dir: Path, guards: list[int], vast_env: None
) -> None:
    # The agent decided a stop, the API did not answer (503 past its retry window), and the
    # agent died: the guard does not wait for the hard deadline an hour away.
    with run_fake_vast(keys={VAST_KEY}) as vast:
        vast.add_instance("1234")
        make_plan(state_dir, deadline_in=3600, provider="vast", api_url=vast.url)
        stale_heartbeat(state_dir)
        decided = {
            "provider": "vast",
            "action": "stop",
            "why": "teardown.on_failure = stop",
            "started_at": time.time() - 400,
            "instance_id": "1234",
            "performed": False,
            "confirmed": False,
            "detail": "vast: stop: no usable answer; NOT confirmed",
            "open": True,
            "attempts": 2,
        }
        save_state(state_dir, Phase.TEARDOWN, reason=Reason.TRAINING_FAILED, teardown=decided)
        assert wait_exit(start(state_dir, guards)) == 0
        assert vast.mutations() == STOPS
        assert vast.calls("show")[0].at < vast.calls("stop")[0].at  # read back before the send
    state = load_state(state_dir)
    assert state.phase == Phase.DONE and state.teardown is not None
    assert state.teardown["confirmed"] is True and "NOT confirmed" in (state.cause or "")


def test_the_guard_keeps_watching_a_done_whose_teardown_was_never_confirmed(
    state_dir: Path, guards: list[int]
) -> None:
    # An older agent's DONE with an unconfirmed destroy: not an end. A live agent (fresh
    # heartbeat) is carrying it on; the guard watches, it does not exit.
    make_plan(state_dir, deadline_in=-60, stale_after_s=3600)
    beat(state_dir)
    td = {"provider": "none", "action": "destroy", "performed": False, "confirmed": False}
    save_state(state_dir, Phase.DONE, reason=Reason.COMPLETED, teardown=td)
    pid = start(state_dir, guards)
    eventually(lambda: "guard: waiting: agent alive" in guard_log(state_dir))
    time.sleep(1.0)  # ten more looks
    assert running(pid)
    assert "job ended" not in guard_log(state_dir)
    os.kill(pid, signal.SIGTERM)
    assert wait_exit(pid) == 0


def test_the_guard_saves_last_pt_to_an_hf_target_through_the_real_hub_client(
    tmp_path: Path,
    state_dir: Path,
    guards: list[int],
    trainers: list[subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.fakes.hub import run_fake_hub

    token = "hf_guard_token_0123456789"
    proc, run_dir = start_trainer(tmp_path, "clean", trainers)
    with run_fake_hub(tokens={token}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", token)
        job = write_job(tmp_path, tmp_path / "unused", None)
        job.write_text(
            job.read_text().replace(
                f'target = "file://{tmp_path / "unused"}"', 'target = "hf://org/run1"'
            )
        )
        plan_with_job(state_dir, job)
        stale_heartbeat(state_dir)
        created = psutil.Process(proc.pid).create_time()
        trainer = trainer_record(proc, run_dir, create_time=created)
        save_state(state_dir, Phase.TRAINING, trainer=trainer)
        assert wait_exit(start(state_dir, guards), timeout=180) == 0
        stored = hub.files("model", "org/run1").get("weights/last.pt")
    assert stored == pt(b"epoch-7-final" * 5000)
    rescue = record(state_dir)["teardown"]["rescue"]
    assert rescue["last_pt"]["saved"] is True and rescue["last_pt"]["target"] == "hf://org/run1"
    assert token not in guard_log(state_dir)


def test_the_guard_watches_on_while_its_stop_is_not_confirmed_and_notifies_once(
    tmp_path: Path,
    state_dir: Path,
    guards: list[int],
    vast_env: None,
    webhook: tuple[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hook, bodies = webhook
    monkeypatch.setenv(
        "LIBREYOLO_AGENT_TEARDOWN_TIMING", "retry_s=0.5,backoff_first_s=0.05,backoff_max_s=0.1"
    )
    job = write_job(tmp_path, tmp_path / "synced", hook)
    with run_fake_vast(keys={VAST_KEY}) as vast:
        vast.add_instance("1234")
        vast.down(503)
        plan_with_job(state_dir, job, provider="vast", api_url=vast.url)
        stale_heartbeat(state_dir)
        save_state(state_dir, Phase.TRAINING)
        pid = start(state_dir, guards)

        def attempts() -> int:
            try:
                return int(record(state_dir).get("attempts") or 0)
            except (OSError, ValueError):
                return 0

        eventually(lambda: attempts() >= 3, timeout=90)
        assert running(pid)  # an unconfirmed stop is not the end of its watch
        assert load_state(state_dir).phase == Phase.TEARDOWN
        assert record(state_dir)["teardown"]["open"] is True
        vast.up()
        assert wait_exit(pid) == 0
        accepted = [c for c in vast.requests if c.method == "PUT" and c.status == 200]
        assert len(accepted) == 1
    assert load_state(state_dir).phase == Phase.DONE
    kinds = [(b["event"]["kind"], b["event"]["data"].get("open")) for b in bodies]
    # One "NOT confirmed" notice for all the failed attempts (at most one per 30 min).
    assert kinds == [
        ("teardown", None),
        ("teardown_confirmed", True),
        ("teardown_confirmed", None),
        ("failure", None),
    ], kinds
    assert "NOT confirmed: the box may still bill" in bodies[1]["text"]


def test_a_failed_job_with_a_kept_box_ends_the_guard_without_acting(
    state_dir: Path, guards: list[int]
) -> None:
    # FAILED (a bad job file's record: the box KEPT, a person must look) is an end, open
    # teardown or not: the guard exits, touching nothing.
    make_plan(state_dir, deadline_in=-60)
    stale_heartbeat(state_dir)
    td = {"provider": None, "action": "keep", "why": "[teardown] cannot be read"}
    save_state(state_dir, Phase.FAILED, reason=Reason.PREFLIGHT_FAILED, teardown=td)
    assert wait_exit(start(state_dir, guards)) == 0
    assert "job ended (FAILED" in guard_log(state_dir)
    assert load_state(state_dir).teardown == td


def test_what_the_agents_ledger_holds_verified_is_not_called_unsaved(tmp_path: Path) -> None:
    import asyncio
    import hashlib

    from agent.config.jobfile import parse_job
    from agent.config.model import Env
    from agent.guard.save import rescue
    from agent.state import RunState, atomic_write_json

    weights = tmp_path / "runs" / "run1" / "weights"
    weights.mkdir(parents=True)
    (weights / "last.pt").write_bytes(pt(b"L" * 100))
    (weights / "best.pt").write_bytes(pt(b"B" * 50))  # rewritten since its verified upload
    (weights / "epoch_1.pt").write_bytes(pt(b"E" * 50))
    state_dir = tmp_path / "state"
    state_dir.mkdir()

    def entry(path: str, data: bytes) -> dict[str, Any]:
        return {
            "remote_path": path,
            "sha256": hashlib.sha256(data).hexdigest(),
            "size": len(data),
            "epoch": 1,
            "kind": "epoch",
            "status": "verified",
            "queued_at": 1.0,
        }

    ledger = [entry("weights/epoch_1.pt", pt(b"E" * 50)), entry("weights/best.pt", pt(b"b" * 50))]
    atomic_write_json(state_dir / "sync-ledger.json", {"entries": ledger})
    job = parse_job(
        f'[job]\nname = "run1"\nruns_dir = "{tmp_path / "runs"}"\n[train]\ndata = "/d.yaml"\n'
        f'[sync]\ntarget = "file://{tmp_path / "synced"}"\n',
        source="t",
    )
    env = Env.from_environ({"LIBREYOLO_AGENT_STATE_DIR": str(state_dir)})
    state = RunState(job_name="run1", job_source="t")
    report = asyncio.run(rescue(state, job, None, env, state_dir, timeout_s=60))
    assert report["last_pt"]["saved"] is True
    assert (tmp_path / "synced" / "weights" / "last.pt").read_bytes() == pt(b"L" * 100)
    # best.pt was rewritten since its verified upload: saved again; epoch_1.pt is verified.
    assert report["best_pt"]["saved"] is True and "already" not in report["best_pt"]
    assert (tmp_path / "synced" / "weights" / "best.pt").read_bytes() == pt(b"B" * 50)
    assert report["unsaved"] == []
    assert report["trainer"] == {"stopped": False, "why": "state.json records no trainer"}


@pytest.mark.parametrize(
    ("silent_s", "hold", "deadline_in", "kind"),
    [
        (10, {"until": -165}, -90, "alive"),  # a live agent ends its own hold
        (3600, {"until": -165}, -90, "due"),  # the case
        (3600, {"until": -1}, 3600, "due"),  # the hold's own end, the deadline far
        (3600, {"until": 3600, "released_at": -5}, 3600, "due"),  # released, then the agent died
        (3600, {"until": 3600}, -1, "due"),  # the hard deadline, in HELD as in every phase
        (3600, {"until": 3600}, 3600, "held"),  # a person's hold, both ahead: wait
        (3600, {"until": 3600}, None, "held"),
        (3600, {"until": -1}, None, "due"),
    ],
)
def test_due_in_held_follows_the_holds_end_and_the_deadline(
    silent_s: float, hold: dict[str, float], deadline_in: float | None, kind: str
) -> None:
    from agent.guard.decide import due
    from agent.state import RunState
    from tests.test_guard import plan_at

    now = 2_000_000_000.0
    plan = plan_at(now, deadline=None if deadline_in is None else now + deadline_in)
    held = {"at": now - 7200, "released_at": None, **{k: now + v for k, v in hold.items()}}
    state = RunState(job_name="run1", job_source="t", phase=Phase.HELD, hold=held)
    verdict = due(plan, now=now, alive_at=now - silent_s, state=state)
    assert verdict.kind == kind, verdict.why


def test_a_deadline_no_calendar_shows_is_logged_in_epoch_seconds_not_a_traceback() -> None:
    # A plan written before durations were bounded ("99999999999999999999d"): the guard's log
    # lines must still be written at every beat.
    from agent.guard.decide import when

    assert when(1e20) == "100000000000000000000 (epoch seconds)"
    assert when(0.0) == "1970-01-01T00:00:00+00:00"
