"""Logging that survives a storm, and enough file descriptors not to start one.

Out of file descriptors, asyncio logs an accept error with a traceback for every attempt
(``socket.accept() out of system resource``): 400,000 tracebacks, 164 MB of log in 73 s on a
real run. :class:`RateLimitFilter` lets each distinct warning through at most once per interval
and says how many it held back; :func:`install` puts it on a handler and routes the ``asyncio``
and ``aiohttp`` loggers (which otherwise reach stderr through ``logging.lastResort``, unfiltered)
to that handler. :func:`raise_fd_limit` lifts ``RLIMIT_NOFILE`` to the hard limit at start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator

from agent.util.redact import redact as redact_secret_text
from agent.util.redact import remember, remembered

#: The standard library's dataclasses for mypy, agent.util.record's at run time: the supervisor
#: imports this module, and dataclasses is 1.0 MiB it does not hold (issue 26).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from dataclasses import dataclass as record
else:
    from agent.util.record import record

log = logging.getLogger(__name__)

#: Seconds during which a repeated record is held back after it was let through.
DEFAULT_INTERVAL_S = 60.0
#: Loggers of the libraries the agent runs on whose records :func:`install` routes to a handler.
LIBRARY_LOGGERS = ("asyncio", "aiohttp")
#: :func:`raise_fd_limit` never asks for more descriptors than this (systemd's LimitNOFILE).
FD_LIMIT_CAP = 65536
#: Below this many descriptors, :func:`raise_fd_limit` warns that it could not raise the limit.
FD_LIMIT_LOW = 4096

# Set on a record once it has been decided, so that one filter on several handlers counts it once.
_DECISION = "_agent_rate_limited"

Key = tuple[str, int, str, str]


@record
class _Window:
    started: float
    suppressed: int = 0


class RateLimiter:
    """At most one pass per key per ``interval_s``; counts what it held back. Thread-safe.

    Keeps at most ``max_keys`` keys, forgetting first the one that passed longest ago. The core
    of :class:`RateLimitFilter` and of the sync's per-path warnings
    (``agent.sync.uploads.Throttle``).
    """

    def __init__(
        self,
        interval_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 1024,
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._max_keys = max_keys
        self._windows: OrderedDict[Hashable, _Window] = OrderedDict()
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forget every key."""
        with self._lock:
            self._windows.clear()

    def admit(self, key: Hashable) -> tuple[int, float] | None:
        """None: hold this one back. Else it passes: how many were held back since ``key`` last
        passed, and the seconds since then (``(0, 0.0)`` for a new key)."""
        now = self._clock()
        with self._lock:
            window = self._windows.get(key)
            if window is not None and now - window.started < self.interval_s:
                window.suppressed += 1
                return None
            if window is None:
                if len(self._windows) >= self._max_keys:
                    self._windows.popitem(last=False)
                self._windows[key] = _Window(now)
                return 0, 0.0
            self._windows[key] = _Window(now)
            self._windows.move_to_end(key)
        return window.suppressed, now - window.started


class RateLimitFilter(logging.Filter):
    """Lets a record through at most once per ``interval_s`` per key; counts the rest.

    The key is the logger name, the level, the first line of the formatted message and the
    exception type: the same failure repeated is one key (asyncio's accept error is always
    ``socket.accept() out of system resource``), while different messages sharing a template
    (``"dataset: %s"``) stay distinct. When a key is let through again after records were held
    back, its first line ends with ``(N similar suppressed in the last Ts)``. Records below
    ``min_level`` always pass: designed INFO lines are not repeated in storms.

    One instance may sit on several handlers: each record is decided once.
    """

    def __init__(
        self,
        interval_s: float = DEFAULT_INTERVAL_S,
        *,
        min_level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 1024,
    ) -> None:
        super().__init__()
        self.min_level = min_level
        self._limiter = RateLimiter(interval_s, clock=clock, max_keys=max_keys)

    @property
    def interval_s(self) -> float:
        return self._limiter.interval_s

    def reset(self) -> None:
        """Forget every key (tests; a new run in the same process)."""
        self._limiter.reset()

    def filter(self, record: logging.LogRecord) -> bool:
        decided = getattr(record, _DECISION, None)
        if isinstance(decided, bool):
            return decided
        passed = record.levelno < self.min_level or self._admit(record)
        setattr(record, _DECISION, passed)
        return passed

    def _admit(self, record: logging.LogRecord) -> bool:
        passed = self._limiter.admit(_key(record))
        if passed is None:
            return False
        held, elapsed = passed
        if held:
            _append_to_first_line(
                record, f" ({held} similar suppressed in the last {elapsed:.0f}s)"
            )
        return True


