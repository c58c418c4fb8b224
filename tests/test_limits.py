"""Deadlines: wall clock and budget, as pure functions of an injected clock (stalls:
tests/test_progress.py)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from agent.config.model import LimitsSection
from agent.policy.limits import (
    DEFAULT_UPLOAD_BYTES_PER_S,
    Breach,
    BudgetView,
    BudgetWarner,
    budget_view,
    check_limits,
    deadlines,
    finish_reserve_s,
)
from agent.state import Reason, RunState, StateStore

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
    cfg: LimitsSection,
    clock: Clock,
    *,
    step: float,
    extended_s: float = 0.0,
    reserve_s: float = 0.0,
) -> tuple[float, Breach]:
    """Tick the clock until a limit fires; returns the elapsed time and the breach."""
    for _ in range(1_000_000):
        clock.advance(step)
        breach = check_limits(
            cfg,
            now=clock(),
            job_started_at=T0,
            extended_s=extended_s,
            reserve_s=reserve_s,
        )
        if breach is not None:
            return clock() - T0, breach
    raise AssertionError("no limit fired")


def test_no_limits_never_fire() -> None:
    assert check_limits(LimitsSection(), now=T0 + 1e9, job_started_at=T0) is None


def test_timeout_fires_exactly_at_max_runtime() -> None:
    cfg = LimitsSection(max_runtime_s=3600.0)
    assert check_limits(cfg, now=T0 + 3599.9, job_started_at=T0) is None
    breach = check_limits(cfg, now=T0 + 3600, job_started_at=T0)
    assert breach is not None
    assert breach.reason is Reason.TIMEOUT
    assert "max_runtime 1h" in breach.message


def test_timeout_with_a_ticking_clock() -> None:
    elapsed, breach = first_breach(LimitsSection(max_runtime_s=5400.0), Clock(), step=60.0)
    assert breach.reason is Reason.TIMEOUT
    assert elapsed == 5400.0
    assert "1h30m" in breach.message


def test_budget_fires_when_spent_reaches_budget() -> None:
    # $10 at $3.60/h lasts 10000 s.
    cfg = LimitsSection(budget_usd=10.0, price_usd_per_hour=3.6)
    assert check_limits(cfg, now=T0 + 9990, job_started_at=T0) is None
    breach = check_limits(cfg, now=T0 + 10001, job_started_at=T0)
    assert breach is not None
    assert breach.reason is Reason.BUDGET
    assert "$10.00" in breach.message


def test_budget_with_a_ticking_clock() -> None:
    cfg = LimitsSection(budget_usd=5.0, price_usd_per_hour=2.0)  # 2.5 h
    elapsed, breach = first_breach(cfg, Clock(), step=30.0)
    assert breach.reason is Reason.BUDGET
    assert elapsed == 9000.0


def test_free_box_never_breaks_the_budget() -> None:
    cfg = LimitsSection(budget_usd=5.0, price_usd_per_hour=0.0)
    assert check_limits(cfg, now=T0 + 1e9, job_started_at=T0) is None


def test_timeout_wins_over_budget_and_stall() -> None:
    cfg = LimitsSection(
        max_runtime_s=100.0, stall_timeout_s=10.0, budget_usd=1.0, price_usd_per_hour=3600.0
    )
    breach = check_limits(cfg, now=T0 + 1000, job_started_at=T0)
    assert breach is not None and breach.reason is Reason.TIMEOUT
    cfg = LimitsSection(stall_timeout_s=10.0, budget_usd=1.0, price_usd_per_hour=3600.0)
    breach = check_limits(cfg, now=T0 + 1000, job_started_at=T0)
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
    ends = [t for t in (expected["max_runtime_at"], expected["budget_at"]) if t is not None]
    expected = {**expected, "stop_training_at": min(ends) if ends else None, "reserve_s": 0.0}
    assert deadlines(cfg, job_started_at=T0) == pytest.approx(expected)


def test_deadlines_agree_with_check_limits() -> None:
    cfg = LimitsSection(max_runtime_s=7200.0, budget_usd=3.0, price_usd_per_hour=2.0)
    d = deadlines(cfg, job_started_at=T0)
    budget_at = d["budget_at"]
    assert budget_at is not None
    before = check_limits(cfg, now=budget_at - 1, job_started_at=T0)
    at = check_limits(cfg, now=budget_at + 1e-6, job_started_at=T0)
    assert before is None
    assert at is not None and at.reason is Reason.BUDGET


# --------------------------------------------------------------------------------------------
# The finish reserve


def test_reserve_set_by_the_job_wins_over_the_estimate() -> None:
    cfg = LimitsSection(finish_reserve_s=300.0)
    assert finish_reserve_s(cfg, upload_bytes_per_s=1.0, final_bytes=10**12) == 300.0
    assert finish_reserve_s(cfg, upload_bytes_per_s=None, final_bytes=0) == 300.0


def test_reserve_estimated_from_upload_speed_and_sizes() -> None:
    # 400 MB of last.pt + best.pt and 100 MB still queued at 5 MB/s: 100 s, doubled, + 60 s.
    reserve = finish_reserve_s(
        LimitsSection(), upload_bytes_per_s=5e6, final_bytes=400_000_000, pending_bytes=100_000_000
    )
    assert reserve == pytest.approx(260.0)


def test_reserve_grows_with_a_slower_link_and_bigger_checkpoints() -> None:
    cfg = LimitsSection()
    fast = finish_reserve_s(cfg, upload_bytes_per_s=50e6, final_bytes=200_000_000)
    slow = finish_reserve_s(cfg, upload_bytes_per_s=5e6, final_bytes=200_000_000)
    big = finish_reserve_s(cfg, upload_bytes_per_s=5e6, final_bytes=2_000_000_000)
    assert fast < slow < big
    assert finish_reserve_s(cfg, upload_bytes_per_s=5e6, final_bytes=0) == pytest.approx(60.0)


@pytest.mark.parametrize("speed", [None, 0.0, -5.0, math.nan, math.inf])
def test_reserve_assumes_a_conservative_speed_before_any_upload(speed: float | None) -> None:
    reserve = finish_reserve_s(LimitsSection(), upload_bytes_per_s=speed, final_bytes=300_000_000)
    assert reserve == pytest.approx(300_000_000 / DEFAULT_UPLOAD_BYTES_PER_S * 2 + 60)
    assert DEFAULT_UPLOAD_BYTES_PER_S <= 10e6


# --------------------------------------------------------------------------------------------
# max_runtime with the reserve, extensions and restarts


def test_timeout_fires_reserve_s_before_max_runtime() -> None:
    cfg = LimitsSection(max_runtime_s=5400.0)
    elapsed, breach = first_breach(cfg, Clock(), step=10.0, reserve_s=600.0)
    assert breach.reason is Reason.TIMEOUT
    assert elapsed == 4800.0
    assert "max_runtime 1h30m ends at 2023-11-14 23:43:20Z (in 10m)" in breach.message
    assert "10m reserve for the final sync" in breach.message
    assert "estimated from the upload speed" in breach.message


def test_timeout_message_names_a_reserve_the_job_set() -> None:
    cfg = LimitsSection(max_runtime_s=3600.0, finish_reserve_s=900.0)
    reserve = finish_reserve_s(cfg, upload_bytes_per_s=None, final_bytes=0)
    elapsed, breach = first_breach(cfg, Clock(), step=30.0, reserve_s=reserve)
    assert elapsed == 2700.0
    assert "15m reserve" in breach.message
    assert "limits.finish_reserve" in breach.message


def test_extension_moves_the_deadline_and_the_stop() -> None:
    cfg = LimitsSection(max_runtime_s=3600.0)
    args = {"job_started_at": T0, "reserve_s": 300.0}
    assert check_limits(cfg, now=T0 + 3300, **args) is not None
    assert check_limits(cfg, now=T0 + 3300, extended_s=1800.0, **args) is None
    assert check_limits(cfg, now=T0 + 5099, extended_s=1800.0, **args) is None
    breach = check_limits(cfg, now=T0 + 5100, extended_s=1800.0, **args)
    assert breach is not None and breach.reason is Reason.TIMEOUT
    assert "max_runtime 1h + 30m extended" in breach.message


def test_restarted_agent_keeps_the_first_boots_deadline(tmp_path: Path) -> None:
    """A restart (or a reboot) reloads started_at and extended_s from state.json: the allowance
    is not handed out again."""
    cfg = LimitsSection(max_runtime_s=7200.0)
    StateStore(tmp_path).save(
        RunState(job_name="j", job_source="job.toml", started_at=T0, extended_s=600.0)
    )
    # The new agent boots 2 hours after the first one.
    state = StateStore(tmp_path).load()
    assert state is not None
    now = T0 + 7200.0
    args = {"now": now, "job_started_at": state.started_at, "extended_s": state.extended_s}
    assert check_limits(cfg, reserve_s=0.0, **args) is None
    breach = check_limits(cfg, reserve_s=600.0, **args)
    assert breach is not None and breach.reason is Reason.TIMEOUT
    assert "(in 10m)" in breach.message
    d = deadlines(cfg, job_started_at=state.started_at, extended_s=state.extended_s, reserve_s=600)
    assert d["max_runtime_at"] == T0 + 7800.0
    assert d["stop_training_at"] == T0 + 7200.0


def test_reserve_past_the_deadline_stops_at_once() -> None:
    cfg = LimitsSection(max_runtime_s=600.0)
    breach = check_limits(cfg, now=T0 + 1, job_started_at=T0, reserve_s=3600.0)
    assert breach is not None and breach.reason is Reason.TIMEOUT
    assert "(in 9m59s)" in breach.message


# --------------------------------------------------------------------------------------------
# Budget with the reserve


def test_budget_stops_before_it_is_reached_keeping_the_reserve() -> None:
    # $10 at $3.60/h lasts 10000 s; the final sync needs 500 s ($0.50): stop at 9500 s.
    cfg = LimitsSection(budget_usd=10.0, price_usd_per_hour=3.6)
    elapsed, breach = first_breach(cfg, Clock(), step=10.0, reserve_s=500.0)
    assert breach.reason is Reason.BUDGET
    assert elapsed == 9500.0
    assert "budget $10.00 nearly reached: $9.50 spent at $3.6000/h" in breach.message
    assert "8m20s ($0.50" in breach.message
    assert "within the budget" in breach.message


def test_budget_reserve_does_not_move_with_an_extension() -> None:
    cfg = LimitsSection(budget_usd=10.0, price_usd_per_hour=3.6)
    args = {"job_started_at": T0, "reserve_s": 500.0}
    breach = check_limits(cfg, now=T0 + 9500, extended_s=3600.0, **args)
    assert breach is not None and breach.reason is Reason.BUDGET


def test_deadlines_agree_with_check_limits_with_reserve_and_extension() -> None:
    cfg = LimitsSection(max_runtime_s=7200.0, budget_usd=30.0, price_usd_per_hour=10.0)
    for extended, reserve, reason in [
        (0.0, 300.0, Reason.TIMEOUT),  # max_runtime 2 h, budget 3 h
        (7200.0, 300.0, Reason.BUDGET),  # max_runtime 4 h, budget 3 h
    ]:
        d = deadlines(cfg, job_started_at=T0, extended_s=extended, reserve_s=reserve)
        stop = d["stop_training_at"]
        assert stop is not None and d["reserve_s"] == reserve
        args = {"job_started_at": T0, "extended_s": extended, "reserve_s": reserve}
        assert check_limits(cfg, now=stop - 1, **args) is None
        breach = check_limits(cfg, now=stop, **args)
        assert breach is not None and breach.reason is reason


# --------------------------------------------------------------------------------------------
# Budget projection and warning


def test_budget_view_needs_a_price() -> None:
    assert budget_view(LimitsSection(budget_usd=5.0), now=T0, job_started_at=T0, eta_s=1.0) is None


def test_budget_view_spent_and_projected() -> None:
    cfg = LimitsSection(budget_usd=10.0, price_usd_per_hour=2.0)
    view = budget_view(cfg, now=T0 + 7200, job_started_at=T0, eta_s=5400.0, reserve_s=1800.0)
    assert view == BudgetView(
        spent_usd=pytest.approx(4.0),
        projected_usd=pytest.approx(8.0),
        budget_usd=10.0,
        over_projection=False,
    )
    view = budget_view(cfg, now=T0 + 7200, job_started_at=T0, eta_s=9000.0, reserve_s=1800.0)
    assert view is not None and view.projected_usd == pytest.approx(10.0)
    assert not view.over_projection  # exactly on budget is not over
    view = budget_view(cfg, now=T0 + 7200, job_started_at=T0, eta_s=9001.0, reserve_s=1800.0)
    assert view is not None and view.over_projection


def test_budget_view_without_an_eta_or_a_budget() -> None:
    view = budget_view(
        LimitsSection(price_usd_per_hour=3.0), now=T0 + 3600, job_started_at=T0, eta_s=1e6
    )
    assert view is not None and view.spent_usd == pytest.approx(3.0)
    assert view.budget_usd is None and not view.over_projection
    cfg = LimitsSection(budget_usd=1.0, price_usd_per_hour=3.0)
    view = budget_view(cfg, now=T0 + 3600, job_started_at=T0, eta_s=None)
    assert view is not None and view.projected_usd is None and not view.over_projection


def test_budget_warner_fires_once_then_once_back_under(caplog: pytest.LogCaptureFixture) -> None:
    cfg = LimitsSection(budget_usd=10.0, price_usd_per_hour=3.6)
    warner = BudgetWarner()
    caplog.set_level(logging.INFO, logger="agent.policy.limits")
    fired: list[str] = []
    # ETA long enough to pass the budget for 20 turns, then the run speeds up.
    for turn in range(40):
        eta = 20_000.0 if turn < 20 else 1000.0
        view = budget_view(cfg, now=T0 + turn * 60, job_started_at=T0, eta_s=eta, reserve_s=300)
        text = warner.update(view)
        if text is not None:
            fired.append(text)
    assert len(fired) == 1
    assert "over limits.budget_usd $10.00" in fired[0]
    assert "raise limits.budget_usd" in fired[0]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == fired
    back = [r.getMessage() for r in caplog.records if "back under the budget" in r.getMessage()]
    assert len(back) == 1
    assert warner.update(None) is None


def test_budget_warner_does_not_flap_on_a_jittery_eta() -> None:
    warner = BudgetWarner()

    def view(projected: float) -> BudgetView:
        return BudgetView(1.0, projected, 10.0, projected > 10.0)

    results = [warner.update(view(p)) for p in (10.1, 9.9, 10.2, 9.8, 10.1)]
    assert sum(r is not None for r in results) == 1
    assert warner.update(view(9.4)) is None  # 5% under: called off, armed again
    assert warner.update(view(10.5)) is not None


def test_limits_already_past_say_reached_even_with_a_reserve() -> None:
    """A restarted agent may find the deadline or the budget already behind it."""
    cfg = LimitsSection(max_runtime_s=3600.0)
    breach = check_limits(cfg, now=T0 + 4000, job_started_at=T0, reserve_s=60)
    assert breach is not None and breach.message == "max_runtime 1h reached after 1h6m40s"
    cfg = LimitsSection(budget_usd=1.0, price_usd_per_hour=3.6)
    breach = check_limits(cfg, now=T0 + 1000, job_started_at=T0, reserve_s=60)
    assert breach is not None and breach.message == "budget $1.00 reached ($1.00 at $3.6000/h)"
