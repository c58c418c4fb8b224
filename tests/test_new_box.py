"""A first launch that cannot go as usual (agent/daemon/training.py, agent/daemon/relaunch.py): a
new box whose
sync target already holds this job's run, and a launch that cannot start. The whole daemon in
this loop, the scripted stand-in trainer as a real process (tests/test_supervise.py's ``Run``).

Seen: an ``assert`` ran before the launch-failure branch, so a second box on a target holding
the finished run, or an unwritable ``runs_dir``, crashed the agent (AssertionError three times,
then ``agent_failed``); and a new box resumed the target's run to that run's total (30 epochs)
for a job that asks for 3, without a word.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

from agent.config.model import Job
from agent.state import Phase, Reason
from agent.trainer.rundir import pid_alive
from tests.fakes.scripted_launcher import ScriptedLauncher
from tests.support import wait_for
from tests.test_supervise import WAIT_S, Run, ckpt_epoch, make_job, metrics_epochs, resumes


def box_job(box: Path, synced: Path, *, epochs: int) -> Job:
    """The job on one box (its own runs and state) with the sync target every box shares."""
    box.mkdir(exist_ok=True)
    return make_job(
        box, epochs=epochs, sync=False, sections=f'[sync]\ntarget = "file://{synced}"\n'
    )


def old_box_dies_at(tmp: Path, *, epochs: int, synced_epochs: int) -> None:
    """A box trains the job (``epochs``) until ``synced_epochs`` are verified on the target,
    then dies with its disk: the agent goes, its trainer is killed."""
    synced = tmp / "synced"
    run = Run(
        tmp / "old",
        box_job(tmp / "old", synced, epochs=epochs),
        ScriptedLauncher(epoch_s=0.05, pause_at=synced_epochs + 1),
    )
    pid: dict[str, int] = {}

    async def during(run: Run) -> None:
        await run.paused()
        await wait_for(
            lambda: (
                run.daemon.sync is not None
                and (run.daemon.sync.last_synced_epoch or 0) >= synced_epochs
            ),
            WAIT_S,
        )
        pid["trainer"] = run.trainer_pid()
        run.shutdown.set()  # the agent goes; its trainer (paused) is left

    try:
        assert run.go(during) == 0
    finally:
        if "trainer" in pid and pid_alive(pid["trainer"]):
            os.kill(pid["trainer"], signal.SIGKILL)
    remote = json.loads((synced / "status.json").read_text())
    assert remote["completed_epochs"] == synced_epochs and remote["total_epochs"] == epochs
    assert ckpt_epoch(synced / "weights" / "last.pt") == synced_epochs


def new_box(tmp: Path, *, epochs: int) -> Run:
    return Run(tmp / "new", box_job(tmp / "new", tmp / "synced", epochs=epochs), ScriptedLauncher())


# ------------------------------------------------------------------ the job's epochs (25.7)


def test_a_new_box_resumes_the_targets_run_to_the_jobs_epochs_not_the_runs(
    tmp_path: Path,
) -> None:
    old_box_dies_at(tmp_path, epochs=30, synced_epochs=2)
    run = new_box(tmp_path, epochs=3)
    assert run.go() == 0
    daemon = run.daemon
    assert daemon.state.reason == Reason.COMPLETED, daemon.state.cause
    assert resumes(daemon) == [("new_box", 2)]
    assert (
        "that run was started for 30 epochs, this job asks for 3: it ends at epoch 3"
        in (daemon.state.resumes[0]["message"])
    )
    [argv] = run.launcher.launched
    assert "resume=true" in argv and "epochs=3" in argv and "epochs=30" not in argv
    synced = tmp_path / "synced"
    # Epochs 1 and 2 were trained on the old box: their rows came from the target, the resumed
    # trainer appended epoch 3's, and the target's copy keeps the whole history.
    assert metrics_epochs(run.run_dir / "metrics.jsonl") == [1, 2, 3]
    assert metrics_epochs(synced / "metrics.jsonl") == [1, 2, 3]
    assert ckpt_epoch(synced / "weights" / "last.pt") == 3
    remote = json.loads((synced / "status.json").read_text())
    assert remote["state"] == "completed" and remote["total_epochs"] == 3
    assert "this job asks for 3" in run.log()


def test_a_target_run_past_the_jobs_epochs_ends_the_job_at_once_naming_both(
    tmp_path: Path,
) -> None:
    old_box_dies_at(tmp_path, epochs=30, synced_epochs=5)
    run = new_box(tmp_path, epochs=3)
    assert run.go() == 0
    daemon = run.daemon
    assert run.launcher.launched == []
    assert daemon.state.phase == Phase.DONE
    assert daemon.state.reason == Reason.COMPLETED
    assert (
        "the sync target's run of this job has already trained 5 epochs and this job asks "
        "for 3: the job is done"
    ) in (daemon.state.cause or "")
    assert daemon.state.crashes == []
    assert ckpt_epoch(tmp_path / "synced" / "weights" / "last.pt") == 5  # left as it was


# ------------------------------------------------------------------ failed launches (25.6)


def test_a_second_box_on_a_target_holding_the_finished_run_ends_the_job_at_once(
    tmp_path: Path,
) -> None:
    synced = tmp_path / "synced"
    first = Run(tmp_path / "old", box_job(tmp_path / "old", synced, epochs=3), ScriptedLauncher())
    assert first.go() == 0
    assert first.daemon.state.reason == Reason.COMPLETED
    before = (synced / "weights" / "last.pt").read_bytes()

    run = new_box(tmp_path, epochs=3)
    assert run.go() == 0
    daemon = run.daemon
    assert run.launcher.launched == []
    assert daemon.state.phase == Phase.DONE
    assert daemon.state.reason == Reason.COMPLETED
    assert "the sync target already holds this job's completed run (3 epochs)" in (
        daemon.state.cause or ""
    )
    assert daemon.state.crashes == []
    assert "AssertionError" not in run.log()
    assert (synced / "weights" / "last.pt").read_bytes() == before


def test_a_runs_dir_that_cannot_be_made_ends_the_job_as_training_failed(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be\n")
    job = make_job(tmp_path)
    job = dataclasses.replace(job, job=dataclasses.replace(job.job, runs_dir=blocker / "runs"))
    run = Run(tmp_path, job, ScriptedLauncher())
    assert run.go() == 0
    daemon = run.daemon
    assert daemon.state.phase == Phase.DONE
    assert daemon.state.reason == Reason.TRAINING_FAILED
    cause = daemon.state.cause or ""
    assert cause.startswith("cannot start the trainer: ") and str(blocker) in cause, cause
    assert daemon.state.crashes == []
    assert daemon.state.teardown is not None and daemon.state.teardown.get("action")
    assert "AssertionError" not in run.log()
