"""The local HTTP endpoint (loopback; reached through ``ssh -L 8421:localhost:8421``).

Every ``GET`` is open: ``/healthz``, ``/status`` (JSON), and the read-outs of
:mod:`agent.status.views` (``/metrics``, ``/events``, ``/logs``, ``/history`` and the dashboard
``/``). The control actions (``POST /stop``, ``/extend``, ``/hold``, ``/release``) need the bearer
token from the state directory (mode 0600), so another user on the box cannot end or steer
someone's run. An action gets the request body as text (at most :data:`MAX_ACTION_BODY_BYTES`;
more is answered 413); one that raises :class:`~agent.policy.steering.SteeringError` is answered
``{"ok": false, "error": message}`` with the error's status (400 a malformed request, 409 one
the run's present state refuses).

The endpoint must never be what stops the agent, whoever connects to it:

- **Connections are capped** (``max_connections``). At the cap, a new connection pushes out the
  one that has waited longest without a request in progress; only when every connection is busy
  with a request is the new one answered 503 and closed. Idle or slow connections therefore
  cannot lock out ``/healthz`` or hold the process's file descriptors (1,100 idle connections
  once took the whole agent down with EMFILE).
- **Request heads have a deadline**: a connection that has not sent a complete request head
  within ``header_timeout_s`` of connecting (slowloris), or within ``keepalive_timeout_s`` of its
  previous response, is closed. aiohttp has no header timeout, so it is kept here, around
  aiohttp's own protocol (:mod:`agent.status.connections`).
- **Only requests addressed to this agent are answered**: the ``Host`` header must name
  localhost, the bound address or the address the client connected to (any port); anything
  else gets 421. A web page on the user's laptop can reach the tunnel's local end, and with DNS
  rebinding could read ``/status`` under its own host name; it cannot choose the ``Host`` header.

An event stream is a request that lasts: it holds a connection slot, is never timed out (a
``: keepalive`` comment goes every ``sse_keepalive_s``) and ends when the server stops, but at the
cap it is pushed out before a newcomer is refused; the browser's EventSource reconnects with
``Last-Event-ID`` and misses nothing the bus still keeps.

None of this logs a line per connection: what was pushed out, refused or timed out is counted
(:meth:`StatusServer.connection_stats`); while connections are pushed out or refused, one
summary line is logged at most once per ``_SUMMARY_INTERVAL_S``, and one more at stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web

from agent.events import QUEUE, EventBus
from agent.policy.steering import SteeringError
from agent.status import views as metrics
from agent.status.connections import ConnectionGuard
from agent.status.views import HistoryFn, LogsFn, StatusFn

log = logging.getLogger(__name__)

#: A control action: gets the request body (text, possibly empty), returns the JSON answer;
#: raises :class:`~agent.policy.steering.SteeringError` for a request it cannot honour.
ActionFn = Callable[[str], Awaitable[dict[str, Any]]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: Connections held open at once; at the cap the longest-idle one is closed to make room.
DEFAULT_MAX_CONNECTIONS = 64
#: Seconds a new connection has to send a complete request head.
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: Seconds an open connection may wait after a response for its next complete request head.
DEFAULT_KEEPALIVE_TIMEOUT_S = 15.0
#: Host names always accepted in the Host header (with any port), besides the bound address.
LOCAL_HOST_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
#: The largest request body an action reads, bytes: a duration needs a few dozen.
MAX_ACTION_BODY_BYTES = 4096


def is_loopback(host: str) -> bool:
    """Whether a listen host only accepts connections from this machine.

    ``localhost`` and loopback IP literals (``127.0.0.0/8``, ``::1``, with or without brackets)
    are; wildcards (``0.0.0.0``, ``::``, ``""``, ``*``) and every other name or address are not.
    """
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_header_name(value: str) -> str | None:
    """The host of a ``Host`` header, lower-case, without port, brackets or a trailing dot.

    None when the header is malformed (a non-numeric port, an unclosed bracket).
    """
    text = value.strip().lower()
    if text.startswith("["):
        name, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not (rest[:1] == ":" and rest[1:].isdigit())):
            return None
        return name
    if text.count(":") > 1:
        return text  # a bare IPv6 address ("::1"): no port without brackets
    name, colon, port = text.partition(":")
    if colon and not port.isdigit():
        return None
    return name.removesuffix(".")


def _address_names(address: str) -> set[str]:
    """How a client may write ``address`` in a Host header (IPv4-mapped IPv6 both ways)."""
    name = address.strip().strip("[]").lower()
    if name in ("", "*"):
        return set()  # a wildcard bind: clients use the address they connected to
    names = {name}
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(name)
        names.add(str(ip))
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            names.add(str(ip.ipv4_mapped))
    return names


class StatusServer:
    """The agent's HTTP endpoint: aiohttp's application behind :class:`ConnectionGuard`.

    ``allowed_hosts`` adds names accepted in the ``Host`` header besides localhost, the bound
    ``host`` and the address each client connected to (e.g. a DNS name of the box when
    ``[server] allow_remote`` is set). The three limits are documented with their defaults.
    ``events``, ``logs`` and ``history`` feed ``/events``, ``/logs`` and ``/history`` (each
    answers 404 without its source); ``event_queue`` is how many events one stream may fall
    behind before its oldest are dropped (it then gets a ``gap`` event).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str,
        status: StatusFn,
        actions: dict[str, ActionFn],
        allowed_hosts: Iterable[str] = (),
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S,
        events: EventBus | None = None,
        logs: LogsFn | None = None,
        history: HistoryFn | None = None,
        sse_keepalive_s: float = metrics.DEFAULT_SSE_KEEPALIVE_S,
        event_queue: int = QUEUE,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        self.host = host
        self.port = port
        self._token = token
        self._status = status
        self._actions = actions
        self._max_connections = max_connections
        self._header_timeout_s = header_timeout_s
        self._keepalive_timeout_s = keepalive_timeout_s
        self._views = metrics.Views(
            status=status,
            events=events,
            logs=logs,
            history=history,
            sse_keepalive_s=sse_keepalive_s,
            event_queue=event_queue,
            stream_started=self._stream_started,
        )
        self._allowed_names = set(LOCAL_HOST_NAMES) | _address_names(host)
        for name in allowed_hosts:
            self._allowed_names |= _address_names(name)
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self._guard: ConnectionGuard | None = None
        self.bound_port: int | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        app.on_response_prepare.append(metrics.common_headers)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/status", self._get_status)
        self._views.add_routes(app.router)
        for name in self._actions:
            app.router.add_post(f"/{name}", self._make_action(name))
        return app

    async def start(self) -> int:
        self._views.open()
        self._runner = web.AppRunner(
            self.app(),
            access_log=None,
            handle_signals=False,
            keepalive_timeout=self._keepalive_timeout_s,
        )
        await self._runner.setup()
        aiohttp_server = self._runner.server
        assert aiohttp_server is not None
        self._guard = ConnectionGuard(
            aiohttp_server,
            max_connections=self._max_connections,
            header_timeout_s=self._header_timeout_s,
            keepalive_timeout_s=self._keepalive_timeout_s,
        )
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                self._guard.protocol_factory, self.host, self.port, reuse_address=True
            )
        except BaseException:
            await self._runner.cleanup()
            self._runner = None
            raise
        sockets = self._server.sockets
        self.bound_port = int(sockets[0].getsockname()[1]) if sockets else self.port
        log.info("http listening on http://%s:%d", self.host, self.bound_port)
        if not is_loopback(self.host):
            log.warning(
                "http listens on %s:%d, which is not a loopback address: anyone who can reach "
                "it can read /status (control requests still need the token)",
                self.host or "*",
                self.bound_port,
            )
        return self.bound_port

    async def stop(self) -> None:
        # 1. Stop accepting, end the event streams and close the connections with no request
        # in progress. 2. Let aiohttp finish the requests in progress and close their
        # connections. 3. Close what is left (connections that never made it to aiohttp's books).
        if self._server is not None:
            await self._stop_accepting(self._server)
            self._server.close()
        self._views.close()
        if self._guard is not None:
            # aiohttp wakes an idle handler to close it only once the handler waits for a
            # request: one accepted a moment before whose task had not started yet would wait
            # for aiohttp's shutdown timeout (60 s) before the agent could exit.
            self._guard.close_idle()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._guard is not None:
            self._guard.close_all()
            self._guard.flush_summary()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            self._server = None

    @staticmethod
    async def _stop_accepting(server: asyncio.Server) -> None:
        """Take the listening sockets off the loop, then give the connections already accepted
        one turn to be set up. asyncio accepts in one turn and sets a connection up in the next;
        a server closed in between refuses the set-up (an assertion in ``Server._attach``,
        logged as "Error on transport creation for incoming connection") and the accepted
        socket stays open, nobody's, until the garbage collector finds it."""
        loop = asyncio.get_running_loop()
        for sock in server.sockets:
            with contextlib.suppress(NotImplementedError, ValueError):  # not a selector loop
                loop.remove_reader(sock.fileno())
        # The accepts that ran before this step queued their set-up ahead of it: one turn runs them.
        await asyncio.sleep(0)

    def connection_stats(self) -> dict[str, int]:
        """Open connections, and totals of those pushed out, refused and timed out."""
        if self._guard is None:
            return {"open": 0, "pushed_out": 0, "refused": 0, "header_timeouts": 0}
        return {"open": self._guard.open_count, **self._guard.totals}

    # ---- requests --------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        guard = self._guard
        transport = request.transport
        if guard is not None:
            guard.request_started(transport)
        try:
            if not self._host_allowed(request):
                return web.json_response(
                    {
                        "error": "misdirected_request",
                        "message": "this agent answers only requests addressed to localhost "
                        "or its own address (the Host header)",
                    },
                    status=421,
                )
            return await handler(request)
        finally:
            if guard is not None:
                guard.request_finished(transport)

    def _host_allowed(self, request: web.Request) -> bool:
        header = request.headers.get("Host")
        if header is None:
            return True  # HTTP/1.0 without Host: not a browser, so not a rebinding page
        name = host_header_name(header)
        if name is None:
            return False
        if name in self._allowed_names:
            return True
        # The address the client connected to (a wildcard bind reached by its IP).
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        return isinstance(sockname, tuple) and name in _address_names(str(sockname[0]))

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _get_status(self, request: web.Request) -> web.Response:
        return metrics.json_answer(self._status())

    def _stream_started(self, request: web.Request, on_lost: Callable[[], None]) -> None:
        if self._guard is not None:
            self._guard.stream_started(request.transport, on_lost)

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self._token.encode()
        )

    def _make_action(self, name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            if not self._authorized(request):
                return web.json_response(
                    {
                        "error": "unauthorized",
                        "message": "send Authorization: Bearer <token>; the token is in the "
                        "agent's state directory (file 'token')",
                    },
                    status=401,
                )
            body = await _read_body(request)
            if isinstance(body, web.Response):
                return body
            log.info("control request: %s", name)
            try:
                answer = await self._actions[name](body)
            except SteeringError as exc:
                log.info("control request %s refused (HTTP %d): %s", name, exc.status, exc)
                return web.json_response({"ok": False, "error": str(exc)}, status=exc.status)
            return web.json_response(answer)

        return handler


async def _read_body(request: web.Request) -> str | web.Response:
    """The body of a control request as text, or the error answer (413 too big, 400 not UTF-8).

    The declared length is checked before anything is read; a chunked body is read up to the
    limit only, so a client cannot make the agent buffer more than that."""
    too_big = web.json_response(
        {
            "ok": False,
            "error": f"the request body is larger than {MAX_ACTION_BODY_BYTES} bytes; a control "
            'request needs only a duration like "2h"',
        },
        status=413,
    )
    length = request.content_length
    if length is not None and length > MAX_ACTION_BODY_BYTES:
        return too_big
    data = bytearray()
    while chunk := await request.content.read(MAX_ACTION_BODY_BYTES + 1 - len(data)):
        data += chunk
        if len(data) > MAX_ACTION_BODY_BYTES:
            return too_big
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return web.json_response(
            {"ok": False, "error": "the request body is not UTF-8 text; send a duration like 2h"},
            status=400,
        )
