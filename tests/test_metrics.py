"""The endpoint's read-outs (agent/status/views.py): the Prometheus exposition read back by
prometheus-client's own parser, server-sent events, log tails, history and the page, all over
a real server on 127.0.0.1 and a real client."""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.events import QUEUE, EventBus, Subscription
from agent.state import Phase
from agent.status.server import StatusServer
from agent.status.views import (
    CONTENT_TYPE,
    MAX_LOG_TAIL,
    TAIL_MAX_LINE_CHARS,
    render,
    tail_lines,
)
from agent.util import logutil

TOKEN = "tok_SECRET_1234"
SECRET = "hf_FAKEsecretValue123456"
NOW = 1_700_000_000.0

#: A /status document as agent/status/document.py builds it, mid-training (plus the keys asked for:
#: ``now``, ``sync.uploads_failed``, ``sync.uploaded_bytes``).
DOC: dict[str, Any] = {
    "job": "run1",
    "now": NOW,
    "phase": "TRAINING",
    "reason": None,
    "epoch": 12,
    "total_epochs": 100,
    "eta_seconds": 880.5,
    "eta_at": NOW + 880.5,
    "training_state": "running",
    "metrics": {
        "epoch": 12,
        "time": 10.25,
        "train/loss": 1.25,
        "train/box_loss": 0.5,
        "validated": True,
        "is_best": True,
        "current_metric": 0.41,
        "current_metric_name": "mAP50_95",
        "best_metric": 0.41,
        "best_metric_name": "mAP50_95",
        "best_epoch": 12,
        "metrics/mAP50": 0.62,
        "metrics/mAP50_95": 0.41,
        "lr/pg0": 0.01,
    },
    "best_epoch": 12,
    "best_metric": 0.41,
    "trainer": {"pid": 4242, "alive": True, "started_at": NOW - 600},
    "last_synced_epoch": 10,
    "sync": {
        "target": "file:///backup/run1",
        "queue": [{"path": "weights/last.pt", "epoch": 12, "attempts": 0, "error": None}],
        "in_flight": [],
        "uploads_done": 7,
        "uploads_failed": 2,
        "uploaded_bytes": 123_456_789,
        "stalled_since": None,
        "disk_full": False,
        "failures": [],
    },
    "limits": {
        "max_runtime_at": NOW + 3600.0,
        "budget_at": NOW + 1800.0,
        "stop_training_at": NOW + 1500.0,
        "reserve_s": 300.0,
        "stall_timeout_s": 1200.0,
    },
    "supervision": {
        "resumes": [{"at": NOW - 900, "epoch": 4, "kind": "crash", "message": "CUDA error"}],
        "max_restarts": 3,
        "stall": {"quiet_s": 42.0, "threshold_s": 600.0},
    },
    "steering": {"extended_s": 0.0, "hold": None, "actions": []},
    "money": {
        "price_usd_per_hour": 3.48,
        "spent_usd": 1.74,
        "projected_usd": 2.59,
        "budget_usd": 50.0,
        "stopped_usd_per_hour": None,
    },
}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, parsed by prometheus-client: (name, labels) -> value."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, key
            out[key] = s.value
    return out


def families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


P = "libreyolo_agent_"


# ---- the exposition ----------------------------------------------------------------------------


def test_render_gives_the_documents_values_exactly() -> None:
    text = render(DOC).decode()
    got = samples(text)
    assert got[(P + "up", ())] == 1
    assert got[(P + "job_info", (("job_name", "run1"),))] == 1
    assert got[(P + "epoch", ())] == 12
    assert got[(P + "total_epochs", ())] == 100
    assert got[(P + "eta_seconds", ())] == 880.5
    assert got[(P + "train_loss", ())] == 1.25
    assert got[(P + "train_loss_item", (("name", "box_loss"),))] == 0.5
    assert got[(P + "metric", (("name", "mAP50_95"),))] == 0.41
    assert got[(P + "metric", (("name", "mAP50"),))] == 0.62
    assert got[(P + "best_metric", (("name", "mAP50_95"),))] == 0.41
    assert got[(P + "learning_rate", (("group", "pg0"),))] == 0.01
    assert got[(P + "time_since_progress_seconds", ())] == 42.0
    assert got[(P + "resumes_total", ())] == 1
    assert got[(P + "restarts_remaining", ())] == 2
    assert got[(P + "uploads_verified_total", ())] == 7
    assert got[(P + "uploads_failed_total", ())] == 2
    assert got[(P + "uploaded_bytes_total", ())] == 123_456_789
    assert got[(P + "uploads_pending", ())] == 1
    assert got[(P + "last_synced_epoch", ())] == 10
    assert got[(P + "cost_usd", ())] == 1.74
    assert got[(P + "budget_usd", ())] == 50.0
    # The budget runs out before max_runtime: that is the deadline.
    assert got[(P + "time_to_deadline_seconds", ())] == 1800.0
    assert got[(P + "deadline_timestamp_seconds", (("limit", "stop_training"),))] == NOW + 1500
    assert got[(P + "trainer_alive", ())] == 1
    phases = {dict(k[1])["phase"]: v for k, v in got.items() if k[0] == P + "phase"}
    assert phases == {p.value: (1.0 if p is Phase.TRAINING else 0.0) for p in Phase}
    kinds = families(text)
    assert kinds[P + "uploads_verified"] == "counter"
    assert kinds[P + "uploaded_bytes"] == "counter"
    assert kinds[P + "epoch"] == "gauge"


