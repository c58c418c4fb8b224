"""How messages show things: a value, a byte count, an error, on one short line.

A base module: it imports nothing of the agent, so every layer can use it, the generic ones
(:mod:`agent.data.archive`, :mod:`agent.data.datacheck`) included.
"""

from __future__ import annotations

import errno
import math
import time


def show(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: control characters come out escaped."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's str() digit limit (hexadecimal TOML reads fine)
        assert isinstance(value, int)
        text = f"<an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(text: str, limit: int = 200) -> str:
    """``text`` on one line, whitespace collapsed, cut to ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units, one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    """``5400 -> "1h30m"``; used in messages and ``/status``."""
    s = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            parts.append(f"{s // size}{unit}")
            s %= size
    if s or not parts:
        parts.append(f"{s}s")
    return "".join(parts)


def format_when(stamp: object) -> str:
    """A unix time as ``2026-12-05 08:56:55 UTC`` for log lines; anything that is not a number
    (a record written by hand, a missing key) is shown as it is."""
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not math.isfinite(stamp):
        return show(stamp)
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stamp))
    except (OverflowError, OSError, ValueError):  # past the C library's range
        return show(stamp)


def os_error(exc: OSError, *, filename: bool = False) -> str:
    """``ENOSPC: No space left on device``: short and greppable. With ``filename``, the file the
    error names follows: ``EACCES: Permission denied (/runs/state.json)``."""
    name = errno.errorcode.get(exc.errno or 0)
    text = exc.strerror or str(exc)
    line = f"{name}: {text}" if name else f"{type(exc).__name__}: {text}"
    return line + (f" ({exc.filename})" if filename and exc.filename else "")
