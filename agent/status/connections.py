"""The HTTP endpoint's connections: a cap, a deadline for each request head, and counts.

aiohttp has neither a connection cap nor a header timeout, so :class:`ConnectionGuard` wraps
aiohttp's protocol in a :class:`Connection` of its own for every accepted socket
(:mod:`agent.status.server` says why the endpoint needs them). At the cap the connection that
has waited longest without a request is pushed out; only when every one is busy is a newcomer
answered 503 (:class:`_Busy`). Nothing logs a line per connection: what was pushed out, refused
or timed out is counted, and summarized at most once per :data:`_SUMMARY_INTERVAL_S`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

log = logging.getLogger(__name__)

#: At most one summary line of closed/refused connections per this many seconds.
_SUMMARY_INTERVAL_S = 60.0

_BUSY_BODY = json.dumps(
    {"error": "busy", "message": "every connection is serving a request; try again"}
).encode()
_BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/json\r\n"
    b"Retry-After: 1\r\n"
    b"Connection: close\r\n"
    b"Content-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY
)


class Connection(asyncio.Protocol):
    """One accepted connection: aiohttp's request handler inside, a deadline for the next
    complete request head outside. asyncio calls these methods; all are passed on."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self._guard = guard
        self._inner = inner
        self.transport: asyncio.Transport | None = None
        self.deadline: asyncio.TimerHandle | None = None
        #: True while a request is being handled: never pushed out or timed out then.
        self.busy = False
        #: The deadline is the first one (since connect), not the one after a response.
        self.awaiting_first = True
        #: aiohttp's handler was given the connection (connection_made passed on).
        self.handed_over = False
        #: Called once when the connection goes (closed by either side): a live event stream
        #: learns at once that nobody listens any more.
        self.on_lost: Callable[[], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        # One closed before it was set up (pushed out, timed out, the server stopping) never
        # reaches aiohttp: its handler would start after the connection is lost.
        self.handed_over = self._guard.connected(self)
        if self.handed_over:
            self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard.disconnected(self)
        if self.handed_over:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class _Busy(asyncio.Protocol):
    """A connection over the cap while every slot serves a request: 503, then closed.

    Closing at once, with the request unread, would make the kernel answer RST, and the client
    could lose the 503: so half-close, discard what comes until the client's EOF, 1 s at most.
    """

    def __init__(self, linger_s: float = 1.0) -> None:
        self._linger_s = linger_s
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_BUSY_RESPONSE)
        transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(self._linger_s, transport.abort)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not read: it is refused whatever it says

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


