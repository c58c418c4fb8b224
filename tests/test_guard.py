"""The guard (agent/guard/run.py): a real process, started the way the agent starts it, watching a
real state directory; real signals, real locks, and the providers' real clients against their fake
APIs on 127.0.0.1.

The rule under test everywhere: the guard acts only when the agent's heartbeat is stale AND the
hard deadline has passed, and then it stops the box - it destroys only a box whose sync was
verified during this job under a destroy policy.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent import demo
from agent.guard.decide import choose_action, due
from agent.guard.plan import (
    HEARTBEAT_FILE,
    LOG_FILE,
    NO_DEADLINE_STALE_S,
    PLAN_FILE,
    GuardPlan,
    beat,
    ensure_running,
    guard_pid,
)
from agent.guard.run import RECORD_FILE
from agent.state import Phase, Reason, RunState, StateStore, atomic_write_json
from tests import test_guardplan
from tests.fakes.providers import run_fake_lambda, run_fake_vast
from tests.support import HANG_S
from tests.test_guardplan import TEARDOWN, make_plan, running

# Fixtures shared with the agent's side, bound here by name (ruff reads an import as unused).
state_dir = test_guardplan.state_dir
guards = test_guardplan.guards

VAST_KEY = "vast-account-key-0123456789"


# ------------------------------------------------------------------------------------ helpers


def stale_heartbeat(state_dir: Path, age_s: float = 300.0) -> None:
    beat(state_dir)
    t = time.time() - age_s
    os.utime(state_dir / HEARTBEAT_FILE, (t, t))


def save_state(state_dir: Path, phase: Phase = Phase.TRAINING, **fields: Any) -> RunState:
    state = RunState(job_name="run1", job_source="test", phase=phase, **fields)
    StateStore(state_dir).save(state)
    return state


def load_state(state_dir: Path) -> RunState:
    state = StateStore(state_dir).load()
    assert state is not None
    return state


def start(state_dir: Path, guards: list[int]) -> int:
    pid = ensure_running(state_dir)
    assert pid is not None
    guards.append(pid)
    return pid


def wait_exit(pid: int, timeout: float = 120.0) -> int:
    """Exit code of the child ``pid``, once it exited; fails after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    raise AssertionError(f"guard pid {pid} still runs after {timeout}s")


def eventually(pred: Callable[[], Any], timeout: float = 120.0, what: str = "") -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(what or "condition not met in time")
        time.sleep(0.05)


