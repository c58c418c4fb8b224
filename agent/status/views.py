"""What the HTTP endpoint shows, besides ``/status`` itself: the read-only routes, while
:mod:`agent.status.server` keeps the connections, the Host check and the control actions.

- ``GET /metrics``: the Prometheus exposition of the /status document (:func:`render`).
- ``GET /events``: server-sent events from the :class:`~agent.events.EventBus`, from
  ``Last-Event-ID`` or ``?since=``, with ``: keepalive`` comments while quiet.
- ``GET /logs?tail=N``: the last lines of agent.log and trainer.log (:func:`tail_lines`),
  redacted like agent.log itself.
- ``GET /history``: the run's metrics.jsonl rows, for the page's chart.
- ``GET /``: the dashboard, ``agent/status/static/index.html``, under a strict
  Content-Security-Policy (:data:`PAGE_CSP`).

The exposition is built from the document alone, by a collector on a fresh registry per
scrape: no global registry, no process metrics, nothing kept between scrapes, so it can never
say something ``/status`` does not. A value the document lacks (no ETA before the first epoch,
no price, no deadline) is left out, never invented: a missing series is what Prometheus
understands as "unknown", while a 0 would be a lie on a dashboard.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web

from agent.events import QUEUE, Event, EventBus, Subscription
from agent.util import redact as redaction
from agent.util.text import os_error
from agent.util.threads import in_thread

log = logging.getLogger(__name__)

#: The /status document, as ``GET /status`` serves it.
StatusFn = Callable[[], dict[str, Any]]
#: The last ``n`` lines of each log by name (``{"agent": [...], "trainer": [...]}``), redacted;
#: called in a thread (:func:`tail_lines` reads one file).
LogsFn = Callable[[int], dict[str, list[str]]]
#: The run's metrics.jsonl rows, oldest first; called in a thread.
HistoryFn = Callable[[], list[dict[str, Any]]]

#: The classic text format (0.0.4): what every Prometheus version scrapes.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: :func:`tail_lines` reads the end of a file in blocks of this many bytes.
TAIL_BLOCK_BYTES = 64 * 1024
#: :func:`tail_lines` never reads more than this many bytes from the end of a file, however
#: many lines are asked for (a multi-GB trainer log of progress bars is never loaded whole).
TAIL_MAX_BYTES = 8 * 1024 * 1024
#: A line of a log tail longer than this many characters is cut (and ends with ``...``).
TAIL_MAX_LINE_CHARS = 4000
#: ``GET /logs``: lines per log without ``tail``, and the most ``tail`` may ask for.
DEFAULT_LOG_TAIL = 200
MAX_LOG_TAIL = 5000
#: Seconds ``/logs`` and ``/history`` wait for their reading thread (a hung disk) before 503.
READ_TIMEOUT_S = 10.0

#: Seconds between ``: keepalive`` comments on a quiet event stream (proxies and the SSH
#: tunnel close silent connections; the browser notices a dead one).
DEFAULT_SSE_KEEPALIVE_S = 15.0
#: Milliseconds an EventSource waits before it reconnects (the ``retry:`` field).
SSE_RETRY_MS = 2000
#: The dashboard may run its own inline script and style, and talk to this agent only.
PAGE_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)


def render(doc: Mapping[str, Any], *, now: float | None = None) -> bytes:
    """The Prometheus text exposition (:data:`CONTENT_TYPE`) of a ``/status`` document.

    ``now`` (epoch seconds) is what ``libreyolo_agent_time_to_deadline_seconds`` counts from:
    the document's own ``now`` when it has one, else ``now``, else the wall clock.
    ``prometheus_client`` is imported here, on the first scrape (:mod:`agent.status.prometheus`).
    """
    from agent.status.prometheus import render as render_exposition

    return render_exposition(doc, now=now)


# ---- log tails -------------------------------------------------------------------------------


def redact_line(line: str) -> str:
    """``line`` with every secret the agent read from the environment replaced by
    ``<VARIABLE>``, and every other secret removed: the same redaction agent.log gets
    (:func:`agent.util.redact.redact`)."""
    return redaction.redact(line)


def tail_lines(path: str | os.PathLike[str], n: int) -> list[str]:
    """The last ``n`` lines of the text file ``path``, oldest first, each redacted
    (:func:`redact_line`). [] for a missing file; other ``OSError`` propagate.

    Only the end of the file is read, block by block from the end and at most
    :data:`TAIL_MAX_BYTES`: a multi-GB log costs no more than a small one. A line holding
    carriage returns (a progress bar redrawn in place) shows its last segment, as a terminal
    would; a line past :data:`TAIL_MAX_LINE_CHARS` is cut. Bytes that are not UTF-8 come out
    as U+FFFD.
    """
    if n <= 0:
        return []
    try:
        with open(Path(path), "rb") as f:
            data, whole = _read_tail(f.fileno(), n)
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the file ends with a newline: no empty last line
    if not whole and lines:
        # It starts mid-line: not a whole line, and a secret cut in two would not be redacted.
        lines.pop(0)
    out: list[str] = []
    for raw in lines[-n:]:
        # Redacted before it is cut or split: a secret never survives half-visible.
        text = redact_line(raw.decode("utf-8", errors="replace"))
        text = text.rstrip("\r").rpartition("\r")[2]
        if len(text) > TAIL_MAX_LINE_CHARS:
            text = text[: TAIL_MAX_LINE_CHARS - 3] + "..."
        out.append(text)
    return out


def _read_tail(fd: int, n: int) -> tuple[bytes, bool]:
    """The end of the file ``fd``: blocks read from its end until they hold more than ``n``
    newlines, the file's start or :data:`TAIL_MAX_BYTES`. True when the file's start was read."""
    pos = os.fstat(fd).st_size
    chunks: list[bytes] = []
    newlines = read = 0
    while pos > 0 and newlines <= n and read < TAIL_MAX_BYTES:
        step = min(TAIL_BLOCK_BYTES, pos, TAIL_MAX_BYTES - read)
        pos -= step
        chunk = os.pread(fd, step, pos)
        if not chunk:  # the file shrank under us (truncated): what was read is the tail
            break
        chunks.append(chunk)
        newlines += chunk.count(b"\n")
        read += len(chunk)
    return b"".join(reversed(chunks)), pos == 0


def finite_json(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None: browsers' ``JSON.parse`` rejects
    the ``NaN`` that Python's ``json`` writes (a diverged loss is NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


# ---- the routes --------------------------------------------------------------------------------


class Views:
    """The read-only routes. ``events``, ``logs`` and ``history`` may be None: their route then
    answers 404. ``event_queue``: how many events one stream may fall behind before its oldest
    are dropped (it then gets a ``gap`` event). Every stream ends at :meth:`close`;
    ``stream_started(request, on_lost)`` tells the connection guard that a request is a stream
    (and who to call when its connection goes)."""

    def __init__(
        self,
        *,
        status: StatusFn,
        events: EventBus | None,
        logs: LogsFn | None,
        history: HistoryFn | None,
        stream_started: Callable[[web.Request, Callable[[], None]], None],
        sse_keepalive_s: float = DEFAULT_SSE_KEEPALIVE_S,
        event_queue: int = QUEUE,
    ) -> None:
        self._status = status
        self._events = events
        self._logs = logs
        self._history = history
        self._stopping = asyncio.Event()
        self._stream_started = stream_started
        self._sse_keepalive_s = sse_keepalive_s
        self._event_queue = event_queue

    def open(self) -> None:
        """Before serving (again): a fresh event, bound to the loop that serves."""
        self._stopping = asyncio.Event()

    def close(self) -> None:
        """End every event stream (the server stops)."""
        self._stopping.set()

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/", self.index)
        router.add_get("/metrics", self.get_metrics)
        router.add_get("/events", self.get_events, allow_head=False)
        router.add_get("/logs", self.get_logs)
        router.add_get("/history", self.get_history)

    async def get_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=render(self._status()), headers={"Content-Type": CONTENT_TYPE})

    async def index(self, request: web.Request) -> web.Response:
        try:
            page = resources.files("agent.status").joinpath("static", "index.html").read_bytes()
        except OSError as exc:
            log.warning("dashboard page unavailable: %s", os_error(exc))
            return web.Response(status=404, text="the dashboard page is not installed\n")
        return web.Response(
            body=page,
            content_type="text/html",
            charset="utf-8",
            headers={"Content-Security-Policy": PAGE_CSP, "X-Frame-Options": "DENY"},
        )

    async def get_logs(self, request: web.Request) -> web.Response:
        if self._logs is None:
            return _not_available("logs")
        raw = request.query.get("tail", str(DEFAULT_LOG_TAIL))
        if not (raw.isascii() and raw.isdigit() and int(raw) <= MAX_LOG_TAIL):
            return _bad_request(f"tail must be a whole number from 0 to {MAX_LOG_TAIL}", raw)
        logs, n = self._logs, int(raw)
        answer = await _read(lambda: logs(n), "logs")
        if isinstance(answer, web.Response):
            return answer
        # Redacted here again: whatever the source, nothing unredacted leaves.
        return json_answer(
            {name: [redact_line(str(line)) for line in lines] for name, lines in answer.items()}
        )

    async def get_history(self, request: web.Request) -> web.Response:
        if self._history is None:
            return _not_available("history")
        answer = await _read(self._history, "history")
        return answer if isinstance(answer, web.Response) else json_answer(answer)

    async def get_events(self, request: web.Request) -> web.StreamResponse:
        if self._events is None:
            return _not_available("events")
        # EventSource sends Last-Event-ID when it reconnects; a script starts at ?since=.
        raw = request.headers.get("Last-Event-ID") or request.query.get("since", "0")
        if not (raw.isascii() and raw.isdigit()):
            return _bad_request("Last-Event-ID and since must be an event number", raw)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "X-Accel-Buffering": "no"}
        )
        sub = self._events.subscribe(since=int(raw), maxsize=self._event_queue)
        gone = asyncio.Event()
        self._stream_started(request, gone.set)
        try:
            await response.prepare(request)
            await response.write(f"retry: {SSE_RETRY_MS}\n\n".encode())
            await self._stream(response, sub, gone)
            await response.write_eof()
        except ConnectionError:
            pass  # the client left, or was pushed out at the cap
        finally:
            sub.close()
        return response

    async def _stream(
        self, response: web.StreamResponse, sub: Subscription, gone: asyncio.Event
    ) -> None:
        """Write ``sub``'s events until the server stops, the bus closes or the client goes."""
        ends: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(self._stopping.wait()),
            asyncio.ensure_future(gone.wait()),
        ]
        nxt: asyncio.Future[Event | None] | None = None
        try:
            while True:
                if nxt is None:
                    nxt = asyncio.ensure_future(_next_event(sub))
                waiting: list[asyncio.Future[Any]] = [nxt, *ends]
                done, _ = await asyncio.wait(
                    waiting, timeout=self._sse_keepalive_s, return_when=asyncio.FIRST_COMPLETED
                )
                if any(end in done for end in ends):
                    return
                if nxt not in done:
                    await response.write(b": keepalive\n\n")
                    continue
                event, nxt = nxt.result(), None
                if event is None:
                    return  # the bus was closed: the daemon is done
                await response.write(sse_frame(event))
        finally:
            for task in [*ends, *([nxt] if nxt else [])]:
                task.cancel()


