"""The guard hosted in the supervisor (agent/guard/hosted.py): a real supervisor process with a
stand-in agent, a real state directory, real locks and signals.

What must hold: the supervisor's guard thread acts as the guard process would; no guard process
runs beside it while it holds ``guard.lock``; and whenever the supervisor goes with the guard's
work not over, a guard process of its own session carries on the watch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from agent.guard.plan import LOG_FILE, ensure_running, guard_pid
from agent.state import Phase, Reason
from agent.supervisor import read_record
from tests import test_guardplan
from tests.test_guard import eventually, load_state, save_state, stale_heartbeat
from tests.test_guardplan import make_plan

state_dir = test_guardplan.state_dir
guards = test_guardplan.guards

ROOT = Path(__file__).resolve().parents[1]

# A supervisor as `libreyolo-agent supervise` builds it (host_guard=True), its agent a stand-in
# that sleeps (the one thing swapped).
SUPERVISOR = """
import sys
from pathlib import Path
from agent.supervisor import Supervisor
from agent.util import logutil
logutil.configure_console(False)
agent = [sys.executable, "-c", "import time; time.sleep(600)"]
sys.exit(Supervisor(agent, Path(sys.argv[1]), host_guard=True).run())
"""


@pytest.fixture
def supervisor(state_dir: Path) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-P", "-c", SUPERVISOR, str(state_dir)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,  # its lines are in supervisor.log and guard.log
        env={**os.environ, "LIBREYOLO_AGENT_STATE_DIR": str(state_dir)},
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        for child in psutil.Process().children(recursive=True):  # a stand-in agent left over
            with contextlib.suppress(psutil.Error):  # gone, or a zombie of another test's
                if "time.sleep(600)" in " ".join(child.cmdline()):
                    child.kill()


def guard_log(state_dir: Path) -> str:
    path = state_dir / LOG_FILE
    return path.read_text() if path.exists() else ""


def guard_processes(state_dir: Path) -> list[psutil.Process]:
    """The guard processes of ``state_dir`` (other tests' guards run beside these)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "agent.guard" in cmd and str(state_dir) in cmd:
            found.append(p)
    return found


def test_the_supervisors_guard_thread_stops_a_dead_agents_box_and_no_guard_process_runs(
    state_dir: Path, supervisor: subprocess.Popen[bytes]
) -> None:
    make_plan(state_dir, deadline_in=-60)
    stale_heartbeat(state_dir)
    save_state(state_dir, Phase.TRAINING)
    eventually(lambda: "guard: stop confirmed" in guard_log(state_dir), what=guard_log(state_dir))
    log = guard_log(state_dir)
    assert f"guard: hosted in the supervisor (pid {supervisor.pid})" in log
    assert "past the hard deadline" in log and ": stop through provider none" in log
    state = load_state(state_dir)
    assert state.phase == Phase.DONE and state.reason == Reason.AGENT_FAILED
    assert guard_pid(state_dir) == supervisor.pid  # the lock is the supervisor's
    # ensure_running (the agent's heartbeat) finds the lock held and starts nothing.
    assert ensure_running(state_dir) == supervisor.pid
    assert guard_processes(state_dir) == []
    # The guard's lines are in guard.log, not in supervisor.log.
    assert "stop confirmed" not in (state_dir / "supervisor.log").read_text()
    # Its work is over: the supervisor stops without handing anything over.
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(60) == 0
    assert "handed over" not in (state_dir / "supervisor.log").read_text()
    assert guard_pid(state_dir) is None


def test_a_supervisor_stopped_mid_watch_hands_the_guard_to_a_process_of_its_own_session(
    state_dir: Path, supervisor: subprocess.Popen[bytes], guards: list[int]
) -> None:
    make_plan(state_dir, deadline_in=3600)
    stale_heartbeat(state_dir, age_s=0)
    save_state(state_dir, Phase.TRAINING)
    eventually(lambda: "guard: waiting" in guard_log(state_dir), what=guard_log(state_dir))
    assert guard_pid(state_dir) == supervisor.pid
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(60) == 0
    eventually(lambda: guard_pid(state_dir) not in (None, 0, supervisor.pid))
    holder = guard_pid(state_dir)
    assert holder is not None
    proc = psutil.Process(holder)
    try:
        assert "agent.guard" in proc.cmdline()
        assert os.getsid(holder) == holder  # its own session: it outlives this one
        assert "handed over to a guard process" in (state_dir / "supervisor.log").read_text()
        eventually(lambda: f"guard: watching {state_dir}" in guard_log(state_dir))
    finally:
        proc.kill()


def test_a_supervisor_killed_outright_lets_go_and_the_agents_next_beat_starts_the_guard(
    state_dir: Path, supervisor: subprocess.Popen[bytes], guards: list[int]
) -> None:
    make_plan(state_dir, deadline_in=3600)
    stale_heartbeat(state_dir, age_s=0)
    save_state(state_dir, Phase.TRAINING)
    eventually(lambda: guard_pid(state_dir) == supervisor.pid)
    eventually(lambda: (read_record(state_dir) or {}).get("agent_pid"))
    agent = psutil.Process((read_record(state_dir) or {})["agent_pid"])
    os.killpg(supervisor.pid, signal.SIGKILL)
    supervisor.wait(30)
    agent.kill()  # its own process group: the stand-in outlives a killed supervisor
    assert guard_pid(state_dir) is None
    pid = ensure_running(state_dir)  # what the agent's heartbeat does
    assert pid is not None and pid != supervisor.pid
    guards.append(pid)
    eventually(lambda: guard_pid(state_dir) == pid)


def test_a_guard_process_already_watching_keeps_the_watch_and_the_supervisor_adds_none(
    state_dir: Path, guards: list[int], tmp_path: Path
) -> None:
    make_plan(state_dir, deadline_in=3600)
    stale_heartbeat(state_dir, age_s=0)
    save_state(state_dir, Phase.TRAINING)
    first = ensure_running(state_dir)
    assert first is not None
    guards.append(first)
    eventually(lambda: guard_pid(state_dir) == first)
    proc = subprocess.Popen(
        [sys.executable, "-P", "-c", SUPERVISOR, str(state_dir)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        eventually(lambda: (state_dir / "supervisor.json").exists())
        eventually(lambda: "agent started" in (state_dir / "supervisor.log").read_text())
        assert guard_pid(state_dir) == first
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert guard_pid(state_dir) == first
    assert "hosted in the supervisor" not in guard_log(state_dir)


def test_a_job_that_ended_since_the_guards_last_look_is_not_handed_over(
    state_dir: Path, supervisor: subprocess.Popen[bytes]
) -> None:
    # The agent exits 0 at DONE and the supervisor with it, before the thread looks again (here:
    # not for 10 minutes): no guard process is started just to find the job over.
    make_plan(state_dir, deadline_in=3600, every_s=600)
    stale_heartbeat(state_dir, age_s=0)
    save_state(state_dir, Phase.TRAINING)
    eventually(lambda: "guard: waiting" in guard_log(state_dir), what=guard_log(state_dir))
    save_state(state_dir, Phase.DONE, reason=Reason.COMPLETED)
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(60) == 0
    assert "handed over" not in (state_dir / "supervisor.log").read_text()
    assert guard_pid(state_dir) is None
    assert guard_processes(state_dir) == []
