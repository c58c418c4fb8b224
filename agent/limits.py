"""Deadlines the agent enforces while training runs: wall clock, stall, cost budget.

Pure functions of the clock, so the tricky timing is tested in milliseconds. ``max_runtime`` and
the budget are counted from the agent's first boot for this job (``job_started_at``: persisted in
state.json, so a restarted agent does not hand out a fresh allowance, and preflight and staging
count); the stall timeout from the last progress of the run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .config import LimitsSection, format_duration
from .providers import Provider, ProviderError
from .state import Reason

log = logging.getLogger("agent.daemon")


@dataclass(frozen=True)
class Breach:
    reason: Reason
    message: str


def check_limits(
    cfg: LimitsSection, *, now: float, job_started_at: float, last_progress_at: float
) -> Breach | None:
    """The first limit that ``now`` breaks, or None. ``job_started_at`` is the agent's first
    boot for this job; ``last_progress_at`` the last time status.json moved on."""
    elapsed = now - job_started_at
    if cfg.max_runtime_s is not None and elapsed >= cfg.max_runtime_s:
        return Breach(
            Reason.TIMEOUT,
            f"max_runtime {format_duration(cfg.max_runtime_s)} reached after "
            f"{format_duration(elapsed)}",
        )
    if cfg.budget_usd is not None and cfg.price_usd_per_hour is not None:
        spent = cfg.price_usd_per_hour * elapsed / 3600.0
        if spent >= cfg.budget_usd:
            return Breach(
                Reason.BUDGET,
                f"budget ${cfg.budget_usd:.2f} reached (${spent:.2f} at "
                f"${cfg.price_usd_per_hour:.4f}/h)",
            )
    if cfg.stall_timeout_s is not None and now - last_progress_at >= cfg.stall_timeout_s:
        return Breach(
            Reason.STALLED,
            f"no progress in status.json for {format_duration(now - last_progress_at)} "
            f"(stall_timeout {format_duration(cfg.stall_timeout_s)})",
        )
    return None


def deadlines(cfg: LimitsSection, *, job_started_at: float) -> dict[str, float | None]:
    """Absolute times (epoch seconds) at which each limit fires, for ``/status``."""
    budget_at = None
    if cfg.budget_usd is not None and cfg.price_usd_per_hour:
        budget_at = job_started_at + cfg.budget_usd / cfg.price_usd_per_hour * 3600.0
    return {
        "max_runtime_at": job_started_at + cfg.max_runtime_s if cfg.max_runtime_s else None,
        "budget_at": budget_at,
        "stall_timeout_s": cfg.stall_timeout_s,
    }


def effective_limits(cfg: LimitsSection, price_usd_per_hour: float | None) -> LimitsSection:
    """``cfg`` with the provider's real price where the job says ``auto``."""
    if cfg.price_auto and price_usd_per_hour is not None:
        return dataclasses.replace(cfg, price_usd_per_hour=price_usd_per_hour)
    return cfg


async def read_price(
    preflight_report: Mapping[str, Any] | None, provider: Callable[[], Provider]
) -> float | None:
    """``price_usd_per_hour = "auto"``: the price preflight read from the provider, else ask
    the provider now (preflight may be off). None, with a warning, when it reports none."""
    price: float | None = None
    for check in (preflight_report or {}).get("checks", []):
        found = (check.get("details") or {}).get("price_usd_per_hour")
        if str(check.get("name", "")).startswith("provider.") and found is not None:
            price = float(found)
    if price is None:
        try:
            price = await provider().price_usd_per_hour()
        except ProviderError as exc:
            log.warning("cannot read this box's price: %s", exc)
    if price is None:
        log.warning("price_usd_per_hour = 'auto', but the provider reports no price: no budget")
    else:
        log.info("this box costs $%.4f/h (from the provider)", price)
    return price
