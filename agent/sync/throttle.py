"""At most one log line per key per interval (part of the upload queue, ``uploads.py``): a
target down for hours, retried every few seconds, must not write megabytes of one warning."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

from agent.util.logutil import RateLimiter

# The upload queue's logger: the throttled lines have always been its own.
log = logging.getLogger("agent.sync.uploads")


class Throttle:
    """At most one log line per key per ``interval_s``: a target down for hours, retried every
    few seconds, must not write megabytes of the same warning. Counts what it held back."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._limiter = RateLimiter(interval_s, clock=clock)

    def allow(self, path: str, error: str) -> int | None:
        """None: suppress this line; else log it, with this many similar lines held back."""
        # Numbers and hashes differ between otherwise identical errors (sizes, request ids).
        passed = self._limiter.admit((path, re.sub(r"[0-9a-f]*\d[0-9a-f.]*", "#", error)))
        return None if passed is None else passed[0]

    def warning(self, path: str, error: str, fmt: str, *args: Any) -> None:
        """A warning, at most once per path and distinct error per ``interval_s``."""
        suppressed = self.allow(path, error)
        if suppressed is None:
            return
        if suppressed:
            fmt += " (%d more like this not logged)"
            args = (*args, suppressed)
        log.warning(fmt, *args)
