"""One value of the job file at a time: read from its TOML table, checked, or refused with a
:class:`ConfigError` that names the key, the value and what was expected.

``config.py`` assembles these values into the job's dataclasses; this module knows nothing of
the sections. Mistakes are collected rather than raised one by one (:class:`ErrorList`), so that
``libreyolo-agent check`` reports every mistake of a job file at once.
"""

from __future__ import annotations

import ipaddress
import math
import re
import sys
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, overload
from urllib.parse import urlsplit

from agent.util.text import format_duration as format_duration
from agent.util.text import show as show


class ConfigError(Exception):
    """A job file or environment value is wrong. The message names the key and the fix.

    The message is always one printable line: a key or value holding a newline, a NUL or an
    escape sequence is shown escaped, so ``check`` prints one line and a terminal stays sane."""

    def __init__(self, key: str, message: str) -> None:
        self.key = printable(key if len(key) <= 200 else key[:197] + "...")
        super().__init__(printable(f"{self.key}: {message}"))

    @property
    def errors(self) -> tuple[ConfigError, ...]:
        """Every mistake this error stands for, one line each: here only itself."""
        return (self,)


class ConfigErrors(ConfigError):
    """Several independent mistakes of one job file: unknown sections first, then section by
    section (job, dataset, train, sync, limits, teardown, server, preflight), keys in order.

    ``str()`` is one line per mistake; ``key`` is the first mistake's key."""

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        flat = tuple(one for error in errors for one in error.errors)
        if not flat:
            raise ValueError("ConfigErrors needs at least one error")
        self._errors = flat
        self.key = flat[0].key
        Exception.__init__(self, "\n".join(str(one) for one in flat))

    @property
    def errors(self) -> tuple[ConfigError, ...]:
        return self._errors


class ErrorList:
    """The mistakes found so far in one job file, at most one per key: a second complaint about
    a key already named is a consequence of the first, not news for the user."""

    def __init__(self) -> None:
        self.items: list[ConfigError] = []

    def add(self, error: ConfigError) -> None:
        for one in error.errors:
            if not self.named(one.key):
                self.items.append(one)

    def named(self, *keys: str) -> bool:
        """Whether a mistake about any of ``keys`` was recorded."""
        return any(error.key in keys for error in self.items)

    @contextmanager
    def catch(self) -> Iterator[None]:
        """Record a :class:`ConfigError` raised in the block instead of letting it out."""
        try:
            yield
        except ConfigError as exc:
            self.add(exc)

    def raise_if_any(self) -> None:
        """Raise the one mistake, or :class:`ConfigErrors` holding them all; nothing if none."""
        if len(self.items) == 1:
            raise self.items[0] from None
        if self.items:
            raise ConfigErrors(self.items) from None


# --------------------------------------------------------------------------------------------
# Text


