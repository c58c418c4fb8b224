"""Before the trainer: PREFLIGHT (the full preflight, with the trainer's Python warmed up beside
the GPU probe) and STAGING (the dataset downloaded and checked, possibly while the probe runs).

One :class:`Preparation` per run, over the run context; each step returns whether it passed
(the cause is in the state when it did not). The always-run checks are
:mod:`agent.daemon.essentials`'s, the profile before the long run :mod:`agent.daemon.sizingrun`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from agent.daemon.context import RunContext
from agent.daemon.doctor import DoctorBeside, runs_beside
from agent.data import staging
from agent.trainer.process import ProcessLauncher

if TYPE_CHECKING:
    from agent.trainer.warmstart import WarmStart

log = logging.getLogger(__name__)


class Preparation:
    """PREFLIGHT and STAGING of one run."""

    def __init__(self, ctx: RunContext, doctor: DoctorBeside) -> None:
        self.ctx = ctx
        #: Queued by a staging that passed when the doctor runs beside the trainer.
        self.doctor = doctor
        #: The warm trainer started early (:meth:`start_warm`), until preflight takes it.
        self.warm: WarmStart | None = None

    def start_warm(self) -> None:
        """Start the warm trainer now, before the agent's own start-up (its HTTP server, the
        sync target's recovery, the provider and target checks) is done: its probe, torch's
        import and CUDA's start-up, is the longest step before the first epoch, and it needs
        none of those. Preflight reads its report; :meth:`drop_early_warm` calls it off when the job
        ends before preflight."""
        self.warm = self._new_warm()
        if self.warm is not None:
            self.warm.start()

    def _new_warm(self) -> WarmStart | None:
        """The warm start of this job's first trainer, not started (None: it starts cold)."""
        ctx = self.ctx
        launcher = ctx.launcher
        if not (ctx.job.preflight.warm_start and isinstance(launcher, ProcessLauncher)):
            return None
        from agent.trainer.warmstart import for_job

        return for_job(
            ctx.job,
            launcher,
            log_path=ctx.store.path("trainer.log"),
            result_path=ctx.store.path("trainer-result.json"),
        )

    async def drop_early_warm(self) -> None:
        """Call off a warm trainer started early that preflight did not take."""
        warm, self.warm = self.warm, None
        if warm is not None:
            await asyncio.shield(warm.abort())

    async def preflight(self, may_stage: asyncio.Event) -> bool:
        """The full preflight; ``may_stage`` is set once the disk and Hub checks passed (the
        dataset is staged while the GPU probe runs). False: it failed (the cause is set)."""
        from agent import preflight

        ctx = self.ctx

        def storage_checked(ok: bool) -> None:
            if ok:
                log.info(
                    "disk and Hub checks passed: the dataset is staged and checked while "
                    "the GPU probe runs"
                )
                may_stage.set()

        launcher = ctx.launcher
        warm, self.warm = self.warm, None  # started early (start_warm), else started now
        if warm is None:
            warm = self._new_warm()
        cause: str | None = "preflight did not finish"
        try:
            report, cause = await preflight.run_and_log(
                ctx.job,
                ctx.env,
                on_storage_checked=storage_checked,
                probe_runner=warm.probe if warm is not None else None,
            )
        finally:
            if warm is not None and cause is None:
                # Passed: the trainer's Python waits for its command line (the launch).
                assert isinstance(launcher, ProcessLauncher)
                launcher.warm = warm
            elif warm is not None:
                await asyncio.shield(warm.abort())
        ctx.preflight_report = report.to_dict()
        ctx.store.write_report("preflight.json", ctx.preflight_report)
        if cause is not None:
            ctx.state.cause = cause
        return cause is None

    async def staging(self, *, after: asyncio.Event | None = None) -> bool:
        """Stage the dataset (once ``after`` is set, when given); False: it failed (the cause
        is set). With the doctor beside the trainer, a staging that passed queues it."""
        ctx = self.ctx
        if after is not None:
            await after.wait()
        stop = (ctx.flags.shutdown, ctx.flags.stop_job)
        beside = runs_beside(ctx.job)
        outcome = await staging.stage(
            ctx.job,
            ctx.env,
            hook=ctx.stage_hook,
            stop=stop,
            doctor=False if beside else None,
        )
        if outcome.cause is not None:
            ctx.state.cause = outcome.cause
        if outcome.report is not None:
            ctx.staging_report = outcome.report
            ctx.store.write_report("staging.json", outcome.report)
        if outcome.ok and beside and not any(e.is_set() for e in stop):
            self.doctor.queue(outcome.report)  # agent/daemon/doctor.py: the trainer need not wait
        return outcome.ok


async def drop_warm(ctx: RunContext) -> None:
    """Call off a warm trainer that will not be launched (the job ends before training)."""
    launcher = ctx.launcher
    if isinstance(launcher, ProcessLauncher) and launcher.warm is not None:
        warm, launcher.warm = launcher.warm, None
        await warm.abort()


async def abandon(task: asyncio.Task[bool]) -> None:
    """Stop waiting for a staging that is no longer wanted (a failed preflight, an agent
    exiting). A download already running in its thread cannot be interrupted: it ends on its
    own and its result is dropped; staging is idempotent, so a later run reuses or redoes it."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
