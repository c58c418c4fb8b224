"""Teardown providers: one module per provider behind one small interface.

Only ``none`` exists in this version: it records the action it would take and why. Cloud
providers (vast, runpod, lambda, command) have their own issue; the job file refuses them with a
clear message instead of pretending.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..config import TeardownAction, TeardownSection


@dataclass(frozen=True)
class TeardownResult:
    #: What was asked, and whether it really happened.
    action: TeardownAction
    performed: bool
    confirmed: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "performed": self.performed,
            "confirmed": self.confirmed,
            "detail": self.detail,
        }


class Provider(Protocol):
    name: str

    async def teardown(self, action: TeardownAction, reason: str) -> TeardownResult:
        """Carry out ``action`` (destroy | stop | keep) and read back that it took effect."""

    async def read_back(self, action: TeardownAction) -> TeardownResult | None:
        """Where the box stands, before a restarted agent sends ``action`` again: a confirmed
        result when it already took effect, None when unknown or not yet done."""


def make_provider(cfg: TeardownSection) -> Provider:
    if cfg.provider == "none":
        from .none import NoneProvider

        return NoneProvider()
    raise ValueError(f"teardown provider {cfg.provider!r} is not built in this version")
