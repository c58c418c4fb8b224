"""The status endpoint under floods, slow clients and foreign Host headers: real sockets only."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from agent.server import StatusServer, host_header_name, is_loopback

TOKEN = "tok_SECRET_1234"


@asynccontextmanager
async def serving(
    host: str = "127.0.0.1",
    actions: dict[str, Callable[[], Awaitable[dict[str, Any]]]] | None = None,
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
    caplog.set_level(logging.INFO, logger="agent.server")

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
            started = time.monotonic()
            closed = await asyncio.gather(*(closed_by_server(r, 3.0) for r, _ in conns))
            assert all(closed)
            assert time.monotonic() - started < 2.5
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
    caplog.set_level(logging.INFO, logger="agent.server")

    async def main() -> None:
        async with serving(header_timeout_s=1.0, keepalive_timeout_s=30.0) as (server, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            started = time.monotonic()
            writer.write(b"GET /status HTTP/1.1\r\n")

            async def trickle() -> None:
                for i in range(40):  # one header line every 0.1 s: never a whole head
                    await asyncio.sleep(0.1)
                    writer.write(b"X-%d: y\r\n" % i)

            task = asyncio.create_task(trickle())
            assert await closed_by_server(reader, 3.0)
            elapsed = time.monotonic() - started
            task.cancel()
            writer.close()
            assert 0.8 < elapsed < 2.5
            assert server.connection_stats()["header_timeouts"] == 1

    asyncio.run(main())
    # Below the cap a slow client harms no one (browsers' spare connections look the same).
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_keep_alive_connection_is_closed_after_the_keepalive_timeout_not_before() -> None:
    async def main() -> None:
        async with serving(header_timeout_s=0.3, keepalive_timeout_s=1.0) as (server, port):
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
            assert await closed_by_server(reader, 3.0)
            idle = time.monotonic() - answered
            writer.close()
            assert 0.8 < idle < 2.5
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

        async def hold() -> dict[str, Any]:
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

    async def stop() -> dict[str, Any]:
        nonlocal stops
        stops += 1
        return {"ok": True}

    async def main() -> None:
        async with serving(actions={"stop": stop}) as (_, port):
            h = f"Host: {host}\r\n".encode()
            auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
            for head in (
                b"GET /status HTTP/1.1\r\n" + h + b"\r\n",
                b"GET /healthz HTTP/1.1\r\n" + h + b"\r\n",
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
    caplog.set_level(logging.INFO, logger="agent.server")

    async def main() -> None:
        async with serving():
            pass

    asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