def _key(record: logging.LogRecord) -> Key:
    try:
        message = record.getMessage()
    except Exception:  # a bad format string: the handler reports it; key on the template
        message = str(record.msg)
    exc_type = record.exc_info[0] if record.exc_info else None
    return (
        record.name,
        record.levelno,
        message.partition("\n")[0],
        exc_type.__qualname__ if exc_type is not None else "",
    )


def _append_to_first_line(record: logging.LogRecord, text: str) -> None:
    # The template is changed, not the formatted message: every handler formats it again.
    first, newline, rest = str(record.msg).partition("\n")
    if record.args:
        text = text.replace("%", "%%")
    record.msg = first + text + newline + rest


class RedactFilter(logging.Filter):
    """Removes every secret from each record, its arguments and its traceback, before any
    handler writes it (:func:`agent.util.redact.redact`: the secrets the agent read from the
    environment (HF_TOKEN, provider keys) as ``<VARIABLE>``, and Bearer tokens, credentials in
    URLs and the like as ``<secret>``): the backstop behind each module's own redaction, since
    agent.log is uploaded with the checkpoints."""

    @property
    def secrets(self) -> tuple[tuple[str, str], ...]:
        """The ``(variable, value)`` pairs redacted (:func:`agent.util.redact.remembered`)."""
        return remembered()

    @secrets.setter
    def secrets(self, secrets: Iterable[tuple[str, str]]) -> None:
        remember(secrets)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: the handler reports it (without the args)
            record.args = None
            message = str(record.msg)
        cleaned = redact_text(message)
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        exc_text = redact_text(record.exc_text) if record.exc_text else record.exc_text
        if cleaned != message or exc_text != record.exc_text:
            record.msg, record.args, record.exc_text = cleaned, None, exc_text
        return True


#: The filters :func:`install` shares between handlers.
rate_limit = RateLimitFilter()
redact = RedactFilter()


def redact_text(text: str) -> str:
    """``text`` without any secret (:func:`agent.util.redact.redact`)."""
    return redact_secret_text(text)


def redact_secrets(secrets: Iterable[tuple[str, str]]) -> None:
    """Redact these ``(variable, value)`` pairs from now on, everywhere
    (:func:`agent.util.redact.remember`)."""
    remember(secrets)


def install(handler: logging.Handler, *, libraries: Iterable[str] = LIBRARY_LOGGERS) -> None:
    """Rate-limit ``handler`` and route the library loggers' records to it (idempotent).

    Call it for every handler the agent logs to (the stderr one, ``agent.log``); undo it with
    :func:`uninstall` before closing the handler.
    """
    if redact not in handler.filters:
        handler.addFilter(redact)  # first: the rate limiter keys on the redacted text
    if rate_limit not in handler.filters:
        handler.addFilter(rate_limit)
    for name in libraries:
        logger = logging.getLogger(name)
        if handler not in logger.handlers:
            logger.addHandler(handler)


def uninstall(handler: logging.Handler, *, libraries: Iterable[str] = LIBRARY_LOGGERS) -> None:
    """Undo :func:`install` for ``handler``."""
    handler.removeFilter(rate_limit)
    handler.removeFilter(redact)
    for name in libraries:
        logging.getLogger(name).removeHandler(handler)


