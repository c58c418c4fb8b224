"""Fake cloud metadata servers on 127.0.0.1: the AWS instance metadata service (IMDSv2, the spot
``instance-action``) and the GCP metadata server (``instance/preempted``, with its long poll).
As strict as the real ones about what they check, so the agent's client is held to the real
contract. Each runs in a background thread with its own event loop (the pattern, and the code,
of :mod:`tests.fakes.providers`), so sync tests, async tests and benchmarks can all use it::

    from tests.fakes.metadata import run_fake_gce, run_fake_imds

    with run_fake_imds() as imds:
        ... PreemptionSection(aws=True, aws_url=imds.url) ...
        imds.notice("terminate")                 # the spot notice appears
        assert imds.count("token", 200) == 1

What both fakes do
    - ``url``: ``http://127.0.0.1:PORT`` (what ``preemption.aws_url`` / ``gcp_url`` take);
    - ``requests``: every request as :class:`Request` (method, route, path, query, headers,
      status, arrival time); ``count(route=None, status=None)``, ``calls(route)``,
      ``clear_requests()``;
    - ``fail_next(n=1, status=500, route="*")``: answer the next ``n`` requests (of ``route``,
      or any) with ``status`` instead, before any other check; returns the :class:`Fault`,
      whose ``hits`` counts;
    - ``notice(...)`` flips to "the box is going away", ``clear()`` back. Thread-safe.

AWS IMDSv2 (:class:`FakeIMDS`, routes ``token`` and ``instance-action``)
    - ``PUT /latest/api/token`` needs ``X-aws-ec2-metadata-token-ttl-seconds`` (1..21600,
      else 400); one carrying ``X-Forwarded-For`` is refused (403); any other method -> 405.
      Answers the token as text, and the TTL granted in the same header: the TTL asked, or
      ``token_ttl_s`` when that is shorter (the knob that makes tokens expire in tests);
    - ``GET /latest/meta-data/spot/instance-action``: ``X-aws-ec2-metadata-token`` must be a
      token it issued, unexpired (else 401); without one, 401 (``v2_only``, the default; with
      ``v2_only=False`` the IMDSv1 GET is answered). 404 while nothing is scheduled, 200
      ``{"action": ..., "time": ...}`` after ``notice(action="terminate", time=None)``
      (``time`` defaults to two minutes from now, ``YYYY-MM-DDTHH:MM:SSZ``);
    - ``expire_tokens()``: every token issued so far is expired from now on.

GCP metadata (:class:`FakeGCE`, route ``preempted``)
    - ``GET /computeMetadata/v1/instance/preempted`` needs ``Metadata-Flavor: Google`` (else
      403); ``X-Forwarded-For`` is refused (403). Answers ``FALSE`` or ``TRUE`` (after
      ``notice()``) with ``Metadata-Flavor: Google`` and an ``ETag`` (a hash of the value);
    - ``?wait_for_change=true``: holds the request until the value's ETag differs from
      ``last_etag`` (from the current one when none is given; a ``last_etag`` that already
      differs answers at once) or ``timeout_sec`` (a positive integer, else 400) has passed;
      ``waiting`` counts the requests held right now;
    - ``flavor_header=False``: answers lack ``Metadata-Flavor`` (something that is not a
      metadata server answering at its address).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from aiohttp import web

from tests.fakes.providers import serve

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MAX_TTL_S = 21600


@dataclass
class Request:
    """One request a fake received."""

    method: str
    #: The route's name (``token``, ``instance-action``, ``preempted``), ``?`` for others.
    route: str
    path: str
    query: dict[str, str]
    #: Header names lowercased.
    headers: dict[str, str]
    status: int = 0
    #: ``time.monotonic()`` when it arrived.
    at: float = field(default_factory=time.monotonic)


@dataclass
class Fault:
    route: str
    times: int
    status: int
    hits: int = 0

    def take(self, route: str) -> bool:
        if self.route not in (route, "*") or self.hits >= self.times:
            return False
        self.hits += 1
        return True


class FakeMetadata:
    """Shared machinery: the request log, faults, the server loop. Subclasses add routes."""

    kind = "metadata"

    def __init__(self) -> None:
        self.url = ""
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self._faults: list[Fault] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ test-side helpers

    def fail_next(self, n: int = 1, status: int = 500, route: str = "*") -> Fault:
        fault = Fault(route, n, status)
        with self.lock:
            self._faults.append(fault)
        return fault

    def count(self, route: str | None = None, status: int | None = None) -> int:
        with self.lock:
            return sum(
                1
                for r in self.requests
                if (route is None or r.route == route) and (status is None or r.status == status)
            )

    def calls(self, route: str) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if r.route == route]

    def clear_requests(self) -> None:
        with self.lock:
            self.requests.clear()

    # ------------------------------------------------------------------ subclass hooks

    def routes(self) -> list[tuple[str, str, str, Handler]]:
        raise NotImplementedError

    def error(self, status: int) -> web.Response:
        return web.Response(status=status, text=f"{status} - error\n", content_type="text/plain")

    async def started(self) -> None:
        """In the server's loop, once it runs."""

    async def stopping(self) -> None:
        """In the server's loop, when it shuts down."""

    # ------------------------------------------------------------------ the server

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        for method, path, name, handler in self.routes():
            app.router.add_route(method, path, handler, name=name)

        async def on_startup(app: web.Application) -> None:
            self._loop = asyncio.get_running_loop()
            await self.started()

        async def on_shutdown(app: web.Application) -> None:
            await self.stopping()

        app.on_startup.append(on_startup)
        app.on_shutdown.append(on_shutdown)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.name or "?"
        call = Request(
            request.method,
            route,
            request.path,
            dict(request.query),
            {k.lower(): v for k, v in request.headers.items()},
        )
        with self.lock:
            self.requests.append(call)
            fault = next((f for f in self._faults if f.take(route)), None)
        try:
            response = self.error(fault.status) if fault else await handler(request)
        except web.HTTPException as exc:  # no such route, or the wrong method
            call.status = exc.status
            raise
        call.status = response.status
        return response

    def wake(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the server's loop (from any thread)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closing
                loop.call_soon_threadsafe(fn)


# --------------------------------------------------------------------------------------------
# AWS IMDSv2


def _html(status: int, title: str) -> web.Response:
    body = (
        '<?xml version="1.0" encoding="iso-8859-1"?>\n<!DOCTYPE html>\n<html><head><title>'
        f"{status} - {title}</title></head><body><h1>{status} - {title}</h1></body></html>\n"
    )
    return web.Response(status=status, text=body, content_type="text/html")


class FakeIMDS(FakeMetadata):
    kind = "imds"

    def __init__(self, *, token_ttl_s: int | None = None, v2_only: bool = True) -> None:
        super().__init__()
        #: The longest TTL granted (None: what is asked, up to 21600).
        self.token_ttl_s = token_ttl_s
        self.v2_only = v2_only
        self._tokens: dict[str, float] = {}
        self._action: dict[str, str] | None = None

    def notice(self, action: str = "terminate", time: str | None = None) -> None:
        when = time or (datetime.now(UTC) + timedelta(minutes=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
        with self.lock:
            self._action = {"action": action, "time": when}

    def clear(self) -> None:
        with self.lock:
            self._action = None

    def expire_tokens(self) -> None:
        with self.lock:
            for token in self._tokens:
                self._tokens[token] = 0.0

    def routes(self) -> list[tuple[str, str, str, Handler]]:
        return [
            ("*", "/latest/api/token", "token", self._token),
            ("GET", "/latest/meta-data/spot/instance-action", "instance-action", self._action_),
        ]

    def error(self, status: int) -> web.Response:
        titles = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found"}
        return _html(status, titles.get(status, "Internal Server Error"))

    async def _token(self, request: web.Request) -> web.Response:
        if request.method != "PUT":
            return _html(405, "Method Not Allowed")
        if "X-Forwarded-For" in request.headers:
            return _html(403, "Forbidden")
        try:
            ttl = int(request.headers.get(TTL_HEADER, ""))
        except ValueError:
            return _html(400, "Bad Request")
        if not 1 <= ttl <= MAX_TTL_S:
            return _html(400, "Bad Request")
        if self.token_ttl_s is not None:
            ttl = min(ttl, self.token_ttl_s)
        token = base64.b64encode(b"\x01\x00" + os.urandom(40)).decode()
        with self.lock:
            self._tokens[token] = time.monotonic() + ttl
        response = web.Response(text=token, content_type="text/plain")
        response.headers[TTL_HEADER] = str(ttl)
        return response

    async def _action_(self, request: web.Request) -> web.Response:
        token = request.headers.get(TOKEN_HEADER)
        with self.lock:
            if token is not None:
                if self._tokens.get(token, 0.0) <= time.monotonic():
                    return _html(401, "Unauthorized")
            elif self.v2_only:
                return _html(401, "Unauthorized")
            action = dict(self._action) if self._action is not None else None
        if action is None:
            return _html(404, "Not Found")
        return web.Response(text=json.dumps(action), content_type="text/plain")


# --------------------------------------------------------------------------------------------
# GCP metadata server


def etag_of(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


class FakeGCE(FakeMetadata):
    kind = "gce"

    def __init__(self, *, flavor_header: bool = True) -> None:
        super().__init__()
        self.flavor_header = flavor_header
        self._value = "FALSE"
        self._waiting = 0
        self._closing = False
        # Set (and replaced) in the server's loop at each change.
        self._changed: asyncio.Event | None = None

    @property
    def value(self) -> str:
        with self.lock:
            return self._value

    @property
    def waiting(self) -> int:
        """Long polls held right now."""
        with self.lock:
            return self._waiting

    def notice(self) -> None:
        self._set("TRUE")

    def clear(self) -> None:
        self._set("FALSE")

    def _set(self, value: str) -> None:
        with self.lock:
            self._value = value
        self.wake(self._signal)

    def _signal(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        if old is not None:
            old.set()

    async def started(self) -> None:
        self._changed = asyncio.Event()

    async def stopping(self) -> None:
        self._closing = True
        self._signal()

    def routes(self) -> list[tuple[str, str, str, Handler]]:
        return [("GET", "/computeMetadata/v1/instance/preempted", "preempted", self._preempted)]

    def _answer(self, status: int, text: str, etag: str | None = None) -> web.Response:
        response = web.Response(status=status, text=text, content_type="application/text")
        if self.flavor_header:
            response.headers["Metadata-Flavor"] = "Google"
        if etag is not None:
            response.headers["ETag"] = etag
        return response

    def error(self, status: int) -> web.Response:
        return self._answer(status, f"{status} error\n")

    async def _preempted(self, request: web.Request) -> web.Response:
        if "X-Forwarded-For" in request.headers:
            return self._answer(403, "Forbidden: X-Forwarded-For\n")
        if request.headers.get("Metadata-Flavor") != "Google":
            return self._answer(403, "Missing Metadata-Flavor:Google header.\n")
        wait = request.query.get("wait_for_change", "false").lower()
        if wait not in ("true", "false"):
            return self._answer(400, "wait_for_change must be true or false\n")
        deadline: float | None = None
        if "timeout_sec" in request.query:
            try:
                timeout = int(request.query["timeout_sec"])
            except ValueError:
                timeout = 0
            if timeout <= 0:
                return self._answer(400, "timeout_sec must be a positive integer\n")
            deadline = time.monotonic() + timeout
        if wait == "true":
            await self._wait(request.query.get("last_etag") or etag_of(self.value), deadline)
        value = self.value
        return self._answer(200, value, etag_of(value))

    async def _wait(self, last_etag: str, deadline: float | None) -> None:
        with self.lock:
            self._waiting += 1
        try:
            # Reading the value and taking the event happen in one step of the loop, and a
            # change sets the value before it sets the event: no change is missed.
            while etag_of(self.value) == last_etag and not self._closing:
                event = self._changed
                assert event is not None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), left)
        finally:
            with self.lock:
                self._waiting -= 1


# --------------------------------------------------------------------------------------------
# Running a fake


def run_fake_imds(
    *, token_ttl_s: int | None = None, v2_only: bool = True
) -> contextlib.AbstractContextManager[FakeIMDS]:
    """A :class:`FakeIMDS` on 127.0.0.1 (a free port) for the ``with`` block."""
    return serve(FakeIMDS(token_ttl_s=token_ttl_s, v2_only=v2_only))  # type: ignore[type-var]


def run_fake_gce(*, flavor_header: bool = True) -> contextlib.AbstractContextManager[FakeGCE]:
    """A :class:`FakeGCE` on 127.0.0.1 (a free port) for the ``with`` block."""
    return serve(FakeGCE(flavor_header=flavor_header))  # type: ignore[type-var]


def closed_port_url() -> str:
    """``http://127.0.0.1:PORT`` where nothing listens (a port bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
