"""What the HTTP providers (vast, runpod, lambda) share: one request with timeouts and bounded
retries, and the teardown itself - send, then read back until the box reads stopped or gone.

Retries: 408, 429 and 5xx answers and network errors (refused, reset, timed out) are retried
with exponential backoff and jitter, honouring ``Retry-After`` (seconds or an HTTP date, capped)
when the provider sends one, for at most :attr:`Timing.retry_s` per call. 401/403 are final at
once: the key cannot act on this instance, and the message names the variable to set. Other
answers go back to the provider module, which knows what its 404 or 409 means.

Confirmation: a teardown is confirmed only by a read of the instance that shows it stopped
(``stop``) or gone (``destroy``; gone also ends a ``stop``: nothing bills). "Accepted but still
running" is read again with backoff until :attr:`Timing.confirm_s` has passed, then reported
unconfirmed with what the last read said. Nothing else counts as confirmed.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import math
import random
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from agent import __version__
from agent.config.jobvalues import instance_id_problem
from agent.config.model import Env, TeardownAction, TeardownSection
from agent.providers import (
    STOP_NOTE,
    Identity,
    OnSent,
    ProviderError,
    TeardownResult,
    finished,
    redact,
)
from agent.util.backoff import delay_s, retry_after_s
from agent.util.text import one_line

log = logging.getLogger(__name__)

#: The most of an answer the agent reads: a provider's reply is a few kilobytes.
MAX_REPLY_BYTES = 1 << 20


@dataclass(frozen=True)
class Timing:
    """How long provider calls may take; tests shrink these."""

    #: Seconds to open a connection (TCP + TLS).
    connect_timeout_s: float = 10.0
    #: Seconds one request may take in all, answer included.
    request_timeout_s: float = 30.0
    #: Seconds one call keeps retrying 429/5xx/network errors before it gives up.
    retry_s: float = 300.0
    #: First pause between retries; doubled each time up to ``backoff_max_s``; jittered.
    backoff_first_s: float = 1.0
    backoff_max_s: float = 30.0
    #: The longest ``Retry-After`` honoured as given; longer ones are cut to this.
    retry_after_max_s: float = 60.0
    #: Seconds the read-back goes on after a teardown was accepted, before "not confirmed".
    confirm_s: float = 600.0
    #: First pause between read-backs; doubled up to ``poll_max_s``; jittered.
    poll_first_s: float = 3.0
    poll_max_s: float = 30.0


#: What a read of the instance says, for the teardown: still up (running, starting, stopping,
#: terminating...), stopped (GPU released, disk kept) or gone (destroyed, nothing bills).
InstanceState = Literal["up", "stopped", "gone"]


@dataclass(frozen=True)
class Reading:
    state: InstanceState
    #: The provider's own words, for messages: ``actual_status=exited cur_state=stopped``.
    status: str
    #: The price the read showed (USD per hour), where the API gives one.
    price_usd_per_hour: float | None = None
    #: The instance's allocated disk (GB) and what storage costs (USD per GB-month), where the
    #: API gives them (Vast's ``disk_space`` and ``storage_cost``): what a stopped box pays.
    disk_gb: float | None = None
    storage_usd_per_gb_month: float | None = None


@dataclass(frozen=True)
class Sent:
    """How the provider answered the mutating call: ``accepted``; ``gone`` (no such instance:
    nothing to act on); ``refused`` (e.g. 409 not allowed in this state: the read-back decides)."""

    outcome: Literal["accepted", "gone", "refused"]
    detail: str
    #: An earlier attempt of the same call got no answer (timeout, reset, 5xx): it may have
    #: taken effect, and this refusal may be the consequence ("already terminating").
    uncertain: bool = False


@dataclass(frozen=True)
class Reply:
    status: int
    text: str
    #: The body parsed as JSON, or None when it is not JSON.
    data: Any
    #: An earlier attempt got no answer or a 5xx: it may have been carried out.
    uncertain: bool = False


def gone_404(reply: Reply) -> bool:
    """A 404 that means "no such instance": the provider's own JSON error body. A 404 without
    one (a proxy, a wrong ``teardown.api_url``) says nothing about the instance, and must never
    be read as "destroyed" - that would end the record of a box that still bills."""
    return reply.status == 404 and isinstance(reply.data, Mapping)


def stop_note(action: TeardownAction, reading: Reading) -> str:
    """``; STOP_NOTE`` for a stop that left the box stopped (a gone box bills nothing)."""
    return f"; {STOP_NOTE}" if action == "stop" and reading.state == "stopped" else ""


def done(action: TeardownAction, reading: Reading) -> bool:
    """Whether ``reading`` shows ``action`` took effect: destroy needs gone; stop, stopped or
    gone."""
    if action == "destroy":
        return reading.state == "gone"
    if action == "stop":
        return reading.state in ("stopped", "gone")
    return True


def number(value: object) -> float | None:
    """A finite, non-negative number from a JSON field (a number or a numeric string)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        n = float(value)
    except (ValueError, OverflowError):
        return None
    return n if math.isfinite(n) and n >= 0 else None


