"""Launching and relaunching a trainer: the first launch (resuming from the sync target's
``last.pt`` when a new box picks up where the old one stopped), the resume after a trainer that
died (``last.pt`` fetched from the target when this box lost it), the backoff between resumes.

The rules (whether to resume at all) are :mod:`agent.policy.resume`'s; this is the daemon's side
of them. Each function takes the run context and returns its result: :func:`launch` the reason
when the launch failed, :func:`resume_or_not` a :class:`Relaunch`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent.daemon.context import RunContext
from agent.policy import resume
from agent.policy.resume import AlreadyDone
from agent.sinks import SinkError
from agent.state import Reason
from agent.trainer.outcome import Outcome, OutcomeKind
from agent.trainer.process import TrainerError, build_argv, start_once
from agent.trainer.rundir import read_status
from agent.util.text import os_error

if TYPE_CHECKING:
    from agent.staterecords import LaunchIntent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Relaunch:
    """What :func:`resume_or_not` did."""

    #: True: a new trainer runs; False: the run ends; None: the agent exits before the resume
    #: (state.json still holds the dead trainer, and the next agent decides again).
    resumed: bool | None
    #: The run's reason when it ends other than its outcome says (completed after all, a stop
    #: before the resume, a failed launch); None: the outcome's reason.
    reason: Reason | None = None


async def launch(ctx: RunContext, argv: list[str] | None = None) -> Reason | None:
    """Start the trainer, safe against this agent being killed at any instant
    (:func:`trainer.start_once`). Returns a reason only when the launch failed."""

    def record_intent(intent: LaunchIntent) -> None:
        ctx.state.launch = intent
        ctx.save(required=True)  # no launch that a restarted agent could not find

    if argv is None and ctx.state.launch is None and not ctx.state.resumes:
        try:
            argv = await resume_from_target(ctx)
        except AlreadyDone as exc:
            ctx.state.cause = str(exc)
            return Reason.COMPLETED
    if argv is None:
        argv = _reuse_empty_run_dir(ctx)
    try:
        ctx.trainer = await start_once(
            ctx.launcher,
            ctx.job,
            intent=ctx.state.launch,
            record_intent=record_intent,
            log_path=ctx.store.path("trainer.log"),
            result_path=ctx.store.path("trainer-result.json"),
            now=ctx.clock(),
            argv=argv,
        )
    except (TrainerError, OSError) as exc:
        message = str(exc) if isinstance(exc, TrainerError) else os_error(exc)
        ctx.state.cause = f"cannot start the trainer: {message}"
        log.error("%s", ctx.state.cause)
        return Reason.TRAINING_FAILED
    ctx.state.trainer = ctx.trainer.record
    ctx.save()
    used = argv or []
    ctx.events.publish(
        "training_started",
        total_epochs=ctx.job.train.epochs,
        resumed="resume=true" in used,
    )
    return None


async def resume_from_target(ctx: RunContext) -> list[str] | None:
    """A first launch on a box whose sync target already holds this job's ``last.pt`` (the
    old box is gone): download it and resume instead of training from scratch, which would
    overwrite the target's checkpoints. None: nothing there, train from scratch."""
    if ctx.sync is None:
        return None
    run_dir = ctx.job.job.runs_dir / ctx.job.job.name
    local_status = run_dir / "status.json"
    try:
        remote = await asyncio.to_thread(ctx.sync.sink.stat, "weights/last.pt")
        if remote is None:
            return None
        got = await asyncio.to_thread(ctx.sync.sink.download, "status.json", local_status)
    except SinkError as exc:
        # Not knowing must not block training (the target may be down for hours); a repo that
        # does not exist yet simply holds no earlier run.
        if "was not found" not in str(exc):
            log.warning(
                "cannot read the sync target to check for an earlier run of this job (%s); "
                "training from scratch: checkpoints an earlier box uploaded there would be "
                "overwritten",
                exc,
            )
        return None
    status = read_status(run_dir) if got is not None else None
    total = resume.new_box_epochs(status, ctx.job.train.epochs)  # AlreadyDone: nothing left
    if not await fetch_last_pt(ctx, run_dir):
        return None
    await _fetch_history(ctx, run_dir)
    started_for = status.total_epochs if status else None
    changed = total is not None and started_for is not None and started_for != total
    note = (
        f"; that run was started for {started_for} epochs, this job asks for {total}: it "
        f"ends at epoch {total}"
        if changed
        else ""
    )
    (log.warning if changed else log.info)(
        "the sync target holds this job's last.pt (epoch %s): resuming from it in %s%s",
        status.completed_epochs if status else "?",
        run_dir,
        note,
    )
    ctx.run_dir = run_dir
    ctx.state.resumes.append(
        {
            "at": ctx.clock(),
            "epoch": status.completed_epochs if status else None,
            "kind": "new_box",
            "message": f"resumed from the sync target's last.pt{note}",
        }
    )
    return _resume_argv(ctx, run_dir, total)