def exited(proc: psutil.Process) -> bool:
    """``proc`` (not our child) is gone, or a zombie nobody reaped yet (PID 1 of a container)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def guard_log(state_dir: Path) -> str:
    return (state_dir / LOG_FILE).read_text()


def record(state_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((state_dir / RECORD_FILE).read_text())
    return data


def verified_sync(state_dir: Path, at: float) -> None:
    atomic_write_json(
        state_dir / "sync-result.json",
        {"sync_verified": True, "checked": 3, "missing": [], "at": at, "skipped": []},
    )


# ------------------------------------------------------------------ the guard, as a process


def test_a_dead_agent_past_the_deadline_gets_its_box_stopped_and_the_guard_exits(
    state_dir: Path, guards: list[int]
) -> None:
    make_plan(state_dir, deadline_in=-60)
    stale_heartbeat(state_dir)
    save_state(state_dir, Phase.TRAINING)
    pid = start(state_dir, guards)
    assert wait_exit(pid) == 0

    rec = record(state_dir)
    td = rec["teardown"]
    assert td["action"] == "stop" and td["by"] == "guard" and td["provider"] == "none"
    assert td["confirmed"] is True and td["performed"] is False
    assert "would stop this machine" in td["detail"]
    assert rec["state_written"] is True and rec["pid"] == pid

    state = load_state(state_dir)
    assert state.phase == Phase.DONE
    assert state.reason == Reason.AGENT_FAILED
    assert state.teardown == td
    assert state.cause is not None
    assert state.cause.startswith("agent dead since ")
    assert "past the hard deadline" in state.cause
    assert "guard would have stopped the box (provider 'none'" in state.cause
    moves = [(h.get("from"), h.get("to")) for h in state.history]
    assert moves[-3:] == [("TRAINING", "BOOTING"), ("BOOTING", "TEARDOWN"), ("TEARDOWN", "DONE")]
    assert f"guard (pid {pid}) took over" in state.history[-3]["note"]

    log = guard_log(state_dir)
    assert f"guard: watching {state_dir} (pid {pid})" in log
    assert "past the hard deadline" in log and ": stop through provider none" in log
    assert "guard: stop confirmed" in log


def test_a_fresh_heartbeat_keeps_the_guard_from_acting(state_dir: Path, guards: list[int]) -> None:
    make_plan(state_dir, deadline_in=-60, stale_after_s=3.0, every_s=0.1)
    save_state(state_dir, Phase.TRAINING)
    # A beat dated ahead stays fresh however slowly this test runs (a beating loop starved
    # for 3 s under load would let the guard act, and fail the test for the machine's speed).
    beat(state_dir)
    ahead = time.time() + 3600
    os.utime(state_dir / HEARTBEAT_FILE, (ahead, ahead))
    pid = start(state_dir, guards)
    eventually(lambda: "guard: waiting: agent alive" in guard_log(state_dir))
    time.sleep(4.0)  # about 40 more looks, each past the deadline (fewer under load)
    assert running(pid)
    assert not (state_dir / RECORD_FILE).exists()
    assert load_state(state_dir).phase == Phase.TRAINING
    assert "guard: waiting: agent alive" in guard_log(state_dir)

    # The control: the same guard, once the beats stop, acts.
    stale_heartbeat(state_dir)
    assert wait_exit(pid) == 0
    assert record(state_dir)["teardown"]["action"] == "stop"
    assert load_state(state_dir).phase == Phase.DONE


def test_a_deadline_still_ahead_keeps_a_dead_agents_box_until_it_passes(
    state_dir: Path, guards: list[int]
) -> None:
    make_plan(state_dir, deadline_in=3600)
    stale_heartbeat(state_dir)
    save_state(state_dir, Phase.TRAINING)
    pid = start(state_dir, guards)
    eventually(lambda: "guard: waiting: agent silent since" in guard_log(state_dir))
    assert "the hard deadline" in guard_log(state_dir)
    # The plan is read at every look: a new one (a restarted agent's) moves the deadline,
    # first still an hour ahead (the guard keeps waiting), then just behind (it acts).
    make_plan(state_dir, deadline_in=3600)
    eventually(lambda: guard_log(state_dir).count("guard: plan for job 'run1'") == 2)
    assert running(pid)
    assert not (state_dir / RECORD_FILE).exists()
    plan = make_plan(state_dir, deadline_in=-0.5)
    assert wait_exit(pid) == 0
    assert plan.hard_deadline is not None
    assert record(state_dir)["teardown"]["started_at"] >= plan.hard_deadline
    assert guard_log(state_dir).count("guard: plan for job 'run1'") == 3


@pytest.mark.parametrize(
    ("policy", "reason", "at_offset", "expected"),
    [
        ({"on_failure": "destroy"}, None, +10.0, "destroy"),
        # After a completed training the case is on_success.
        ({"on_failure": "stop", "on_success": "destroy"}, Reason.COMPLETED, +10.0, "destroy"),
        # A verified result older than the job is a leftover of an earlier run: not this sync.
        ({"on_failure": "destroy"}, None, -10.0, "stop"),
        # Verified, but the policy says stop.
        ({"on_failure": "stop"}, None, +10.0, "stop"),
    ],
)
def test_destroy_only_with_a_sync_verified_in_this_job_and_a_destroy_policy(
    state_dir: Path,
    guards: list[int],
    policy: dict[str, str],
    reason: Reason | None,
    at_offset: float,
    expected: str,
) -> None:
    plan = make_plan(state_dir, **policy)  # type: ignore[arg-type]
    stale_heartbeat(state_dir)
    verified_sync(state_dir, plan.started_at + at_offset)
    save_state(state_dir, Phase.FINISHING, reason=reason)
    assert wait_exit(start(state_dir, guards)) == 0
    assert record(state_dir)["teardown"]["action"] == expected
    state = load_state(state_dir)
    assert state.phase == Phase.DONE and state.teardown is not None
    assert state.teardown["action"] == expected


@pytest.mark.parametrize("phase", [Phase.DONE, Phase.FAILED])
def test_an_ended_job_makes_the_guard_exit_without_acting(
    state_dir: Path, guards: list[int], phase: Phase
) -> None:
    make_plan(state_dir, deadline_in=-60)
    stale_heartbeat(state_dir)
    before = save_state(state_dir, phase, reason=Reason.COMPLETED).to_dict()
    assert wait_exit(start(state_dir, guards)) == 0
    assert not (state_dir / RECORD_FILE).exists()
    after = json.loads((state_dir / "state.json").read_text())
    assert after["phase"] == phase.value and after["history"] == before["history"]
    assert after["teardown"] is None
    assert f"guard: job ended ({phase.value}, reason completed); exiting" in guard_log(state_dir)


def test_a_guard_waiting_a_long_interval_exits_once_the_job_ends_not_an_interval_later(
    state_dir: Path, guards: list[int]
) -> None:
    # One look an hour: only a glance at state.json between looks can make this guard see
    # DONE before the test's own hang limit (before it, a guard lingered up to an interval
    # after every job).
    make_plan(state_dir, deadline_in=None, stale_after_s=7200.0, every_s=3600.0)
    save_state(state_dir, Phase.TRAINING)
    beat(state_dir)
    pid = start(state_dir, guards)
    eventually(lambda: "guard: waiting: agent alive" in guard_log(state_dir))
    assert running(pid)
    save_state(state_dir, Phase.DONE, reason=Reason.COMPLETED)
    assert wait_exit(pid, timeout=HANG_S) == 0
    assert "guard: job ended (DONE, reason completed); exiting" in guard_log(state_dir)
    assert not (state_dir / RECORD_FILE).exists()


def test_a_second_guard_on_the_same_state_dir_exits_at_once(
    state_dir: Path, guards: list[int]
) -> None:
    make_plan(state_dir, deadline_in=3600)
    stale_heartbeat(state_dir)
    save_state(state_dir, Phase.TRAINING)
    first = start(state_dir, guards)
    eventually(lambda: guard_pid(state_dir) == first)
    assert ensure_running(state_dir) == first  # no second spawn

    # A second guard that watched instead would never exit: the cap is for that hang only.
    second = subprocess.run(
        [sys.executable, "-m", "agent.guard", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 0
    assert f"guard: another guard (pid {first}) watches {state_dir}; exiting" in second.stderr
    assert "guard: plan for job" not in second.stderr  # it exited before its first look
    assert running(first)
    assert not (state_dir / RECORD_FILE).exists()


def test_a_hold_still_running_before_the_deadline_is_never_touched_and_sigterm_ends_the_guard(
    state_dir: Path, guards: list[int]
) -> None:
    # The guard acts in HELD too (tests/test_guard_save.py), but only at the hold's own end
    # or the hard deadline: before both, a person's hold is left alone.
    make_plan(state_dir, deadline_in=3600)
    stale_heartbeat(state_dir)
    hold = {"at": time.time(), "until": time.time() + 3600, "released_at": None}
    save_state(state_dir, Phase.HELD, reason=Reason.COMPLETED, hold=hold)
    pid = start(state_dir, guards)
    eventually(lambda: "HELD by a person until" in guard_log(state_dir))
    time.sleep(1.0)  # ten more looks
    assert running(pid)
    assert not (state_dir / RECORD_FILE).exists()
    os.kill(pid, signal.SIGTERM)
    assert wait_exit(pid) == 0
    assert "guard: asked to exit; exiting" in guard_log(state_dir)
    assert load_state(state_dir).phase == Phase.HELD


def test_a_hung_agent_holding_the_state_dir_is_stopped_without_touching_its_state(
    state_dir: Path, guards: list[int]
) -> None:
    # A process that holds agent.lock but never beats: the agent's event loop is stuck.
    make_plan(state_dir, deadline_in=-60)
    stale_heartbeat(state_dir)
    save_state(state_dir, Phase.TRAINING)
    hung = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(state_dir / 'agent.lock')!r}, os.O_RDWR | os.O_CREAT, 0o600)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.pwrite(fd, f'{os.getpid()}\\n'.encode(), 0)\n"
            "print('locked', flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hung.stdout is not None and hung.stdout.readline().strip() == "locked"
        assert wait_exit(start(state_dir, guards)) == 0
    finally:
        hung.kill()
        hung.communicate()
    rec = record(state_dir)
    assert rec["teardown"]["action"] == "stop" and rec["teardown"]["confirmed"] is True
    assert rec["state_written"] is False
    assert load_state(state_dir).phase == Phase.TRAINING  # the hung agent's file, untouched
    log = guard_log(state_dir)
    assert f"guard: pid {hung.pid} holds" in log and "a hung agent" in log


def test_the_guard_exits_when_its_state_dir_is_wiped(state_dir: Path, guards: list[int]) -> None:
    # The demo wipes its folder at each start: the old guard must not go on beside a new one.
    make_plan(state_dir, deadline_in=3600)
    stale_heartbeat(state_dir)
    pid = start(state_dir, guards)
    eventually(lambda: guard_pid(state_dir) == pid)
    shutil.rmtree(state_dir)
    assert wait_exit(pid) == 0


def test_a_guard_without_a_plan_exits(state_dir: Path, guards: list[int]) -> None:
    assert wait_exit(start(state_dir, guards)) == 0
    assert f"guard: no {PLAN_FILE} in {state_dir}: nothing to guard; exiting" in guard_log(
        state_dir
    )


def test_the_guard_imports_neither_torch_nor_the_http_server() -> None:
    code = (
        "import sys, agent.guard.__main__\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'libreyolo') "
        "or m in ('aiohttp.web', 'agent.daemon', 'agent.status.server', 'agent.sync')]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------- through the providers' real APIs


def test_vast_box_of_a_dead_agent_gets_one_stop_call_and_no_destroy(
    state_dir: Path, guards: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    with run_fake_vast(keys={VAST_KEY}) as vast:
        vast.add_instance("1234")
        vast.fail("stop", 503, times=1)  # a blip: the provider retries it
        monkeypatch.setenv("CONTAINER_ID", "1234")
        monkeypatch.setenv("VAST_API_KEY", VAST_KEY)
        monkeypatch.delenv("CONTAINER_API_KEY", raising=False)
        make_plan(state_dir, provider="vast", api_url=vast.url, on_failure="destroy")
        stale_heartbeat(state_dir)
        save_state(state_dir, Phase.TRAINING)
        assert wait_exit(start(state_dir, guards)) == 0
        stops = [("PUT", "/api/v0/instances/1234/", {"state": "stopped"})]
        assert vast.mutations() == stops * 2  # the 503, then the accepted one; no DELETE
        inst = vast.instance("1234")
        assert inst is not None and inst["actual_status"] in ("exited", "stopped")
    td = record(state_dir)["teardown"]
    assert td["action"] == "stop" and td["performed"] is True and td["confirmed"] is True
    assert td["instance_id"] == "1234" and td["sent_at"] >= td["started_at"]  # the steps
    state = load_state(state_dir)
    assert state.phase == Phase.DONE
    assert state.cause is not None and state.cause.endswith("; guard stopped the box")
    assert VAST_KEY not in guard_log(state_dir)
    assert VAST_KEY not in (state_dir / PLAN_FILE).read_text()


def test_vast_box_with_a_verified_sync_and_a_destroy_policy_is_destroyed(
    state_dir: Path, guards: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    with run_fake_vast(keys={VAST_KEY}) as vast:
        vast.add_instance("1234")
        monkeypatch.setenv("CONTAINER_ID", "1234")
        monkeypatch.setenv("VAST_API_KEY", VAST_KEY)
        monkeypatch.delenv("CONTAINER_API_KEY", raising=False)
        plan = make_plan(state_dir, provider="vast", api_url=vast.url, on_failure="destroy")
        stale_heartbeat(state_dir)
        verified_sync(state_dir, plan.started_at + 60)
        save_state(state_dir, Phase.FINISHING)
        assert wait_exit(start(state_dir, guards)) == 0
        assert vast.mutations() == [("DELETE", "/api/v0/instances/1234/", {})]
        assert vast.instance("1234") is None
    assert load_state(state_dir).teardown == record(state_dir)["teardown"]
    assert record(state_dir)["teardown"]["action"] == "destroy"


@pytest.mark.parametrize("sent", [True, False])
def test_an_agent_killed_after_sending_destroy_gets_no_second_call_from_the_guard(
    state_dir: Path, guards: list[int], monkeypatch: pytest.MonkeyPatch, sent: bool
) -> None:
    # sent: the agent recorded the provider's acceptance (it is only confirmed then); without
    # it, the agent died between the call and that record (it is read back before anything).
    # The agent sent a verified destroy and died before its read-back: the instance is gone.
    with run_fake_vast(keys={VAST_KEY}) as vast:
        monkeypatch.setenv("CONTAINER_ID", "1234")
        monkeypatch.setenv("VAST_API_KEY", VAST_KEY)
        monkeypatch.delenv("CONTAINER_API_KEY", raising=False)
        make_plan(state_dir, provider="vast", api_url=vast.url)
        stale_heartbeat(state_dir)
        decided = {"provider": "vast", "action": "destroy", "why": "on_success", "started_at": 1.0}
        if sent:
            decided.update(sent_at=2.0, sent="DELETE /api/v0/instances/1234/ accepted")
        save_state(state_dir, Phase.TEARDOWN, reason=Reason.COMPLETED, teardown=decided)
        assert wait_exit(start(state_dir, guards)) == 0
        assert vast.mutations() == []  # read back only: no stop on top of the destroy
        assert vast.calls("show")
    td = load_state(state_dir).teardown
    assert td is not None and td["action"] == "destroy" and td["confirmed"] is True
    assert td["by"] == (
        "agent, carried on by the guard" if sent else "agent, confirmed by the guard"
    )
    assert load_state(state_dir).phase == Phase.DONE


def test_a_provider_that_cannot_stop_keeps_the_box_and_says_so(
    state_dir: Path, guards: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lambda has no stop, and the sync is not verified: never a destroy.
    with run_fake_lambda() as lam:
        lam.add_instance("0920582c7ff041399e34823a0be62549", ip="10.0.0.5")
        monkeypatch.setenv("LAMBDA_API_KEY", "lambda-key-0123456789")
        make_plan(state_dir, provider="lambda", api_url=lam.url, on_failure="destroy")
        stale_heartbeat(state_dir)
        save_state(state_dir, Phase.TRAINING)
        assert wait_exit(start(state_dir, guards)) == 0
        assert lam.mutations() == []
    td = record(state_dir)["teardown"]
    assert td["action"] == "keep" and td["performed"] is False
    state = load_state(state_dir)
    assert state.phase == Phase.DONE
    assert state.cause is not None and "the box is KEPT and bills on" in state.cause
    assert "ERROR agent.guard.run: guard: provider lambda cannot stop a box" in guard_log(state_dir)


def test_a_stop_refused_at_first_is_read_back_then_sent_again(
    state_dir: Path, guards: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 401 is not retried by the provider: the guard's attempt ends unconfirmed, and the guard
    # tries again one interval later (reading back first), until the box is stopped.
    with run_fake_vast(keys={VAST_KEY}) as vast:
        vast.add_instance("1234")
        vast.fail("stop", 401, times=1)
        monkeypatch.setenv("CONTAINER_ID", "1234")
        monkeypatch.setenv("VAST_API_KEY", VAST_KEY)
        monkeypatch.delenv("CONTAINER_API_KEY", raising=False)
        make_plan(state_dir, provider="vast", api_url=vast.url)
        stale_heartbeat(state_dir)
        save_state(state_dir, Phase.TRAINING)
        assert wait_exit(start(state_dir, guards)) == 0
        assert [m[0] for m in vast.mutations()] == ["PUT", "PUT"]
    rec = record(state_dir)
    assert rec["attempts"] == 2 and rec["teardown"]["confirmed"] is True
    assert "guard: stop NOT confirmed: the box may still bill" in guard_log(state_dir)
    state = load_state(state_dir)
    assert state.phase == Phase.DONE
    moves = [h.get("to") for h in state.history]
    assert moves.count("TEARDOWN") == 1  # the second attempt carries on, it does not re-enter


# -------------------------------------------------------------------- the rule, in milliseconds


def plan_at(now: float, *, deadline: float | None, stale_after_s: float = 600.0) -> GuardPlan:
    return GuardPlan(
        job_name="run1",
        started_at=now - 10_000,
        max_runtime_s=None,
        margin_s=900.0,
        hard_deadline=deadline,
        stale_after_s=stale_after_s,
        no_deadline_stale_s=NO_DEADLINE_STALE_S,
        check_every_s=30.0,
        heartbeat_every_s=30.0,
        teardown=dict(TEARDOWN),
        written_at=now - 10_000,
    )


@pytest.mark.parametrize(
    ("silent_s", "deadline_in", "kind"),
    [
        (10, -100, "alive"),  # past the deadline, but the agent beats: it handles its own end
        (599, -100, "alive"),
        (600, -100, "due"),
        (3600, 100, "before_deadline"),  # dead, but the job still has time: wait
        (3600, 0, "due"),
        (600, None, "no_deadline_wait"),
        (NO_DEADLINE_STALE_S - 1, None, "no_deadline_wait"),
        (NO_DEADLINE_STALE_S, None, "due"),
    ],
)
def test_due_needs_a_stale_heartbeat_and_a_passed_deadline(
    silent_s: float, deadline_in: float | None, kind: str
) -> None:
    now = 1_800_000_000.0
    deadline = None if deadline_in is None else now + deadline_in
    verdict = due(plan_at(now, deadline=deadline), now=now, alive_at=now - silent_s)
    assert verdict.kind == kind
    assert verdict.act == (kind == "due")


@pytest.mark.parametrize(
    ("teardown", "reason", "sync", "action"),
    [
        ({"on_failure": "destroy"}, None, None, "stop"),
        ({"on_failure": "destroy"}, None, {"sync_verified": False, "at": 2e9}, "stop"),
        ({"on_failure": "destroy"}, None, {"sync_verified": True, "at": 2e9}, "destroy"),
        ({"on_failure": "destroy"}, None, {"sync_verified": "yes", "at": 2e9}, "stop"),
        ({"on_failure": "destroy"}, None, {"sync_verified": True}, "stop"),
        ({"on_failure": "keep"}, None, {"sync_verified": True, "at": 2e9}, "stop"),
        (
            {"on_success": "destroy"},
            Reason.COMPLETED,
            {"sync_verified": True, "at": 2e9},
            "destroy",
        ),
        ({"on_success": "destroy"}, Reason.TIMEOUT, {"sync_verified": True, "at": 2e9}, "stop"),
    ],
)
def test_choose_action_stops_unless_verified_and_destroy(
    teardown: dict[str, str], reason: Reason | None, sync: dict[str, Any] | None, action: str
) -> None:
    plan = plan_at(1e9, deadline=None)
    plan = GuardPlan(**{**plan.to_dict(), "teardown": {**TEARDOWN, **teardown}})
    assert choose_action(plan, reason=reason, sync_result=sync)[0] == action


# -------------------------------------------------------------------------------- end to end

requires_libreyolo = pytest.mark.skipif(
    shutil.which("libreyolo", path=str(Path(sys.executable).parent)) is None
    and shutil.which("libreyolo") is None,
    reason="the training stack (libreyolo) is not installed: run ./install.sh",
)


@pytest.mark.training
@requires_libreyolo
def test_agent_sigkilled_for_good_past_its_deadline_gets_its_box_stopped_by_the_guard(
    tmp_path: Path,
) -> None:
    data = demo.make_dataset(tmp_path / "data" / "ds")
    state_dir = tmp_path / "state"
    job = tmp_path / "job.toml"
    job.write_text(
        f"""