def printable(text: str) -> str:
    """``text`` with every unprintable character escaped as ``repr`` does: one safe line."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def refuse_unprintable(key: str, value: str, *, lax: bool = False) -> None:
    """Refuse NUL, control characters, line breaks and (unless ``lax``) invisible ones.

    Strict is for names, paths, repo ids and URLs, where such a character is always a mistake
    (or a spoof: U+202E reverses the text shown). ``lax`` is for ``[train]`` values, passed on
    as one command-line argument each: only control characters and line breaks are refused."""
    for i, ch in enumerate(value):
        bad = unicodedata.category(ch) in ("Cc", "Zl", "Zp") if lax else not ch.isprintable()
        if bad:
            what = "a NUL character" if ch == "\x00" else f"the unprintable character {ch!a}"
            expected = "a single line of text" if lax else "printable text"
            raise ConfigError(
                key, f"{show(value)} contains {what} at position {i}; expected {expected}"
            )


# --------------------------------------------------------------------------------------------
# The whole document

#: TOML integers are 64-bit (toml.io: "an error must be thrown" past them); tomllib reads any size.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def check_document(doc: Mapping[str, Any], errors: ErrorList) -> None:
    """Record, anywhere in the document, what no setting can use and later code trips over:
    NUL in a key or a string (it ends C strings: paths and argv fail at every restart) and an
    integer beyond TOML's 64-bit range (``str()`` of it may raise)."""
    for k in doc:
        if "\x00" in str(k):
            errors.add(ConfigError(str(k), "the name contains a NUL character"))
    stack: list[tuple[str, object]] = [(str(k), v) for k, v in reversed(list(doc.items()))]
    while stack:
        key, value = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                i = value.index("\x00")
                errors.add(
                    ConfigError(key, f"{show(value)} contains a NUL character at position {i}")
                )
        elif isinstance(value, int) and not isinstance(value, bool):
            if not _INT64_MIN <= value <= _INT64_MAX:
                errors.add(
                    ConfigError(key, f"{show(value)} is outside TOML's 64-bit integer range")
                )
        elif isinstance(value, Mapping):
            for k in value:
                if "\x00" in str(k):
                    errors.add(ConfigError(f"{key}.{k}", "the key contains a NUL character"))
            stack.extend((f"{key}.{k}", v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list | tuple):
            stack.extend((f"{key}[{i}]", v) for i, v in reversed(list(enumerate(value))))


def huge_integer_problem(text: str) -> str | None:
    """Why tomllib refused ``text`` with a plain ValueError, when an integer of more digits than
    Python's ``int()`` accepts is the reason; None otherwise."""
    limit = sys.get_int_max_str_digits() or 4300
    for m in re.finditer(rf"[0-9_]{{{limit + 1},}}", text):
        if len(m.group().replace("_", "")) > limit:
            line = text.count("\n", 0, m.start()) + 1
            return (
                f"the integer at line {line} has more than {limit} digits "
                "(TOML integers are 64-bit: at most 19 digits)"
            )
    return None


# --------------------------------------------------------------------------------------------
# One table


class Table:
    """Reads one TOML table, remembering which keys were consumed so the rest can be refused.

    A reader that meets a mistake records it in ``errors`` and returns the default it was given
    (None for a required value), so the rest of the file is still read and checked."""

    def __init__(self, name: str, data: object, errors: ErrorList) -> None:
        self.name = name
        self.errors = errors
        self.used: set[str] = set()
        self.data: dict[str, Any] = {}
        if isinstance(data, dict):
            self.data = data
        else:
            errors.add(ConfigError(name, f"{show(data)} must be a table ([{name}])"))

    def key(self, k: str) -> str:
        return f"{self.name}.{k}"

    def bad(self, k: str, message: str) -> None:
        """Record a mistake about key ``k`` of this table."""
        self.errors.add(ConfigError(self.key(k), message))

    def _get(self, k: str, required: bool) -> Any:
        self.used.add(k)
        if k not in self.data:
            if required:
                self.bad(k, "is required but missing")
            return None
        return self.data[k]

    def str_(self, k: str, default: str | None = None, *, required: bool = False) -> str | None:
        """A non-empty string of printable characters (names, paths, URLs, choices)."""
        v = self._get(k, required)
        if v is None:
            return default
        if not isinstance(v, str):
            self.bad(k, f"{show(v)} is not a string")
            return default
        if not v.strip():
            self.bad(k, f"{show(v)} must not be empty")
            return default
        try:
            refuse_unprintable(self.key(k), v)
        except ConfigError as exc:
            self.errors.add(exc)
            return default
        return v

    def req_str(self, k: str) -> str | None:
        """A required :meth:`str_`; None (and a recorded mistake) when missing or wrong."""
        return self.str_(k, required=True)

    def bool_(self, k: str, default: bool) -> bool:
        v = self._get(k, False)
        if v is None:
            return default
        if not isinstance(v, bool):
            self.bad(k, f"{show(v)} is not a boolean (true or false)")
            return default
        return v

    def number(
        self, k: str, default: float | None, *, minimum: float = 0.0, strict: bool = False
    ) -> float | None:
        v = self._get(k, False)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int | float):
            self.bad(k, f"{show(v)} is not a number")
            return default
        try:
            finite = math.isfinite(float(v))
        except OverflowError:
            finite = False
        if not finite:
            self.bad(k, f"{show(v)} is not a finite number")
            return default
        if v < minimum or (strict and v == minimum):
            rel = ">" if strict else ">="
            self.bad(k, f"{show(v)} must be {rel} {minimum:g}")
            return default
        return float(v)

    def int_(self, k: str, default: int, *, minimum: int) -> int:
        v = self._get(k, False)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            self.bad(k, f"{show(v)} is not an integer")
            return default
        if v < minimum:
            self.bad(k, f"{show(v)} must be >= {minimum}")
            return default
        return v

    @overload
    def duration(
        self, k: str, default: float, *, allow_zero: bool = False, maximum: float = ...
    ) -> float: ...
    @overload
    def duration(
        self, k: str, default: None, *, allow_zero: bool = False, maximum: float = ...
    ) -> float | None: ...
    def duration(
        self,
        k: str,
        default: float | None,
        *,
        allow_zero: bool = False,
        maximum: float = 0.0,
    ) -> float | None:
        """A duration (:func:`parse_duration`), at most ``maximum`` seconds (default, or 0:
        :data:`MAX_DURATION_S`)."""
        v = self._get(k, False)
        if v is None:
            return default
        try:
            return parse_duration(
                self.key(k), v, allow_zero=allow_zero, maximum=maximum or MAX_DURATION_S
            )
        except ConfigError as exc:
            self.errors.add(exc)
            return default

    def argv(self, k: str) -> tuple[str, ...]:
        """A command line as a list of strings (run without a shell); ``()`` when missing."""
        v = self._get(k, False)
        if v is None:
            return ()
        if isinstance(v, str):
            self.bad(
                k,
                f"{show(v)} must be a list of strings, one per argument (it runs without a "
                f'shell), e.g. ["shutdown", "-h", "now"]',
            )
            return ()
        if not isinstance(v, list) or not v:
            self.bad(k, f"{show(v)} must be a non-empty list of strings (the command's argv)")
            return ()
        for i, arg in enumerate(v):
            if not isinstance(arg, str):
                self.bad(k, f"item {i}: {show(arg)} is not a string")
                return ()
            try:
                refuse_unprintable(f"{self.key(k)}[{i}]", arg, lax=True)
            except ConfigError as exc:
                self.bad(k, str(exc).partition(": ")[2])
                return ()
        if not v[0].strip():
            self.bad(k, f"{show(v)}: the program (item 0) must not be empty")
            return ()
        return tuple(v)

    def choice(self, k: str, default: str, choices: tuple[str, ...]) -> str:
        v = self.str_(k, default)
        assert v is not None
        if v not in choices:
            self.bad(k, f"{show(v)} is not one of {', '.join(choices)}")
            return default
        return v

    def finish(self) -> None:
        """Record every key of the table that no reader asked for."""
        expected = ", ".join(sorted(self.used))
        for k in sorted(set(self.data) - self.used):
            self.bad(k, f"unknown key (expected one of: {expected})")