async def fetch_last_pt(ctx: RunContext, run_dir: Path) -> bool:
    """``run_dir/weights/last.pt`` is valid, or was fetched from the target and is now."""
    last = run_dir / "weights" / "last.pt"
    if await asyncio.to_thread(resume.valid_checkpoint, last):
        return True
    if ctx.sync is None:
        return False
    what = "is not a valid checkpoint" if last.exists() else "is missing"
    log.warning("%s %s; fetching the verified copy from the sync target", last, what)
    try:
        got = await asyncio.to_thread(ctx.sync.sink.download, "weights/last.pt", last)
    except SinkError as exc:
        log.error("cannot fetch last.pt from %s: %s", ctx.sync.sink.description, exc)
        return False
    if got is None or not await asyncio.to_thread(resume.valid_checkpoint, last):
        log.error("the sync target has no usable last.pt either")
        return False
    log.info("fetched last.pt (%d bytes, sha256 %s) from the target", got.size, got.sha256[:12])
    return True


async def _fetch_history(ctx: RunContext, run_dir: Path) -> None:
    """The earlier box's ``metrics.jsonl`` and ``results.csv``: LibreYOLO appends a resumed
    run's rows to them, so the copies this box uploads keep every epoch's row instead of
    replacing the target's history with the epochs trained here."""
    assert ctx.sync is not None
    for name in ("metrics.jsonl", "results.csv"):
        try:
            await asyncio.to_thread(ctx.sync.sink.download, name, run_dir / name)
        except SinkError as exc:
            log.warning(
                "cannot fetch %s from %s (%s): the target's copy will hold only the epochs "
                "trained from here on",
                name,
                ctx.sync.sink.description,
                exc,
            )


def _resume_argv(ctx: RunContext, run_dir: Path, total_epochs: int | None) -> list[str]:
    argv = getattr(ctx.launcher, "resume_argv", None)
    if callable(argv):
        result: list[str] = argv(ctx.job, run_dir, total_epochs)
        return result
    return build_argv(ctx.job, resume_dir=run_dir, total_epochs=total_epochs)


# ------------------------------------------------------------------ resuming


async def _backoff(ctx: RunContext, seconds: float) -> None:
    """Wait before a resume; a stop request or the agent exiting cuts it short."""
    events = (ctx.flags.shutdown, ctx.flags.stop_job)
    if seconds <= 0 or any(e.is_set() for e in events):
        return
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


