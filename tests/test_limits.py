"""Deadlines: wall clock, stall, budget, as pure functions of an injected clock."""

from __future__ import annotations

import pytest

from agent.config import LimitsSection
from agent.limits import Breach, check_limits, deadlines
from agent.state import Reason

T0 = 1_700_000_000.0


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, start: float = T0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def first_breach(
    cfg: LimitsSection, clock: Clock, *, step: float, progress_every: float | None = None
) -> tuple[float, Breach]:
    """Tick the clock until a limit fires; returns the elapsed time and the breach."""
    last_progress = clock()
    for _ in range(1_000_000):
        clock.advance(step)
        if progress_every is not None and (clock() - T0) % progress_every == 0:
            last_progress = clock()
        breach = check_limits(cfg, now=clock(), job_started_at=T0, last_progress_at=last_progress)
        if breach is not None:
            return clock() - T0, breach
    raise AssertionError("no limit fired")


def test_no_limits_never_fire() -> None:
    assert (
        check_limits(LimitsSection(), now=T0 + 1e9, job_started_at=T0, last_progress_at=T0) is None
    )


def test_timeout_fires_exactly_at_max_runtime() -> None:
    cfg = LimitsSection(max_runtime_s=3600.0)
    assert check_limits(cfg, now=T0 + 3599.9, job_started_at=T0, last_progress_at=T0 + 3599) is None
    breach = check_limits(cfg, now=T0 + 3600, job_started_at=T0, last_progress_at=T0 + 3599)
    assert breach is not None
    assert breach.reason is Reason.TIMEOUT
    assert "max_runtime 1h" in breach.message


def test_timeout_with_a_ticking_clock() -> None:
    elapsed, breach = first_breach(
        LimitsSection(max_runtime_s=5400.0), Clock(), step=60.0, progress_every=60.0
    )
    assert breach.reason is Reason.TIMEOUT
    assert elapsed == 5400.0
    assert "1h30m" in breach.message


def test_budget_fires_when_spent_reaches_budget() -> None:
    # $10 at $3.60/h lasts 10000 s.
    cfg = LimitsSection(budget_usd=10.0, price_usd_per_hour=3.6)
    assert check_limits(cfg, now=T0 + 9990, job_started_at=T0, last_progress_at=T0 + 9990) is None
    breach = check_limits(cfg, now=T0 + 10001, job_started_at=T0, last_progress_at=T0 + 10001)
    assert breach is not None
    assert breach.reason is Reason.BUDGET
    assert "$10.00" in breach.message


def test_budget_with_a_ticking_clock() -> None:
    cfg = LimitsSection(budget_usd=5.0, price_usd_per_hour=2.0)  # 2.5 h
    elapsed, breach = first_breach(cfg, Clock(), step=30.0, progress_every=30.0)
    assert breach.reason is Reason.BUDGET
    assert elapsed == 9000.0


def test_free_box_never_breaks_the_budget() -> None:
    cfg = LimitsSection(budget_usd=5.0, price_usd_per_hour=0.0)
    assert check_limits(cfg, now=T0 + 1e9, job_started_at=T0, last_progress_at=T0 + 1e9) is None


def test_stall_fires_after_stall_timeout_without_progress() -> None:
    cfg = LimitsSection(stall_timeout_s=1200.0)
    now = T0 + 50_000
    assert check_limits(cfg, now=now, job_started_at=T0, last_progress_at=now - 1199) is None
    breach = check_limits(cfg, now=now, job_started_at=T0, last_progress_at=now - 1200)
    assert breach is not None
    assert breach.reason is Reason.STALLED
    assert "20m" in breach.message


def test_progress_keeps_stall_away_until_it_stops() -> None:
    cfg = LimitsSection(stall_timeout_s=600.0)
    clock = Clock()
    last_progress = clock()
    for _ in range(100):  # an epoch every 5 minutes for 500 minutes: never stalled
        clock.advance(300)
        last_progress = clock()
        assert (
            check_limits(cfg, now=clock(), job_started_at=T0, last_progress_at=last_progress)
            is None
        )
    clock.advance(599)
    assert check_limits(cfg, now=clock(), job_started_at=T0, last_progress_at=last_progress) is None
    clock.advance(1)
    breach = check_limits(cfg, now=clock(), job_started_at=T0, last_progress_at=last_progress)
    assert breach is not None and breach.reason is Reason.STALLED


def test_timeout_wins_over_budget_and_stall() -> None:
    cfg = LimitsSection(
        max_runtime_s=100.0, stall_timeout_s=10.0, budget_usd=1.0, price_usd_per_hour=3600.0
    )
    breach = check_limits(cfg, now=T0 + 1000, job_started_at=T0, last_progress_at=T0)
    assert breach is not None and breach.reason is Reason.TIMEOUT
    cfg = LimitsSection(stall_timeout_s=10.0, budget_usd=1.0, price_usd_per_hour=3600.0)
    breach = check_limits(cfg, now=T0 + 1000, job_started_at=T0, last_progress_at=T0)
    assert breach is not None and breach.reason is Reason.BUDGET


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (LimitsSection(), {"max_runtime_at": None, "budget_at": None, "stall_timeout_s": None}),
        (
            LimitsSection(max_runtime_s=3600.0, stall_timeout_s=600.0),
            {"max_runtime_at": T0 + 3600, "budget_at": None, "stall_timeout_s": 600.0},
        ),
        (
            LimitsSection(budget_usd=7.0, price_usd_per_hour=3.5),
            {"max_runtime_at": None, "budget_at": T0 + 7200, "stall_timeout_s": None},
        ),
        (
            LimitsSection(budget_usd=7.0, price_usd_per_hour=0.0),
            {"max_runtime_at": None, "budget_at": None, "stall_timeout_s": None},
        ),
    ],
)
def test_deadlines(cfg: LimitsSection, expected: dict[str, float | None]) -> None:
    assert deadlines(cfg, job_started_at=T0) == pytest.approx(expected)


def test_deadlines_agree_with_check_limits() -> None:
    cfg = LimitsSection(max_runtime_s=7200.0, budget_usd=3.0, price_usd_per_hour=2.0)
    d = deadlines(cfg, job_started_at=T0)
    budget_at = d["budget_at"]
    assert budget_at is not None
    before = check_limits(cfg, now=budget_at - 1, job_started_at=T0, last_progress_at=budget_at)
    at = check_limits(cfg, now=budget_at + 1e-6, job_started_at=T0, last_progress_at=budget_at)
    assert before is None
    assert at is not None and at.reason is Reason.BUDGET