# --------------------------------------------------------------------------------------------
# Durations

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(d|h|m|s)")
_DURATION_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}

#: The one bound on every duration the agent reads: the job file's, the guard's environment
#: variables' and a control request's (``extend``, ``hold``). A year is longer than any run or
#: timeout; ``"99999999999999999999d"`` is a typo, and a deadline no clock can show (it once made
#: ``/hold`` and ``/extend`` fail after saving, and the guard fail at every beat).
MAX_DURATION_S = 365 * 86400.0
#: The most steering may keep a box up or push its deadline, seconds (30 days): one ``hold``
#: (counted from the request; the job's ``teardown.hold_timeout`` too) and all the ``extend``
#: requests of a run together. A box nobody looks at must not bill for months.
MAX_STEERING_S = 30 * 86400.0


def parse_duration(
    key: str, value: object, *, allow_zero: bool = False, maximum: float = MAX_DURATION_S
) -> float:
    """Parse ``"12h"``, ``"20m"``, ``"1h30m"``, ``"45s"``, ``"2d"`` or a number of seconds
    (``"0s"`` only with ``allow_zero``), at most ``maximum`` seconds (365 days unless a key has
    a tighter bound): the one rule every duration of the agent goes through."""
    expected = 'a duration like "90s", "20m", "12h", "1h30m", "2d" or a number of seconds'
    if isinstance(value, bool):
        raise ConfigError(key, f"{value!r} is not {expected}")
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:
            raise ConfigError(key, f"{show(value)} is too large for {expected}") from None
    elif isinstance(value, str):
        text = value.strip().lower()
        pos = 0
        seconds = 0.0
        for m in _DURATION_PART.finditer(text):
            if m.start() != pos:
                break
            seconds += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
            pos = m.end()
        if not text or pos != len(text):
            raise ConfigError(key, f"{value!r} is not {expected}")
    else:
        raise ConfigError(key, f"{value!r} is not {expected}")
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        what = "zero or a positive" if allow_zero else "a positive"
        raise ConfigError(key, f"{value!r} must be {what} duration ({expected})")
    if seconds > maximum:
        # The conversion is shown while it is readable (a typo like "2000h" is then obvious).
        said = (
            f"{show(value)} is {format_duration(seconds)},"
            if seconds < 1e12
            else f"{show(value)} is"
        )
        raise ConfigError(
            key,
            f"{said} more than {format_duration(maximum)}, the longest this duration may be; "
            "give a shorter one",
        )
    return seconds


