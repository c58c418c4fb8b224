"""The daemon's side of "is this the right box?" (:mod:`agent.watch.sizing`,
:mod:`agent.watch.profiling`):
the optional ``[profile]`` pre-run between STAGING and TRAINING, the live samples of the first
epochs, the log line after epoch 1 ("this job: ~7.2 h, ~$25 on this box; verdict: ..."), the
``sizing`` key of ``/status``, and ``profile.on_verdict = "stop"``.

A stop ends the job with reason ``preflight_failed`` (cause ``sizing: ...``): like a failed
preflight, it says this box should not train this job, and its teardown policy
(``on_preflight_failure``, gated by the verified sync when a checkpoint exists) is the one that
fits: nothing worth keeping was trained.

A mixin of :class:`agent.daemon.spine.Daemon`; it never imports the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from agent.config.model import Env, Job, LimitsSection
from agent.events import EventBus
from agent.gpu.health import GpuMonitor
from agent.policy.limits import budget_view
from agent.state import RunState
from agent.trainer.process import TrainerProcess
from agent.trainer.rundir import RunStatus
from agent.watch.profiling import ProfileResult, run_profile
from agent.watch.sampling import ProcessSampler
from agent.watch.sizing import (
    Projection,
    SizingWatch,
    profile_seconds_per_epoch,
    project,
    sizing_status,
    stop_reason,
    summary_line,
    train_images,
)

log = logging.getLogger(__name__)


class SizingMixin:
    # Provided by the daemon.
    job: Job
    env: Env
    clock: Callable[[], float]
    state: RunState
    status: RunStatus | None
    trainer: TrainerProcess | None
    gpu: GpuMonitor | None
    events: EventBus
    staging_report: dict[str, Any] | None
    sizing: SizingWatch
    sizer: ProcessSampler | None
    projection: Projection | None
    profile_result: ProfileResult | None
    _sizing_said: str | None

    def limits(self) -> LimitsSection:
        raise NotImplementedError

    async def _read_price(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ before the long run

    async def _profile_gate(self) -> str | None:
        """``[profile]``: LibreYOLO's profiler on this card; the reason to stop (with
        ``on_verdict = "stop"``), else None. Never a fake verdict: where the profiler cannot
        run, the message says why and the first epochs' samples judge the box instead."""
        if not self.job.profile.enabled:
            return None
        await self._read_price()
        result = await run_profile(
            self.job, work_dir=self.env.state_dir / "profile", cpu_count=os.cpu_count()
        )
        self.profile_result = result
        log.info("profile: %s", result.message)
        doctor = (self.staging_report or {}).get("doctor")
        spe = (
            profile_seconds_per_epoch(result.img_per_s, train_images(doctor) or 0)
            if result.img_per_s
            else None
        )
        if spe is not None and self.job.train.epochs:
            self.projection = project(
                self.job.train.epochs, 0, spe, self.limits().price_usd_per_hour, self._spent()
            )
        why = stop_reason(
            result.verdict, self.projection, self.job.profile, self.limits().budget_usd
        )
        return f"sizing: {why}" if why else None

    # ------------------------------------------------------------------ during the run

    def _start_sizing(self) -> None:
        gpu = self.gpu
        self.sizer = ProcessSampler(
            gpu.samples if gpu is not None else list,
            lambda: self.trainer.pids() if self.trainer is not None else set(),
        )

    async def _sample_sizing(self) -> str | None:
        """One sample of the live run; after epoch 1 the log line (again when the verdict
        changes its mind). Returns the reason to stop under ``on_verdict = "stop"``."""
        if self.sizer is None:
            return None
        await asyncio.to_thread(self.sizing.sample, self.sizer, self.clock(), self.status)
        status = self.status
        spe = self.sizing.seconds_per_epoch()
        if status is None or status.completed_epochs < 1 or spe is None:
            return None
        verdict = self.sizing.verdict()
        total = status.total_epochs or self.job.train.epochs
        if total:
            price = self.limits().price_usd_per_hour
            self.projection = project(total, status.completed_epochs, spe, price, self._spent())
        if verdict.bound == self._sizing_said:
            return None
        self._sizing_said = verdict.bound
        line = summary_line(
            verdict,
            self.projection,
            self.job,
            price_known=self.limits().price_usd_per_hour is not None,
        )
        log.info("sizing: %s", line)
        if verdict.wrong_box:
            self.events.publish("warning", message=f"sizing: {line}")
        why = stop_reason(verdict, self.projection, self.job.profile, self.limits().budget_usd)
        return f"sizing: {why}" if why else None

    def _spent(self) -> float:
        view = budget_view(
            self.limits(), now=self.clock(), job_started_at=self.state.started_at, eta_s=None
        )
        return view.spent_usd if view is not None else 0.0

    def _sizing_status(self) -> dict[str, Any]:
        verdict = self.sizing.verdict() if self.sizer is not None else None
        profile = self.profile_result.to_dict() if self.profile_result is not None else None
        return sizing_status(verdict, self.projection, profile)
