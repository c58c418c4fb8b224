"""The provider side of preflight: can the agent act on THIS box, and what does it cost?

Identifying the instance reads it and changes nothing, so a wrong or missing key fails while the
box is still cheap, not at 3 a.m. after training; the check names the variable to set (the
``command`` provider: its executables are found, nothing is run). Where the provider reports the
instance's price, it is the job's price (``price_usd_per_hour = "auto"``) and
``limits.max_price_usd_per_hour`` refuses a box that costs more; a price the provider does not
report is a warning (no cost figures), never a failure that would tear down a good box.
"""

from __future__ import annotations

import asyncio

from agent.config.model import Env, Job
from agent.preflight.report import FAIL, PASS, WARN, Check, make_check
from agent.providers import Provider, ProviderError, make_provider

#: A read of one instance; the provider's own retries are bounded well above this.
PROVIDER_TIMEOUT_S = 60.0


async def provider_check(
    job: Job | None, env: Env, timeout_s: float, *, provider: Provider | None = None
) -> Check | None:
    """The ``provider`` check; None when there is no job or the provider cannot be asked.
    ``provider`` defaults to the one the job names (the daemon passes its own factory's)."""
    if job is None or job.teardown.provider == "none":
        return None
    if provider is None:
        provider = make_provider(job.teardown, env)
    name = f"provider.{job.teardown.provider}"
    try:
        ident = await asyncio.wait_for(provider.identify(), min(timeout_s, PROVIDER_TIMEOUT_S))
    except ProviderError as exc:
        return make_check(
            name,
            FAIL,
            str(exc),
            "the agent could not end this box's bill: fix the key or id it names",
            kind=exc.kind,
        )
    except TimeoutError:
        return make_check(
            name,
            FAIL,
            f"no answer from the {job.teardown.provider} API within {timeout_s:.0f} s",
            "check the network, or teardown.api_url",
        )
    price = ident.price_usd_per_hour
    limits = job.limits
    value = ident.detail + (f", ${price:.4f}/h" if price is not None else "")
    details = {
        "instance_id": ident.instance_id,
        "price_usd_per_hour": price,
        # What a stopped box pays, where the provider says it (agent/status/document.py reads
        # these).
        "disk_gb": ident.disk_gb,
        "storage_usd_per_gb_month": ident.storage_usd_per_gb_month,
    }
    if limits.price_auto and price is None:
        # Unknown is not wrong: failing here would tear down a box that can train.
        unguarded = [
            what
            for what, on in (
                ("no budget_usd stop", limits.budget_usd is not None),
                ("no max_price_usd_per_hour check", limits.max_price_usd_per_hour is not None),
            )
            if on
        ]
        return make_check(
            name,
            WARN,
            f"{value}; the provider reports no price for price_usd_per_hour = 'auto': no cost "
            "figures or budget projection" + "".join(f", {u}" for u in unguarded),
            "give limits.price_usd_per_hour as a number",
            **details,
        )
    known = price if limits.price_auto else limits.price_usd_per_hour
    cap = limits.max_price_usd_per_hour
    if cap is not None and known is not None and known > cap:
        return make_check(
            name,
            FAIL,
            f"{value}: ${known:.4f}/h is over limits.max_price_usd_per_hour ${cap:.4f}/h",
            "rent a cheaper box, or raise limits.max_price_usd_per_hour",
            **details,
        )
    if not provider.can_stop:
        return make_check(
            name,
            WARN,
            f"{value}; this provider has no stop: an unverified sync keeps the box (billing)",
            None,
            **details,
        )
    return make_check(name, PASS, value, None, **details)
