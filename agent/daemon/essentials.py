"""The checks every job passes before training, even with ``[preflight] enabled = false``
(:mod:`agent.preflight.canary` says what each proves), as the daemon runs them: the provider
(when the full preflight, which has its own, is off), the target's canary and the guard's plan;
a failure is recorded and reported, and the caller tears the box down as ``preflight_failed``."""

from __future__ import annotations

import logging
import time

from agent.daemon.context import RunContext
from agent.preflight.canary import target_check
from agent.preflight.cloud import PROVIDER_TIMEOUT_S, provider_check
from agent.preflight.guardplan_check import guard_plan_check
from agent.preflight.report import FAIL, Check, PreflightReport

log = logging.getLogger(__name__)


async def essential_checks(ctx: RunContext) -> list[Check]:
    """The provider (only when the full preflight, which has its own, is off) and the target."""
    job, env = ctx.job, ctx.env
    checks: list[Check] = []
    if not job.preflight.enabled:
        provider = ctx.provider_factory(job.teardown, env)
        found = await provider_check(job, env, PROVIDER_TIMEOUT_S, provider=provider)
        if found is not None:
            checks.append(found)
    if ctx.sync is not None:
        checks.append(await target_check(ctx.sync.sink))
    if (kept := guard_plan_check(job)) is not None:  # a box the guard would keep, said now
        checks.append(kept)
    return checks


async def gate(ctx: RunContext) -> bool:
    """Run :func:`essential_checks` for a job about to start; False when one failed (the cause
    is recorded, the report written and, where the target works, sent): the caller tears the
    box down as ``preflight_failed``."""
    t0 = time.monotonic()
    checks = await essential_checks(ctx)
    if not checks:
        return True
    report = PreflightReport(tuple(checks), time.monotonic() - t0)
    for check in report.warnings():
        fix = f" (fix: {check.fix})" if check.fix else ""
        log.warning("preflight warning: %s: %s%s", check.name, check.value, fix)
    if not ctx.job.preflight.enabled:
        # The full preflight is off: these checks are the job's preflight report.
        ctx.preflight_report = report.to_dict()
        ctx.store.write_report("preflight.json", ctx.preflight_report)
    if report.ok:
        log.info(
            "provider and target checks passed: %s",
            ", ".join(f"{c.name} {c.status}" for c in checks),
        )
        return True
    failed = ", ".join(f"{c.name} ({c.value})" for c in report.failures())
    log.error("preflight failed: %s", failed)
    ctx.state.cause = f"preflight failed: {failed}"
    if ctx.job.preflight.enabled:
        ctx.preflight_report = report.to_dict()
        ctx.store.write_report("preflight.json", ctx.preflight_report)
    if any(c.name == "target.canary" and c.status == FAIL for c in checks):
        # Nothing can be sent there: no billed minutes spent waiting on uploads that cannot
        # succeed (the report and the teardown go ahead without a target).
        if ctx.sync is not None:
            await ctx.sync.close()
            ctx.sync = None
    else:
        await ctx.sync_reports()  # the target works: the reason leaves the box first
    return False