def test_a_value_the_document_lacks_is_left_out_never_invented() -> None:
    doc = json.loads(json.dumps(DOC))
    doc["eta_seconds"] = None
    doc["money"]["spent_usd"] = None
    doc["metrics"] = None
    doc["limits"] = {"max_runtime_at": None, "budget_at": None, "stop_training_at": None}
    del doc["sync"]["uploaded_bytes"]
    doc["supervision"]["stall"] = None
    doc["epoch"] = "12"  # not a number: not a value either
    doc["trainer"]["alive"] = None
    names = {name for name, _ in samples(render(doc).decode())}
    for missing in (
        "eta_seconds",
        "cost_usd",
        "train_loss",
        "metric",
        "time_to_deadline_seconds",
        "deadline_timestamp_seconds",
        "uploaded_bytes_total",
        "time_since_progress_seconds",
        "epoch",
        "trainer_alive",
    ):
        assert P + missing not in names, missing
    assert P + "uploads_verified_total" in names
    assert P + "total_epochs" in names


def test_a_document_from_before_anything_is_known_still_says_up() -> None:
    got = samples(render({"phase": "BOOTING", "sync": None, "money": None}).decode())
    assert got[(P + "up", ())] == 1
    assert got[(P + "phase", (("phase", "BOOTING"),))] == 1
    assert {name for name, _ in got} == {P + "up", P + "phase"}


def test_a_diverged_loss_is_exposed_as_nan() -> None:
    doc = {**DOC, "metrics": {"train/loss": float("nan")}}
    assert math.isnan(samples(render(doc).decode())[(P + "train_loss", ())])


def test_time_to_deadline_counts_from_now_when_the_document_has_no_now() -> None:
    doc = {k: v for k, v in DOC.items() if k != "now"}
    got = samples(render(doc, now=NOW + 100).decode())
    assert got[(P + "time_to_deadline_seconds", ())] == 1700.0


# ---- a real server ----------------------------------------------------------------------------


@asynccontextmanager
async def serving(**kw: Any) -> AsyncIterator[tuple[StatusServer, str]]:
    kw.setdefault("status", lambda: DOC)
    server = StatusServer("127.0.0.1", 0, token=TOKEN, actions={}, **kw)
    port = await server.start()
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await server.stop()


def test_metrics_endpoint_is_parsed_by_prometheus_clients_parser() -> None:
    async def main() -> str:
        async with (
            serving() as (_, base),
            aiohttp.ClientSession() as session,
            session.get(f"{base}/metrics") as r,
        ):
            assert r.status == 200
            assert r.headers["Content-Type"] == CONTENT_TYPE
            return await r.text()

    got = samples(asyncio.run(main()))
    assert got[(P + "epoch", ())] == 12
    assert got[(P + "uploads_failed_total", ())] == 2
    assert got[(P + "phase", (("phase", "TRAINING"),))] == 1


# ---- server-sent events ------------------------------------------------------------------------


