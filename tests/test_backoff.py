"""How long to wait before trying again: exponential, capped, jittered."""

from __future__ import annotations

import random

from agent.util.backoff import delay_s


def test_delay_doubles_with_jitter_and_is_capped() -> None:
    rng = random.Random(1)
    for attempt in range(1, 40):
        base = min(60.0, 5.0 * 2 ** (attempt - 1))
        assert base * 0.5 <= delay_s(attempt, first_s=5.0, cap_s=60.0, rng=rng) <= base


def test_a_retry_count_that_grew_for_days_does_not_overflow() -> None:
    assert 150.0 <= delay_s(10_000, first_s=1.0, cap_s=300.0) <= 300.0


def test_retry_after_reads_seconds_and_http_dates() -> None:
    import email.utils
    import time

    from agent.util.backoff import retry_after_s

    assert retry_after_s({"Retry-After": "7"}) == 7.0
    assert retry_after_s({"Retry-After": "-3"}) == 0.0
    assert retry_after_s({"Retry-After": "nan"}) is None
    assert retry_after_s({"Retry-After": "soon"}) is None
    assert retry_after_s({}) is None
    later = email.utils.formatdate(time.time() + 120, usegmt=True)
    got = retry_after_s({"Retry-After": later})
    assert got is not None and 100 < got <= 120


def test_doubling_without_jitter_is_what_restarts_and_resumes_wait() -> None:
    from agent.util.backoff import doubling_s

    assert [doubling_s(n, first_s=5.0, cap_s=300.0) for n in range(0, 9)] == [
        5, 5, 10, 20, 40, 80, 160, 300, 300,
    ]  # fmt: skip
    assert doubling_s(10**9, first_s=1.0, cap_s=600.0) == 600.0
