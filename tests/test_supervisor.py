"""The container supervisor (agent/supervisor.py, ``libreyolo-agent supervise``) as a real process:
with a stand-in agent (a small script whose exits the test scripts) for the restart rules and the
signals, and with the real agent on the tiny real job for a kill in the middle of training."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent.state import Phase, Reason, StateStore
from agent.supervisor import LOG_FILE, PID_FILE, Policy, read_record
from tests.support import HANG_S
from tests.test_daemon import dataset, requires_libreyolo
from tests.test_restart import agent_env, job_toml, kill_tree, trainers_of

__all__ = ["dataset"]  # the module-scoped fixture, shared with test_daemon

ROOT = Path(__file__).resolve().parent.parent

# The stand-in agent: its Nth start does what the Nth word of its script says (the last word
# repeats): exit with that code, "kill" itself with SIGKILL, or "wait" for SIGTERM and exit 0.
FAKE_AGENT = """
import os, pathlib, signal, sys
folder, script = pathlib.Path(sys.argv[1]), sys.argv[2].split(",")
n = len(list(folder.glob("start-*")))
what = script[min(n, len(script) - 1)]
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
(folder / f"start-{n}").write_text(str(os.getpid()))
print(f"fake agent start {n}: {what}", flush=True)
if what == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if what == "wait":
    got = signal.sigwait({signal.SIGTERM})
    (folder / "got").write_text(signal.Signals(got).name)
    sys.exit(0)
