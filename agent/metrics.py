"""What the HTTP endpoint shows, besides ``/status`` itself: the read-only routes, while
:mod:`agent.server` keeps the connections, the Host check and the control actions.

- ``GET /metrics``: the Prometheus exposition of the /status document (:func:`render`).
- ``GET /events``: server-sent events from the :class:`~agent.events.EventBus`, from
  ``Last-Event-ID`` or ``?since=``, with ``: keepalive`` comments while quiet.
- ``GET /logs?tail=N``: the last lines of agent.log and trainer.log (:func:`tail_lines`),
  redacted like agent.log itself.
- ``GET /history``: the run's metrics.jsonl rows, for the page's chart.
- ``GET /``: the dashboard, ``agent/static/index.html``, under a strict
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
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from . import logutil
from .events import QUEUE, Event, EventBus, Subscription
from .state import Phase
from .text import os_error
from .threads import in_thread

log = logging.getLogger("agent.metrics")

#: The /status document, as ``GET /status`` serves it.
StatusFn = Callable[[], dict[str, Any]]
#: The last ``n`` lines of each log by name (``{"agent": [...], "trainer": [...]}``), redacted;
#: called in a thread (:func:`tail_lines` reads one file).
LogsFn = Callable[[int], dict[str, list[str]]]
#: The run's metrics.jsonl rows, oldest first; called in a thread.
HistoryFn = Callable[[], list[dict[str, Any]]]

#: Every series is named ``libreyolo_agent_<what>``.
PREFIX = "libreyolo_agent_"
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

    ``now`` (epoch seconds) is what ``libreyolo_agent_seconds_to_deadline`` counts from: the
    document's own ``now`` when it has one, else ``now``, else the wall clock.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatusCollector(doc, now=now))
    return generate_latest(registry)


def _num(value: Any) -> float | None:
    """A number the document really holds (NaN and infinities included: Prometheus takes
    them); None for a missing value, a bool, a string or anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


