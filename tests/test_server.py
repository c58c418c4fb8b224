"""The status endpoint under floods, slow clients and foreign Host headers: real sockets only."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from agent.events import EventBus
from agent.policy import steering
from agent.policy.steering import SteeringError
from agent.state import Phase, RunState
from agent.status.server import StatusServer, host_header_name, is_loopback

TOKEN = "tok_SECRET_1234"


@asynccontextmanager
async def serving(
    host: str = "127.0.0.1",
    actions: dict[str, Callable[[str], Awaitable[dict[str, Any]]]] | None = None,
    **kw: Any,
) -> AsyncIterator[tuple[StatusServer, int]]:
    server = StatusServer(
        host, 0, token=TOKEN, status=lambda: {"phase": "TRAINING"}, actions=actions or {}, **kw
    )
    port = await server.start()
    try:
        yield server, port
    finally:
        await server.stop()


#: How long a test waits for the server's timer (of about a second) to close a connection: far
#: from the timer and from "never", so a late timer on a loaded machine decides nothing.
SLACK_S = 20.0


async def closed_by_server(reader: asyncio.StreamReader, timeout: float) -> bool:
    """True once the server has closed the connection (EOF or reset), False on timeout."""
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


async def raw_request(port: int, head: bytes, host: str = "127.0.0.1") -> tuple[int, bytes]:
    """Send ``head`` (a whole request) on a fresh socket; the status code and the body."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head)
        await writer.drain()
        async with asyncio.timeout(5):
            data = await reader.read()
    finally:
        writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


async def healthz_seconds(port: int) -> float:
    started = time.monotonic()
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"http://127.0.0.1:{port}/healthz", timeout=aiohttp.ClientTimeout(total=5)
        ) as r,
    ):
        assert r.status == 200
        assert await r.json() == {"ok": True}
    return time.monotonic() - started


# ---- connections -------------------------------------------------------------------------------


