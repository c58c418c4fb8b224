"""What happened, as a stream: phase changes, epochs, uploads, warnings, the teardown.

The daemon publishes; ``GET /events`` (server-sent events), the dashboard page and the webhook
notifier (:mod:`agent.status.notify`) subscribe. Publishing never blocks and never fails the
daemon: a
subscriber that does not keep up loses its oldest events (and is told how many, as a ``gap``
event) instead of growing without bound or slowing the run down.

Kinds (``Event.kind``) and their ``data``:

- ``job_started`` {job, phase}: an agent started on the job (``restarted``: True after a restart)
- ``phase`` {from, to, reason, note}: a phase change (every one, as in state.json's history)
- ``training_started`` {total_epochs, resumed}: a trainer was launched or resumed
- ``epoch`` {epoch, total_epochs, eta_s, loss, metric, metric_name}: an epoch ended
- ``best`` {epoch, metric, metric_name}: a new best checkpoint
- ``upload`` {path, epoch, size, ok, error}: an upload was verified (ok) or failed
- ``warning`` {message}: something needs a look (stall, budget/deadline projection, disk...)
- ``stall`` {message}: the trainer is stalled; ``resume`` {cause, epoch, why}: it is resumed
- ``preempted`` {source, message}: a preemption notice
- ``teardown`` {action, why, downgraded, provider}: the decision (``downgraded``: a destroy
  became a stop or a keep because the sync was not verified: the box keeps billing)
- ``teardown_sent`` {action}, ``teardown_confirmed`` {action, confirmed, detail}
- ``failure`` {reason, cause}: the run ended without completing
- ``done`` {reason, cause}: the job ended
- ``steering`` {action, ...}: extend, hold, release
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: Events kept for late subscribers (the page's first load, ``/events?since=``).
HISTORY = 500
#: Events a subscriber may have waiting before its oldest are dropped.
QUEUE = 1000


@dataclass(frozen=True)
class Event:
    seq: int
    at: float
    kind: str
    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "at": self.at, "kind": self.kind, "data": self.data}


class Subscription:
    """One subscriber's queue; iterate it (``async for event in sub``) or call :meth:`get`."""

    def __init__(self, bus: EventBus, maxsize: int) -> None:
        self._bus = bus
        self._queue: deque[Event] = deque()
        self._maxsize = maxsize
        self._wake = asyncio.Event()
        self.dropped = 0
        self.closed = False

    def _put(self, event: Event) -> None:
        if len(self._queue) >= self._maxsize:
            self._queue.popleft()
            self.dropped += 1
        self._queue.append(event)
        self._wake.set()

    async def get(self) -> Event:
        while not self._queue:
            if self.closed:
                raise StopAsyncIteration
            self._wake.clear()
            await self._wake.wait()
        if self.dropped:
            gap = Event(self._queue[0].seq, time.time(), "gap", {"dropped": self.dropped})
            self.dropped = 0
            return gap
        return self._queue.popleft()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        return await self.get()

    def close(self) -> None:
        self.closed = True
        self._wake.set()
        self._bus._subs.discard(self)


class EventBus:
    """In-process publish/subscribe on the daemon's event loop."""

    def __init__(self, *, history: int = HISTORY, clock: Callable[[], float] = time.time) -> None:
        self._history: deque[Event] = deque(maxlen=history)
        self._subs: set[Subscription] = set()
        self._seq = itertools.count(1)
        self._clock = clock
        self._listeners: list[Callable[[Event], None]] = []

    def publish(self, kind: str, **data: Any) -> Event:
        """Record and hand out one event. Call it from the event loop's thread."""
        event = Event(next(self._seq), self._clock(), kind, data)
        self._history.append(event)
        for sub in list(self._subs):
            sub._put(event)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a listener bug must never fail the daemon
                log.exception("event listener failed on %s", kind)
        return event

    def subscribe(self, *, since: int = 0, maxsize: int = QUEUE) -> Subscription:
        """A new subscriber; it first gets the kept events after ``since`` (a seq)."""
        sub = Subscription(self, maxsize)
        for event in self._history:
            if event.seq > since:
                sub._put(event)
        self._subs.add(sub)
        return sub

    def listen(self, listener: Callable[[Event], None]) -> None:
        """Call ``listener`` (synchronously, must not block) on every event."""
        self._listeners.append(listener)

    def recent(self, since: int = 0) -> list[Event]:
        return [e for e in self._history if e.seq > since]

    def close(self) -> None:
        for sub in list(self._subs):
            sub.close()
        with contextlib.suppress(Exception):
            self._listeners.clear()
