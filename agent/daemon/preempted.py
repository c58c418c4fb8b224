"""A cloud taking the box back, as the TRAINING phase handles it: the watchers that deliver the
notice (AWS/GCP metadata, :mod:`agent.watch.preemption`), and what follows once the trainer was
stopped for one (``last.pt`` off the box, the preemption recorded, the wait for the box to go).

The notice itself only sets ``flags.preempt`` (and ``ctx.notice``); the training loop's next turn
saves ``last.pt`` and stops the trainer, then calls :func:`after_notice`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from agent.daemon.context import RunContext
from agent.watch.preemption import Notice, PreemptionWatcher, detect

log = logging.getLogger(__name__)

#: After a cloud preemption notice was handled, how long the agent waits for the box to go
#: before it decides the box survived and resumes training on it, seconds.
PREEMPT_SURVIVAL_S = 300.0
#: The longest the agent waits for ``last.pt`` to reach the target after a notice, seconds.
PREEMPT_UPLOAD_S = 120.0


def watch_notices(ctx: RunContext) -> None:
    """Preemption watchers (AWS/GCP metadata) for the job's lifetime on this box."""
    if ctx.watcher is not None:
        return
    sources = detect(ctx.job.preemption)
    if not sources:
        return

    def on_notice(notice: Notice) -> None:
        ctx.notice = notice
        ctx.flags.preempt.set()

    ctx.watcher = PreemptionWatcher(
        ctx.job.preemption, sources, on_notice=on_notice, clock=ctx.clock
    )
    log.info("watching for preemption notices: %s", ", ".join(sources))
    ctx.spawn(ctx.watcher.run(), "preemption")


async def after_notice(ctx: RunContext) -> bool:
    """The trainer was stopped after a notice: get ``last.pt`` off the box, record the
    preemption (the next boot resumes), then wait for the box to go. True: the box survived
    the notice, resume here; False: the agent exits (SIGTERM notice, or asked to)."""
    notice = ctx.notice
    ctx.state.preempted = {
        "at": ctx.clock(),
        "source": notice.source if notice else "?",
        "message": notice.message if notice else "",
    }
    ctx.save()
    if ctx.sync is not None:
        await ctx.save_now()
        await ctx.sync.drain(PREEMPT_UPLOAD_S)
    ctx.save()
    saved = ctx.sync.verified_remote("weights/last.pt") if ctx.sync is not None else None
    if saved is not None:
        what = f"last.pt saved (epoch {saved.epoch}, verified on the target)"
    elif ctx.sync is None:
        what = "no [sync] target: last.pt stays on this box only"
    else:
        what = "last.pt could NOT be saved to the target (see the sync errors above)"
    (log.warning if saved is not None else log.error)("preempted: %s", what)
    if notice is None or notice.source == "sigterm":
        log.warning("preempted: the agent exits and the next boot resumes")
        return False
    wait = PREEMPT_SURVIVAL_S
    if notice.action_at is not None:
        # The cloud's action time is wall-clock epoch seconds, as the injected clock is.
        wait = max(wait, notice.action_at - ctx.clock() + 120.0)
    log.warning("preempted: waiting up to %.0fs for the box to go", wait)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(ctx.flags.shutdown.wait(), wait)
    if ctx.flags.shutdown.is_set():
        return False
    log.warning("the box survived the preemption notice; resuming training on it")
    ctx.flags.preempt.clear()
    ctx.notice = None
    return True
