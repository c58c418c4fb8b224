"""Chaos: the agent SIGKILLed at random moments of one real run, and at the named dangerous
points (right after the launch, mid-upload, FINISHING, TEARDOWN). The rules it must keep: one
trainer ever, one run dir, every epoch checkpoint on the target, no traceback, and the job ends
as planned once the agent is left alone.

The seed is printed (``-s``) and can be replayed with ``CHAOS_SEED``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from agent.state import Phase, Reason, StateStore
from agent.trainer.rundir import RunStatus
from tests.support import HANG_S
from tests.test_daemon import dataset, requires_libreyolo
from tests.test_restart import agent_env, job_toml, run_dirs, trainers_of

__all__ = ["dataset"]

pytestmark = pytest.mark.training

#: One real run of about a minute idle, many agent start-ups: under load (2 cores, load 8-18)
#: it takes many minutes; a cap for a hang only, as every wait below waits on a process's exit.
CHAOS_TIMEOUT_S = 2400

#: Random kills in one run (the issue asks for 20), then the named points.
RANDOM_KILLS = 20
#: The run's length, and the most of it trained during the random kills: the trainer runs only
#: while an agent lives and at most one epoch per agent, so the kills always land in TRAINING
#: and the run ends after them (then the FINISHING and TEARDOWN points), however fast or slow
#: this machine trains. LibreYOLO's early stop is off (patience above the epochs).
EPOCHS = 16
KILL_EPOCHS = 8
NAMED_POINTS = ("staging", "after-launch", "upload-sent", "finishing", "teardown-sending")


def wait_for_training(state_dir: Path, proc: subprocess.Popen[bytes]) -> None:
    """Until the agent ``proc`` wrote TRAINING as its own phase (or exited)."""
    deadline = time.monotonic() + HANG_S
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the agent never reached TRAINING"
        with contextlib.suppress(OSError, ValueError):
            st = StateStore(state_dir).load()
            if st is not None and st.agent_pid == proc.pid and st.phase == Phase.TRAINING:
                return
        time.sleep(0.05)


def start_agent(job: Path, state_dir: Path, log: Path, **extra: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", str(job)],
            stdout=out,
            stderr=out,
            env=agent_env(state_dir, **extra),
        )


def roots_of(live: list[psutil.Process]) -> list[psutil.Process]:
    """The trainers among ``live`` trainer processes (not the children of another)."""
    pids = {q.pid for q in live}
    roots = []
    for p in live:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.ppid() not in pids:
                roots.append(p)
    return roots


def epochs_done(runs: Path) -> int:
    """The run's completed epochs as its status.json says (0 before the first)."""
    try:
        return int(json.loads((runs / "run1" / "status.json").read_text())["completed_epochs"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def extra_run_dirs(runs: Path, log: str) -> str:
    """What a second run dir holds and what the agents said of launches: the evidence for a
    failure seen once under load (CI, seed 633073965) and not reproduced idle."""
    out = []
    for d in sorted(p for p in runs.iterdir() if p.is_dir() and p.name != "run1"):
        files = sorted(str(f.relative_to(d)) for f in d.rglob("*"))
        status = (d / "status.json").read_text()[:400] if (d / "status.json").exists() else ""
        out.append(f"{d.name}: {files} {status}")
    said = [ln for ln in log.splitlines() if "launch" in ln or "run dir" in ln or "resum" in ln]
    return "\n".join([*out, *said[-40:]])


def kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=HANG_S)


@requires_libreyolo
@pytest.mark.timeout(CHAOS_TIMEOUT_S)
def test_agent_killed_at_random_moments_and_named_points_loses_nothing(
    tmp_path: Path, dataset: Path
) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.randrange(1 << 30))
    print(f"chaos seed {seed}")
    rng = random.Random(seed)
    job = job_toml(
        tmp_path,
        dataset,
        epochs=EPOCHS,
        extra="every_epochs = 1",
        save_period=3,
        train=f"patience = {EPOCHS * 10}",
    )
    state_dir = tmp_path / "state"
    runs = tmp_path / "runs"
    log = tmp_path / "agents.log"
    trainer_pids: set[int] = set()

    def note_trainers() -> None:
        st = StateStore(state_dir).load() if (state_dir / "state.json").exists() else None
        if st is not None and st.trainer is not None:
            trainer_pids.add(st.trainer.pid)
        # Never two trainers at once (DataLoader workers are children, not trainers).
        roots = roots_of(trainers_of(runs))
        assert len(roots) <= 1, [p.info.get("cmdline") for p in roots]

    # 1. STAGING, then the launch instant itself.
    named: dict[str, int | None] = {}
    for point in NAMED_POINTS[:2]:
        proc = start_agent(job, state_dir, log, LIBREYOLO_AGENT_CRASHPOINT=point)
        named[point] = proc.wait(timeout=HANG_S)
        note_trainers()

    # 2. Random moments while it trains (each agent lives 0.2-2.5 s, or until the trainer
    # ended an epoch: a kill right at the epoch's sync). The trainer the launch left is frozen
    # (SIGSTOP) whenever no agent lives, and once it trained KILL_EPOCHS epochs here.
    (trainer,) = roots_of(trainers_of(runs))
    os.kill(trainer.pid, signal.SIGSTOP)
    first = epochs_done(runs)
    phases_killed: list[str] = []
    try:
        for i in range(RANDOM_KILLS):
            proc = start_agent(job, state_dir, log)
            seen = epochs_done(runs)
            runs_now = seen < first + KILL_EPOCHS
            if runs_now:
                os.kill(trainer.pid, signal.SIGCONT)
            if i % 2:
                # Every other kill lands in TRAINING for sure: its random moment counts from the
                # agent's own TRAINING, not from its start (a loaded CI machine took longer than
                # 2.5 s to boot an agent, and the kills all hit BOOTING).
                wait_for_training(state_dir, proc)
            deadline = time.monotonic() + rng.uniform(0.2, 2.5)
            while time.monotonic() < deadline and proc.poll() is None:
                if runs_now and epochs_done(runs) > seen:
                    break
                time.sleep(0.05)
            os.kill(trainer.pid, signal.SIGSTOP)
            note_trainers()
            kill(proc)
            st = StateStore(state_dir).load() if (state_dir / "state.json").exists() else None
            phases_killed.append(st.phase.value if st else "none")
    finally:
        os.kill(trainer.pid, signal.SIGCONT)

    # 3. The named points: mid-upload (the next milestone), FINISHING (once the run has ended
    # by itself), TEARDOWN (the next agent, finishing it).
    for point in NAMED_POINTS[2:]:
        proc = start_agent(job, state_dir, log, LIBREYOLO_AGENT_CRASHPOINT=point)
        try:
            # Up to a whole run's end (FINISHING): the cap is the test's own timeout.
            named[point] = proc.wait()
        finally:
            kill(proc)
        note_trainers()
    # Each named point was really reached (killed there), not skipped.
    assert named == dict.fromkeys(NAMED_POINTS, -signal.SIGKILL), named

    # 4. Left alone, the agent finishes the job.
    last = start_agent(job, state_dir, log)
    try:
        assert last.wait(timeout=HANG_S) == 0
    finally:
        kill(last)

    print("phases at the random kills:", phases_killed)
    assert phases_killed.count("TRAINING") >= RANDOM_KILLS // 2, phases_killed
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-4000:]
    assert len(trainer_pids) == 1, trainer_pids
    assert run_dirs(runs) == ["run1"], extra_run_dirs(runs, text)
    assert not trainers_of(runs)
    state = StateStore(state_dir).load()
    assert state is not None and state.phase == Phase.DONE
    status = json.loads((runs / "run1" / "status.json").read_text())
    assert state.reason == Reason.COMPLETED, (state.reason, state.cause)
    assert state.outcome is not None and state.outcome["kind"] == "completed"
    assert not state.resumes, state.resumes  # only agents were killed: the trainer never died
    done = RunStatus.from_dict(status).completed_epochs
    # Every epoch trained once, in order, to the last.
    rows = (runs / "run1" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["epoch"] for r in rows] == list(range(1, done + 1))
    assert done == EPOCHS
    synced = {p.name for p in (tmp_path / "synced" / "weights").glob("*.pt")}
    assert {f"epoch_{n}.pt" for n in range(3, done + 1, 3)} <= synced, sorted(synced)
    on_disk = {p.name for p in (runs / "run1" / "weights").glob("*.pt")}
    assert "last.pt" in on_disk and on_disk <= synced, on_disk - synced
    result = json.loads((state_dir / "sync-result.json").read_text())
    assert result["sync_verified"] is True, result
    # Killed agents left no snapshot behind once the job is done.
    left = list((state_dir / "snapshots").glob("*")) if (state_dir / "snapshots").exists() else []
    assert not left, left
    # No process of the run survives it.
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(runs) in " ".join(p.info.get("cmdline") or [])
    ]
