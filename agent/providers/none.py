"""The ``none`` provider: touches nothing, records what a real provider would have done."""

from __future__ import annotations

import logging

from agent.config.model import TeardownAction
from agent.providers import Identity, OnSent, TeardownResult

log = logging.getLogger(__name__)


class NoneProvider:
    name = "none"
    can_stop = True

    async def identify(self) -> Identity:
        return Identity("none", None, "teardown.provider", None, "none: a dry run, no provider")

    async def price_usd_per_hour(self) -> float | None:
        return None

    async def teardown(
        self, action: TeardownAction, reason: str, *, on_sent: OnSent | None = None
    ) -> TeardownResult:
        detail = f"provider 'none': would {action} this machine (reason {reason}); nothing was done"
        log.info("teardown: %s", detail)
        return TeardownResult(action=action, performed=False, confirmed=True, detail=detail)

    async def confirm(self, action: TeardownAction) -> TeardownResult:
        return TeardownResult(action, False, True, "provider 'none': nothing was sent")

    async def read_back(self, action: TeardownAction) -> TeardownResult | None:
        # Nothing was ever sent, so there is nothing to read back: the dry run is repeated.
        return None
