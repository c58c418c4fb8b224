"""systemd's notification protocol (``sd_notify``), for the agent run as a ``Type=notify`` unit.

systemd passes ``NOTIFY_SOCKET`` (a path, or ``@name`` for an abstract socket) and, with
``WatchdogSec=``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID``. A message is one datagram of
``KEY=value`` lines on a plain ``AF_UNIX`` ``SOCK_DGRAM`` socket (no python-systemd needed):
``READY=1`` once the agent serves ``/status``, ``STATUS=...`` on each phase change (what
``systemctl status`` shows), ``WATCHDOG=1`` at half the watchdog timeout while the event loop is
healthy, ``STOPPING=1`` when the agent exits. See sd_notify(3) and systemd.service(5).

Without ``NOTIFY_SOCKET`` (a container, a terminal) every call does nothing. A failed send is
logged once and never raised: supervision must not fail because systemd's socket went away.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


def _address(raw: str | None) -> str | bytes | None:
    """The socket address of ``NOTIFY_SOCKET``: a path, or (``@name``) an abstract socket, whose
    name starts with a NUL byte; None when unset or of a kind this module does not speak
    (``vsock:``)."""
    if not raw:
        return None
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    log.warning("NOTIFY_SOCKET=%r is not a unix socket path; not notifying systemd", raw)
    return None


def _watchdog_usec(environ: Mapping[str, str], pid: int) -> int | None:
    """``WATCHDOG_USEC`` when it is meant for this process (``WATCHDOG_PID`` unset or ours)."""
    raw = environ.get("WATCHDOG_USEC", "").strip()
    if not raw:
        return None
    owner = environ.get("WATCHDOG_PID", "").strip()
    if owner and owner != str(pid):
        return None  # set for another process (inherited through it): not ours to feed
    try:
        usec = int(raw)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not a number of microseconds; no watchdog", raw)
        return None
    return usec if usec > 0 else None


def _one_line(text: str) -> str:
    # A newline would start another KEY=value assignment in the datagram.
    return " ".join(text.split())


class SdNotify:
    """The agent's side of sd_notify: :meth:`ready`, :meth:`status`, :meth:`watchdog`,
    :meth:`stopping`. Inert (``enabled`` False) without a socket. Never raises."""

    def __init__(self, address: str | bytes | None, *, watchdog_usec: int | None = None) -> None:
        """``address``: the notification socket (a path, or bytes starting with NUL for an
        abstract one); None disables everything. ``watchdog_usec``: systemd's ``WatchdogSec``
        in microseconds; None: no watchdog."""
        self.address = address
        self.watchdog_usec = watchdog_usec if address is not None else None
        self._sock: socket.socket | None = None
        self._ready_sent = False
        self._error_logged = False
        self._unhealthy_logged = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SdNotify:
        """From ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` (``os.environ`` by
        default); the watchdog only when ``WATCHDOG_PID`` is unset or this process's pid."""
        e = os.environ if environ is None else environ
        address = _address(e.get("NOTIFY_SOCKET"))
        usec = _watchdog_usec(e, os.getpid()) if address is not None else None
        return cls(address, watchdog_usec=usec)

    @property
    def enabled(self) -> bool:
        """True when there is a socket to notify."""
        return self.address is not None

    def watchdog_interval_s(self) -> float | None:
        """Seconds between two ``WATCHDOG=1`` pings: half the watchdog timeout, as sd_notify(3)
        advises; None without a watchdog."""
        if self.watchdog_usec is None:
            return None
        return self.watchdog_usec / 2 / 1e6

    # --------------------------------------------------------------------------- messages

    def ready(self, status: str) -> bool:
        """Start-up is over (the HTTP server listens): ``READY=1`` with a ``STATUS=``."""
        self._ready_sent = True
        return self._send(f"READY=1\nSTATUS={_one_line(status)}")

    def status(self, text: str) -> bool:
        """What ``systemctl status`` shows, e.g. ``phase TRAINING``."""
        return self._send(f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        """One watchdog ping (``WATCHDOG=1``); nothing without a watchdog."""
        if self.watchdog_usec is None:
            return False
        return self._send("WATCHDOG=1")

    def stopping(self, status: str) -> bool:
        """The agent is exiting: ``STOPPING=1``. An agent that exits before it was ready (the
        job had already ended) says ``READY=1`` first: a ``Type=notify`` service that exits
        without it counts as failed (protocol) and would be restarted."""
        ready = "" if self._ready_sent else "READY=1\n"
        self._ready_sent = True
        return self._send(f"{ready}STOPPING=1\nSTATUS={_one_line(status)}")

    async def watchdog_task(self, alive: Callable[[], bool]) -> None:
        """Ping the watchdog every :meth:`watchdog_interval_s` while ``alive()`` says the agent
        is healthy; skip the ping (systemd then restarts the agent) while it says not. Returns
        at once without a watchdog. Run it as a long-lived task; cancel it at shutdown."""
        interval = self.watchdog_interval_s()
        if interval is None:
            return
        log.info("systemd watchdog: pinging every %.1fs", interval)
        while True:
            try:
                healthy = alive()
            except Exception:
                log.exception("watchdog health check failed; counting the agent unhealthy")
                healthy = False
            if healthy:
                self._unhealthy_logged = False
                self.watchdog()
            elif not self._unhealthy_logged:
                self._unhealthy_logged = True
                log.error("systemd watchdog: the agent is unhealthy; not pinging")
            await asyncio.sleep(interval)

    # --------------------------------------------------------------------------- plumbing

    def _send(self, message: str) -> bool:
        """One datagram; True when it was sent. Non-blocking: a full queue drops the message
        rather than stall the event loop."""
        if self.address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                )
            self._sock.sendto(message.encode(), self.address)
        except OSError as exc:
            if not self._error_logged:
                self._error_logged = True
                log.error(
                    "cannot notify systemd on %s: %s (logged once)",
                    self._printable_address(),
                    exc.strerror or exc,
                )
            return False
        if self._error_logged:
            self._error_logged = False
            log.info("notifying systemd again")
        return True

    def _printable_address(self) -> str:
        if isinstance(self.address, bytes):
            return "@" + self.address[1:].decode(errors="replace")
        return str(self.address)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