# --------------------------------------------------------------------------------------------
# Hub repo ids, paths inside a folder, revisions, URLs

#: A Hub repo id part (namespace or name), as ``huggingface_hub.utils.validate_repo_id`` checks
#: it (``REPO_ID_REGEX``, ASCII): 1-96 of ``[A-Za-z0-9_.-]``, not starting or ending with ``-``
#: or ``.``.
_REPO_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")


def repo_id_problem(repo_id: str) -> str | None:
    """Why ``repo_id`` is not a Hub ``namespace/name`` repo id, or None when it is one.

    Mirrors ``huggingface_hub.utils.validate_repo_id`` (importing the library costs the agent's
    start-up a few hundred ms) plus the namespace the agent needs."""
    parts = repo_id.split("/")
    if len(parts) != 2:
        return "must be namespace/name, with exactly one '/'"
    if not all(_REPO_PART.fullmatch(p) for p in parts):
        hint = " ('@revision' is not part of a repo id)" if "@" in repo_id else ""
        return (
            "may use only letters, digits, '-', '_' and '.', not start or end either part with "
            f"'-' or '.', and have at most 96 characters per part{hint}"
        )
    if "--" in repo_id or ".." in repo_id:
        return "must not contain '--' or '..'"
    if repo_id.endswith(".git"):
        return "must not end in '.git'"
    return None


def check_inside(key: str, value: str, where: str) -> None:
    """``value`` is a relative path that stays inside ``where`` (no ``..``, not absolute)."""
    if value.startswith(("/", "~")) or ".." in value.replace("\\", "/").split("/"):
        raise ConfigError(key, f"{show(value)} must be a relative path inside {where}")


def check_revision(key: str, value: str) -> None:
    if any(ch.isspace() for ch in value):
        raise ConfigError(key, f"{show(value)} must be a branch, tag or commit (no spaces)")


def url_scheme(url: str) -> str | None:
    """The scheme of ``url``, or None when it does not even split as a URL."""
    try:
        return urlsplit(url).scheme
    except ValueError:
        return None


#: A provider's instance id: it becomes one segment of an API path, so nothing that could
#: change the path (``/``, ``..``, ``?``, ``%``) gets through. Vast ids are digits, RunPod's
#: letters and digits, Lambda's hexadecimal.
_INSTANCE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def instance_id_problem(value: str) -> str | None:
    """Why ``value`` is not a usable instance id, or None when it is one."""
    if _INSTANCE_ID.fullmatch(value) and ".." not in value:
        return None
    return "must be 1-128 letters, digits, '_', '.' or '-' (starting with a letter or digit)"


