"""The resume rules (agent/policy/resume.py) and the resume command line
(agent/trainer/process.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config.jobfile import parse_job
from agent.config.model import LimitsSection
from agent.policy.resume import (
    BOOT_ID_ENV,
    AlreadyDone,
    boot_id,
    counted,
    death_record,
    decide,
    new_box_epochs,
)
from agent.state import Reason
from agent.trainer.outcome import Outcome, OutcomeKind
from agent.trainer.process import build_argv
from agent.trainer.rundir import RunStatus

CFG = LimitsSection(max_restarts=3, restart_backoff_s=10.0)


def status(epoch: int, total: int = 10) -> RunStatus:
    return RunStatus.from_dict(
        {"state": "running", "completed_epochs": epoch, "total_epochs": total}
    )


def died(kind: OutcomeKind = OutcomeKind.KILLED, message: str = "killed by SIGKILL") -> Outcome:
    return Outcome(kind, -9, message)


def test_a_killed_trainer_is_resumed_with_a_doubling_backoff() -> None:
    first = decide(died(), status(4), cfg=CFG, resumes=[], stop_reason=None)
    assert first.resume and first.wait_s == 10.0 and "resume 1/3" in first.why
    earlier = [{"kind": "runtime", "epoch": 2, "message": "x"}]
    second = decide(died(), status(4), cfg=CFG, resumes=earlier, stop_reason=None)
    assert second.resume and second.wait_s == 20.0 and "resume 2/3" in second.why


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        (OutcomeKind.CONFIG, "cannot fix a config error"),
        (OutcomeKind.DATA, "cannot fix a data error"),
        (OutcomeKind.MODEL, "cannot fix a model error"),
        (OutcomeKind.INTERRUPTED, "SIGINT by someone else"),
    ],
)
def test_exits_a_restart_cannot_fix_are_never_resumed(kind: OutcomeKind, words: str) -> None:
    d = decide(Outcome(kind, 2, "boom"), status(3), cfg=CFG, resumes=[], stop_reason=None)
    assert not d.resume and words in d.why


def test_completed_stopped_and_box_faults_are_not_resumed() -> None:
    done = decide(
        Outcome(OutcomeKind.COMPLETED, 0, "ok"), status(10), cfg=CFG, resumes=[], stop_reason=None
    )
    assert not done.resume and not done.completed
    all_written = decide(died(), status(10, total=10), cfg=CFG, resumes=[], stop_reason=None)
    assert not all_written.resume and all_written.completed
    stopped = decide(died(), status(3), cfg=CFG, resumes=[], stop_reason=Reason.TIMEOUT)
    assert not stopped.resume and "timeout" in stopped.why
    fault = decide(died(), status(3), cfg=CFG, resumes=[], stop_reason=None, box_fault="Xid 79")
    assert not fault.resume and "Xid 79" in fault.why


def test_a_resume_libreyolo_refuses_as_fully_trained_is_a_completed_run() -> None:
    # Seen under load: the trainer was killed in its last epoch after LibreYOLO saved last.pt
    # and before status.json said so (epoch_N.pt and best.pt are saved in between); the resume
    # from that last.pt was refused with exit 2, and the run ended as training_failed.
    refused = Outcome(
        OutcomeKind.CONFIG,
        2,
        "Training failed: Cannot resume from runs/run1/weights/last.pt: its run already "
        "trained 4/4 epochs, so nothing is left to resume. Start a new run from these "
        "weights instead: model.train(data=...) without resume.",
    )
    d = decide(refused, status(3, total=4), cfg=CFG, resumes=[], stop_reason=None)
    assert not d.resume and d.completed and "last.pt holds every epoch" in d.why
    # Any other config error is still one a restart cannot fix.
    other = decide(
        died(OutcomeKind.CONFIG, "bad option"), status(3, 4), cfg=CFG, resumes=[], stop_reason=None
    )
    assert not other.resume and not other.completed


def test_the_same_failure_at_the_same_epoch_twice_is_deterministic() -> None:
    earlier = [
        death_record(died(OutcomeKind.OOM, "CUDA out of memory"), status(5), now=1.0, cause=None)
    ]
    again = decide(
        died(OutcomeKind.OOM, "CUDA out of memory"),
        status(5),
        cfg=CFG,
        resumes=earlier,
        stop_reason=None,
    )
    assert not again.resume and "deterministic" in again.why
    elsewhere = decide(
        died(OutcomeKind.OOM, "CUDA out of memory"),
        status(6),
        cfg=CFG,
        resumes=earlier,
        stop_reason=None,
    )
    assert elsewhere.resume
    # Reboots are the box's doing, not the run's: two at one epoch are not "deterministic".
    reboots = [death_record(died(), status(5), now=1.0, cause="reboot")]
    assert decide(
        died(), status(5), cfg=CFG, resumes=reboots, stop_reason=None, cause="reboot"
    ).resume


def test_max_restarts_counts_every_resume_but_a_handled_preemption() -> None:
    resumes = [
        {"kind": "killed", "epoch": 1, "message": "a"},
        {"kind": "preempted", "epoch": 2, "message": "b"},
        {"kind": "runtime", "epoch": 3, "message": "c"},
        {"kind": "reboot", "epoch": 4, "message": "d"},
    ]
    assert counted(resumes) == 3
    d = decide(died(), status(6), cfg=CFG, resumes=resumes, stop_reason=None)
    assert not d.resume and "gave up after 3" in d.why
    # ... and a preemption is resumed at once, whatever the count.
    p = decide(
        died(OutcomeKind.INTERRUPTED, "stopped with SIGINT"),
        status(6),
        cfg=CFG,
        resumes=resumes,
        stop_reason=None,
        cause="preempted",
    )
    assert p.resume and p.wait_s == 0.0
    assert not decide(
        died(), status(6), cfg=LimitsSection(max_restarts=0), resumes=[], stop_reason=None
    ).resume


def test_the_resume_command_goes_on_in_the_same_run_dir(tmp_path: Path) -> None:
    job = parse_job(
        f"""
