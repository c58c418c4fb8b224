"""Webhook notices (``[notify]``): what happened to the run, sent to Slack, Discord or any
receiver of JSON, so that a person asleep learns that the box is still billing.

:class:`Notifier` listens on the daemon's :class:`~agent.events.EventBus`. The listener only
formats, redacts and queues (it never waits: a bounded queue drops its oldest notice, counted,
when the receiver does not keep up); :meth:`Notifier.run` POSTs the notices in order::

    {"text": line, "content": line, "event": {seq, at, kind, data}, "job": name}

Slack reads ``text``, Discord ``content``, anything else the structured ``event``. A 429, a 5xx
or a network error is retried with backoff (``Retry-After`` honoured, capped); any other 4xx is
given up at once with one log line. :meth:`Notifier.flush` waits for what is queued: the daemon
calls it before a destroy, so the last notice leaves before the box is gone.

No secret ever leaves: every text and the whole payload are redacted of the secrets given (the
environment's keys) and of the webhook URL itself, which is a secret too (Slack and Discord put
their token in the path): logs and :meth:`Notifier.status` show it as ``https://host/...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from agent.config.jobvalues import format_duration
from agent.config.model import NotifySection
from agent.events import Event, EventBus
from agent.util import redact as redaction
from agent.util.backoff import delay_s, retry_after_s
from agent.util.text import one_line

log = logging.getLogger(__name__)

#: Notices that may wait for the receiver before the oldest are dropped.
QUEUE = 200
#: What a redacted secret becomes.
REDACTED = redaction.SECRET
#: Discord refuses a ``content`` over 2,000 characters.
MAX_TEXT = 1900
#: An open teardown (not confirmed, tried again with backoff) is said again at most this often,
#: seconds: loud enough to wake a person, never a storm.
REPEAT_OPEN_S = 1800.0

Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class Retry:
    """How a notice is retried after a 429, a 5xx or a network error."""

    #: The first pause, seconds; doubled each time (with jitter) up to ``cap_s``.
    first_s: float = 1.0
    cap_s: float = 60.0
    #: The longest ``Retry-After`` honoured as given; a longer one is cut to this.
    retry_after_max_s: float = 120.0
    #: Attempts per notice before it is given up (the ones after it must not wait forever).
    attempts: int = 8


@dataclass(frozen=True)
class _Notice:
    #: Position in the order notices were queued (1 for the first).
    index: int
    kind: str
    #: The redacted JSON body.
    body: bytes


# --------------------------------------------------------------------------------------------
# Redaction


class Redactor:
    """Every form of every secret (and of the webhook URL) out of a notice, as :data:`REDACTED`,
    and every other secret the agent knows or recognises (:mod:`agent.util.redact`)."""

    def __init__(self, secrets: Iterable[str]) -> None:
        # Named like the secrets found by their shape: a notice does not say which one it was.
        self.secrets = tuple(("secret", s) for s in secrets if s)

    def text(self, text: str) -> str:
        return redaction.redact(text, self.secrets)

    def value(self, value: Any) -> Any:
        """A JSON-safe copy of ``value`` with every string redacted (keys too)."""
        return redaction.redact_value(_json_safe(value), self.secrets)


def _json_safe(value: Any) -> Any:
    """``value`` as JSON can carry it: a number it cannot (NaN, infinity) becomes None, a set a
    list, a key or an unknown object its ``str``."""
    if isinstance(value, str | bool | int) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_safe(v) for v in value]
    return str(value)


# --------------------------------------------------------------------------------------------
# One line per event


def _num(value: object, spec: str = ".4g") -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return format(value, spec)


def _epoch(data: dict[str, Any]) -> str:
    epoch, total = data.get("epoch"), data.get("total_epochs")
    return f"{epoch}/{total}" if total else str(epoch)


def _metric(data: dict[str, Any]) -> str:
    value = _num(data.get("metric"))
    return f"{data.get('metric_name') or 'metric'} {value}" if value is not None else ""


def _teardown_line(data: dict[str, Any]) -> str:
    action, why = data.get("action"), str(data.get("why") or "")
    if data.get("downgraded") and action == "stop":
        return (
            "destroy downgraded to stop - checkpoints not verified off the box; the box keeps "
            "billing (its disk), and its GPUs are released: they may be gone on restart"
        )
    if data.get("downgraded") or "KEPT" in why:
        return f"the box is KEPT and keeps billing (all of it) - {why}"
    provider = data.get("provider")
    return f"teardown: {action}" + (f" via {provider}" if provider else "") + f" ({why})"


def notice_text(job: str, event: Event) -> str:
    """The human line for ``event``: ``run1: new best at epoch 12 - mAP50-95 0.456``."""
    d, kind = event.data, event.kind
    text: str
    if kind == "job_started":
        phase = str(d.get("phase")).lower()
        text = (
            f"agent restarted, carrying on from phase {phase}"
            if d.get("restarted")
            else f"agent started (phase {phase})"
        )
    elif kind == "phase":
        text = f"phase {str(d.get('from')).lower()} -> {str(d.get('to')).lower()}"
        extra = d.get("reason") or d.get("note")
        text += f" ({extra})" if extra else ""
    elif kind == "training_started":
        total = f" ({d['total_epochs']} epochs)" if d.get("total_epochs") else ""
        text = ("training resumed" if d.get("resumed") else "training started") + total
    elif kind == "epoch":
        parts = [p for p in (_metric(d), _loss(d), _eta(d)) if p]
        text = f"epoch {_epoch(d)}" + (" - " + ", ".join(parts) if parts else "")
    elif kind == "best":
        metric = _metric(d)
        text = f"new best at epoch {d.get('epoch')}" + (f" - {metric}" if metric else "")
    elif kind == "upload":
        what = f"{d.get('path')}" + (f" (epoch {d['epoch']})" if d.get("epoch") else "")
        text = f"uploaded {what}" if d.get("ok") else f"upload of {what} failed: {d.get('error')}"
    elif kind == "warning":
        text = f"warning - {d.get('message')}"
    elif kind == "stall":
        text = f"STALLED - {d.get('message')}"
    elif kind == "resume":
        text = f"trainer resumed ({d.get('cause')}) from epoch {d.get('epoch')} - {d.get('why')}"
    elif kind == "preempted":
        text = f"preempted ({d.get('source')}) - {d.get('message')}"
    elif kind == "teardown":
        text = _teardown_line(d)
    elif kind == "teardown_sent":
        text = f"{d.get('action')} sent to the provider"
    elif kind == "teardown_confirmed" and d.get("open"):
        tries = f" (attempt {d['attempts']}, tried again with backoff)" if d.get("attempts") else ""
        text = f"{d.get('action')} NOT confirmed: the box may still bill{tries}" + (
            f" - {d['detail']}" if d.get("detail") else ""
        )
    elif kind == "teardown_confirmed":
        state = "confirmed" if d.get("confirmed") else "NOT confirmed: check the box by hand"
        text = f"{d.get('action')} {state}" + (f" - {d['detail']}" if d.get("detail") else "")
    elif kind == "failure":
        text = f"FAILED ({d.get('reason')})" + (f" - {d['cause']}" if d.get("cause") else "")
    elif kind == "done":
        text = f"done ({d.get('reason')})" + (f" - {d['cause']}" if d.get("cause") else "")
    elif kind == "steering":
        seconds = _num(d.get("seconds"), ".0f")
        text = f"{d.get('action')}" + (f" {format_duration(float(seconds))}" if seconds else "")
    else:
        text = f"{kind} {json.dumps(d, default=str, sort_keys=True)}"
    return one_line(f"{job}: {text}", MAX_TEXT)


def _loss(data: dict[str, Any]) -> str:
    value = _num(data.get("loss"))
    return f"loss {value}" if value is not None else ""


def _eta(data: dict[str, Any]) -> str:
    value = data.get("eta_s")
    if _num(value) is None or not isinstance(value, int | float) or value < 0:
        return ""
    return f"ETA {format_duration(float(value))}"


# --------------------------------------------------------------------------------------------
# The notifier


class Notifier:
    """Sends the job's events to ``cfg.webhook``; see the module docstring."""

    def __init__(
        self,
        cfg: NotifySection,
        bus: EventBus,
        *,
        secrets: Sequence[str] = (),
        job: str,
        queue_size: int = QUEUE,
        retry: Retry | None = None,
        sleep: Sleep | None = None,
        repeat_open_s: float = REPEAT_OPEN_S,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``secrets``: every value no notice may carry (``Env.secrets()``'s values); the
        webhook URL is added. ``retry`` and ``sleep`` are for tests (``sleep`` replaces the
        pause between attempts; the default one ends early when the notifier is closed)."""
        self.cfg = cfg
        self.job = job
        self.retry = retry or Retry()
        self._redact = Redactor([*secrets, *redaction.url_forms(cfg.webhook)])
        self._queue: deque[_Notice] = deque()
        self._queue_size = max(1, queue_size)
        self._in_flight: _Notice | None = None
        self._queued_total = 0
        #: Positions of the notices given up or dropped (for :meth:`flush`'s answer).
        self._lost: deque[int] = deque(maxlen=4 * self._queue_size)
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._stop = asyncio.Event()
        self._sleep: Sleep = sleep or self._pause
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self.last_error: str | None = None
        #: An open teardown's notices: the first goes, the next ones at most every
        #: ``repeat_open_s`` (``repeats_held`` counts the ones held back).
        self.repeat_open_s = repeat_open_s
        self._clock = clock or time.monotonic
        self._open_said_at: float | None = None
        self.repeats_held = 0
        bus.listen(self._on_event)

    # ------------------------------------------------------------------ the listener

    def wanted(self, event: Event) -> bool:
        """Whether ``event`` is sent: its kind is chosen, or it is an N-th (or the last) epoch
        with ``every_epochs = N``."""
        if event.kind == "epoch":
            every = self.cfg.every_epochs
            epoch, total = event.data.get("epoch"), event.data.get("total_epochs")
            if every <= 0 or not isinstance(epoch, int) or isinstance(epoch, bool):
                return False
            return epoch % every == 0 or epoch == total
        return event.kind in self.cfg.events

    def _on_event(self, event: Event) -> None:
        # Called inside EventBus.publish: format and queue, never wait.
        if self._closed or not self.wanted(event) or self._repeat_held(event):
            return
        text = self._redact.text(notice_text(self.job, event))
        payload = {
            "text": text,
            "content": text,
            "event": self._redact.value(event.to_dict()),
            "job": self._redact.text(self.job),
        }
        body = self._redact.text(json.dumps(payload, ensure_ascii=False, allow_nan=False))
        self._queued_total += 1
        if len(self._queue) >= self._queue_size:
            oldest = self._queue.popleft()
            self._lost.append(oldest.index)
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, 8...: counted, not a storm
                log.warning(
                    "notify: the webhook does not keep up (%d notices waiting); dropped the "
                    "oldest (%s), %d dropped so far",
                    self._queue_size,
                    oldest.kind,
                    self.dropped,
                )
            self._progress.set()
        self._queue.append(_Notice(self._queued_total, event.kind, body.encode()))
        self._wake.set()

    def _repeat_held(self, event: Event) -> bool:
        """An open teardown said again sooner than ``repeat_open_s``: held back."""
        if event.kind != "teardown_confirmed" or not event.data.get("open"):
            return False
        now = self._clock()
        if self._open_said_at is not None and now - self._open_said_at < self.repeat_open_s:
            self.repeats_held += 1
            return True
        self._open_said_at = now
        return False

    # ------------------------------------------------------------------ the sender

    async def run(self) -> None:
        """Send the queued notices in order until :meth:`close`. Never raises for a failed
        notice: it is logged, counted, and the next one goes."""
        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, trust_env=True)
        try:
            while not self._closed:
                if not self._queue:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                notice = self._in_flight = self._queue.popleft()
                try:
                    await self._deliver(notice)
                except Exception as exc:  # a bug here must not end the notices
                    if not self._closed:  # closing ends the session under a request
                        self._give_up(notice, f"{type(exc).__name__}: {exc}")
                finally:
                    self._in_flight = None
                    self._progress.set()
        finally:
            await self._session.close()

    async def _deliver(self, notice: _Notice) -> None:
        assert self._session is not None
        headers = {"Content-Type": "application/json"}
        problem = "not sent"
        for attempt in range(1, self.retry.attempts + 1):
            if self._closed:
                return
            retry_after: float | None = None
            try:
                async with self._session.post(
                    self.cfg.webhook, data=notice.body, headers=headers
                ) as reply:
                    status = reply.status
                    retry_after = retry_after_s(reply.headers)
                    answer = one_line((await reply.text(errors="replace"))[:1000], 150)
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                if self._closed:
                    return
                problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                if 200 <= status < 300:
                    self.sent += 1
                    log.debug("notify: %s notice sent", notice.kind)
                    return
                problem = f"HTTP {status}" + (f": {answer}" if answer else "")
                if status != 429 and status < 500:
                    # Sending it again would get the same answer (a wrong or revoked URL).
                    self._give_up(notice, problem, retried=False)
                    return
            self.last_error = self._redact.text(problem)
            if attempt == self.retry.attempts or self._closed:
                break
            delay = self._delay(attempt, retry_after)
            (log.warning if attempt == 1 else log.info)(
                "notify: the %s notice to %s failed (%s); attempt %d of %d in %.1fs",
                notice.kind,
                self.cfg.shown,
                self.last_error,
                attempt + 1,
                self.retry.attempts,
                delay,
            )
            await self._sleep(delay)
        self._give_up(notice, problem)

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        r = self.retry
        if retry_after is not None:
            # Never below the first pause: "Retry-After: 0" every time must not busy-loop.
            return max(r.first_s, min(retry_after, r.retry_after_max_s))
        return delay_s(attempt, first_s=r.first_s, cap_s=r.cap_s)

    def _give_up(self, notice: _Notice, problem: str, *, retried: bool = True) -> None:
        self.failed += 1
        self._lost.append(notice.index)
        self.last_error = self._redact.text(problem)
        why = (
            f"after {self.retry.attempts} attempts"
            if retried
            else "(not retried: check notify.webhook)"
        )
        log.error(
            "notify: gave up on the %s notice to %s %s: %s",
            notice.kind,
            self.cfg.shown,
            why,
            self.last_error,
        )

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    # ------------------------------------------------------------------ the daemon's side

    def _next_pending(self) -> float:
        if self._in_flight is not None:
            return self._in_flight.index
        return self._queue[0].index if self._queue else math.inf

    async def flush(self, timeout: float) -> bool:
        """Wait until every notice queued so far was sent or given up, at most ``timeout``
        seconds. True when all of them were delivered; False when the time ran out first or
        one was given up or dropped."""
        target = self._queued_total
        first = self._next_pending()
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self._next_pending() <= target:
            left = end - loop.time()
            if left <= 0:
                return False
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), left)
            except TimeoutError:
                return False
        return not any(first <= i <= target for i in self._lost)

    def status(self) -> dict[str, Any]:
        """For ``/status``: counts and the last error, never the URL."""
        return {
            "webhook": self.cfg.shown,
            "sent": self.sent,
            "failed": self.failed,
            "dropped": self.dropped,
            "queued": len(self._queue) + (self._in_flight is not None),
            "last_error": self.last_error,
        }

    async def close(self) -> None:
        """Stop sending (what is still queued is not sent) and close the HTTP session."""
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._session is not None:
            await self._session.close()