class _StatusCollector(Collector):
    """One scrape's worth of series, read defensively out of one /status document."""

    def __init__(self, doc: Mapping[str, Any], *, now: float | None) -> None:
        self.doc = doc
        doc_now = _num(doc.get("now"))
        self.now = doc_now if doc_now is not None else (now if now is not None else time.time())

    def collect(self) -> Iterator[Metric]:
        yield from self._agent()
        yield from self._training()
        yield from self._sync()
        yield from self._limits()

    # ---- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _gauge(name: str, doc: str, value: Any, unit: str = "") -> Iterator[Metric]:
        number = _num(value)
        if number is not None:
            yield GaugeMetricFamily(PREFIX + name, doc, value=number, unit=unit)

    @staticmethod
    def _counter(name: str, doc: str, value: Any) -> Iterator[Metric]:
        number = _num(value)
        if number is not None and number >= 0:
            yield CounterMetricFamily(PREFIX + name, doc, value=number)

    @staticmethod
    def _labelled(
        name: str, doc: str, label: str, values: Iterable[tuple[str, Any]]
    ) -> Iterator[Metric]:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=[label])
        for key, value in values:
            number = _num(value)
            if number is not None:
                family.add_metric([key], number)
        if family.samples:
            yield family

    # ---- the parts of the document ----------------------------------------------------------

    def _agent(self) -> Iterator[Metric]:
        doc = self.doc
        yield GaugeMetricFamily(PREFIX + "up", "1: the agent answered this scrape", value=1)
        job = doc.get("job")
        if isinstance(job, str):
            info = GaugeMetricFamily(PREFIX + "job_info", "the job this agent runs", labels=["job"])
            info.add_metric([job], 1)
            yield info
        phase = doc.get("phase")
        if isinstance(phase, str):
            names = [p.value for p in Phase]
            if phase not in names:
                names.append(phase)  # a phase newer than this module still shows
            yield from self._labelled(
                "phase",
                "1 for the run's current phase, 0 for the others",
                "phase",
                ((name, 1 if name == phase else 0) for name in names),
            )
        trainer = _dict(doc.get("trainer"))
        if isinstance(trainer.get("alive"), bool):
            yield from self._gauge(
                "trainer_alive", "1 while the training process lives", int(trainer["alive"])
            )
        supervision = _dict(doc.get("supervision"))
        yield from self._gauge(
            "resumes", "times the trainer was resumed in this job", supervision.get("resumes")
        )
        yield from self._gauge(
            "seconds_since_progress",
            "seconds since the trainer last showed progress (a new epoch, log line, checkpoint)",
            _dict(supervision.get("stall")).get("quiet_s"),
        )
        yield from self._gauge(
            "stall_threshold_seconds",
            "the quiet time after which the trainer counts as stalled",
            _dict(supervision.get("stall")).get("threshold_s"),
        )

    def _training(self) -> Iterator[Metric]:
        doc = self.doc
        yield from self._gauge("epoch", "epochs completed", doc.get("epoch"))
        yield from self._gauge("total_epochs", "epochs the run trains for", doc.get("total_epochs"))
        yield from self._gauge(
            "eta_seconds",
            "seconds until training ends, at the mean epoch time",
            doc.get("eta_seconds"),
        )
        row = _dict(doc.get("metrics"))
        yield from self._gauge(
            "train_loss", "the last epoch's training loss", row.get("train/loss")
        )
        yield from self._gauge("epoch_seconds", "the last epoch's duration", row.get("time"))
        yield from self._labelled(
            "train_loss_item",
            "the last epoch's training loss components",
            "name",
            (
                (key.removeprefix("train/"), value)
                for key, value in row.items()
                if key.startswith("train/") and key != "train/loss"
            ),
        )
        metrics = {
            key.removeprefix("metrics/"): value
            for key, value in row.items()
            if key.startswith("metrics/")
        }
        current = row.get("current_metric_name")
        if isinstance(current, str) and current not in metrics:
            metrics[current] = row.get("current_metric")
        yield from self._labelled(
            "metric",
            "the last validation's metrics (mAP50_95: the main one)",
            "name",
            metrics.items(),
        )
        best_name = row.get("best_metric_name")
        if isinstance(best_name, str):
            yield from self._labelled(
                "best_metric",
                "the best value of the main metric so far",
                "name",
                [(best_name, doc.get("best_metric"))],
            )
        yield from self._gauge(
            "best_epoch", "the epoch of the best checkpoint", doc.get("best_epoch")
        )
        yield from self._labelled(
            "learning_rate",
            "the last epoch's learning rate per parameter group",
            "group",
            ((k.removeprefix("lr/"), v) for k, v in row.items() if k.startswith("lr/")),
        )

    def _sync(self) -> Iterator[Metric]:
        sync = _dict(self.doc.get("sync"))
        yield from self._gauge(
            "last_synced_epoch",
            "the newest epoch whose checkpoint is verified on the target",
            self.doc.get("last_synced_epoch"),
        )
        yield from self._counter(
            "uploads_verified",
            "uploads read back and verified on the target (this agent process)",
            sync.get("uploads_done"),
        )
        yield from self._counter(
            "uploads_failed",
            "upload attempts that failed (this agent process)",
            sync.get("uploads_failed"),
        )
        yield from self._counter(
            "uploaded_bytes",
            "bytes uploaded and verified (this agent process)",
            sync.get("uploaded_bytes"),
        )
        queue, in_flight = sync.get("queue"), sync.get("in_flight")
        if isinstance(queue, list) and isinstance(in_flight, list):
            yield from self._gauge(
                "uploads_pending", "uploads queued or in flight", len(queue) + len(in_flight)
            )
        yield from self._gauge(
            "upload_bytes_per_second", "observed checkpoint upload speed", sync.get("bytes_per_s")
        )
        if "stalled_since" in sync:
            yield from self._gauge(
                "uploads_stalled",
                "1 while uploads are owed and none completes",
                int(sync["stalled_since"] is not None),
            )
        if isinstance(sync.get("disk_full"), bool):
            yield from self._gauge(
                "disk_full",
                "1 while the disk is too full to snapshot checkpoints",
                int(sync["disk_full"]),
            )

    def _limits(self) -> Iterator[Metric]:
        money = _dict(self.doc.get("money"))
        yield from self._gauge("cost_usd", "spent on the box so far (USD)", money.get("spent_usd"))
        yield from self._gauge(
            "projected_cost_usd",
            "spent plus the rest of training (USD)",
            money.get("projected_usd"),
        )
        yield from self._gauge("budget_usd", "the job's budget (USD)", money.get("budget_usd"))
        yield from self._gauge(
            "price_usd_per_hour", "the box's price (USD per hour)", money.get("price_usd_per_hour")
        )
        limits = _dict(self.doc.get("limits"))
        deadlines = {
            name: limits.get(f"{name}_at") for name in ("max_runtime", "budget", "stop_training")
        }
        yield from self._labelled(
            "deadline_timestamp_seconds",
            "when each limit fires (epoch seconds): max_runtime, budget, stop_training",
            "limit",
            deadlines.items(),
        )
        ends = [
            t for t in (_num(deadlines["max_runtime"]), _num(deadlines["budget"])) if t is not None
        ]
        if ends:
            yield from self._gauge(
                "seconds_to_deadline",
                "seconds until the earlier of max_runtime and the budget (negative: past it)",
                min(ends) - self.now,
            )
        hold = _dict(_dict(self.doc.get("steering")).get("hold"))
        if hold.get("active") is True:
            yield from self._gauge(
                "hold_remaining_seconds",
                "seconds left on the teardown hold",
                hold.get("remaining_s"),
            )


# ---- log tails -------------------------------------------------------------------------------


def redact_line(line: str) -> str:
    """``line`` with every secret the agent read from the environment replaced by
    ``<VARIABLE>``: the same redaction agent.log gets (:data:`agent.logutil.redact`)."""
    return logutil.redact_text(line)


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
            page = resources.files("agent").joinpath("static", "index.html").read_bytes()
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
