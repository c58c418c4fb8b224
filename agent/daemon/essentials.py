"""The checks every job passes before training, even with ``[preflight] enabled = false``
(:mod:`agent.preflight.canary` says what each proves), as the daemon runs them: the provider
(when the full preflight, which has its own, is off), the target's canary and the guard's plan;
a failure is recorded and reported, and the caller tears the box down as ``preflight_failed``."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from agent.preflight.canary import target_check
from agent.preflight.cloud import PROVIDER_TIMEOUT_S, provider_check
from agent.preflight.guardplan_check import guard_plan_check
from agent.preflight.report import FAIL, Check, PreflightReport

if TYPE_CHECKING:
    from agent.config.model import Env, Job
    from agent.daemon.spine import Daemon

log = logging.getLogger(__name__)


async def essential_checks(daemon: Daemon) -> list[Check]:
    """The provider (only when the full preflight, which has its own, is off) and the target."""
    job: Job = daemon.job
    env: Env = daemon.env
    checks: list[Check] = []
    if not job.preflight.enabled:
        provider = daemon.provider_factory(job.teardown, env)
        found = await provider_check(job, env, PROVIDER_TIMEOUT_S, provider=provider)
        if found is not None:
            checks.append(found)
    if daemon.sync is not None:
        checks.append(await target_check(daemon.sync.sink))
    if (kept := guard_plan_check(job)) is not None:  # a box the guard would keep, said now
        checks.append(kept)
    return checks


async def gate(daemon: Daemon) -> bool:
    """Run :func:`essential_checks` for a job about to start; False when one failed (the cause
    is recorded, the report written and, where the target works, sent): the caller tears the
    box down as ``preflight_failed``."""
    t0 = time.monotonic()
    checks = await essential_checks(daemon)
    if not checks:
        return True
    report = PreflightReport(tuple(checks), time.monotonic() - t0)
    for check in report.warnings():
        fix = f" (fix: {check.fix})" if check.fix else ""
        log.warning("preflight warning: %s: %s%s", check.name, check.value, fix)
    if not daemon.job.preflight.enabled:
        # The full preflight is off: these checks are the job's preflight report.
        daemon.preflight_report = report.to_dict()
        daemon.store.write_report("preflight.json", daemon.preflight_report)
    if report.ok:
        log.info(
            "provider and target checks passed: %s",
            ", ".join(f"{c.name} {c.status}" for c in checks),
        )
        return True
    failed = ", ".join(f"{c.name} ({c.value})" for c in report.failures())
    log.error("preflight failed: %s", failed)
    daemon.state.cause = f"preflight failed: {failed}"
    if daemon.job.preflight.enabled:
        daemon.preflight_report = report.to_dict()
        daemon.store.write_report("preflight.json", daemon.preflight_report)
    if any(c.name == "target.canary" and c.status == FAIL for c in checks):
        # Nothing can be sent there: no billed minutes spent waiting on uploads that cannot
        # succeed (the report and the teardown go ahead without a target).
        if daemon.sync is not None:
            await daemon.sync.close()
            daemon.sync = None
    else:
        await daemon._sync_reports()  # the target works: the reason leaves the box first
    return False