def test_idle_and_slowloris_flood_past_the_cap_leaves_healthz_answering(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """1,100 idle connections once held every descriptor of the agent; 200 slowloris
    connections were all held. Now the cap holds, /healthz answers at once, and every idle
    socket is closed by the server within the header timeout."""
    caplog.set_level(logging.INFO, logger="agent.status.server")

    async def main() -> None:
        async with serving(max_connections=8, header_timeout_s=1.0) as (server, port):
            conns = []
            for i in range(200):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                if i % 2:  # slowloris: a request head that never ends
                    writer.write(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-a: ")
                conns.append((reader, writer))
            await asyncio.sleep(0.2)
            assert server.connection_stats()["open"] <= 8
            assert await healthz_seconds(port) < 1.0
            # Closed at the header timeout (1 s), not never: the bound is far from both, so a
            # loaded machine's late timers do not decide the verdict.
            closed = await asyncio.gather(*(closed_by_server(r, SLACK_S) for r, _ in conns))
            assert all(closed)
            stats = server.connection_stats()
            assert stats["pushed_out"] >= 200 - 8
            assert stats["header_timeouts"] >= 1
            assert stats["refused"] == 0
            for _, writer in conns:
                writer.close()
            assert await healthz_seconds(port) < 1.0

    asyncio.run(main())
    # One summary at the first event, one with the rest when the server stops: no line per
    # connection.
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "1 pushed out at the cap of 8" in warnings[0]
    assert "sent no request head within 1s" in warnings[1]


def test_slowloris_trickling_a_head_is_closed_at_the_header_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="agent.status.server")

    async def main() -> None:
        async with serving(header_timeout_s=1.0, keepalive_timeout_s=30.0) as (server, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            started = time.monotonic()
            writer.write(b"GET /status HTTP/1.1\r\n")

            async def trickle() -> None:
                i = 0
                while True:  # one header line every 0.1 s: never a whole head
                    await asyncio.sleep(0.1)
                    writer.write(b"X-%d: y\r\n" % i)
                    i += 1

            task = asyncio.create_task(trickle())
            # A timer reset by every line would never close it (nor the 30 s keep-alive first).
            assert await closed_by_server(reader, SLACK_S)
            elapsed = time.monotonic() - started
            task.cancel()
            writer.close()
            assert 0.8 < elapsed < SLACK_S
            assert server.connection_stats()["header_timeouts"] == 1

    asyncio.run(main())
    # Below the cap a slow client harms no one (browsers' spare connections look the same).
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_keep_alive_connection_is_closed_after_the_keepalive_timeout_not_before() -> None:
    async def main() -> None:
        # The second request comes 0.5 s after the first answer: past the header timeout, well
        # before the keep-alive one even when this loop is late under load.
        async with serving(header_timeout_s=0.3, keepalive_timeout_s=3.0) as (server, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            answered = time.monotonic()
            # A second request on the same connection, past the header timeout: still served.
            await asyncio.sleep(0.5)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await reader.readuntil(b"\r\n\r\n")
            answered = time.monotonic()
            assert await closed_by_server(reader, SLACK_S)
            idle = time.monotonic() - answered
            writer.close()
            assert 2.8 < idle < SLACK_S
            assert server.connection_stats() == {
                "open": 0,
                "pushed_out": 0,
                "refused": 0,
                "header_timeouts": 0,  # an idle keep-alive is normal, not counted
            }

    asyncio.run(main())


def test_when_every_connection_is_busy_a_new_one_gets_503_and_is_closed() -> None:
    async def main() -> None:
        release, both_in = asyncio.Event(), asyncio.Event()
        entered: list[int] = []

        async def hold(body: str) -> dict[str, Any]:
            entered.append(1)
            if len(entered) == 2:
                both_in.set()
            await release.wait()
            return {"ok": True}

        async with (
            serving(actions={"hold": hold}, max_connections=2) as (server, port),
            aiohttp.ClientSession() as session,
        ):
            url = f"http://127.0.0.1:{port}/hold"
            auth = {"Authorization": f"Bearer {TOKEN}"}

            async def post() -> int:
                async with session.post(url, headers=auth) as r:
                    return r.status

            busy = [asyncio.create_task(post()) for _ in range(2)]
            await asyncio.wait_for(both_in.wait(), 5)
            status, body = await raw_request(
                port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            )
            assert status == 503
            assert json.loads(body)["error"] == "busy"
            assert server.connection_stats()["refused"] == 1
            release.set()
            assert await asyncio.gather(*busy) == [200, 200]
            # Served connections are idle again: a newcomer pushes one out.
            assert await healthz_seconds(port) < 1.0

    asyncio.run(main())


def test_stop_closes_idle_connections() -> None:
    async def main() -> None:
        server = StatusServer("127.0.0.1", 0, token=TOKEN, status=dict, actions={})
        port = await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.05)
        await server.stop()
        assert await closed_by_server(reader, 2.0)
        writer.close()

    asyncio.run(main())


# ---- the Host header (DNS rebinding) -----------------------------------------------------------

#: Every read-out wired, as the daemon wires them: the logs and history say TRAINING too, so a
#: leak through any route shows in the body.
READOUTS: dict[str, Any] = {
    "events": EventBus(),
    "logs": lambda n: {"agent": ["phase TRAINING"], "trainer": []},
    "history": lambda: [{"epoch": 1, "note": "TRAINING"}],
}
GET_ROUTES = ("/", "/status", "/healthz", "/metrics", "/events", "/logs?tail=5", "/history")


@pytest.mark.parametrize(
    "host",
    [
        "evil.example:8421",
        "evil.example",
        "127.0.0.1.evil.example:8421",
        "localhost.evil.example",
        "attacker.localhost.evil",
        "127.0.0.1:notaport",
        "[::1",
        "",
    ],
)
def test_requests_for_another_host_are_refused_on_every_route(host: str) -> None:
    """A page on the user's laptop that rebinds its own name to 127.0.0.1 reaches the SSH
    tunnel, but its requests carry its own host name."""
    stops = 0

    async def stop(body: str) -> dict[str, Any]:
        nonlocal stops
        stops += 1
        return {"ok": True}

    async def main() -> None:
        async with serving(actions={"stop": stop}, **READOUTS) as (_, port):
            h = f"Host: {host}\r\n".encode()
            auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
            for head in (
                *(b"GET %s HTTP/1.1\r\n" % path.encode() + h + b"\r\n" for path in GET_ROUTES),
                b"GET /nowhere HTTP/1.1\r\n" + h + b"\r\n",
                b"POST /stop HTTP/1.1\r\n" + h + auth + b"Content-Length: 0\r\n\r\n",
            ):
                status, body = await raw_request(
                    port, head.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n", 1)
                )
                assert status == 421, head
                assert json.loads(body)["error"] == "misdirected_request"
                assert b"TRAINING" not in body

    asyncio.run(main())
    assert stops == 0


def test_requests_from_a_real_client_with_a_foreign_host_get_421() -> None:
    async def main() -> None:
        async with (
            serving() as (_, port),
            aiohttp.ClientSession() as session,
            session.get(
                f"http://127.0.0.1:{port}/status", headers={"Host": "evil.example:8421"}
            ) as r,
        ):
            assert r.status == 421
            assert (await r.json())["error"] == "misdirected_request"

    asyncio.run(main())


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:{port}",
        "127.0.0.1",
        "localhost:{port}",
        "LOCALHOST:9999",
        "localhost.",
        "[::1]:{port}",
        "::1",
        "box.example:8421",  # allowed_hosts
        None,  # HTTP/1.0 without Host
    ],
)
def test_requests_for_localhost_or_the_bound_address_are_served(host: str | None) -> None:
    async def main() -> None:
        async with serving(allowed_hosts=["box.example"]) as (_, port):
            if host is None:
                head = b"GET /status HTTP/1.0\r\n\r\n"
            else:
                head = b"GET /status HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (
                    host.format(port=port).encode()
                )
            status, body = await raw_request(port, head)
            assert status == 200
            assert json.loads(body) == {"phase": "TRAINING"}

    asyncio.run(main())


