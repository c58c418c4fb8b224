"""Teardown providers: one module per provider behind one small interface.

- ``vast``, ``runpod``, ``lambda``: the provider's HTTP API (``api.py`` holds what they share:
  timeouts, retries with backoff, the read-back loop), keys from the environment only.
- ``command``: ``teardown.command``, run without a shell; its exit status is the result.
- ``none``: a dry run that records what it would do.

What the rest of the agent calls (every provider has all of it):

- :meth:`Provider.identify` - who this box is, read from the provider with no change made
  (preflight: proves the key can read THIS instance). Raises :class:`ProviderError`.
- :meth:`Provider.teardown` - send the action, then read back until it took effect or a bounded
  time passed. Never raises for a provider failure: the result says what happened.
- :meth:`Provider.confirm` - the read-back loop alone (an action already sent).
- :meth:`Provider.read_back` - one read: a confirmed result when the action already took effect.
- :meth:`Provider.price_usd_per_hour` - what the box costs, where the API says it.

Keys never appear in a log line, an error or a result: every text that may hold one goes
through :func:`redact` with the environment's secrets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from agent.config.model import Env, TeardownAction, TeardownSection
from agent.util import redact as redaction

if TYPE_CHECKING:
    from agent.providers.api import Timing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TeardownResult:
    #: What was asked, and whether it really happened.
    action: TeardownAction
    #: The provider accepted the call (or the command ran): something was done to the box.
    performed: bool
    #: Read back: the box is stopped or gone (``keep``: kept). For ``command``: exit status 0.
    confirmed: bool
    #: One line for state.json, /status and the log; keys redacted.
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "performed": self.performed,
            "confirmed": self.confirmed,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class Identity:
    """This box as its provider sees it (:meth:`Provider.identify`)."""

    provider: str
    #: The instance id every call names; None for ``command`` and ``none``.
    instance_id: str | None
    #: Where the id came from: ``CONTAINER_ID``, ``teardown.instance_id``, ``ip 1.2.3.4``...
    source: str
    #: The provider's own word for the state it reads now (``running``, ``RUNNING``, ``active``).
    status: str | None
    #: One line for preflight and the log.
    detail: str
    #: What the instance costs per hour (USD) where the API says it, else None.
    price_usd_per_hour: float | None = None
    #: The allocated disk (GB) and the storage price (USD per GB-month) where the API says
    #: them (Vast), else None: what the box costs once stopped.
    disk_gb: float | None = None
    storage_usd_per_gb_month: float | None = None


ProviderErrorKind = Literal["config", "auth", "not_found", "ambiguous", "unavailable", "rejected"]


class ProviderError(Exception):
    """A provider call that cannot go on. ``kind``:

    - ``config``: a variable or setting is missing or wrong (the message names it);
    - ``auth``: 401/403, this key cannot act on this instance (the message names the variable);
    - ``not_found``: the instance does not exist (any more);
    - ``ambiguous``: Lambda found several (or no) instances matching this machine;
    - ``unavailable``: 429/5xx/network errors past the retry time;
    - ``rejected``: the provider refused the request or answered something unexpected.

    The message is one line with every key redacted."""

    def __init__(self, kind: ProviderErrorKind, message: str) -> None:
        self.kind = kind
        super().__init__(message)


#: Called once the provider accepted a mutating call (or the command started), before the
#: read-back; the argument is one line saying what was sent.
OnSent = Callable[[str], None]


class Provider(Protocol):
    name: str

    @property
    def can_stop(self) -> bool:
        """Whether ``stop`` exists here (Lambda: no; command: only with ``stop_command``). A
        stop asked of a provider without one does nothing and says so (never a destroy)."""

    async def identify(self) -> Identity:
        """Find and read THIS instance, changing nothing; raises :class:`ProviderError` whose
        message names the variable or setting to fix."""

    async def teardown(
        self, action: TeardownAction, reason: str, *, on_sent: OnSent | None = None
    ) -> TeardownResult:
        """Carry out ``action`` (destroy | stop | keep) and read back that it took effect;
        ``on_sent`` is called between the two. Retries and read-backs are bounded in time."""

    async def confirm(self, action: TeardownAction) -> TeardownResult:
        """Read back, polling for a bounded time, whether ``action`` (already sent) took
        effect; sends nothing."""

    async def read_back(self, action: TeardownAction) -> TeardownResult | None:
        """Where the box stands, before a restarted agent sends ``action`` again: a confirmed
        result when it already took effect, None when unknown or not yet done."""

    async def price_usd_per_hour(self) -> float | None:
        """The instance's price (USD per hour) as the provider reports it, or None."""


def make_provider(
    cfg: TeardownSection, env: Env | None = None, *, timing: Timing | None = None
) -> Provider:
    """The provider ``cfg.provider`` names. ``env`` defaults to :meth:`Env.from_environ`;
    ``timing`` (timeouts, retry and read-back time of the HTTP providers) to :class:`Timing`'s
    defaults: tests shrink it.

    Never raises for a missing variable or key: :meth:`Provider.identify` reports those (with
    the variable to set), and :meth:`Provider.teardown` returns them as an unconfirmed result."""
    env = Env.from_environ() if env is None else env
    if cfg.provider == "vast":
        from agent.providers.vast import VastProvider

        return VastProvider(cfg, env, timing=timing)
    if cfg.provider == "runpod":
        from agent.providers.runpod import RunPodProvider

        return RunPodProvider(cfg, env, timing=timing)
    if cfg.provider == "lambda":
        from agent.providers.lambdalabs import LambdaProvider

        return LambdaProvider(cfg, env, timing=timing)
    if cfg.provider == "command":
        from agent.providers.command import CommandProvider

        return CommandProvider(cfg, env)
    from agent.providers.none import NoneProvider

    return NoneProvider()


#: What every confirmed stop says (the result, so the log, state.json, /status and the
#: notification): a stopped box is not free, and what made it worth renting may not come back.
STOP_NOTE = (
    "stopped, not destroyed: its disk keeps billing, and its GPUs are released: nothing "
    "reserves them, they may be gone on restart"
)


def finished(
    action: TeardownAction, performed: bool, confirmed: bool, detail: str
) -> TeardownResult:
    """A teardown's result, logged: ``teardown: DETAIL`` at INFO when confirmed, else ERROR (a
    box that may still be billing is worth a loud line)."""
    log.log(logging.INFO if confirmed else logging.ERROR, "teardown: %s", detail)
    return TeardownResult(action, performed, confirmed, detail)


# --------------------------------------------------------------------------------------------
# Text that leaves the agent


def redact(text: str, secrets: Iterable[tuple[str, str]]) -> str:
    """``text`` with each secret ``(name, value)`` replaced by ``<NAME>`` in every form an error
    shows it in (stripped, escaped, HTTP Basic's base64 of ``KEY:``), and every other secret
    removed (:func:`agent.util.redact.redact`)."""
    return redaction.redact(text, secrets)