async def resume_or_not(
    ctx: RunContext, outcome: Outcome | None, stop_reason: Reason | None
) -> Relaunch:
    """The trainer ended without a clean end (``outcome``; ``stop_reason`` when the agent
    stopped it): resume it (after the backoff, with the new trainer launched) or not (the run
    ends; the cause says why), or give way to the agent exiting before the resume (the next
    agent decides again)."""
    if outcome is None:
        return Relaunch(False)  # the launch itself failed: nothing to resume
    if stop_reason == Reason.DIVERGED or outcome.kind == OutcomeKind.DIVERGED:
        # NaN is deterministic: a resume from the same weights and options diverges again.
        return Relaunch(False, Reason.DIVERGED)
    cause: str | None = None
    if ctx.state.preempted:
        cause = "preempted"
    elif stop_reason == Reason.STALLED:
        cause = "stalled"
    elif ctx.rebooted:
        cause = "reboot"
    decision = resume.decide(
        outcome,
        ctx.status,
        cfg=ctx.limits(),
        resumes=ctx.state.resumes,
        stop_reason=None
        if stop_reason in (Reason.STALLED, Reason.PREEMPTED) or ctx.box_fault
        else stop_reason,
        box_fault=ctx.box_fault,
        cause=cause,
    )
    if decision.completed:
        log.info("%s", decision.why)
        ctx.state.cause = decision.why
        return Relaunch(False, Reason.COMPLETED)
    if not decision.resume:
        log.error("not resuming: %s", decision.why)
        ctx.state.cause = f"{ctx.state.cause}; not resumed: {decision.why}"
        return Relaunch(False)
    run_dir = ctx.run_dir
    epoch = ctx.status.completed_epochs if ctx.status else 0
    argv: list[str] | None = None
    if run_dir is not None and epoch > 0:
        if not await fetch_last_pt(ctx, run_dir):
            ctx.state.cause = (
                f"{ctx.state.cause}; not resumed: last.pt is missing or invalid and the "
                "sync target has no usable copy"
            )
            log.error("%s", ctx.state.cause)
            return Relaunch(False)
        total = ctx.status.total_epochs if ctx.status else None
        argv = _resume_argv(ctx, run_dir, total)
    log.warning("%s: relaunching in %.0fs", decision.why, decision.wait_s)
    ctx.events.publish(
        "resume",
        cause=cause or outcome.kind.value,
        epoch=ctx.status.completed_epochs if ctx.status else 0,
        why=decision.why,
    )
    # The backoff comes before anything is recorded: an agent that exits meanwhile leaves
    # the dead trainer in state.json, and the next agent takes the same decision afresh
    # (recording the resume first would count it twice: "the same failure twice").
    await _backoff(ctx, decision.wait_s)
    if ctx.flags.shutdown.is_set():
        log.info("agent exiting before the resume; the next agent resumes the trainer")
        return Relaunch(None)
    if ctx.flags.stop_job.is_set():
        ctx.state.cause = f"{ctx.state.cause}; stop requested before the resume"
        log.warning("stop requested: not resuming the trainer")
        return Relaunch(False, Reason.STOPPED_BY_USER)
    ctx.state.resumes.append(resume.death_record(outcome, ctx.status, now=ctx.clock(), cause=cause))
    ctx.state.trainer = None
    ctx.state.launch = None
    ctx.state.preempted = None
    ctx.state.outcome = None
    ctx.state.cause = None
    ctx.box_fault = None
    ctx.rebooted = False
    ctx.breach_message = None
    ctx.save()
    if argv is None:
        # Died before its first epoch: start it over, in the same run dir when known.
        argv = list(ctx.launcher.argv(ctx.job)) if run_dir is None else _fresh_argv_in(ctx, run_dir)
    failed = await launch(ctx, argv)
    if failed is not None:
        return Relaunch(False, failed)
    return Relaunch(True)


def _reuse_empty_run_dir(ctx: RunContext) -> list[str] | None:
    """A fresh launch whose run dir (``runs_dir/name``) is already there with no checkpoint in
    it (a trainer of this job that died before its first save, its pid never read back):
    train in it, with ``exist_ok=true``, instead of letting LibreYOLO make ``run12`` beside it
    (one job, one run dir). A dir with a checkpoint is left to LibreYOLO's rule: nothing in it
    is overwritten. None: the plain command line."""
    run_dir = ctx.job.job.runs_dir / ctx.job.job.name
    try:
        if not run_dir.is_dir() or any((run_dir / "weights").glob("*.pt")):
            return None
    except OSError:
        return None
    log.warning(
        "%s is already there with no checkpoint (a trainer of this job that ended before its "
        "first save): training in it instead of beside it",
        run_dir,
    )
    return _fresh_argv_in(ctx, run_dir)


def _fresh_argv_in(ctx: RunContext, run_dir: Path) -> list[str]:
    argv = list(ctx.launcher.argv(ctx.job))
    return [a for a in argv if not a.startswith("name=")] + [
        f"name={run_dir.name}",
        "exist_ok=true",
    ]
