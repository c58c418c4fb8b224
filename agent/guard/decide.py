"""The guard's decision (agent/guard/run.py): whether it acts at one look, and what it sends.

Pure functions of the plan, the clock, the heartbeat and state.json: tested in milliseconds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from agent.guard.plan import GuardPlan
from agent.state import NOT_CONFIRMED, Phase, Reason, RunState, teardown_open
from agent.util.text import format_duration

#: ``typing.TYPE_CHECKING`` without importing typing (0.5 MiB the supervisor does not hold);
#: the standard library's dataclasses for mypy, agent.util.record's at run time (1.0 MiB less).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from dataclasses import dataclass as record
    from typing import Any, Literal

    from agent.config.model import TeardownAction

    #: Where the guard stands at one look: alive agent, dead agent before the deadline, due.
    DueKind = Literal["alive", "before_deadline", "no_deadline_wait", "held", "due"]
else:
    from agent.util.record import record


@record(frozen=True)
class Due:
    """Whether the guard acts now, and why (one line for the log and the records)."""

    kind: DueKind
    why: str

    @property
    def act(self) -> bool:
        return self.kind == "due"


def when(t: float) -> str:
    """A time for the guard's log lines. Never raises: a deadline no calendar can show (a plan
    written before durations were bounded) comes out as epoch seconds, not as a traceback at
    every beat."""
    # time.gmtime, not datetime: the guard waits in the supervisor, which stays small (issue 26).
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(t))
    except (OverflowError, ValueError, OSError):
        return f"{t:.0f} (epoch seconds)"


def hold_end(state: RunState) -> float | None:
    """When the hold of a HELD run ends: its release, else its own timeout (``until``)."""
    hold = state.hold or {}
    for key in ("released_at", "until"):
        value = hold.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def due(plan: GuardPlan, *, now: float, alive_at: float, state: RunState | None = None) -> Due:
    """Act only when the agent has been silent past ``stale_after_s`` AND the hard deadline
    has passed (without one: silent past ``no_deadline_stale_s``) - in every phase, HELD
    included. Two more reasons to act on a dead agent's box: a HELD run whose hold ended (the
    agent would have torn down then), and a teardown the agent decided and nobody confirmed."""
    silent = max(0.0, now - alive_at)
    if silent < plan.stale_after_s:
        return Due("alive", f"agent alive (heartbeat {format_duration(silent)} ago)")
    dead = f"agent dead since {when(alive_at)}"
    if state is not None and state.phase == Phase.TEARDOWN and teardown_open(state.teardown):
        td = state.teardown or {}
        return Due("due", f"{dead}, with its {td.get('action')} teardown {NOT_CONFIRMED}")
    if state is not None and state.phase == Phase.HELD:
        end = hold_end(state)
        if end is not None and now >= end:
            return Due("due", f"{dead}; the hold ended at {when(end)} (HELD)")
        if plan.hard_deadline is not None and now >= plan.hard_deadline:
            return Due("due", f"{dead}, past the hard deadline {when(plan.hard_deadline)} (HELD)")
        until = when(end) if end is not None else "its release"
        return Due("held", f"{dead}; HELD by a person until {until}: the guard acts then")
    if plan.hard_deadline is None:
        if silent < plan.no_deadline_stale_s:
            return Due(
                "no_deadline_wait",
                f"agent silent since {when(alive_at)}; without limits.max_runtime the guard "
                f"acts after {format_duration(plan.no_deadline_stale_s)} of silence",
            )
        return Due(
            "due",
            f"agent dead since {when(alive_at)}, silent for {format_duration(silent)} "
            "(no limits.max_runtime)",
        )
    if now < plan.hard_deadline:
        return Due(
            "before_deadline",
            f"agent silent since {when(alive_at)}; the hard deadline {when(plan.hard_deadline)} "
            f"is in {format_duration(plan.hard_deadline - now)}",
        )
    return Due(
        "due",
        f"agent dead since {when(alive_at)}, past the hard deadline {when(plan.hard_deadline)}",
    )


def sync_verified(result: Mapping[str, Any] | None, *, since: float) -> bool:
    """``sync-result.json`` says verified, and was written during this job (not a leftover)."""
    if not result or result.get("sync_verified") is not True:
        return False
    at = result.get("at")
    return isinstance(at, int | float) and not isinstance(at, bool) and at >= since


def choose_action(
    plan: GuardPlan, *, reason: Reason | None, sync_result: Mapping[str, Any] | None
) -> tuple[TeardownAction, str]:
    """Stop, never destroy, unless the sync is verified and the job's policy for the case
    (``on_success`` after a completed training, else ``on_failure``) is destroy."""
    case = "on_success" if reason == Reason.COMPLETED else "on_failure"
    policy = plan.teardown.get(case)
    if policy == "destroy" and sync_verified(sync_result, since=plan.started_at):
        return "destroy", f"the sync is verified and teardown.{case} = destroy"
    if policy == "destroy":
        return "stop", f"teardown.{case} = destroy, but the sync is not verified: the guard stops"
    return "stop", f"the guard stops the box of a dead agent (teardown.{case} = {policy})"