[job]
name = "run1"
runs_dir = "{tmp_path / "runs"}"
[train]
model = "yolox-n"
pretrained = false
data = "{data}"
epochs = 5000
patience = 5000
imgsz = 64
batch = 4
workers = 0
device = "cpu"
[dataset]
doctor = false
[preflight]
enabled = false
[server]
listen = "127.0.0.1:0"
[limits]
max_runtime = "25s"
"""
    )
    env = {k: v for k, v in os.environ.items() if k != "LIBREYOLO_AGENT_CRASHPOINT"}
    env.update(
        LIBREYOLO_AGENT_STATE_DIR=str(state_dir),
        LIBREYOLO_AGENT_GUARD_STALE_AFTER="2s",
        LIBREYOLO_AGENT_GUARD_MARGIN="1s",
    )
    agent_err = tmp_path / "agent.err"
    with agent_err.open("w") as err:
        agent = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", str(job)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    leftovers: list[psutil.Process] = []
    try:

        def training() -> bool:
            state = StateStore(state_dir).load() if (state_dir / "state.json").exists() else None
            return bool(state and state.phase == Phase.TRAINING and state.trainer)

        eventually(lambda: agent.poll() is not None or training(), timeout=HANG_S)
        assert agent.poll() is None, agent_err.read_text()[-3000:]
        state = load_state(state_dir)
        assert state.trainer is not None
        leftovers.append(psutil.Process(state.trainer.pid))
        eventually(
            lambda: guard_pid(state_dir),
            timeout=HANG_S,
            what="the agent started no guard: agent/daemon/spine.py must call guard.write_plan, "
            "guard.heartbeat_task and guard.ensure_running (see agent/guard/run.py)",
        )
        guard = psutil.Process(guard_pid(state_dir) or 0)
        leftovers.append(guard)
        assert guard.ppid() == agent.pid and os.getsid(guard.pid) == guard.pid
        assert os.getsid(guard.pid) != os.getsid(agent.pid)

        agent.send_signal(signal.SIGKILL)  # for good: nothing restarts it
        agent.wait(HANG_S)
        killed_at = time.time()
        # It acts past the deadline: stops the trainer (SIGINT: LibreYOLO's clean stop), then
        # the box, then exits.
        eventually(lambda: exited(guard), timeout=HANG_S)
        assert exited(leftovers[0])

        state = load_state(state_dir)
        assert state.phase == Phase.DONE and state.reason == Reason.AGENT_FAILED
        assert state.cause is not None and "past the hard deadline" in state.cause
        td = state.teardown
        assert td is not None and td["by"] == "guard" and td["action"] == "stop"
        assert td["confirmed"] is True
        assert td["started_at"] >= state.started_at + 25 + 1  # max_runtime + margin
        assert td["started_at"] >= killed_at  # it acted only once the agent was dead
        assert record(state_dir)["teardown"] == td
        assert "guard: stop confirmed" in guard_log(state_dir)
        rescue = td["rescue"]
        assert rescue["trainer"]["stopped"] is True
        assert rescue["trainer"]["pid"] == leftovers[0].pid
        # No [sync] target: a last.pt cannot leave the box (this loaded machine may not have
        # reached one yet), and the record says why.
        last = rescue["last_pt"]
        assert last["saved"] is False and last["why"]
        assert ("weights/last.pt" in rescue["unsaved"]) == ("path" in last)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        for proc in leftovers:
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in proc.children(recursive=True):
                    child.kill()
                proc.kill()
