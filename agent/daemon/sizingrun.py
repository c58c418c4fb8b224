"""The daemon's side of "is this the right box?" (:mod:`agent.watch.sizing`,
:mod:`agent.watch.profiling`):
the optional ``[profile]`` pre-run between STAGING and TRAINING, the live samples of the first
epochs, the log line after epoch 1 ("this job: ~7.2 h, ~$25 on this box; verdict: ..."), the
``sizing`` key of ``/status``, and ``profile.on_verdict = "stop"``.

A stop ends the job with reason ``preflight_failed`` (cause ``sizing: ...``): like a failed
preflight, it says this box should not train this job, and its teardown policy
(``on_preflight_failure``, gated by the verified sync when a checkpoint exists) is the one that
fits: nothing worth keeping was trained.

One :class:`SizingRun` per run: it owns the samples, the projection and the profile's result;
the daemon's phases ask it and the status document reads it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from agent.daemon.context import RunContext
from agent.policy.limits import budget_view
from agent.watch.profiling import ProfileResult, run_profile
from agent.watch.sampling import ProcessSampler
from agent.watch.sizing import (
    Projection,
    SizingWatch,
    job_gpu_indices,
    job_workers,
    profile_seconds_per_epoch,
    project,
    sizing_status,
    stop_reason,
    summary_line,
    train_images,
)

log = logging.getLogger(__name__)


class SizingRun:
    """ "Is this the right box?" for one run: the profile before it, the samples during it."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.watch = SizingWatch(gpu_indices=job_gpu_indices(ctx.job), workers=job_workers(ctx.job))
        #: Samples the trainer's processes (None until training starts).
        self.sampler: ProcessSampler | None = None
        self.projection: Projection | None = None
        self.profile_result: ProfileResult | None = None
        #: The verdict last logged (logged again only when it changes its mind).
        self.said: str | None = None

    # ------------------------------------------------------------------ before the long run

    async def profile_gate(self) -> str | None:
        """``[profile]``: LibreYOLO's profiler on this card; the reason to stop (with
        ``on_verdict = "stop"``), else None. Never a fake verdict: where the profiler cannot
        run, the message says why and the first epochs' samples judge the box instead."""
        ctx = self.ctx
        job = ctx.job
        if not job.profile.enabled:
            return None
        await ctx.read_price()
        result = await run_profile(
            job, work_dir=ctx.env.state_dir / "profile", cpu_count=os.cpu_count()
        )
        self.profile_result = result
        log.info("profile: %s", result.message)
        doctor = (ctx.staging_report or {}).get("doctor")
        spe = (
            profile_seconds_per_epoch(result.img_per_s, train_images(doctor) or 0)
            if result.img_per_s
            else None
        )
        if spe is not None and job.train.epochs:
            self.projection = project(
                job.train.epochs, 0, spe, ctx.limits().price_usd_per_hour, self._spent()
            )
        why = stop_reason(result.verdict, self.projection, job.profile, ctx.limits().budget_usd)
        return f"sizing: {why}" if why else None

    # ------------------------------------------------------------------ during the run

    def start(self) -> None:
        """Sample the GPUs (when watched) and the trainer's processes from now on."""
        ctx = self.ctx
        gpu = ctx.gpu
        self.sampler = ProcessSampler(
            gpu.samples if gpu is not None else list,
            lambda: ctx.trainer.pids() if ctx.trainer is not None else set(),
        )

    async def sample(self) -> str | None:
        """One sample of the live run; after epoch 1 the log line (again when the verdict
        changes its mind). Returns the reason to stop under ``on_verdict = "stop"``."""
        if self.sampler is None:
            return None
        ctx = self.ctx
        await asyncio.to_thread(self.watch.sample, self.sampler, ctx.clock(), ctx.status)
        status = ctx.status
        spe = self.watch.seconds_per_epoch()
        if status is None or status.completed_epochs < 1 or spe is None:
            return None
        verdict = self.watch.verdict()
        total = status.total_epochs or ctx.job.train.epochs
        if total:
            price = ctx.limits().price_usd_per_hour
            self.projection = project(total, status.completed_epochs, spe, price, self._spent())
        if verdict.bound == self.said:
            return None
        self.said = verdict.bound
        line = summary_line(
            verdict,
            self.projection,
            ctx.job,
            price_known=ctx.limits().price_usd_per_hour is not None,
        )
        log.info("sizing: %s", line)
        if verdict.wrong_box:
            ctx.events.publish("warning", message=f"sizing: {line}")
        why = stop_reason(verdict, self.projection, ctx.job.profile, ctx.limits().budget_usd)
        return f"sizing: {why}" if why else None

    def _spent(self) -> float:
        ctx = self.ctx
        view = budget_view(
            ctx.limits(), now=ctx.clock(), job_started_at=ctx.state.started_at, eta_s=None
        )
        return view.spent_usd if view is not None else 0.0

    def status(self) -> dict[str, Any]:
        """The ``sizing`` key of ``/status``."""
        verdict = self.watch.verdict() if self.sampler is not None else None
        profile = self.profile_result.to_dict() if self.profile_result is not None else None
        return sizing_status(verdict, self.projection, profile)