[job]
name = "run1"
runs_dir = "{tmp_path / "runs"}"
[train]
model = "yolox-n"
pretrained = false
data = "{tmp_path / "data.yaml"}"
epochs = 40
imgsz = 64
""",
        source="test",
        base_dir=tmp_path,
        train_options=None,
    )
    run = tmp_path / "runs" / "run12"
    argv = build_argv(job, resume_dir=run, total_epochs=None)
    args = argv[2:]
    assert args[:2] == [f"model={run / 'weights' / 'last.pt'}", "resume=true"]
    assert "pretrained=false" not in args and "model=yolox-n" not in args
    assert f"data={tmp_path / 'data.yaml'}" in args and "imgsz=64" in args
    assert "epochs=40" in args
    assert args[-4:] == [f"project={run.parent}", "name=run12", "exist_ok=true", "json=true"]
    assert "epochs=60" in build_argv(job, resume_dir=run, total_epochs=60)


def test_the_boot_id_comes_from_the_kernel_unless_a_test_sets_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(BOOT_ID_ENV, raising=False)
    real = boot_id()
    assert real is None or len(real) >= 32
    monkeypatch.setenv(BOOT_ID_ENV, "simulated")
    assert boot_id() == "simulated"


def test_a_new_box_resumes_to_the_jobs_epochs_or_says_the_job_is_done() -> None:
    # The job's epochs win over the ones the target's run was started for (issue 25.7).
    assert new_box_epochs(status(2, total=30), 3) == 3
    assert new_box_epochs(status(2, total=3), 30) == 30
    assert new_box_epochs(status(2, total=30), None) == 30  # the job leaves it to LibreYOLO
    assert new_box_epochs(None, 3) == 3  # no status.json on the target: the job's
    with pytest.raises(AlreadyDone, match="already trained 3 epochs and this job asks for 3"):
        new_box_epochs(status(3, total=30), 3)
    # A resumed run's final status.json counts its last invocation's epochs: the total is named.
    finished = RunStatus.from_dict(
        {"state": "completed", "completed_epochs": 1, "total_epochs": 30}
    )
    with pytest.raises(AlreadyDone, match=r"completed run \(30 epochs; this job asks for 60\)"):
        new_box_epochs(finished, 60)
    with pytest.raises(AlreadyDone, match=r"completed run \(30 epochs\); nothing to train"):
        new_box_epochs(finished, 30)