class ConnectionGuard:
    """Counts connections, keeps them under the cap, and closes those that send no request."""

    def __init__(
        self,
        inner_factory: Callable[[], asyncio.Protocol],
        *,
        max_connections: int,
        header_timeout_s: float,
        keepalive_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._inner_factory = inner_factory
        self._max = max_connections
        self._header_timeout_s = header_timeout_s
        self._keepalive_timeout_s = keepalive_timeout_s
        self._clock = clock
        self._loop = asyncio.get_running_loop()
        #: Every connection holding a slot (accepted and not yet closed by us or the peer).
        self._open: set[Connection] = set()
        #: Slot holders with no request in progress, longest-waiting first.
        self._idle: OrderedDict[Connection, None] = OrderedDict()
        #: Slot holders serving an event stream, oldest first: busy, but pushed out before a
        #: newcomer is refused (an EventSource reconnects by itself, with Last-Event-ID).
        self._streams: OrderedDict[Connection, None] = OrderedDict()
        self._by_transport: dict[asyncio.BaseTransport, Connection] = {}
        self.totals = {"pushed_out": 0, "refused": 0, "header_timeouts": 0}
        self._unreported = dict.fromkeys(self.totals, 0)
        self._last_summary: float | None = None

    # ---- asyncio's side --------------------------------------------------------------------

    def protocol_factory(self) -> asyncio.Protocol:
        """Called by the event loop for every accepted socket."""
        if len(self._open) >= self._max:
            victim = next(iter(self._idle), None) or next(iter(self._streams), None)
            if victim is None:
                self._count("refused")
                return _Busy()
            self._count("pushed_out")
            self._close(victim)
        conn = Connection(self, self._inner_factory())
        # Counted from here, not from connection_made: a connection the loop never finishes
        # setting up still times out and frees its slot.
        self._open.add(conn)
        self._idle[conn] = None
        self._arm(conn, self._header_timeout_s)
        return conn

    def connected(self, conn: Connection) -> bool:
        """A connection is set up: False if it was closed before (it is aborted now)."""
        assert conn.transport is not None
        if conn not in self._open:  # pushed out, timed out or stopped before it was set up
            conn.transport.abort()
            return False
        self._by_transport[conn.transport] = conn
        return True

    def disconnected(self, conn: Connection) -> None:
        self._forget(conn)
        if conn.transport is not None:
            self._by_transport.pop(conn.transport, None)

    # ---- aiohttp's side (the middleware) ---------------------------------------------------

    def request_started(self, transport: asyncio.BaseTransport | None) -> None:
        conn = self._by_transport.get(transport) if transport is not None else None
        if conn is None:
            return
        self._disarm(conn)
        self._idle.pop(conn, None)
        conn.busy = True

    def stream_started(
        self, transport: asyncio.BaseTransport | None, on_lost: Callable[[], None]
    ) -> None:
        """The request on ``transport`` is a long-lived stream: no deadline (it is busy), but
        the first to be pushed out at the cap; ``on_lost`` is called when the connection goes."""
        conn = self._by_transport.get(transport) if transport is not None else None
        if conn is None or conn not in self._open:
            on_lost()
            return
        conn.on_lost = on_lost
        self._streams[conn] = None

    def request_finished(self, transport: asyncio.BaseTransport | None) -> None:
        conn = self._by_transport.get(transport) if transport is not None else None
        if conn is None or conn not in self._open:
            return
        self._streams.pop(conn, None)
        conn.on_lost = None
        conn.busy = False
        conn.awaiting_first = False
        self._idle[conn] = None
        self._idle.move_to_end(conn)
        self._arm(conn, self._keepalive_timeout_s)

    # ---- shared ----------------------------------------------------------------------------

    @property
    def open_count(self) -> int:
        return len(self._open)

    def close_idle(self) -> None:
        """Close every connection with no request in progress (the server stops): one between
        requests, and one accepted and not set up yet."""
        for conn in list(self._idle):
            self._close(conn)

    def close_all(self) -> None:
        for conn in list(self._open):
            self._close(conn)

    def flush_summary(self) -> None:
        """Log what has not been reported yet (on shutdown)."""
        if self._under_pressure():
            self._summarize()

    def _arm(self, conn: Connection, timeout_s: float) -> None:
        self._disarm(conn)
        conn.deadline = self._loop.call_later(timeout_s, self._expire, conn)

    def _disarm(self, conn: Connection) -> None:
        if conn.deadline is not None:
            conn.deadline.cancel()
            conn.deadline = None

    def _expire(self, conn: Connection) -> None:
        conn.deadline = None
        if conn.busy or conn not in self._open:
            return
        if conn.awaiting_first:
            self._count("header_timeouts")
        self._close(conn)

    def _close(self, conn: Connection) -> None:
        # abort, not close: a peer that does not read must not keep the socket open.
        self._forget(conn)
        if conn.transport is not None:
            conn.transport.abort()

    def _forget(self, conn: Connection) -> None:
        self._disarm(conn)
        self._open.discard(conn)
        self._idle.pop(conn, None)
        self._streams.pop(conn, None)
        on_lost, conn.on_lost = conn.on_lost, None
        if on_lost is not None:
            on_lost()

    def _count(self, what: str) -> None:
        self.totals[what] += 1
        self._unreported[what] += 1
        last = self._last_summary
        if self._under_pressure() and (last is None or self._clock() - last >= _SUMMARY_INTERVAL_S):
            self._summarize()

    def _under_pressure(self) -> bool:
        # Header timeouts alone are not logged: browsers open spare connections that never
        # send a request (preconnect), and below the cap a slow client harms no one.
        return bool(self._unreported["pushed_out"] or self._unreported["refused"])

    def _summarize(self) -> None:
        now = self._clock()
        since = (
            "" if self._last_summary is None else f" in the last {now - self._last_summary:.0f}s"
        )
        counts = self._unreported
        log.warning(
            "http connections%s: %d pushed out at the cap of %d, %d refused (all busy), "
            "%d sent no request head within %.0fs",
            since,
            counts["pushed_out"],
            self._max,
            counts["refused"],
            counts["header_timeouts"],
            self._header_timeout_s,
        )
        self._unreported = dict.fromkeys(self.totals, 0)
        self._last_summary = now
