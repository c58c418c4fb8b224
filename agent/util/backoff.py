"""How long to wait before trying again: exponential, capped, jittered. The one home of the
rule: the notifier, the sync, the providers (:func:`delay_s`), the supervisor's restarts and the
trainer's resumes (:func:`doubling_s`, no jitter: one process, nothing to spread out) all ask it.
Imports nothing heavy: the supervisor, which must stay small, uses it."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping

#: ``typing.TYPE_CHECKING`` without importing typing (0.5 MiB the supervisor does not hold).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import random

#: Doublings past this many change nothing (any cap is reached long before); a retry count that
#: grows for days must not overflow a float.
_MAX_DOUBLINGS = 64

#: The jitter's generator, made at the first :func:`delay_s` (``random`` is 0.2 MiB the
#: supervisor, which only doubles, never imports).
_rng: random.Random | None = None


def doubling_s(attempt: int, *, first_s: float, cap_s: float) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1 for the first): ``first_s``,
    twice that, four times... never more than ``cap_s``."""
    doublings = min(max(attempt - 1, 0), _MAX_DOUBLINGS)
    return float(min(cap_s, first_s * 2**doublings))


def delay_s(
    attempt: int, *, first_s: float, cap_s: float, rng: random.Random | None = None
) -> float:
    """:func:`doubling_s` scaled by a random factor in [0.5, 1] so that retries of many clients
    (or items) spread out. Never more than the cap."""
    global _rng
    base = doubling_s(attempt, first_s=first_s, cap_s=cap_s)
    if rng is None:
        if _rng is None:
            import random

            _rng = random.Random()
        rng = _rng
    return float(base * rng.uniform(0.5, 1.0))


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """An HTTP ``Retry-After`` header in seconds (a number or an HTTP date), or None."""
    value = (headers.get("Retry-After") or "").strip()
    if not value:
        return None
    with contextlib.suppress(ValueError, OverflowError):
        seconds = float(value)
        return max(0.0, seconds) if math.isfinite(seconds) else None
    import email.utils  # here: the supervisor never reads a Retry-After

    with contextlib.suppress(TypeError, ValueError, IndexError, OverflowError):
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    return None


def honouring_s(delay_s: float, retry_after_s: float | None, *, max_s: float) -> float:
    """The wait before a retry: this client's own ``delay_s``, but never sooner than the server
    asked (``Retry-After``, :func:`retry_after_s`). A server's word is believed up to ``max_s``
    (a clock gone wrong must not park a retry for days)."""
    if retry_after_s is None:
        return delay_s
    return max(delay_s, min(retry_after_s, max_s))
