"""Deadlines the agent enforces while training runs: wall clock and cost budget (stalls are
:mod:`agent.watch.progress`'s, the disk :mod:`agent.watch.disk`'s).

Pure functions of the clock, so the tricky timing is tested in milliseconds. ``max_runtime`` and
the budget are counted from the agent's first boot for this job (``job_started_at``: persisted in
state.json, so a restarted agent does not hand out a fresh allowance, and preflight and staging
count).

Training stops a *finish reserve* before the wall-clock deadline and before the budget runs out:
the final sync (upload of last.pt and best.pt, its read-back verification, the teardown call)
takes time and costs money too, and the point of the deadline is a box torn down with the
checkpoints already off it. :func:`finish_reserve_s` estimates that reserve from the observed
upload speed and the checkpoints' sizes unless ``limits.finish_reserve`` sets it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from agent.config.model import LimitsSection, format_duration
from agent.providers import Provider, ProviderError
from agent.state import Reason

log = logging.getLogger(__name__)

#: Upload speed assumed before any upload was timed, bytes per second (10 MB/s): slow enough
#: for a typical rented box's uplink, so the first estimate errs on the side of stopping early.
DEFAULT_UPLOAD_BYTES_PER_S = 10e6
#: The upload time is multiplied by this: upload speed varies (a Hub commit, a slow moment of the
#: link), and a reserve that runs out misses the deadline with the checkpoints still on the box.
RESERVE_SAFETY_FACTOR = 2.0
#: Seconds added to the reserve for what is not an upload: the read-back verification of the
#: final files and the provider's teardown call.
RESERVE_OVERHEAD_S = 60.0
#: A budget warning that fired is only called off once the projection is this far under the
#: budget, so an ETA that jitters around the budget does not log a line every turn.
_BUDGET_REARM_FRACTION = 0.95


@dataclass(frozen=True)
class Breach:
    reason: Reason
    message: str


def finish_reserve_s(
    cfg: LimitsSection,
    *,
    upload_bytes_per_s: float | None,
    final_bytes: int,
    pending_bytes: int = 0,
) -> float:
    """Seconds to keep before the deadline (and the budget's end) for the final sync.

    ``limits.finish_reserve`` when the job sets it; otherwise::

        (final_bytes + pending_bytes) / speed x RESERVE_SAFETY_FACTOR (2.0)
            + RESERVE_OVERHEAD_S (60 s: read-back verification, teardown call)

    ``final_bytes`` is what the final sync must still upload (the sizes of last.pt and best.pt),
    ``pending_bytes`` what the upload queue still owes besides. ``speed`` is the observed upload
    speed (bytes per second), or ``DEFAULT_UPLOAD_BYTES_PER_S`` (10 MB/s) while nothing was
    measured yet (None, zero, negative or not a number).
    """
    if cfg.finish_reserve_s is not None:
        return cfg.finish_reserve_s
    speed = upload_bytes_per_s
    if speed is None or not math.isfinite(speed) or speed <= 0:
        speed = DEFAULT_UPLOAD_BYTES_PER_S
    to_upload = max(0, final_bytes) + max(0, pending_bytes)
    return to_upload / speed * RESERVE_SAFETY_FACTOR + RESERVE_OVERHEAD_S


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _reserve_why(cfg: LimitsSection, reserve_s: float) -> str:
    if cfg.finish_reserve_s is not None and reserve_s == cfg.finish_reserve_s:
        return "limits.finish_reserve"
    return "estimated from the upload speed and the checkpoints' sizes"


def check_limits(
    cfg: LimitsSection,
    *,
    now: float,
    job_started_at: float,
    extended_s: float = 0.0,
    reserve_s: float = 0.0,
) -> Breach | None:
    """The first limit that ``now`` breaks, or None. ``job_started_at`` is the agent's first
    boot for this job; ``extended_s``
    what ``libreyolo-agent extend`` added to ``max_runtime``; ``reserve_s`` the finish reserve
    (:func:`finish_reserve_s`).

    - max_runtime: breach once ``now >= job_started_at + max_runtime_s + extended_s - reserve_s``.
    - budget: breach once ``spent + price x reserve_s / 3600 >= budget_usd``: training stops
      before the money runs out, because the final sync is billed too.
    """
    elapsed = now - job_started_at
    if cfg.max_runtime_s is not None:
        deadline = job_started_at + cfg.max_runtime_s + extended_s
        if now >= deadline - reserve_s:
            limit = format_duration(cfg.max_runtime_s)
            if extended_s:
                limit += f" + {format_duration(extended_s)} extended"
            if reserve_s <= 0 or now >= deadline:
                message = f"max_runtime {limit} reached after {format_duration(elapsed)}"
            else:
                message = (
                    f"max_runtime {limit} ends at {_utc(deadline)} "
                    f"(in {format_duration(max(0.0, deadline - now))}): stopping training now "
                    f"to keep a {format_duration(reserve_s)} reserve for the final sync "
                    f"({_reserve_why(cfg, reserve_s)}), so the checkpoints are off the box "
                    "by the deadline"
                )
            return Breach(Reason.TIMEOUT, message)
    price = cfg.price_usd_per_hour
    if cfg.budget_usd is not None and price is not None:
        spent = price * elapsed / 3600.0
        reserve_cost = price * reserve_s / 3600.0
        if price > 0 and spent + reserve_cost >= cfg.budget_usd:
            if reserve_s <= 0 or spent >= cfg.budget_usd:
                message = f"budget ${cfg.budget_usd:.2f} reached (${spent:.2f} at ${price:.4f}/h)"
            else:
                message = (
                    f"budget ${cfg.budget_usd:.2f} nearly reached: ${spent:.2f} spent at "
                    f"${price:.4f}/h, and the final sync needs about "
                    f"{format_duration(reserve_s)} (${reserve_cost:.2f}, "
                    f"{_reserve_why(cfg, reserve_s)}): stopping training now so the job "
                    "stays within the budget"
                )
            return Breach(Reason.BUDGET, message)
    return None


def deadlines(
    cfg: LimitsSection, *, job_started_at: float, extended_s: float = 0.0, reserve_s: float = 0.0
) -> dict[str, float | None]:
    """Absolute times (epoch seconds) at which each limit fires, for ``/status``.

    ``max_runtime_at`` includes the extensions; ``budget_at`` is when the money runs out;
    ``stop_training_at`` the earlier of the two minus ``reserve_s`` (when :func:`check_limits`
    stops the trainer), None without either limit.
    """
    budget_at = None
    if cfg.budget_usd is not None and cfg.price_usd_per_hour:
        budget_at = job_started_at + cfg.budget_usd / cfg.price_usd_per_hour * 3600.0
    max_runtime_at = None
    if cfg.max_runtime_s is not None:
        max_runtime_at = job_started_at + cfg.max_runtime_s + extended_s
    ends = [t for t in (max_runtime_at, budget_at) if t is not None]
    return {
        "max_runtime_at": max_runtime_at,
        "budget_at": budget_at,
        "stop_training_at": min(ends) - reserve_s if ends else None,
        "reserve_s": reserve_s,
        "stall_timeout_s": cfg.stall_timeout_s,
    }


@dataclass(frozen=True)
class BudgetView:
    """What the job has cost so far and will cost, for ``/status`` and the budget warning."""

    #: USD spent since the job's first boot (restarts and reboots included: the box is billed).
    spent_usd: float
    #: ``spent`` + the remaining training (the ETA) + the finish reserve, USD; None without an ETA.
    projected_usd: float | None
    #: ``limits.budget_usd``; None without a budget.
    budget_usd: float | None
    #: The projection is over the budget: the job will stop early with reason ``budget``.
    over_projection: bool


def budget_view(
    cfg: LimitsSection,
    *,
    now: float,
    job_started_at: float,
    eta_s: float | None,
    reserve_s: float = 0.0,
) -> BudgetView | None:
    """Spent and projected cost: ``projected = spent + price x (eta_s + reserve_s) / 3600``.
    None without a price (``price_usd_per_hour`` unset, or ``auto`` not read yet)."""
    price = cfg.price_usd_per_hour
    if price is None:
        return None
    spent = price * max(0.0, now - job_started_at) / 3600.0
    projected = None
    if eta_s is not None:
        projected = spent + price * (max(0.0, eta_s) + reserve_s) / 3600.0
    over = cfg.budget_usd is not None and projected is not None and projected > cfg.budget_usd
    return BudgetView(spent, projected, cfg.budget_usd, over)


class BudgetWarner:
    """Says once that the projected cost passed the budget, so the loop can call it each turn.

    After it fired, one INFO line says so when the projection comes back under the budget (by 5%,
    so a jittery ETA does not flap), and it may then fire again.
    """

    def __init__(self) -> None:
        #: The warning fired and the projection has not come back under since.
        self.warned = False

    def update(self, view: BudgetView | None) -> str | None:
        """The warning text (also logged) when the projection first passes the budget, else
        None. The "back under" line is logged only."""
        if view is None or view.budget_usd is None or view.projected_usd is None:
            return None
        if view.over_projection and not self.warned:
            self.warned = True
            text = (
                f"budget: the job is projected to cost ${view.projected_usd:.2f} "
                f"(${view.spent_usd:.2f} spent, the rest for the remaining epochs and the final "
                f"sync), over limits.budget_usd ${view.budget_usd:.2f}: training will stop early "
                "(reason budget) before the budget is reached; raise limits.budget_usd or lower "
                "the epochs to let it finish"
            )
            log.warning("%s", text)
            return text
        if self.warned and view.projected_usd <= view.budget_usd * _BUDGET_REARM_FRACTION:
            self.warned = False
            log.info(
                "budget: the projected cost is back under the budget ($%.2f of $%.2f)",
                view.projected_usd,
                view.budget_usd,
            )
        return None


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