def check_api_url(key: str, url: str, api_path: str | None = None) -> str:
    """``url`` is an http(s) base URL with a host and nothing after the path; returns it
    without a trailing ``/``. ``api_path`` (``/api/v0``...) is the part the agent appends: a URL
    that already ends with it is refused, as the request would go to ``/api/v0/api/v0``."""
    try:
        parsed = urlsplit(url)
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise ConfigError(key, f"{show(url)} is not a valid URL ({exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(key, f"{show(url)} must be an http:// or https:// URL with a host")
    if parsed.username is not None or parsed.password is not None:
        raise ConfigError(
            key,
            f"{show(parsed.scheme + '://...@' + parsed.hostname)}: credentials in the URL would "
            "be logged; the API key comes from the environment only",
        )
    if parsed.query or parsed.fragment or "?" in url or "#" in url:
        raise ConfigError(key, f"{show(url)} must not have a query or fragment")
    base = url.rstrip("/")
    if api_path and urlsplit(base).path.endswith(api_path):
        raise ConfigError(
            key,
            f"{show(url)} ends with {api_path}, which the agent appends itself: give the part "
            f"before {api_path}",
        )
    return base


def check_sync_target(key: str, target: str) -> None:
    """``target`` is ``file:///abs/dir`` or ``hf://namespace/name``."""
    try:
        parsed = urlsplit(target)
    except ValueError as exc:  # e.g. an unbalanced '[' reads as a broken IPv6 host
        raise ConfigError(key, f"{show(target)} is not a valid URL ({exc})") from None
    if parsed.scheme == "file":
        if not parsed.path.startswith("/") or parsed.netloc:
            raise ConfigError(
                key, f"{show(target)} must be an absolute file:///path (three slashes)"
            )
        if "?" in target or "#" in target:
            # urlsplit would cut the path there: the checkpoints would land in another folder.
            raise ConfigError(key, f"{show(target)}: a file:/// path cannot contain '?' or '#'")
    elif parsed.scheme == "hf":
        _, sep, rest = target.partition("://")
        repo = rest.rstrip("/") if sep else ""
        problem = repo_id_problem(repo)
        if problem:
            raise ConfigError(
                key, f"{show(target)} must be hf://namespace/name, a Hub repo id that {problem}"
            )
    else:
        raise ConfigError(
            key, f"{show(target)} must start with file:/// or hf:// (got {parsed.scheme!r})"
        )


# --------------------------------------------------------------------------------------------
# Listen addresses

_HOSTNAME = re.compile(
    r"(?=.{1,253}\.?$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


def parse_listen(key: str, listen: str, *, allow_remote: bool) -> tuple[str, int]:
    """``host:port`` -> ``(host, port)``, IPv6 brackets removed; a host that is not loopback
    only with ``allow_remote``."""
    expected = "host:port (e.g. '127.0.0.1:8421', '[::1]:8421')"
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host or not (port_text.isascii() and port_text.isdigit()):
        raise ConfigError(key, f"{show(listen)} is not {expected}")
    # Length first: int() of a 5,000-digit text raises ValueError.
    if len(port_text) > 5 or int(port_text) > 65535:
        raise ConfigError(key, f"{show(listen)}: the port must be 0 to 65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(
                key, f"{show(listen)}: {host!r} in brackets is not an IPv6 address"
            ) from None
    elif host == "*":
        raise ConfigError(
            key,
            f"{show(listen)}: '*' is not a host; to listen on every interface write "
            "0.0.0.0:PORT (or [::]:PORT) and set server.allow_remote = true",
        )
    elif ":" in host:
        raise ConfigError(key, f"{show(listen)}: write an IPv6 address in brackets ([::1]:8421)")
    elif not _HOSTNAME.fullmatch(host) or (host.replace(".", "").isdigit() and not _is_ipv4(host)):
        raise ConfigError(key, f"{show(listen)}: {host!r} is not an IP address or host name")
    if not allow_remote and not is_loopback(host):
        raise ConfigError(
            key,
            f"{show(listen)} is not a loopback address (127.0.0.1, [::1], localhost): anyone "
            "who can reach it could read /status. Reach the agent through an SSH tunnel, or "
            "set server.allow_remote = true",
        )
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    """True for a loopback address (127.0.0.0/8, ::1) or ``localhost``."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True