class Client:
    """One aiohttp session to one provider's API, with its key, its timeouts and its retries."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        key_fix: str,
        secrets: tuple[tuple[str, str], ...],
        timing: Timing,
    ) -> None:
        self.session = session
        self.base_url = base_url
        self.key_fix = key_fix
        self.secrets = secrets
        self.timing = timing

    def clean(self, text: str, limit: int = 300) -> str:
        return one_line(redact(text, self.secrets), limit)

    def message(self, reply: Reply) -> str:
        """The provider's error message in a reply: Vast ``{error, msg}``, RunPod problem+json
        ``{title, detail}``, Lambda ``{error: {code, message, suggestion}}``, or the text."""
        parts: list[object] = []
        data = reply.data
        if isinstance(data, Mapping):
            err = data.get("error")
            if isinstance(err, Mapping):
                parts += [err.get("code"), err.get("message"), err.get("suggestion")]
            else:
                parts.append(err)
            parts += [data.get(k) for k in ("msg", "message", "title", "detail")]
        said = [str(p).strip() for p in parts if isinstance(p, str | int) and str(p).strip()]
        text = "; ".join(dict.fromkeys(said))  # RunPod's title and detail are often the same
        return self.clean(text or reply.text, 200)

    def describe(self, reply: Reply) -> str:
        message = self.message(reply)
        return f"HTTP {reply.status}" + (f" ({message})" if message else "")

    async def request(
        self,
        method: str,
        path: str,
        what: str,
        *,
        body: object = None,
        deadline: float | None = None,
    ) -> Reply:
        """Send one request, retrying 408/429/5xx and network errors until ``Timing.retry_s``
        (or ``deadline``, a ``loop.time()``) has passed. 401/403 raise ``auth`` at once; other
        answers are returned. ``what`` names the call in messages (``vast: destroy 123``)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        end = start + self.timing.retry_s
        if deadline is not None:
            end = min(end, deadline)
        url = self.base_url + path
        attempt = 0
        uncertain = False
        while True:
            attempt += 1
            retry_after: float | None = None
            try:
                async with self.session.request(
                    method, url, json=body, allow_redirects=False
                ) as resp:
                    raw = await resp.content.read(MAX_REPLY_BYTES)
                    text = raw.decode("utf-8", "replace")
                    reply = Reply(resp.status, text, _json(raw), uncertain)
                    headers = resp.headers
            except (aiohttp.ClientError, TimeoutError) as exc:
                problem = self.clean(f"{type(exc).__name__}: {exc}".rstrip(": "), 200)
                uncertain = True
            else:
                if reply.status in (401, 403):
                    raise ProviderError(
                        "auth",
                        f"{what}: {self.describe(reply)}: this key cannot act on this instance; "
                        f"{self.key_fix}",
                    )
                if 300 <= reply.status < 400:
                    location = self.clean(headers.get("Location", ""), 120)
                    raise ProviderError(
                        "rejected",
                        f"{what}: HTTP {reply.status} redirect to {location or '?'} (not "
                        "followed: a redirect could drop or leak the key); set "
                        "teardown.api_url to the API's real address",
                    )
                if not (reply.status in (408, 429) or 500 <= reply.status <= 599):
                    return reply
                problem = self.describe(reply)
                retry_after = retry_after_s(headers)
                uncertain = uncertain or reply.status >= 500
            delay = self._backoff(attempt, retry_after)
            now = loop.time()
            if now + delay > end:
                raise ProviderError(
                    "unavailable",
                    f"{what}: no usable answer after {attempt} attempt(s) over "
                    f"{now - start:.0f}s; last: {problem}",
                )
            log.warning("%s: %s; retrying in %.1fs (attempt %d)", what, problem, delay, attempt + 1)
            await asyncio.sleep(delay)

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        t = self.timing
        if retry_after is not None:
            # Never below the first backoff: a server answering "Retry-After: 0" every time
            # must not turn the retries into a busy loop.
            wait = max(t.backoff_first_s, min(retry_after, t.retry_after_max_s))
            return wait * random.uniform(1.0, 1.1)
        return delay_s(attempt, first_s=t.backoff_first_s, cap_s=t.backoff_max_s)


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