def sse_frame(event: Event) -> bytes:
    """One server-sent event: ``id``, ``event`` (the kind) and ``data`` (JSON of
    :meth:`Event.to_dict`). A ``gap`` has no ``id``: the client's Last-Event-ID stays at the
    last event it really got, so a reconnect fetches what was dropped, if the bus still has it.
    """
    data = json.dumps(finite_json(event.to_dict()), default=str, separators=(",", ":"))
    head = "" if event.kind == "gap" else f"id: {event.seq}\n"
    return f"{head}event: {event.kind}\ndata: {data}\n\n".encode()


async def _next_event(sub: Subscription) -> Event | None:
    """The subscription's next event; None once it is closed."""
    try:
        return await sub.get()
    except StopAsyncIteration:
        return None


async def _read(fn: Callable[[], Any], what: str) -> Any:
    """``fn()`` in a daemon thread (reading files must not stall the event loop); a 503 answer
    when it fails or hangs past :data:`READ_TIMEOUT_S`."""
    try:
        return await in_thread(fn, READ_TIMEOUT_S, name=f"http-{what}")
    except TimeoutError:
        message = f"reading the {what} took longer than {READ_TIMEOUT_S:.0f}s"
    except OSError as exc:
        message = f"cannot read the {what}: {os_error(exc, filename=True)}"
    log.warning("GET /%s: %s", what, message)
    return web.json_response({"error": "unavailable", "message": message}, status=503)


def json_answer(value: Any) -> web.Response:
    """A JSON answer browsers can parse: NaN (a diverged loss) becomes null."""
    return web.json_response(finite_json(value), dumps=lambda v: json.dumps(v, default=str))


def _not_available(what: str) -> web.Response:
    return web.json_response(
        {"error": "not_available", "message": f"this agent serves no {what}"}, status=404
    )


def _bad_request(message: str, raw: str) -> web.Response:
    return web.json_response(
        {"error": "bad_request", "message": f"{message}, not {raw[:20]!r}"}, status=400
    )


async def common_headers(request: web.Request, response: web.StreamResponse) -> None:
    """On every answer: never cached (it is live), never sniffed, no referrer sent on."""
    response.headers.setdefault("Cache-Control", "no-store")
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "no-referrer")
