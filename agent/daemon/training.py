"""The TRAINING phase: launch (or re-attach to, or resume) the trainer, follow it, sync its
milestones, and stop it when a limit, a stall, a GPU fault, a preemption notice or a person says so.

One turn of the loop wakes on an event (a file change in the run dir, the trainer's exit, a stop
request, a notice) or on the poll interval. Each turn reads the run dir, feeds new epochs to the
sync policy, and checks, in order: a stop request, a preemption notice, divergence (NaN/inf
losses or weights: :mod:`agent.daemon.diverge`), a GPU fault, the stall verdict
(:mod:`agent.watch.progress`), the disk (:mod:`agent.watch.disk`), then the deadline and budget
with the final sync's reserve kept (:mod:`agent.policy.limits`). When the trainer has ended
without a clean end, :mod:`agent.policy.resume` decides whether it goes on from its ``last.pt``;
a diverged run never does.

One :class:`Training` per run: it owns what only this phase needs (the followed trainer's exit,
its outcome, the turn count, the budget warner); what the other phases read (the state, the run
directory, the last status, a box fault) is on the run context. Launching and resuming are
:mod:`agent.daemon.relaunch`'s, a preemption notice's aftermath :mod:`agent.daemon.preempted`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from agent.daemon.context import RunContext
from agent.daemon.diverge import DivergenceWatch
from agent.daemon.doctor import DoctorBeside
from agent.daemon.preempted import after_notice, watch_notices
from agent.daemon.relaunch import launch, resume_or_not
from agent.daemon.sizingrun import SizingRun
from agent.policy.limits import BudgetWarner, budget_view, check_limits, finish_reserve_s
from agent.state import Reason
from agent.trainer.exitwait import unless_exited
from agent.trainer.outcome import Outcome, OutcomeKind, classify, read_result
from agent.trainer.rundir import (
    RunStatus,
    find_dead_run_dir,
    find_run_dir,
    read_status,
    run_dir_from_result,
)
from agent.util.text import format_duration
from agent.util.watch import RunWatcher
from agent.watch import disk as diskwatch
from agent.watch.progress import ProgressTracker

log = logging.getLogger(__name__)
T = TypeVar("T")
U = TypeVar("U")


class Training:
    """The TRAINING phase of one run (:meth:`run`), resumes included."""

    def __init__(self, ctx: RunContext, doctor: DoctorBeside, sizing: SizingRun) -> None:
        self.ctx = ctx
        self.doctor = doctor
        self.sizing = sizing
        #: Turns of the loop (each a wake-up: an event, a file change or the poll).
        self.loop_turns = 0
        #: The wait for the followed trainer's exit, while it is followed (:meth:`_observed`).
        self.exit_task: asyncio.Future[Any] | None = None
        #: The last trainer's exit code and outcome (None: none ran, or the launch failed).
        self.exit_code: int | None = None
        self.outcome: Outcome | None = None
        #: The trainer said completed and did not exit: it was killed, the run counts as done.
        self.hung_at_exit = False
        self.budget = BudgetWarner()
        #: NaN/inf in the losses or the checkpoints (agent/daemon/diverge.py).
        self.diverge = DivergenceWatch(ctx)

    # ------------------------------------------------------------------ the phase

    async def run(self) -> Reason | None:
        """Supervise until the training ends for good: resumes included. Returns the reason it
        ended, or None when the agent itself is exiting (the trainer, if any, goes on)."""
        try:
            return await self._run()
        finally:
            await self.diverge.close()

    async def _run(self) -> Reason | None:
        ctx = self.ctx
        watch_notices(ctx)
        while True:
            followed = await self._supervise_once()
            if isinstance(followed, _Exiting):
                return None
            if isinstance(followed, LaunchFailed):
                # Nothing ran: a target that holds the finished run (completed), or a launch
                # that could not start (training_failed); the cause is already set.
                return followed.reason
            stop_reason = followed
            if stop_reason is None and self.exit_code != 0:
                bad_data = await self.doctor.after_exit()
                if bad_data is not None:
                    ctx.breach_message = bad_data
                    stop_reason = Reason.PREFLIGHT_FAILED
            reason = self._classify_and_reason(self.exit_code, stop_reason)
            if reason in _MAY_HAVE_DIVERGED:
                reason = await self._diverged_or(reason)
            if reason == Reason.PREEMPTED:
                if not await after_notice(ctx):
                    return None
            elif reason != Reason.TRAINING_FAILED and reason != Reason.STALLED:
                return reason
            relaunch = await resume_or_not(ctx, self.outcome, stop_reason)
            if relaunch.resumed is None:
                return None  # the agent is exiting; state.json still holds the dead trainer
            if not relaunch.resumed:
                return relaunch.reason or reason

    async def _diverged_or(self, reason: Reason) -> Reason:
        """``diverged`` when the losses or the weights went NaN/inf (whether the agent stopped
        the trainer for it, or it exited 0 through NaN, or crashed on NaN), with the last good
        checkpoint queued for the target; else ``reason``."""
        ctx = self.ctx
        verdict = await self.diverge.after_exit(ctx.run_dir, self.outcome)
        if verdict is None:
            return reason
        await self.diverge.keep_last_good()
        if reason != Reason.DIVERGED:
            self.outcome = Outcome(OutcomeKind.DIVERGED, self.exit_code, verdict.why)
            ctx.state.outcome = self.outcome.to_dict()
            ctx.events.publish("warning", message=f"diverged at epoch {verdict.epoch}")
        ctx.state.cause = self.diverge.cause()
        log.error("%s", ctx.state.cause)
        ctx.save()
        return Reason.DIVERGED

    # ------------------------------------------------------------------ one trainer

    async def _supervise_once(self) -> Reason | LaunchFailed | _Exiting | None:
        """Follow one trainer to its end. Returns the agent's own stop reason (None when the
        trainer ended by itself), ``_EXITING`` when the agent is exiting, or why the launch
        failed."""
        ctx = self.ctx
        flags = ctx.flags
        self.exit_code = None
        started = await self._trainer_to_follow()
        if started is None or isinstance(started, LaunchFailed):
            return started  # the previous agent's trainer is gone, or none could start
        launched_at = started
        trainer = ctx.trainer
        assert trainer is not None
        if ctx.progress is not None:
            ctx.progress.start(ctx.clock())

        changed = asyncio.Event()
        watcher = RunWatcher(asyncio.get_running_loop(), changed)
        watcher.watch(ctx.job.job.runs_dir)
        if ctx.run_dir is not None:
            watcher.watch(ctx.run_dir)
        exit_task = asyncio.ensure_future(trainer.wait())
        self.exit_task = exit_task
        stop_reason: Reason | None = None
        stop_task: asyncio.Future[str] | None = None
        completed_seen: float | None = None
        self.hung_at_exit = False
        try:
            while True:
                self.loop_turns += 1
                await self._follow(launched_at)
                if exit_task.done():
                    break
                if stop_task is None:
                    stop_reason = await self._check_turn()
                    if stop_reason is None and ctx.status and ctx.status.state == "completed":
                        completed_seen = completed_seen or ctx.clock()
                        if ctx.clock() - completed_seen >= ctx.limits().exit_grace_s:
                            log.warning(
                                "status.json says completed but the trainer has not exited in "
                                "%.0fs: killing it (hung at exit); the run counts as completed",
                                ctx.limits().exit_grace_s,
                            )
                            self.hung_at_exit = True
                            stop_task = asyncio.ensure_future(self._stop_trainer())
                    if stop_reason is not None:
                        stop_task = asyncio.ensure_future(self._stop_trainer())
                if flags.shutdown.is_set() and stop_task is None:
                    if not ctx.job.job.stop_trainer_on_exit:
                        log.info(
                            "agent exiting; trainer pid=%d keeps running (run the agent again "
                            "to re-attach)",
                            trainer.pid,
                        )
                        return _EXITING
                    stop_reason = Reason.STOPPED_BY_USER
                    stop_task = asyncio.ensure_future(self._stop_trainer())
                await self._wait_turn(exit_task, changed, stop_task)
                changed.clear()
            if stop_task is not None:
                await stop_task
        finally:
            watcher.stop()
            self.exit_task = None
            if not exit_task.done():
                exit_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await exit_task
        self.exit_code = trainer.exit_code
        await self._follow(launched_at)
        return stop_reason

    async def _trainer_to_follow(self) -> float | LaunchFailed | None:
        """Make ``ctx.trainer`` the trainer to follow and return when it was launched: this
        agent's own (a resume), the previous agent's (re-attached) or a new one. None: the
        previous agent's trainer is gone (what its run wrote is read); or why no trainer could
        start."""
        ctx = self.ctx
        if ctx.trainer is not None and ctx.trainer.record is ctx.state.trainer:
            # Launched by this agent (a resume, in relaunch.resume_or_not): follow it as our child.
            # Re-attaching would lose its exit code and leave it a zombie nobody reaps.
            return ctx.state.trainer.started_at
        if ctx.state.trainer is not None:
            ctx.trainer = None if ctx.rebooted else ctx.launcher.attach(ctx.state.trainer)
            if ctx.trainer is None:
                why = "the box rebooted" if ctx.rebooted else "it is gone"
                log.warning(
                    "trainer pid=%d from the previous agent: %s; reading what its run wrote",
                    ctx.state.trainer.pid,
                    why,
                )
                self._find_dead_run_dir()
                if ctx.run_dir is not None:
                    ctx.status = read_status(ctx.run_dir) or ctx.status
                return None
            return ctx.state.trainer.started_at
        failed = await launch(ctx)
        if failed is not None:
            self.outcome = None
            return LaunchFailed(failed)
        assert ctx.state.trainer is not None
        return ctx.state.trainer.started_at

    async def _wait_turn(
        self,
        exit_task: asyncio.Future[Any],
        changed: asyncio.Event,
        stop_task: asyncio.Future[str] | None,
    ) -> None:
        ctx = self.ctx
        flags = ctx.flags
        # Only events that have not fired yet: a set Event's wait() returns at once, and waiting
        # on it would spin this loop until the trainer is gone.
        waiters: set[asyncio.Future[Any]] = {exit_task}
        waiters.add(asyncio.ensure_future(changed.wait()))
        if stop_task is None:
            for event in (flags.stop_job, flags.preempt):
                if not event.is_set():
                    waiters.add(asyncio.ensure_future(event.wait()))
        if not flags.shutdown.is_set():
            waiters.add(asyncio.ensure_future(flags.shutdown.wait()))
        if stop_task is None and not self.diverge.changed.is_set():
            waiters.add(asyncio.ensure_future(self.diverge.changed.wait()))
        doctor = self.doctor.waiter() if stop_task is None else None
        if doctor is not None:
            waiters.add(doctor)
        try:
            await asyncio.wait(
                waiters, timeout=ctx.poll_interval_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waiters:
                if w is not exit_task and not w.done():
                    w.cancel()

    async def _check_turn(self) -> Reason | None:
        """The first reason to stop the trainer this turn, in order of urgency; None: go on."""
        ctx = self.ctx
        if ctx.flags.stop_job.is_set():
            return Reason.STOPPED_BY_USER
        if ctx.flags.preempt.is_set():
            notice = ctx.notice
            ctx.breach_message = f"preempted: {notice.message if notice else 'notice'}"
            log.warning("%s: saving last.pt now, then stopping the trainer", ctx.breach_message)
            ctx.events.publish(
                "preempted",
                source=notice.source if notice else "?",
                message=notice.message if notice else "",
            )
            await ctx.save_now()
            return Reason.PREEMPTED
        diverged = await self.diverge.poll(ctx.run_dir)
        if diverged is not None:
            ctx.breach_message = f"diverged at epoch {diverged.epoch}: {diverged.why}"
            log.error(
                "%s: stopping the trainer (a diverged run is not resumed)", ctx.breach_message
            )
            ctx.events.publish("warning", message=ctx.breach_message)
            return Reason.DIVERGED
        bad_data = self.doctor.verdict()
        if bad_data is not None:
            ctx.breach_message = bad_data
            # The doctor's findings were logged as it reported them (staging.check_data).
            log.info("stopping the trainer: the dataset doctor found errors")
            return Reason.PREFLIGHT_FAILED
        if ctx.gpu is not None and ctx.box_fault is None:
            read = asyncio.ensure_future(asyncio.to_thread(ctx.gpu.faults))
            faults = await self._observed(read, None)
            if faults is None:  # a clean exit came first: what the read finds is kept for later
                read.add_done_callback(self._late_faults)
            elif faults:
                ctx.box_fault = "; ".join(f.message for f in faults)
                ctx.breach_message = f"GPU fault: {ctx.box_fault}"
                log.error("%s: stopping the run (a box fault)", ctx.breach_message)
                ctx.events.publish("warning", message=ctx.breach_message)
                await ctx.save_now()
                return Reason.TRAINING_FAILED
        if ctx.disk_stop is not None:
            ctx.breach_message = ctx.disk_stop  # it says "disk full: ..." itself
            return Reason.DISK_FULL
        if ctx.progress is not None:
            observed = await self._observed(self._observe_progress(ctx.progress), False)
            # Not observed: the run completed, and the tracker may still be in its thread.
            stall = ctx.progress.verdict() if observed else None
            if stall is not None:
                ctx.breach_message = f"stalled: {stall.message}"
                log.warning("%s; uploading what exists, then stopping the trainer", stall.message)
                ctx.events.publish("stall", message=stall.message)
                await ctx.save_now()
                return Reason.STALLED
        wrong_box = await self._observed(self.sizing.sample(), None)
        if wrong_box is not None:
            ctx.breach_message = wrong_box
            log.error("%s: stopping the trainer", wrong_box)
            return Reason.PREFLIGHT_FAILED
        reserve = reserve_s(ctx)
        cfg = ctx.limits()
        now = ctx.clock()
        breach = check_limits(
            cfg,
            now=now,
            job_started_at=ctx.state.started_at,  # stalls are the progress tracker's (above)
            extended_s=ctx.state.extended_s,
            reserve_s=reserve,
        )
        warning = self.budget.update(
            budget_view(
                cfg,
                now=now,
                job_started_at=ctx.state.started_at,
                eta_s=ctx.status.eta_seconds if ctx.status else None,
                reserve_s=reserve,
            )
        )
        if warning is not None:
            ctx.events.publish("warning", message=warning)
        if breach is not None:
            ctx.breach_message = breach.message
            log.warning("limit reached: %s", breach.message)
            ctx.events.publish("warning", message=f"limit reached: {breach.message}")
            return breach.reason
        return None

    async def _observed(self, work: Awaitable[T], gone: U) -> T | U:
        """This turn's observation (NVML through its host, the progress sample, the sizing
        sample), unless the followed trainer exits cleanly first (:func:`unless_exited`)."""
        return await unless_exited(work, self.exit_task, gone)

    def _late_faults(self, read: asyncio.Future[list[Any]]) -> None:
        """The GPU health read the trainer's clean exit did not wait for: a fault it found is
        still recorded (the teardown record says the box is bad)."""
        ctx = self.ctx
        if read.cancelled() or read.exception() is not None:
            return
        faults = read.result()
        if faults and ctx.box_fault is None:
            ctx.box_fault = "; ".join(f.message for f in faults)
            log.error("GPU fault seen as the trainer exited: %s", ctx.box_fault)
            ctx.events.publish("warning", message=f"GPU fault: {ctx.box_fault}")

    async def _observe_progress(self, progress: ProgressTracker) -> bool:
        ctx = self.ctx
        await asyncio.to_thread(
            progress.observe,
            status=ctx.status,
            log_paths=self._log_paths(),
            run_dir=ctx.run_dir,
            pids=ctx.trainer.pids() if ctx.trainer else set(),
        )
        return True

    def _log_paths(self) -> list[Path]:
        ctx = self.ctx
        paths = [ctx.store.path("trainer.log")]
        if ctx.run_dir is not None:
            paths.append(ctx.run_dir / "train.log")
        return paths

    async def _check_disk(self) -> str | None:
        """After an epoch: make room for the next checkpoint, or say why the run must stop."""
        ctx = self.ctx
        if ctx.run_dir is None:
            return None
        sync = ctx.sync
        verdict = await asyncio.to_thread(
            diskwatch.check_disk,
            ctx.run_dir,
            is_verified=sync.is_verified if sync is not None else (lambda _p: False),
        )
        return verdict.stop_message

    # ------------------------------------------------------------------ reading the run

    def _find_dead_run_dir(self) -> None:
        """The trainer died with the previous agent: its run dir from the state file, else by
        the pid its status.json names, else from its json result."""
        ctx = self.ctx
        rec = ctx.state.trainer
        if ctx.run_dir is not None or rec is None:
            return
        result = read_result(ctx.store.path("trainer-result.json"))
        ctx.run_dir = find_dead_run_dir(ctx.job.job.runs_dir, rec.pid, rec.started_at, result)
        if ctx.run_dir is not None:
            log.info("run directory of the dead trainer: %s", ctx.run_dir)
            rec.run_dir = str(ctx.run_dir)
            ctx.save()

    async def _stop_trainer(self) -> str:
        ctx = self.ctx
        assert ctx.trainer is not None
        sent = await ctx.trainer.stop(
            stop_grace_s=ctx.job.train.stop_grace_s, kill_grace_s=ctx.job.train.kill_grace_s
        )
        log.info("trainer stopped (%s)", sent)
        return sent

    def _classify_and_reason(self, exit_code: int | None, stop_reason: Reason | None) -> Reason:
        ctx = self.ctx
        result = read_result(ctx.store.path("trainer-result.json"))
        if ctx.run_dir is None and ctx.state.trainer is not None:
            ctx.run_dir = run_dir_from_result(result)
        if ctx.run_dir is not None:
            ctx.status = read_status(ctx.run_dir) or ctx.status
        outcome = classify(exit_code, ctx.status, result, stop_requested=stop_reason is not None)
        if self.hung_at_exit:
            outcome = Outcome(
                OutcomeKind.COMPLETED, exit_code, "training completed; killed while hung at exit"
            )
        self.outcome = outcome
        ctx.state.outcome = outcome.to_dict()
        log.info("trainer outcome: %s (%s)", outcome.kind, outcome.message)
        reason, ctx.state.cause = outcome.reason(stop_reason, ctx.breach_message)
        trained = bool(ctx.status and ctx.status.completed_epochs) or bool(ctx.state.resumes)
        if reason == Reason.TRAINING_FAILED and outcome.kind == OutcomeKind.CONFIG and not trained:
            reason = Reason.PREFLIGHT_FAILED  # LibreYOLO refused the job before epoch 1
        return reason

    async def _follow(self, launched_at: float) -> None:
        """Read the run dir (found by pid) and feed new epochs to the sync policy."""
        ctx = self.ctx
        self.doctor.when_started(status_seen=False, since_launch_s=ctx.clock() - launched_at)
        if ctx.run_dir is None and ctx.trainer is not None:
            ctx.run_dir = find_run_dir(
                ctx.job.job.runs_dir, ctx.trainer.pids(), newer_than=launched_at - 5
            )
            if ctx.run_dir is not None:
                log.info("run directory: %s", ctx.run_dir)
                if ctx.state.trainer is not None:
                    ctx.state.trainer.run_dir = str(ctx.run_dir)
                ctx.save()
        if ctx.run_dir is None:
            return
        if ctx.sync is not None:
            ctx.sync.follow(ctx.run_dir)
        status = read_status(ctx.run_dir)
        if status is None:
            return
        self.doctor.when_started(status_seen=True, since_launch_s=0.0)
        previous = ctx.status
        ctx.status = status
        if previous is None or status.completed_epochs != previous.completed_epochs:
            if previous is not None:
                ctx.state.crashes.clear()  # an epoch went by: whatever crashed was survivable
            if status.completed_epochs == 0:
                log.info("training started (%s epochs)", status.total_epochs)
                ctx.save()
                return
            log.info(
                "epoch %d/%s done%s",
                status.completed_epochs,
                status.total_epochs,
                epoch_eta(status),
            )
            self._publish_epoch(status, previous)
            self.diverge.on_epoch(ctx.run_dir)
            if ctx.sync is not None:
                await ctx.sync.on_epoch(ctx.run_dir, status, extra_files=ctx.agent_files())
            stop = await self._check_disk()
            if stop is not None and ctx.disk_stop is None:
                log.error("%s", stop)
                ctx.events.publish("warning", message=stop)
                ctx.disk_stop = stop
            ctx.save()

    def _publish_epoch(self, status: RunStatus, previous: RunStatus | None) -> None:
        ctx = self.ctx
        raw = status.raw
        metric_name = raw.get("current_metric_name") or raw.get("best_metric_name")
        ctx.events.publish(
            "epoch",
            epoch=status.completed_epochs,
            total_epochs=status.total_epochs,
            eta_s=status.eta_seconds,
            loss=raw.get("train_loss"),
            metric=raw.get("current_metric"),
            metric_name=metric_name,
        )
        if status.best_epoch is not None and (
            previous is None or previous.best_epoch != status.best_epoch
        ):
            ctx.events.publish(
                "best",
                epoch=status.best_epoch,
                metric=status.best_metric,
                metric_name=raw.get("best_metric_name"),
            )


def reserve_s(ctx: RunContext) -> float:
    """Time to keep before a deadline for the final sync (agent/policy/limits.py); none without
    a sync target (nothing to get off the box)."""
    if ctx.sync is None:
        return 0.0
    final = 0
    if ctx.run_dir is not None:
        for name in ("last.pt", "best.pt"):
            with contextlib.suppress(OSError):
                final += (ctx.run_dir / "weights" / name).stat().st_size
    uploads = ctx.sync.uploads if ctx.sync is not None else None
    return finish_reserve_s(
        ctx.limits(),
        upload_bytes_per_s=uploads.bytes_per_s if uploads else None,
        final_bytes=final,
        pending_bytes=uploads.pending_bytes if uploads else 0,
    )


#: Reasons a run that diverged may first be classified as: the agent's stop for it, an exit 0
#: through NaN, a crash on NaN (exit 1), a trainer stalled on NaN.
_MAY_HAVE_DIVERGED = frozenset(
    {Reason.DIVERGED, Reason.COMPLETED, Reason.TRAINING_FAILED, Reason.STALLED}
)


@dataclass(frozen=True)
class LaunchFailed:
    """``_supervise_once``: no trainer ran; the run's reason (completed: the target holds the
    finished run; training_failed: it could not start)."""

    reason: Reason


class _Exiting:
    """``_supervise_once``: the agent is exiting and the trainer goes on."""


_EXITING = _Exiting()


def epoch_eta(status: RunStatus) -> str:
    """What follows "epoch N/M done" in the log: `` (eta 2m5s)``, `` (the last)``, or nothing
    where LibreYOLO gave no estimate."""
    if status.total_epochs is not None and status.completed_epochs >= status.total_epochs:
        return " (the last)"
    if status.eta_seconds is None or not 0 <= status.eta_seconds < math.inf:  # NaN included
        return ""
    return f" (eta {format_duration(status.eta_seconds)})"