def test_host_header_parsing() -> None:
    assert host_header_name("LocalHost:8421") == "localhost"
    assert host_header_name("[::1]:8421") == "::1"
    assert host_header_name("[::1]") == "::1"
    assert host_header_name("::1") == "::1"
    assert host_header_name("localhost.") == "localhost"
    assert host_header_name("evil.example:80") == "evil.example"
    assert host_header_name("[::1]:x") is None
    assert host_header_name("[::1]8421") is None
    assert host_header_name("a:b") is None


# ---- non-loopback binds ------------------------------------------------------------------------


def test_is_loopback() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "[::]", "", "*", "192.0.2.1", "box.example"):
        assert not is_loopback(host), host


def test_loopback_bind_does_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent.status.server")

    async def main() -> None:
        async with serving():
            pass

    asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ---- control requests: token, body, refusals ---------------------------------------------------


class Recorder:
    """Actions that record the bodies they get; ``fail`` makes them raise it instead."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, str]] = []
        self.fail: Exception | None = None

    def action(self, name: str) -> Callable[[str], Awaitable[dict[str, Any]]]:
        async def act(body: str) -> dict[str, Any]:
            if self.fail is not None:
                raise self.fail
            self.bodies.append((name, body))
            return {"ok": True, "message": f"{name} done"}

        return act

    def actions(self, *names: str) -> dict[str, Callable[[str], Awaitable[dict[str, Any]]]]:
        return {name: self.action(name) for name in names}


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_control_requests_need_the_token() -> None:
    rec = Recorder()

    async def main() -> None:
        async with (
            serving(actions=rec.actions("extend", "hold", "release")) as (_, port),
            aiohttp.ClientSession() as session,
        ):
            for name in ("extend", "hold", "release"):
                url = f"http://127.0.0.1:{port}/{name}"
                for headers in (
                    {},
                    {"Authorization": "Bearer wrong"},
                    {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": TOKEN},
                ):
                    async with session.post(url, data="2h", headers=headers) as r:
                        assert r.status == 401, (name, headers)
                        answer = await r.json()
                        assert answer["error"] == "unauthorized"
                        assert TOKEN not in json.dumps(answer)
            # GET is not a control request.
            async with session.get(f"http://127.0.0.1:{port}/extend", headers=AUTH) as r:
                assert r.status == 405

    asyncio.run(main())
    assert rec.bodies == []


def test_actions_get_the_request_body_as_text() -> None:
    rec = Recorder()

    async def main() -> None:
        async with (
            serving(actions=rec.actions("extend", "hold")) as (_, port),
            aiohttp.ClientSession() as session,
        ):
            base = f"http://127.0.0.1:{port}"

            async def chunked() -> AsyncIterator[bytes]:
                for part in (b'{"dura', b'tion": ', b'"1h30m"}'):
                    yield part

            for url, data in (
                (f"{base}/extend", "2h"),
                (f"{base}/extend", json.dumps({"duration": "90m"})),
                (f"{base}/extend", chunked()),
                (f"{base}/hold", None),
                (f"{base}/hold", "x" * 4096),  # exactly the limit
                (f"{base}/hold", "durée 2h"),
            ):
                async with session.post(url, data=data, headers=AUTH) as r:
                    assert r.status == 200
                    assert (await r.json())["ok"] is True

    asyncio.run(main())
    assert rec.bodies == [
        ("extend", "2h"),
        ("extend", '{"duration": "90m"}'),
        ("extend", '{"duration": "1h30m"}'),
        ("hold", ""),
        ("hold", "x" * 4096),
        ("hold", "durée 2h"),
    ]


def test_a_body_past_4_kib_is_answered_413_and_the_action_never_runs() -> None:
    rec = Recorder()

    async def main() -> None:
        async with (
            serving(actions=rec.actions("extend")) as (_, port),
            aiohttp.ClientSession() as session,
        ):
            url = f"http://127.0.0.1:{port}/extend"

            async def chunked() -> AsyncIterator[bytes]:
                for _ in range(5):  # no Content-Length: found while reading
                    yield b"y" * 1000

            for data in ("x" * 4097, chunked()):
                async with session.post(url, data=data, headers=AUTH) as r:
                    assert r.status == 413
                    answer = await r.json()
                    assert answer["ok"] is False
                    assert "larger than 4096 bytes" in answer["error"]
            # A declared length past the limit is answered before the body is sent.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /extend HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
                b"Content-Length: 10000000\r\n\r\n2h"
            )
            async with asyncio.timeout(5):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
            writer.close()
            assert head.startswith(b"HTTP/1.1 413 ")
            assert json.loads(body)["ok"] is False
            # Without the token the size does not matter: 401 first.
            async with session.post(url, data="x" * 5000) as r:
                assert r.status == 401

    asyncio.run(main())
    assert rec.bodies == []


def test_a_body_that_is_not_utf8_is_a_bad_request() -> None:
    rec = Recorder()

    async def main() -> None:
        async with (
            serving(actions=rec.actions("extend")) as (_, port),
            aiohttp.ClientSession() as session,
            session.post(f"http://127.0.0.1:{port}/extend", data=b"\xff\xfe2h", headers=AUTH) as r,
        ):
            assert r.status == 400
            assert (await r.json()) == {
                "ok": False,
                "error": "the request body is not UTF-8 text; send a duration like 2h",
            }

    asyncio.run(main())
    assert rec.bodies == []


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (SteeringError("duration: '2x' is not a duration"), 400),
        (SteeringError("cannot extend: the run has ended (DONE)", status=409), 409),
    ],
)
def test_a_steering_error_is_answered_with_its_status_and_message(
    error: SteeringError, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.status.server")
    rec = Recorder()
    rec.fail = error

    async def main() -> None:
        async with (
            serving(actions=rec.actions("extend")) as (_, port),
            aiohttp.ClientSession() as session,
            session.post(f"http://127.0.0.1:{port}/extend", data="2x", headers=AUTH) as r,
        ):
            assert r.status == status
            assert await r.json() == {"ok": False, "error": str(error)}

    asyncio.run(main())
    assert f"control request extend refused (HTTP {status}): {error}" in caplog.messages


def test_steering_through_the_endpoint_changes_the_state() -> None:
    """The actions as the daemon wires them: the body parsed, the state changed and shown."""
    state = RunState(job_name="run1", job_source="job.toml", phase=Phase.TRAINING)

    async def do_extend(body: str) -> dict[str, Any]:
        seconds = steering.parse_request_duration(body)
        return steering.extend(state, seconds, now=time.time(), max_runtime_s=3600.0)

    async def do_hold(body: str) -> dict[str, Any]:
        timeout_s = steering.parse_request_duration(body, default=12 * 3600.0)
        return steering.hold(state, now=time.time(), timeout_s=timeout_s)

    async def main() -> None:
        server = StatusServer(
            "127.0.0.1",
            0,
            token=TOKEN,
            status=lambda: steering.steering_status(state, time.time()),
            actions={"extend": do_extend, "hold": do_hold},
        )
        port = await server.start()
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{base}/extend", data="2h", headers=AUTH) as r:
                    assert r.status == 200
                    answer = await r.json()
                    assert answer["extended_s"] == 7200.0
                    assert answer["message"].startswith("deadline extended by 2h:")
                async with session.post(f"{base}/extend", data="2x", headers=AUTH) as r:
                    assert r.status == 400
                    assert (await r.json())["error"].startswith("duration: '2x' is not")
                async with session.post(f"{base}/hold", headers=AUTH) as r:
                    assert r.status == 200
                    assert (await r.json())["hold"]["remaining_s"] > 11 * 3600
                state.phase = Phase.FINISHING
                async with session.post(f"{base}/extend", data="1h", headers=AUTH) as r:
                    assert r.status == 409
                    assert "phase FINISHING" in (await r.json())["error"]
                async with session.get(f"{base}/status") as r:
                    shown = await r.json()
        finally:
            await server.stop()
        assert shown["extended_s"] == 7200.0
        assert shown["hold"]["active"] is True
        assert [a["action"] for a in shown["actions"]] == ["extend", "hold"]

    asyncio.run(main())


def test_every_get_is_open_and_every_post_needs_the_token() -> None:
    rec = Recorder()

    async def main() -> None:
        bus = EventBus()
        async with (
            serving(actions=rec.actions("stop"), **{**READOUTS, "events": bus}) as (_, port),
            aiohttp.ClientSession() as session,
        ):
            base = f"http://127.0.0.1:{port}"
            for path in GET_ROUTES:
                async with session.get(base + path) as r:
                    assert r.status == 200, path
                    if path == "/events":
                        assert await r.content.readline() == b"retry: 2000\n"
            async with session.post(f"{base}/stop") as r:
                assert r.status == 401
            assert rec.bodies == []
            async with session.post(f"{base}/stop", headers=AUTH) as r:
                assert r.status == 200
                assert await r.json() == {"ok": True, "message": "stop done"}
            assert rec.bodies == [("stop", "")]

    asyncio.run(main())


# ---- event streams and the connection cap ------------------------------------------------------


async def open_stream(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert b"retry: 2000" in await reader.readuntil(b"\n\n")
    return reader, writer


def test_at_the_cap_the_oldest_event_stream_makes_room() -> None:
    """Streams are busy forever: if they were never pushed out, a few open dashboards would
    lock out /healthz. The oldest goes first; EventSource reconnects with Last-Event-ID."""

    async def main() -> None:
        bus = EventBus()
        async with serving(events=bus, max_connections=2) as (server, port):
            first = await open_stream(port)
            second = await open_stream(port)
            assert server.connection_stats()["open"] == 2
            assert await healthz_seconds(port) < 5.0  # answered 200, not 503
            assert await closed_by_server(first[0], 5.0)
            stats = server.connection_stats()
            assert (stats["pushed_out"], stats["refused"]) == (1, 0)
            # The younger stream is untouched and still delivers.
            bus.publish("warning", message="still here")
            async with asyncio.timeout(5):
                frame = await second[0].readuntil(b"\n\n")
            assert b"event: warning" in frame
            for _, writer in (first, second):
                writer.close()

    asyncio.run(main())


def test_stopping_the_server_ends_every_event_stream() -> None:
    async def main() -> None:
        server = StatusServer(
            "127.0.0.1", 0, token=TOKEN, status=dict, actions={}, events=EventBus()
        )
        port = await server.start()
        streams = [await open_stream(port) for _ in range(3)]
        await asyncio.wait_for(server.stop(), 10)
        for reader, writer in streams:
            async with asyncio.timeout(5):
                rest = await reader.read()
            assert rest.endswith(b"0\r\n\r\n")  # the chunked body's end: a clean finish
            writer.close()

    asyncio.run(main())


@pytest.mark.parametrize("turns", [0, 1, 2, 3])
def test_a_connection_accepted_as_the_server_stops_is_closed_not_leaked(turns: int) -> None:
    """asyncio accepts in one loop turn and sets the connection up in the next; closing the
    server in between made the set-up fail (``Server._attach`` asserts the server is open:
    "Error on transport creation for incoming connection") and left the accepted socket open
    until the garbage collector found it (an unclosed-transport warning in a later test).
    The loop is driven into that order: the stop starts in the turn that accepts, or
    ``turns`` later (the connection half set up: aiohttp's handler made, its task not started,
    which aiohttp's shutdown then waited on for its 60 s timeout)."""

    async def main() -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        errors: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: errors.append(context))
        server = StatusServer("127.0.0.1", 0, token=TOKEN, status=dict, actions={})
        port = await server.start()
        client = socket.create_connection(("127.0.0.1", port))  # in the backlog at once
        stopping: asyncio.Future[asyncio.Task[None]] = loop.create_future()

        # Next turn: this callback runs first, then the accept the select just saw, so the
        # stop is queued after the accept and before the accepted connection's set-up.
        def later(left: int) -> None:
            if left:
                loop.call_soon(later, left - 1)
            else:
                stopping.set_result(loop.create_task(server.stop()))

        loop.call_soon(later, turns)
        await asyncio.wait_for(await stopping, 10)
        client.settimeout(5)
        try:
            assert client.recv(1) == b""  # closed by the server, not left open
        except ConnectionResetError:
            pass
        finally:
            client.close()
        return errors

    errors = asyncio.run(main())
    assert errors == [], [c.get("message") for c in errors]