class ApiProvider(abc.ABC):
    """The teardown of an HTTP provider: subclasses say where the key is (:meth:`_key`,
    :meth:`_key_fix`) and how to find the instance, read it and send an action
    (:meth:`_locate`, :meth:`_read`, :meth:`_send`); this class retries, reads back and words
    the results."""

    name: str = "api"
    can_stop: bool = True
    #: Base URL when ``teardown.api_url`` is not set.
    default_url: str = ""
    #: Where a person checks the box by hand, for unconfirmed teardowns.
    console: str = ""

    def __init__(self, cfg: TeardownSection, env: Env, *, timing: Timing | None = None) -> None:
        self.cfg = cfg
        self.env = env
        self.timing = timing or Timing()
        self.base_url = (cfg.api_url or self.default_url).rstrip("/")
        self.secrets = env.secrets()
        #: The instance found by :meth:`_locate`: ``(id, where it came from)``.
        self._found: tuple[str, str] | None = None

    # ------------------------------------------------------------------ subclass hooks

    @abc.abstractmethod
    def _key(self) -> tuple[str, str]:
        """``(variable, value)`` of the API key; raises ``config`` naming what to set."""
        raise NotImplementedError

    @abc.abstractmethod
    def _key_fix(self, variable: str) -> str:
        """What to do when the key ``variable`` is refused (401/403)."""
        raise NotImplementedError

    @abc.abstractmethod
    async def _locate(self, api: Client) -> tuple[str, str, Reading | None]:
        """This instance: ``(id, source, reading)``; ``reading`` when finding it read it."""
        raise NotImplementedError

    @abc.abstractmethod
    async def _read(self, api: Client, instance_id: str, deadline: float | None) -> Reading:
        raise NotImplementedError

    @abc.abstractmethod
    async def _send(self, api: Client, action: TeardownAction, instance_id: str) -> Sent:
        raise NotImplementedError

    def _no_stop(self) -> str:
        return f"{self.name} has no stop"

    # ------------------------------------------------------------------ helpers for subclasses

    def configured_id(self, variable: str, value: str | None, fix: str) -> tuple[str, str]:
        """The instance id from ``teardown.instance_id``, else from the variable ``variable``
        (``value``); raises ``config`` when neither is set or the id is malformed."""
        source, iid = ("teardown.instance_id", self.cfg.instance_id)
        if iid is None:
            source, iid = variable, value
        if iid is None:
            raise ProviderError(
                "config",
                f"{self.name}: {variable} is not set, so this instance's id is unknown: {fix}, "
                "or set teardown.instance_id",
            )
        problem = instance_id_problem(iid)
        if problem:
            raise ProviderError("config", f"{self.name}: {source} = {iid[:60]!r} {problem}")
        return iid, source

    def id_in_path(self, instance_id: str) -> str:
        """``instance_id`` checked again right before it goes into a URL path."""
        if instance_id_problem(instance_id):
            raise ProviderError("rejected", f"{self.name}: refusing malformed id {instance_id!r}")
        return instance_id

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[Client]:
        variable, key = self._key()
        t = self.timing
        timeout = aiohttp.ClientTimeout(
            total=t.request_timeout_s, connect=t.connect_timeout_s, sock_connect=t.connect_timeout_s
        )
        headers = {
            "Authorization": f"Bearer {key}",
            "Accept": "application/json",
            "User-Agent": f"libreyolo-agent/{__version__}",
        }
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            yield Client(
                session,
                self.base_url,
                key_fix=self._key_fix(variable),
                secrets=self.secrets,
                timing=t,
            )

    async def _instance(self, api: Client) -> str:
        if self._found is None:
            iid, source, _ = await self._locate(api)
            self._found = (iid, source)
        return self._found[0]

    # ------------------------------------------------------------------ the interface

    async def identify(self) -> Identity:
        """Find THIS instance and read it (no change made); raises :class:`ProviderError`."""
        async with self.client() as api:
            iid, source, reading = await self._locate(api)
            self._found = (iid, source)
            if reading is None:
                reading = await self._read(api, iid, None)
        if reading.state == "gone":
            raise ProviderError(
                "not_found",
                f"{self.name}: instance {iid} (from {source}) does not exist or is terminated: "
                f"check {source}",
            )
        price = reading.price_usd_per_hour
        detail = f"{self.name} instance {iid} (from {source}) reads {reading.status}" + (
            f", ${price:.4f}/h" if price is not None else ""
        )
        log.info("provider: %s", detail)
        return Identity(
            self.name,
            iid,
            source,
            reading.status,
            detail,
            price,
            disk_gb=reading.disk_gb,
            storage_usd_per_gb_month=reading.storage_usd_per_gb_month,
        )

    async def price_usd_per_hour(self) -> float | None:
        try:
            return (await self.identify()).price_usd_per_hour
        except ProviderError as exc:
            log.warning("provider: no price: %s", exc)
            return None

    async def teardown(
        self, action: TeardownAction, reason: str, *, on_sent: OnSent | None = None
    ) -> TeardownResult:
        if action == "keep":
            detail = (
                f"{self.name}: keep: nothing sent, the box stays up and bills (reason {reason})"
            )
            return finished("keep", False, True, detail)
        if action == "stop" and not self.can_stop:
            detail = f"{self._no_stop()}: nothing was sent; the box is KEPT and still bills"
            return finished(action, False, False, detail)
        performed = False
        try:
            async with self.client() as api:
                iid = await self._instance(api)
                log.info("teardown: %s %s instance %s (reason %s)", self.name, action, iid, reason)
                sent = await self._send(api, action, iid)
                if sent.outcome == "refused" and not sent.uncertain:
                    return await self._after_refusal(api, action, iid, sent)
                if sent.outcome == "refused":
                    log.warning(
                        "teardown: %s %s instance %s refused on a retry (%s); an earlier attempt "
                        "got no answer and may have been carried out: reading back",
                        self.name,
                        action,
                        iid,
                        sent.detail,
                    )
                performed = sent.outcome == "accepted"
                log.info(
                    "teardown: %s %s instance %s sent: %s", self.name, action, iid, sent.detail
                )
                if on_sent is not None:
                    try:
                        on_sent(sent.detail)
                    except Exception:
                        log.exception("teardown: recording 'sent' failed; reading back anyway")
                return await self._poll(api, action, iid, performed)
        except ProviderError as exc:
            detail = f"{exc}; {action} NOT confirmed: the box may still be billing"
            return finished(action, performed, False, detail)

    async def confirm(self, action: TeardownAction) -> TeardownResult:
        if action == "keep":
            return TeardownResult("keep", False, True, f"{self.name}: keep: nothing to read back")
        try:
            async with self.client() as api:
                return await self._poll(api, action, await self._instance(api), True)
        except ProviderError as exc:
            detail = f"{exc}; {action} NOT confirmed: the box may still be billing"
            return finished(action, True, False, detail)

    async def read_back(self, action: TeardownAction) -> TeardownResult | None:
        if action == "keep":
            return None
        try:
            async with self.client() as api:
                iid = await self._instance(api)
                reading = await self._read(api, iid, None)
        except ProviderError as exc:
            log.warning("teardown: read-back before re-sending failed: %s", exc)
            return None
        if not done(action, reading):
            log.info("teardown: %s instance %s reads %s: not done", self.name, iid, reading.status)
            return None
        detail = (
            f"{self.name}: {action} of instance {iid} confirmed: it reads {reading.status}"
            + stop_note(action, reading)
        )
        log.info("teardown: %s (read back, nothing re-sent)", detail)
        return TeardownResult(action, True, True, detail)

    # ------------------------------------------------------------------ internals

    async def _after_refusal(
        self, api: Client, action: TeardownAction, iid: str, sent: Sent
    ) -> TeardownResult:
        """The provider refused the call: one read says whether the box is already there."""
        reading = await self._read(api, iid, None)
        if done(action, reading):
            detail = (
                f"{self.name}: {action} of instance {iid} confirmed: it reads {reading.status} "
                f"(the call itself was refused: {sent.detail})" + stop_note(action, reading)
            )
            return finished(action, False, True, detail)
        detail = (
            f"{self.name}: {action} of instance {iid} refused: {sent.detail}; it reads "
            f"{reading.status}; NOT confirmed: the box may still be billing ({self.console})"
        )
        return finished(action, False, False, detail)

    async def _poll(
        self, api: Client, action: TeardownAction, iid: str, performed: bool
    ) -> TeardownResult:
        """Read back until ``action`` shows or ``Timing.confirm_s`` passed."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self.timing.confirm_s
        pause = self.timing.poll_first_s
        reads = 0
        last: Reading | None = None
        error: str | None = None
        while True:
            try:
                reading = await self._read(api, iid, deadline)
            except ProviderError as exc:
                if exc.kind in ("auth", "config"):
                    raise
                error = str(exc)
                log.warning("teardown: read-back failed: %s", exc)
            else:
                reads += 1
                last, error = reading, None
                if done(action, reading):
                    detail = (
                        f"{self.name}: {action} of instance {iid} confirmed: it reads "
                        f"{reading.status} ({reads} read-back(s), {loop.time() - start:.0f}s)"
                        + stop_note(action, reading)
                    )
                    return finished(action, performed, True, detail)
            left = deadline - loop.time()
            if left <= 0:
                break
            wait = min(left, pause * random.uniform(0.75, 1.0))
            log.info(
                "teardown: %s instance %s still reads %s; reading again in %.1fs",
                self.name,
                iid,
                last.status if last else "nothing",
                wait,
            )
            await asyncio.sleep(wait)
            pause = min(self.timing.poll_max_s, pause * 2)
        seen = f"it still reads {last.status}" if last else "no read-back succeeded"
        detail = (
            f"{self.name}: {action} of instance {iid} "
            f"{'accepted' if performed else 'asked'} but NOT confirmed: after {reads} "
            f"read-back(s) over {loop.time() - start:.0f}s {seen}"
            + (f" (last error: {error})" if error else "")
            + f"; the box may still be billing: check {self.console}"
        )
        return finished(action, performed, False, detail)