_fd_limit_logged = False


def raise_fd_limit(cap: int = FD_LIMIT_CAP) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit, at most ``cap``; return the soft limit
    now in force (``resource.RLIM_INFINITY`` when unlimited). Never lowers it. Logged once.

    The default soft limit (1,024) is what one idle-connection flood exhausted; the trainer,
    started later, inherits the raised limit too.
    """
    global _fd_limit_logged
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
    new, problem = soft, ""
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            new = target
        except (ValueError, OSError) as exc:
            problem = f": raising it to {target} failed ({exc})"
    if not _fd_limit_logged:
        _fd_limit_logged = True
        shown_hard = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
        if new != soft:
            log.info("file descriptor limit raised from %d to %d (hard %s)", soft, new, shown_hard)
        elif new != resource.RLIM_INFINITY and new < FD_LIMIT_LOW:
            log.warning(
                "file descriptor limit is %d (hard %s)%s; raise it (systemd LimitNOFILE=, "
                "ulimit -n) or a connection flood may starve uploads",
                new,
                shown_hard,
                problem,
            )
    return new


# --------------------------------------------------------------------------------------------
# The one place logging is configured: the console (the CLI) and agent.log (the daemon).


#: The syslog priority of each logging level, as journald reads it from a ``<N>`` prefix.
SYSLOG_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


def journal_stream(fd: int | None = None) -> bool:
    """Whether ``fd`` (default: stderr) is connected to the systemd journal: systemd sets
    ``JOURNAL_STREAM=DEVICE:INODE`` for a service whose output goes there, and the descriptor
    must be that very stream (sd-daemon(3)): a child that inherited the variable with its
    stderr sent to a file (the guard's guard.log) gets no prefixes."""
    value = os.environ.get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(sys.stderr.fileno() if fd is None else fd)
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (OSError, ValueError, AttributeError):
        return False


def syslog_prefix(priority: int) -> str:
    """``<N>`` when stderr is the journal (:func:`journal_stream`), else ""."""
    return f"<{priority}>" if journal_stream() else ""


class SyslogPrefixFormatter(logging.Formatter):
    """Each line of a record starts with its syslog priority (``<4>`` for a warning), which
    journald turns into the entry's priority (``SyslogLevelPrefix=``, on by default), so
    ``journalctl -p warning`` finds warnings; a traceback's lines keep their record's level."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{SYSLOG_PRIORITY.get(record.levelno, _nearest_priority(record.levelno))}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


def _nearest_priority(levelno: int) -> int:
    """A custom level's priority: that of the standard level just below it."""
    below = [level for level in SYSLOG_PRIORITY if level <= levelno]
    return SYSLOG_PRIORITY[max(below)] if below else SYSLOG_PRIORITY[logging.DEBUG]


def configure_console(verbose: bool) -> None:
    """The ``agent`` loggers to stderr, short lines, repeated warnings rate-limited; each line
    with its syslog priority when stderr is the journal (:func:`journal_stream`)."""
    handler = logging.StreamHandler(sys.stderr)
    formatter = SyslogPrefixFormatter if journal_stream() else logging.Formatter
    handler.setFormatter(formatter("%(asctime)s %(levelname)-7s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("agent")
    for old in root.handlers:
        uninstall(old)
    root.handlers[:] = [handler]
    install(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


@contextlib.contextmanager
def to_file(handler: logging.Handler) -> Iterator[None]:
    """agent.log for the life of a daemon run: the record a person reads after the fact, so
    always at INFO or finer, with the same rate limit as the console."""
    agent_log = logging.getLogger("agent")
    agent_log.addHandler(handler)
    install(handler)
    if agent_log.getEffectiveLevel() > logging.INFO:
        agent_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        uninstall(handler)
        agent_log.removeHandler(handler)
        handler.close()
