"""The ``none`` provider: touches nothing, records what a real provider would have done."""

from __future__ import annotations

import logging

from ..config import TeardownAction
from . import TeardownResult

log = logging.getLogger("agent.providers.none")


class NoneProvider:
    name = "none"

    async def teardown(self, action: TeardownAction, reason: str) -> TeardownResult:
        detail = f"provider 'none': would {action} this machine (reason {reason}); nothing was done"
        log.info("teardown: %s", detail)
        return TeardownResult(action=action, performed=False, confirmed=True, detail=detail)

    async def read_back(self, action: TeardownAction) -> TeardownResult | None:
        # Nothing was ever sent, so there is nothing to read back: the dry run is repeated.
        return None
