"""sd_notify (agent/util/sdnotify.py) against a real unix datagram socket bound here, as systemd
binds it; and the unit file (systemd/libreyolo-agent.service) through ``systemd-analyze verify``."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.util.sdnotify import SdNotify

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "libreyolo-agent.service"


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket at a short path (sun_path holds 108 bytes), as NOTIFY_SOCKET."""
    folder = tempfile.mkdtemp(prefix="sdn", dir="/tmp")
    path = os.path.join(folder, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    try:
        yield sock, path
    finally:
        sock.close()
        shutil.rmtree(folder)


def received(sock: socket.socket) -> list[bytes]:
    """Every datagram waiting on ``sock``, in order."""
    sock.setblocking(False)
    out = []
    while True:
        try:
            out.append(sock.recv(4096))
        except BlockingIOError:
            return out


def test_ready_status_stopping_arrive_as_datagrams(
    notify_socket: tuple[socket.socket, str],
) -> None:
    sock, path = notify_socket
    n = SdNotify.from_env({"NOTIFY_SOCKET": path})
    assert n.enabled and n.watchdog_interval_s() is None
    assert n.ready("phase BOOTING")
    assert n.status("phase TRAINING")
    assert n.status("phase\nFINISHING")  # a newline would start another assignment
    assert n.stopping("phase DONE")
    n.close()
    assert received(sock) == [
        b"READY=1\nSTATUS=phase BOOTING",
        b"STATUS=phase TRAINING",
        b"STATUS=phase FINISHING",
        b"STOPPING=1\nSTATUS=phase DONE",
    ]


def test_stopping_before_ready_says_ready_first(notify_socket: tuple[socket.socket, str]) -> None:
    # Seen in systemd: a Type=notify service that exits 0 without READY=1 fails ("protocol"),
    # and Restart=on-failure would start an ended job's agent again and again.
    sock, path = notify_socket
    n = SdNotify.from_env({"NOTIFY_SOCKET": path})
    n.stopping("job already ended")
    n.close()
    assert received(sock) == [b"READY=1\nSTOPPING=1\nSTATUS=job already ended"]


def test_an_abstract_socket_is_reached_through_its_at_name() -> None:
    name = f"libreyolo-agent-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    try:
        n = SdNotify.from_env({"NOTIFY_SOCKET": f"@{name}"})
        assert n.ready("phase PREFLIGHT")
        n.close()
        assert received(sock) == [b"READY=1\nSTATUS=phase PREFLIGHT"]
    finally:
        sock.close()


def test_watchdog_pings_while_alive_and_none_after(
    notify_socket: tuple[socket.socket, str],
) -> None:
    sock, path = notify_socket
    environ = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "40000", "WATCHDOG_PID": str(os.getpid())}
    n = SdNotify.from_env(environ)
    assert n.watchdog_interval_s() == pytest.approx(0.02)  # half of WATCHDOG_USEC
    healthy_turns = 3
    calls = 0

    def alive() -> bool:
        nonlocal calls
        calls += 1
        return calls <= healthy_turns

    async def main() -> None:
        task = asyncio.create_task(n.watchdog_task(alive))
        while calls < healthy_turns + 4:  # four turns after the loop went unhealthy
            await asyncio.sleep(0.01)
            assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    n.close()
    pings = received(sock)
    assert pings == [b"WATCHDOG=1"] * healthy_turns


def test_watchdog_of_another_pid_is_not_ours_to_feed(
    notify_socket: tuple[socket.socket, str],
) -> None:
    # WATCHDOG_PID names the process systemd watches; a child that inherited the variables
    # (the guard, a trainer) must not keep a dead agent looking alive.
    sock, path = notify_socket
    other = str(os.getpid() + 1)
    n = SdNotify.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "40000", "WATCHDOG_PID": other})
    assert n.watchdog_interval_s() is None
    assert not n.watchdog()
    asyncio.run(asyncio.wait_for(n.watchdog_task(lambda: True), timeout=10))  # returns at once
    assert n.ready("phase BOOTING")  # the rest of the protocol still works
    n.close()
    assert received(sock) == [b"READY=1\nSTATUS=phase BOOTING"]


def test_without_notify_socket_nothing_is_sent() -> None:
    n = SdNotify.from_env({"WATCHDOG_USEC": "40000"})
    assert not n.enabled
    assert n.watchdog_interval_s() is None
    assert not n.ready("phase BOOTING") and not n.status("x") and not n.stopping("y")


def test_a_vanished_socket_never_raises_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    n = SdNotify.from_env({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    with caplog.at_level(logging.ERROR, logger="agent.util.sdnotify"):
        results = [n.ready("a"), n.status("b"), n.status("c"), n.stopping("d")]
    n.close()
    assert results == [False] * 4
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "cannot notify systemd" in errors[0]


# ------------------------------------------------------------------------------- the unit file


def unit_settings() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_the_unit_is_a_notify_service_that_never_kills_the_trainer() -> None:
    s = unit_settings()
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert s["WatchdogSec"] and s["Restart"] == ["on-failure"]
    assert s["KillMode"] == ["process"]  # a restarted agent re-attaches to the trainer
    assert "2" in s["RestartPreventExitStatus"][0].split()  # a bad job file: no restart
    assert int(s["StartLimitBurst"][0]) > 3  # the agent's own crash-loop rule needs 4 starts
    assert s["StandardOutput"] == ["journal"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify refuses an ExecStart binary that does not exist: check a copy that runs a real one.
    exe = shutil.which("true")
    assert exe is not None
    copy = tmp_path / "libreyolo-agent.service"
    copy.write_text(UNIT.read_text().replace("/opt/libreyolo-agent/.venv/bin/libreyolo-agent", exe))
    done = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "libreyolo-agent.service" not in done.stderr, done.stderr  # no warning about it