class SSE:
    """A client's view of an event stream: frames as dicts of their fields; a comment is
    ``{"comment": text}``."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    async def frame(self) -> dict[str, str]:
        fields: dict[str, str] = {}
        async with asyncio.timeout(10):
            while True:
                line = (await self.response.content.readline()).decode()
                if not line:
                    raise EOFError(f"stream ended; partial frame {fields}")
                line = line.removesuffix("\n")
                if not line:
                    if fields:
                        return fields
                    continue
                name, _, value = line.partition(":")
                fields[name or "comment"] = value.removeprefix(" ")

    async def events(self, count: int) -> list[dict[str, str]]:
        """The next ``count`` frames that are events (comments and ``retry`` skipped)."""
        out: list[dict[str, str]] = []
        while len(out) < count:
            f = await self.frame()
            if "event" in f:
                out.append(f)
        return out


@asynccontextmanager
async def stream(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> AsyncIterator[SSE]:
    async with session.get(url, headers=headers) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        sse = SSE(r)
        assert await sse.frame() == {"retry": "2000"}  # also: the subscription exists now
        yield sse


def test_events_arrive_in_order_with_ids_and_a_reconnect_gets_only_newer_ones() -> None:
    async def main() -> None:
        bus = EventBus()
        async with serving(events=bus) as (_, base), aiohttp.ClientSession() as session:
            async with stream(session, f"{base}/events") as sse:
                sent = [bus.publish("epoch", epoch=i, loss=1.0 / i) for i in range(1, 6)]
                got = await sse.events(5)
            assert [f["id"] for f in got] == ["1", "2", "3", "4", "5"]
            assert [f["event"] for f in got] == ["epoch"] * 5
            assert [json.loads(f["data"]) for f in got] == [e.to_dict() for e in sent]
            # Reconnecting as EventSource does, then as a script does.
            async with stream(session, f"{base}/events", {"Last-Event-ID": "3"}) as sse:
                assert [f["id"] for f in await sse.events(2)] == ["4", "5"]
                bus.publish("warning", message="disk 90% full")
                (new,) = await sse.events(1)
                assert (new["id"], new["event"]) == ("6", "warning")
                assert json.loads(new["data"])["data"] == {"message": "disk 90% full"}
            async with stream(session, f"{base}/events?since=5") as sse:
                assert [f["id"] for f in await sse.events(1)] == ["6"]
            # The header wins over the URL the page first opened.
            async with stream(session, f"{base}/events?since=1", {"Last-Event-ID": "4"}) as sse:
                assert [f["id"] for f in await sse.events(1)] == ["5"]

    asyncio.run(main())


def test_a_slow_client_gets_a_gap_event_then_the_newest() -> None:
    async def main() -> None:
        bus = EventBus()
        async with (
            serving(events=bus, event_queue=5) as (_, base),
            aiohttp.ClientSession() as session,
            stream(session, f"{base}/events") as sse,
        ):
            bus.publish("epoch", epoch=1)
            assert [f["id"] for f in await sse.events(1)] == ["1"]
            for i in range(2, 22):  # 20 at once: the stream can keep 5
                bus.publish("epoch", epoch=i)
            gap, *rest = await sse.events(6)
            assert gap["event"] == "gap"
            assert "id" not in gap  # Last-Event-ID stays at 1: a reconnect refetches the rest
            assert json.loads(gap["data"])["data"] == {"dropped": 15}
            assert [f["id"] for f in rest] == ["17", "18", "19", "20", "21"]

    asyncio.run(main())


def test_a_quiet_stream_gets_keepalives_and_outlives_the_idle_timeouts() -> None:
    """The connection guard closes connections idle past keepalive_timeout_s; a live stream is
    not idle, and its keepalive comments are what keeps tunnels and proxies open."""

    async def main() -> None:
        bus = EventBus()
        async with (
            serving(
                events=bus, sse_keepalive_s=0.1, header_timeout_s=0.3, keepalive_timeout_s=0.3
            ) as (server, base),
            aiohttp.ClientSession() as session,
            stream(session, f"{base}/events") as sse,
        ):
            for _ in range(10):  # >= 1 s of silence, past both timeouts
                assert await sse.frame() == {"comment": "keepalive"}
            assert server.connection_stats()["open"] == 1  # it counts toward the cap
            bus.publish("phase", **{"from": "TRAINING", "to": "FINISHING"})
            (f,) = await sse.events(1)
            assert (f["id"], f["event"]) == ("1", "phase")
            assert server.connection_stats()["header_timeouts"] == 0

    asyncio.run(main())


def test_stopping_the_server_ends_streams_cleanly() -> None:
    async def main() -> None:
        bus = EventBus()
        server = StatusServer("127.0.0.1", 0, token=TOKEN, status=dict, actions={}, events=bus)
        port = await server.start()
        async with (
            aiohttp.ClientSession() as session,
            stream(session, f"http://127.0.0.1:{port}/events") as sse,
        ):
            bus.publish("done", reason="completed", cause=None)
            assert [f["event"] for f in await sse.events(1)] == ["done"]
            await asyncio.wait_for(server.stop(), 10)
            # The chunked body is terminated properly: no ClientPayloadError, just the end.
            assert await sse.response.content.read() == b""
            assert sse.response.content.at_eof()

    asyncio.run(main())


class WatchedBus(EventBus):
    """An EventBus that says when a subscription is closed."""

    def __init__(self) -> None:
        super().__init__()
        self.unsubscribed = asyncio.Event()

    def subscribe(self, *, since: int = 0, maxsize: int = QUEUE) -> Subscription:
        sub = super().subscribe(since=since, maxsize=maxsize)
        close = sub.close

        def closing() -> None:
            close()
            self.unsubscribed.set()

        sub.close = closing  # type: ignore[method-assign]
        return sub


def test_a_client_leaving_unsubscribes_and_closing_the_bus_ends_streams() -> None:
    async def main() -> None:
        bus = WatchedBus()
        async with serving(events=bus) as (_, base), aiohttp.ClientSession() as session:
            async with stream(session, f"{base}/events"):
                assert len(bus._subs) == 1
            # Noticed when the connection goes, not at the next keepalive (15 s away).
            await asyncio.wait_for(bus.unsubscribed.wait(), 5)
            assert not bus._subs
            async with stream(session, f"{base}/events") as sse:
                bus.close()
                assert await sse.response.content.read() == b""

    asyncio.run(main())


def test_events_refuse_a_bad_last_event_id_and_need_a_bus() -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            async with serving(events=EventBus()) as (_, base):
                for headers, query in (({"Last-Event-ID": "x1"}, ""), ({}, "?since=-1")):
                    async with session.get(f"{base}/events{query}", headers=headers) as r:
                        assert r.status == 400
                        assert (await r.json())["error"] == "bad_request"
            async with serving() as (_, base), session.get(f"{base}/events") as r:
                assert r.status == 404
                assert (await r.json())["error"] == "not_available"

    asyncio.run(main())


# ---- log tails ----------------------------------------------------------------------------------


@pytest.fixture
def secret() -> Iterator[str]:
    saved = logutil.redact.secrets
    logutil.redact_secrets([("HF_TOKEN", SECRET)])
    yield SECRET
    logutil.redact.secrets = saved


def test_tail_lines_of_a_large_file(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    with log.open("w") as f:
        for i in range(300_000):  # about 4 MB
            f.write(f"line {i}\n")
    assert tail_lines(log, 3) == ["line 299997", "line 299998", "line 299999"]
    assert tail_lines(log, 5000) == [f"line {i}" for i in range(295_000, 300_000)]
    assert tail_lines(log, 0) == []
    with log.open("a") as f:
        f.write("no newline yet")
    assert tail_lines(log, 2) == ["line 299999", "no newline yet"]


def test_tail_lines_of_short_empty_and_missing_files(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    assert tail_lines(log, 10) == []
    log.write_bytes(b"")
    assert tail_lines(log, 10) == []
    log.write_bytes(b"a\n\nb\n")
    assert tail_lines(log, 10) == ["a", "", "b"]


def test_tail_lines_reads_only_the_end_of_a_huge_file(tmp_path: Path) -> None:
    """An 8 GiB (sparse) log: the tail comes back without the file being read through."""
    log = tmp_path / "huge.log"
    with log.open("wb") as f:
        f.truncate(8 * 1024**3)
        f.seek(0, os.SEEK_END)
        f.write(b"first\nsecond\nthird\n")
    assert tail_lines(log, 2) == ["second", "third"]
    # Asking for more: "first" begins somewhere in 8 GiB of NULs; it is not a whole line.
    assert tail_lines(log, 10) == ["second", "third"]


def test_tail_lines_shows_what_a_terminal_shows_of_a_progress_bar(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    log.write_bytes(b"epoch 1:  10%\repoch 1:  50%\repoch 1: 100%\r\nbad \xff byte\n")
    assert tail_lines(log, 5) == ["epoch 1: 100%", "bad \ufffd byte"]


def test_tail_lines_redacts_secrets_before_cutting_long_lines(tmp_path: Path, secret: str) -> None:
    log = tmp_path / "agent.log"
    log.write_text(
        f"token={secret} failed\n"
        + "x" * (TAIL_MAX_LINE_CHARS - 5)
        + secret  # would be cut in half: redacted first
        + "\n"
        + f"{secret}\r10%\n"
    )
    lines = tail_lines(log, 10)
    assert lines[0] == "token=<HF_TOKEN> failed"
    assert len(lines[1]) == TAIL_MAX_LINE_CHARS
    assert lines[1].endswith("...")
    assert lines[2] == "10%"
    assert not any("hf_" in line for line in lines)


def test_logs_endpoint_tails_and_redacts(tmp_path: Path, secret: str) -> None:
    agent_log, trainer_log = tmp_path / "agent.log", tmp_path / "trainer.log"
    agent_log.write_text("".join(f"agent {i} {secret}\n" for i in range(300)))
    trainer_log.write_text("epoch 1\n")
    asked: list[int] = []

    def logs(n: int) -> dict[str, list[str]]:
        asked.append(n)
        return {"agent": tail_lines(agent_log, n), "trainer": tail_lines(trainer_log, n)}

    async def main() -> None:
        async with serving(logs=logs) as (_, base), aiohttp.ClientSession() as session:
            async with session.get(f"{base}/logs") as r:
                assert r.status == 200
                body = await r.text()
            assert secret not in body
            answer = json.loads(body)
            assert len(answer["agent"]) == 200
            assert answer["agent"][-1] == "agent 299 <HF_TOKEN>"
            assert answer["trainer"] == ["epoch 1"]
            async with session.get(f"{base}/logs?tail=2") as r:
                assert (await r.json())["agent"] == ["agent 298 <HF_TOKEN>", "agent 299 <HF_TOKEN>"]
            for bad in ("abc", "-1", str(MAX_LOG_TAIL + 1), "1.5", "", "٣"):
                async with session.get(f"{base}/logs", params={"tail": bad}) as r:
                    assert r.status == 400, bad
                    assert (await r.json())["error"] == "bad_request"

    asyncio.run(main())
    assert asked == [200, 2]


def test_logs_from_a_source_that_does_not_redact_are_redacted_anyway(secret: str) -> None:
    async def main() -> dict[str, Any]:
        async with (
            serving(logs=lambda n: {"agent": [f"leak {secret}"], "trainer": []}) as (_, base),
            aiohttp.ClientSession() as session,
            session.get(f"{base}/logs") as r,
        ):
            result: dict[str, Any] = await r.json()
            return result

    assert asyncio.run(main()) == {"agent": ["leak <HF_TOKEN>"], "trainer": []}


def test_logs_and_history_that_cannot_be_read_answer_503() -> None:
    def broken(*_: Any) -> Any:
        raise PermissionError(13, "Permission denied", "/state/agent.log")

    async def main() -> None:
        async with (
            serving(logs=broken, history=broken) as (_, base),
            aiohttp.ClientSession() as session,
        ):
            for path in ("/logs", "/history"):
                async with session.get(base + path) as r:
                    assert r.status == 503
                    assert "EACCES" in (await r.json())["message"]

    asyncio.run(main())


# ---- history and the page ----------------------------------------------------------------------


def test_history_serves_the_rows_as_strict_json() -> None:
    rows: list[dict[str, Any]] = [
        {"epoch": 1, "train/loss": 2.5, "metrics/mAP50_95": 0.1},
        {"epoch": 2, "train/loss": float("nan"), "metrics/mAP50_95": 0.2},
    ]

    def no_constants(name: str) -> Any:
        raise AssertionError(f"{name} is not JSON a browser parses")

    async def main() -> list[dict[str, Any]]:
        async with (
            serving(history=lambda: rows) as (_, base),
            aiohttp.ClientSession() as session,
            session.get(f"{base}/history") as r,
        ):
            assert r.status == 200
            result: list[dict[str, Any]] = json.loads(await r.text(), parse_constant=no_constants)
            return result

    got = asyncio.run(main())
    assert got == [rows[0], {"epoch": 2, "train/loss": None, "metrics/mAP50_95": 0.2}]


def test_the_page_is_served_with_its_security_headers() -> None:
    expected = resources.files("agent.status").joinpath("static", "index.html").read_bytes()

    async def main() -> None:
        async with (
            serving() as (_, base),
            aiohttp.ClientSession() as session,
            session.get(f"{base}/") as r,
        ):
            assert r.status == 200
            assert await r.read() == expected
            h = r.headers
            assert h["Content-Type"] == "text/html; charset=utf-8"
            assert h["Cache-Control"] == "no-store"
            assert h["X-Content-Type-Options"] == "nosniff"
            assert h["Referrer-Policy"] == "no-referrer"
            csp = [part.strip() for part in h["Content-Security-Policy"].split(";")]
            for directive in (
                "default-src 'self'",
                "script-src 'self' 'unsafe-inline'",
                "style-src 'self' 'unsafe-inline'",
                "connect-src 'self'",
                "frame-ancestors 'none'",
            ):
                assert directive in csp

    asyncio.run(main())


@pytest.mark.parametrize("path", ["/logs", "/history"])
def test_routes_without_their_source_answer_404(path: str) -> None:
    async def main() -> None:
        async with (
            serving() as (_, base),
            aiohttp.ClientSession() as session,
            session.get(base + path) as r,
        ):
            assert r.status == 404
            assert (await r.json())["error"] == "not_available"

    asyncio.run(main())