sys.exit(int(what))
"""

# The supervisor in a process of its own (real signals), supervising the stand-in.
RUN_SUPERVISOR = """
import json, sys
from pathlib import Path
from agent.util import logutil
from agent.supervisor import Policy, Supervisor
cfg = json.loads(sys.argv[1])
logutil.configure_console(False)
sup = Supervisor(cfg["argv"], Path(cfg["state_dir"]), policy=Policy(**cfg["policy"]))
sys.exit(sup.run())
"""


def wait_until(pred: Callable[[], Any], timeout: float = 120.0) -> Any:
    end = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


class Stand:
    """A supervisor process over the stand-in agent, and what the stand-in recorded."""

    def __init__(self, tmp: Path, script: str, **policy: Any) -> None:
        self.folder = tmp / "fake"
        self.folder.mkdir(exist_ok=True)
        self.state_dir = tmp / "state"
        agent = tmp / "fake_agent.py"
        agent.write_text(FAKE_AGENT)
        cfg = {
            "argv": [sys.executable, str(agent), str(self.folder), script],
            "state_dir": str(self.state_dir),
            "policy": {"first_backoff_s": 0.05, "max_backoff_s": 0.2, **policy},
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RUN_SUPERVISOR, json.dumps(cfg)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err

    def starts(self) -> int:
        return len(list(self.folder.glob("start-*")))

    def record(self) -> dict[str, Any]:
        data = read_record(self.state_dir)
        assert data is not None
        return data

    def log(self) -> str:
        return (self.state_dir / LOG_FILE).read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
        self.proc.communicate()  # reaped, its pipe closed


@pytest.fixture
def stand(tmp_path: Path) -> Iterator[Callable[..., Stand]]:
    made: list[Stand] = []

    def make(script: str, **policy: Any) -> Stand:
        made.append(Stand(tmp_path, script, **policy))
        return made[-1]

    yield make
    for s in made:
        s.kill()


# ---------------------------------------------------------------------------------- the rules


def test_backoff_doubles_from_the_first_wait_up_to_the_cap() -> None:
    p = Policy(first_backoff_s=5, max_backoff_s=300)
    assert [p.backoff_s(n) for n in range(1, 9)] == [5, 10, 20, 40, 80, 160, 300, 300]
    assert p.backoff_s(10_000) == 300  # a count that grows for days does not overflow


def test_verdicts_on_each_kind_of_exit() -> None:
    p = Policy(max_restarts=3, first_backoff_s=5, min_uptime_s=60)
    assert not p.after_exit(0, 1, 2).restart and p.after_exit(0, 1, 2).state == "finished"
    assert not p.after_exit(2, 1, 0).restart and p.after_exit(2, 1, 0).state == "bad_job"
    killed = p.after_exit(-signal.SIGKILL, 1, 0)
    assert killed.restart and killed.delay_s == 5 and killed.in_a_row == 1
    assert p.after_exit(1, 1, 2).delay_s == 20
    gave_up = p.after_exit(1, 1, 3)
    assert not gave_up.restart and gave_up.state == "gave_up"
    # An agent that stayed up a while was not crash-looping: the count starts over.
    again = p.after_exit(1, 61, 3)
    assert again.restart and again.in_a_row == 1 and again.delay_s == 5


# ------------------------------------------------------------------- the stand-in agent


def test_a_failed_or_killed_agent_is_restarted_and_a_clean_finish_is_not(
    stand: Callable[..., Stand],
) -> None:
    s = stand("1,kill,0")
    code, err = s.finish()
    assert code == 0, err
    assert s.starts() == 3
    rec = s.record()
    assert rec["state"] == "finished" and rec["restarts"] == 2
    assert [(e["code"], e["signal"]) for e in rec["exits"]] == [
        (1, None),
        (None, "SIGKILL"),
        (0, None),
    ]
    assert rec["agent_pid"] is None and rec["next_restart_at"] is None
    log = s.log()
    assert "fake agent start 0: 1" in log and "fake agent start 2: 0" in log  # its output
    assert "supervisor: agent killed by SIGKILL" in log
    assert "the job ended (exit 0)" in log


def test_a_clean_finish_is_never_restarted(stand: Callable[..., Stand]) -> None:
    s = stand("0")
    code, err = s.finish()
    assert code == 0, err
    assert s.starts() == 1
    assert s.record()["restarts"] == 0 and s.record()["state"] == "finished"


def test_a_bad_job_file_exit_is_not_restarted(stand: Callable[..., Stand]) -> None:
    s = stand("2,0")
    code, err = s.finish()
    assert code == 2, err
    assert s.starts() == 1
    assert s.record()["state"] == "bad_job"
    assert "a restart cannot fix it" in s.log()


def test_a_crash_loop_gives_up_after_the_restarts_in_a_row(stand: Callable[..., Stand]) -> None:
    s = stand("1", max_restarts=2)
    code, err = s.finish()
    assert code == 1, err
    assert s.starts() == 3  # the first start and two restarts
    rec = s.record()
    assert rec["state"] == "gave_up" and rec["restarts"] == 2 and rec["restarts_in_a_row"] == 2
    assert "giving up" in s.log()


def test_sigterm_is_passed_on_to_the_agent_which_is_not_restarted(
    stand: Callable[..., Stand],
) -> None:
    s = stand("wait")
    wait_until(lambda: s.starts() == 1 and (s.record().get("agent_pid") is not None))
    agent_pid = int((s.folder / "start-0").read_text())
    assert s.record()["agent_pid"] == agent_pid
    # Its own process group: a signal to the supervisor's group does not reach it twice.
    assert os.getpgid(agent_pid) != os.getpgid(s.proc.pid)
    s.proc.send_signal(signal.SIGTERM)
    code, err = s.finish()
    assert code == 0, err
    assert (s.folder / "got").read_text() == "SIGTERM"
    assert s.starts() == 1
    assert s.record()["state"] == "stopped"
    assert "SIGTERM received: passing it on to the agent" in s.log()


def test_sigterm_during_the_backoff_ends_the_supervisor_without_a_restart(
    stand: Callable[..., Stand],
) -> None:
    s = stand("1", first_backoff_s=600, max_backoff_s=600)
    rec = wait_until(lambda: (r := read_record(s.state_dir)) and r["state"] == "waiting" and r)
    assert rec["next_restart_at"] > rec["last_exit"]["at"]
    s.proc.send_signal(signal.SIGTERM)
    code, err = s.finish()  # well before the 600 s wait (the test's timeout is shorter)
    assert code == 0, err
    assert s.starts() == 1
    assert s.record()["state"] == "stopped"


# --------------------------------------------------------------------- the real agent, CLI


def supervise(job: Path, state_dir: Path, *options: str, **extra: str) -> subprocess.Popen[str]:
    """``libreyolo-agent supervise JOB``, as bootstrap starts it (its own session)."""
    return subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "supervise", str(job), *options],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=agent_env(state_dir, **extra),
        start_new_session=True,
    )


@contextlib.contextmanager
def reaped(proc: subprocess.Popen[str], runs: Path | None = None) -> Iterator[None]:
    """Whatever happens in the test, no supervisor, agent or trainer is left running."""
    try:
        yield
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
        proc.communicate()  # reaped, its pipe closed
        if runs is not None:
            for p in trainers_of(runs):
                kill_tree(p.pid)


def test_a_second_supervisor_on_the_same_state_dir_refuses_naming_the_first(
    stand: Callable[..., Stand], tmp_path: Path, dataset: Path
) -> None:
    first = stand("wait")
    wait_until(lambda: first.starts() == 1)
    assert (first.state_dir / PID_FILE).read_text().strip() == str(first.proc.pid)
    job = job_toml(tmp_path, dataset, epochs=2)
    second = supervise(job, first.state_dir)
    with reaped(second):
        _, err = second.communicate(timeout=120)
    assert second.returncode == 1
    assert f"a supervisor (pid {first.proc.pid}) already runs" in err
    assert first.starts() == 1 and first.proc.poll() is None  # the first one goes on
    assert not (tmp_path / "runs").exists()  # no second agent ever started


def test_the_real_agent_exiting_2_is_not_restarted(tmp_path: Path, dataset: Path) -> None:
    # A setting only the agent checks (the guard's margin): it exits 2, a restart cannot help.
    job = job_toml(tmp_path, dataset, epochs=2)
    state_dir = tmp_path / "state"
    proc = supervise(job, state_dir, LIBREYOLO_AGENT_GUARD_MARGIN="soon")
    with reaped(proc):
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    rec = read_record(state_dir)
    assert rec is not None and rec["state"] == "bad_job" and rec["restarts"] == 0
    assert rec["last_exit"]["code"] == 2
    assert "LIBREYOLO_AGENT_GUARD_MARGIN" in (state_dir / LOG_FILE).read_text()


def test_a_bad_option_or_job_file_is_exit_2_before_anything_starts(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    bad_job = tmp_path / "job.toml"
    bad_job.write_text("[job]\nname = 1\n")
    for options, named in (
        (["--max-restarts", "-1"], "--max-restarts: must be 0 or more"),
        ([], "name"),
    ):
        proc = supervise(bad_job, state_dir, *options)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, err
        assert "error:" in err and named in err
        if options:
            assert not state_dir.exists()
    # No agent was started; the bad job file got the box's failure decision, in state.json
    # (agent/daemon/badjob.py; provider "none" here: a dry run).
    assert not (state_dir / LOG_FILE).exists()
    state = json.loads((state_dir / "state.json").read_text())
    assert state["reason"] == "preflight_failed" and state["cause"].startswith("bad job file")


# ``python -m agent.cli supervise JOB`` as the bootstrap runs it, its agent a stand-in that exits
# 0 at once (the one thing swapped: agent_argv); at its exit the supervisor writes the modules it
# held.
RUN_CLI_SUPERVISE = """
import atexit, json, runpy, sys
import agent.supervisor
out, stand_in = sys.argv[1], json.loads(sys.argv[2])
agent.supervisor.agent_argv = lambda job, verbose=False: stand_in
atexit.register(lambda: open(out, "w").write("\\n".join(sorted(sys.modules))))
sys.argv = ["agent.cli", "supervise", *sys.argv[3:]]
runpy.run_module("agent.cli", run_name="__main__", alter_sys=True)
"""

#: A stand-in agent that ends its job as one that went well does: DONE, the teardown confirmed.
STAND_IN_DONE = """
import sys, time
from pathlib import Path
from agent.guard.plan import PLAN_FILE, GuardPlan
from agent.state import Phase, Reason, RunState, StateStore, atomic_write_json
state_dir, now = Path(sys.argv[1]), time.time()
teardown = {"provider": "none"}
plan = GuardPlan("run1", now, None, 900.0, None, 600.0, 21600.0, 30.0, 30.0, teardown, now)
atomic_write_json(state_dir / PLAN_FILE, plan.to_dict())
state = RunState(job_name="run1", job_source="job.toml", phase=Phase.DONE)
state.reason = Reason.COMPLETED
state.teardown = {"provider": "vast", "action": "destroy", "confirmed": True, "finished_at": 1.0}
StateStore(state_dir).save(state)
print("stand-in agent")
"""

#: What the supervisor, alive for the whole job, must not hold (issue 26: our processes
#: together under 80 MiB PSS): the CLI and the job parser (the job file is checked in a forked
#: child that exits), the job's configuration (the waiting guard reads its plan without it),
#: asyncio (its loop waits with select on a pidfd), what the hosted guard imports only when it
#: acts (the providers, the teardown, the rescue of last.pt), and of the standard library
#: tempfile, datetime, typing (types for mypy only), dataclasses with inspect (agent.util.record
#: stands in), argparse (a plain command line is read without it), random (the supervisor's
#: backoff has no jitter) and base64: 0.7, 0.5, 0.5, 1.0, 0.4, 0.2 and 0.1 MiB here.
NOT_IN_THE_SUPERVISOR = (
    "tempfile",
    "datetime",
    "typing",
    "dataclasses",
    "inspect",
    "argparse",
    "random",
    "base64",
    "asyncio",
    "tomllib",
    "agent.cli",
    "agent.client",
    "agent.config",
    "agent.config.jobfile",
    "agent.config.jobvalues",
    "agent.config.model",
    "agent.daemon.badjob",
    "agent.demo",
    "agent.staterecords",
    "agent.providers",
    "agent.policy",
    "agent.guard.save",
    "aiohttp",
)


def test_the_supervisor_holds_neither_the_cli_nor_the_job_parser_nor_asyncio(
    tmp_path: Path, dataset: Path
) -> None:
    job = job_toml(tmp_path, dataset, epochs=1)
    state_dir = tmp_path / "state"
    out = tmp_path / "modules.txt"
    # The stand-in leaves what a job that went well leaves: DONE, its teardown confirmed (the
    # guard's last look reads it, and must not import the teardown policy for that).
    stand_in = [sys.executable, "-c", STAND_IN_DONE, str(state_dir)]
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN_CLI_SUPERVISE, str(out), json.dumps(stand_in), str(job)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=agent_env(state_dir),
        start_new_session=True,
    )
    with reaped(proc):
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    rec = read_record(state_dir)
    assert rec is not None and rec["state"] == "finished" and rec["argv"] == stand_in
    assert "stand-in agent" in (state_dir / LOG_FILE).read_text()
    held = set(out.read_text().split())
    assert "agent.supervisor" in held and "subprocess" in held  # the list is the real one
    assert "agent.guard.hosted" in held  # the guard is a thread of the supervisor
    assert (
        sorted(
            m
            for m in held
            if m.split(".")[0] in NOT_IN_THE_SUPERVISOR or m in NOT_IN_THE_SUPERVISOR
        )
        == []
    )


def test_the_console_script_enters_the_supervisor_without_the_cli(tmp_path: Path) -> None:
    # pyproject's libreyolo-agent is agent.entry:main: supervise goes straight to the supervisor.
    code = (
        "import sys\n"
        "from agent import entry\n"
        "sys.argv = ['libreyolo-agent', 'supervise', '--max-restarts', '-1', 'job.toml']\n"
        "code = entry.main()\n"
        "print(code, 'agent.cli' in sys.modules, 'asyncio' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["2", "False", "False"], out.stderr
    assert "--max-restarts: must be 0 or more" in out.stderr


@requires_libreyolo
@pytest.mark.training
def test_sigkill_of_the_agent_mid_training_restarts_it_onto_the_same_trainer(
    tmp_path: Path, dataset: Path
) -> None:
    job = job_toml(tmp_path, dataset, epochs=4)
    state_dir = tmp_path / "state"
    runs = tmp_path / "runs"
    log_path = tmp_path / "agent.out"
    proc = supervise(job, state_dir, "--first-backoff", "0.2", "--log", str(log_path))
    with reaped(proc, runs):

        def training() -> tuple[int, int] | None:
            state = StateStore(state_dir).load() if (state_dir / "state.json").exists() else None
            if state is None or state.phase != Phase.TRAINING or state.trainer is None:
                return None
            if not state.trainer.run_dir:
                return None
            status = Path(state.trainer.run_dir) / "status.json"
            with contextlib.suppress(OSError, ValueError):
                if json.loads(status.read_text()).get("completed_epochs", 0) >= 1:
                    return state.trainer.pid, state.agent_pid or 0
            return None

        trainer_pid, agent_pid = wait_until(training, timeout=HANG_S)
        rec = read_record(state_dir)
        assert rec is not None and rec["agent_pid"] == agent_pid
        assert psutil.Process(agent_pid).ppid() == proc.pid  # the supervisor's child
        os.kill(agent_pid, signal.SIGKILL)

        _, err = proc.communicate(timeout=HANG_S)
        assert proc.returncode == 0, err + log_path.read_text()[-3000:]

    rec = read_record(state_dir)
    assert rec is not None
    assert rec["state"] == "finished" and rec["restarts"] == 1  # the clean finish: no restart
    assert [(e["code"], e["signal"]) for e in rec["exits"]] == [(None, "SIGKILL"), (0, None)]
    state = StateStore(state_dir).load()
    assert state is not None
    assert state.reason == Reason.COMPLETED, state.cause
    assert state.trainer is not None and state.trainer.pid == trainer_pid  # one trainer, all run
    restarted = [h for h in state.history if h.get("event") == "agent restarted"]
    assert [h["was"] for h in restarted] == ["TRAINING"]
    log = log_path.read_text()
    assert f"re-attached to trainer pid={trainer_pid}" in log
    assert "supervisor: agent killed by SIGKILL" in log
    assert sorted(p.name for p in runs.iterdir()) == ["run1"]
    assert not trainers_of(runs)
