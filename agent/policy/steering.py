"""Steering an unattended run: ``extend`` its deadline, ``hold`` the box after it, ``release``.

Pure functions on :class:`~agent.state.RunState`: the daemon calls them from its HTTP action
callbacks (``POST /extend``, ``/hold``, ``/release``) with its one clock, then persists the state.
Every accepted action is appended to ``state.steering`` (shown in ``/status``) and logged as one
INFO line on ``agent.policy.steering``; a request that cannot be honoured raises
:class:`SteeringError`, whose message says why and what to do instead, and changes nothing.

- ``extend`` adds to ``state.extended_s``: the ``max_runtime`` deadline is
  ``started_at + max_runtime_s + extended_s`` (:func:`deadline_at`). Only while the run can still
  reach that deadline (up to TRAINING, and not once a stop is under way); a job without
  ``max_runtime`` has nothing to extend. All the extensions of a run add up to at most
  :data:`~agent.config.jobvalues.MAX_STEERING_S` (30 days).
- ``hold`` keeps the box up after the run: instead of tearing down, the daemon parks the run in
  phase HELD while :func:`hold_active` says so. The hold ends at ``release`` or at its own
  timeout (``until``, counted from the ``hold`` request, at most 30 days; a second ``hold``
  renews it).
- ``stop`` while HELD (:func:`stop_held`) releases the hold: the teardown goes ahead now. A
  person who says ``stop`` to a held box wants it to stop billing.

Every request is checked whole before anything changes: a refused one (400, 409) leaves the
state as it was, and an accepted one changes it only after its answer is built.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from datetime import UTC, datetime
from typing import Any

from agent.config.jobvalues import (
    MAX_STEERING_S,
    ConfigError,
    format_duration,
    parse_duration,
    printable,
)
from agent.state import Phase, RunState
from agent.util.text import show

log = logging.getLogger(__name__)

#: The most one request may add or hold for, seconds (30 days): a typo like ``2000h`` must not
#: keep a box billing for months. The same bound caps all the extensions of a run together.
MAX_REQUEST_S = MAX_STEERING_S
#: How many of the latest actions ``/status`` shows (the state file keeps them all).
STATUS_ACTIONS = 20

#: HTTP status of a request that is malformed (a bad duration).
BAD_REQUEST = 400
#: HTTP status of a well-formed request that the run's present state refuses (its phase, no
#: ``max_runtime``, nothing held).
CONFLICT = 409

#: Phases in which the ``max_runtime`` deadline still applies; after TRAINING it has done its
#: work (the final sync and the teardown are not cut short by it).
_EXTENDABLE = frozenset({Phase.BOOTING, Phase.PREFLIGHT, Phase.STAGING, Phase.TRAINING})

_DURATION_HINT = 'e.g. "2h", "90m", "1h30m" or a number of seconds'


class SteeringError(Exception):
    """A steering request that cannot be honoured. The message (one printable line) says why and
    the fix; ``status`` is the HTTP answer: 400 for a malformed request, 409 for one the run's
    present state refuses."""

    def __init__(self, message: str, *, status: int = BAD_REQUEST) -> None:
        super().__init__(printable(message))
        self.status = status


def utc_iso(t: float) -> str:
    """``2025-06-01T14:00:00Z``: how steering messages and log lines give a time. Never raises:
    a time no calendar can show (a state file from before the duration bound) comes out as
    epoch seconds."""
    try:
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, ValueError, OSError):
        return f"{t:.0f} (epoch seconds)"


# --------------------------------------------------------------------------------------------
# the request body


def parse_request_duration(body: str, *, default: float | None = None) -> float:
    """The duration a request body asks for, in seconds.

    ``body`` is plain text (``2h``, ``90m``, ``1h30m``, ``3600``) or JSON
    (``{"duration": "2h"}``, ``{"duration": 3600}``). An empty body (or ``{}``) means
    ``default`` when one is given (``hold`` without a duration: the job's hold timeout), and is a
    mistake otherwise. The duration must be positive and at most 30 days."""
    text = body.strip()
    value: object = text
    if text.startswith(("{", '"')):
        value = _json_duration(text)
    elif text:
        # "3600": seconds (parse_duration wants a unit in text)
        with contextlib.suppress(ValueError):
            value = float(text)
        if isinstance(value, float) and not (math.isfinite(value) and value > 0):
            raise SteeringError(
                f"duration: {show(text)} must be a positive duration ({_DURATION_HINT})"
            )
    if value is None or value == "":
        if default is not None:
            return default
        raise SteeringError(f"no duration given: send one as the request body ({_DURATION_HINT})")
    try:
        # The request's own bound (30 days, tighter than the job file's year) is said below.
        seconds = parse_duration("duration", value, maximum=math.inf)
    except ConfigError as exc:
        raise SteeringError(str(exc)) from None
    if seconds > MAX_REQUEST_S:
        said = f"{format_duration(seconds)}, more" if seconds < 1e12 else "more"
        raise SteeringError(
            f"duration: {show(value)} is {said} than the {format_duration(MAX_REQUEST_S)} one "
            "request may ask for; ask for less (and again later if need be)"
        )
    return seconds


def _json_duration(text: str) -> object:
    """The ``duration`` of a JSON body; None when it has none."""
    try:
        data = json.loads(text)
    except ValueError:
        raise SteeringError(
            f"the body {show(text)} is not valid JSON; send plain text like 2h, or "
            '{"duration": "2h"}'
        ) from None
    if isinstance(data, str):
        return data
    if not isinstance(data, dict):
        raise SteeringError(f'the body must be {{"duration": ...}}, not {show(data)}')
    unknown = sorted(set(data) - {"duration"})
    if unknown:
        raise SteeringError(
            f'unknown key {show(unknown[0])} in the body; the only key is "duration" '
            f"({_DURATION_HINT})"
        )
    value: object = data.get("duration")
    return value


# --------------------------------------------------------------------------------------------
# extend


def deadline_at(state: RunState, max_runtime_s: float | None) -> float | None:
    """When ``max_runtime`` ends the run, extensions included (epoch seconds); None without one.
    The same sum as :func:`agent.policy.limits.deadlines`' ``max_runtime_at``."""
    if max_runtime_s is None:
        return None
    return state.started_at + max_runtime_s + state.extended_s


def extend(
    state: RunState,
    seconds: float,
    *,
    now: float,
    max_runtime_s: float | None,
    stopping: str | None = None,
) -> dict[str, Any]:
    """Move the ``max_runtime`` deadline ``seconds`` later; the JSON answer of ``POST /extend``.

    Refused (:class:`SteeringError`, 409) when the job has no ``max_runtime``, when the run is
    past TRAINING (the deadline no longer applies), when a stop is already under way
    (``stopping`` says why: a stop request, a limit reached), when the run's extensions would
    add up to more than 30 days, and when the deadline has already passed by more than
    ``seconds`` (the extension would end the run at once)."""
    _check_seconds(seconds)
    if state.phase not in _EXTENDABLE:
        raise SteeringError(_not_extendable(state.phase), status=CONFLICT)
    if stopping is not None:
        raise SteeringError(
            f"cannot extend: the run is already stopping ({stopping}); an extension cannot "
            "call the stop back",
            status=CONFLICT,
        )
    if max_runtime_s is None:
        raise SteeringError(
            "nothing to extend: the job has no limits.max_runtime, so no deadline ends the run "
            "(it trains until it completes, stalls or hits its budget)",
            status=CONFLICT,
        )
    total = state.extended_s + seconds
    if total > MAX_STEERING_S:
        room = max(0.0, MAX_STEERING_S - state.extended_s)
        more = (
            f"at most {format_duration(room)} more may be added"
            if room >= 1
            else "nothing more may be added"
        )
        raise SteeringError(
            f"cannot extend by {format_duration(seconds)}: a run's extensions add up to at most "
            f"{format_duration(MAX_STEERING_S)} and {format_duration(state.extended_s)} were "
            f"already added; {more} (to train longer, raise limits.max_runtime in the job file "
            "for the next run)",
            status=CONFLICT,
        )
    old = deadline_at(state, max_runtime_s)
    assert old is not None
    new = old + seconds
    if new <= now:
        raise SteeringError(
            f"max_runtime passed at {utc_iso(old)}, {format_duration(now - old)} ago: extending "
            f"by {format_duration(seconds)} would still be past it; extend by more than "
            f"{format_duration(now - old)}",
            status=CONFLICT,
        )
    left = format_duration(new - now)
    answer = {
        "ok": True,
        "action": "extend",
        "phase": state.phase.value,
        "message": f"deadline extended by {format_duration(seconds)}: max_runtime now ends the "
        f"run at {utc_iso(new)} (in {left})",
        "extended_s": total,
        "deadline_at": new,
    }
    # Checked and answered: only now does the state change.
    state.extended_s = total
    state.steering.append({"at": now, "action": "extend", "seconds": seconds, "deadline_at": new})
    log.info(
        "steering at %s: extend by %s: max_runtime deadline now %s (in %s; %s added in all)",
        utc_iso(now),
        format_duration(seconds),
        utc_iso(new),
        left,
        format_duration(total),
    )
    return answer


def _not_extendable(phase: Phase) -> str:
    if phase is Phase.HELD:
        return (
            "cannot extend: the run has ended and the box is held (HELD); `hold` renews the "
            "hold, `release` lets the teardown go ahead"
        )
    if phase.terminal:
        return f"cannot extend: the run has ended ({phase.value})"
    return (
        f"cannot extend: training is over (phase {phase.value}) and max_runtime no longer "
        "applies; to keep the box up after the run, use `hold`"
    )


# --------------------------------------------------------------------------------------------
# hold / release


def hold(state: RunState, *, now: float, timeout_s: float) -> dict[str, Any]:
    """Keep the box up after the run (phase HELD, nothing torn down) until ``release`` or
    ``now + timeout_s``; a second hold renews ``until``. The JSON answer of ``POST /hold``.

    Refused (409) once the run has ended (DONE or FAILED): the teardown has happened."""
    _check_seconds(timeout_s)
    if timeout_s > MAX_STEERING_S:
        raise SteeringError(
            f"cannot hold for {format_duration(timeout_s)}: a hold lasts at most "
            f"{format_duration(MAX_STEERING_S)} from the request (hold again later to renew it)",
        )
    if state.phase.terminal:
        raise SteeringError(
            f"cannot hold: the run has ended ({state.phase.value}) and its teardown is done",
            status=CONFLICT,
        )
    decided = (state.teardown or {}).get("action") if state.phase is Phase.TEARDOWN else None
    if decided:
        raise SteeringError(
            f"cannot hold: the teardown is under way ({decided}, decided already) and a hold "
            "cannot call it back",
            status=CONFLICT,
        )
    renewed = hold_active(state, now)
    until = now + timeout_s
    left = format_duration(until - now)
    when = f"until {utc_iso(until)} (in {left}) unless released (`release`)"
    if state.phase is Phase.HELD:
        message = f"hold renewed: the box stays up {when}"
    elif state.phase is Phase.TEARDOWN:
        message = (
            f"hold {'renewed' if renewed else 'set'} while the teardown runs: a teardown "
            f"already under way goes on; otherwise the box stays up {when}"
        )
    else:
        message = (
            f"hold {'renewed' if renewed else 'set'}: when the run ends the box stays up "
            f"(phase HELD, nothing torn down) {when}; the teardown goes ahead after that"
        )
    # Checked and answered: only now does the state change.
    if renewed and state.hold is not None:
        state.hold["until"] = until
    else:
        state.hold = {"at": now, "until": until, "released_at": None}
    state.steering.append(
        {"at": now, "action": "hold", "seconds": timeout_s, "until": until, "renewed": renewed}
    )
    log.info(
        "steering at %s: hold %s in phase %s: the box is kept until %s (in %s) unless released",
        utc_iso(now),
        "renewed" if renewed else "set",
        state.phase.value,
        utc_iso(until),
        left,
    )
    return {
        "ok": True,
        "action": "hold",
        "phase": state.phase.value,
        "message": message,
        "hold": _hold_view(state, now),
    }


def release(state: RunState, *, now: float) -> dict[str, Any]:
    """End the hold: the teardown goes ahead (at once when the run is HELD). The JSON answer of
    ``POST /release``. Refused (409) when nothing is held."""
    if not hold_active(state, now):
        raise SteeringError(_nothing_held(state, now), status=CONFLICT)
    if state.phase is Phase.HELD:
        message = "released: the teardown goes ahead now"
    else:
        message = "hold released: when the run ends, the teardown goes ahead as planned"
    _release(state, now, "release")
    return {
        "ok": True,
        "action": "release",
        "phase": state.phase.value,
        "message": message,
        "hold": _hold_view(state, now),
    }


def stop_held(state: RunState, *, now: float, teardown: str) -> dict[str, Any]:
    """``stop`` to a held box (phase HELD): release the hold, so the teardown goes ahead now;
    the JSON answer of ``POST /stop`` then. ``teardown`` says what the teardown will do (the
    job's plan for the run's reason). Refused (409) when the box is not held."""
    if not hold_active(state, now):
        raise SteeringError(
            _nothing_held(state, now).replace("release", "stop", 1), status=CONFLICT
        )
    _release(state, now, "stop")
    return {
        "ok": True,
        "action": "stop",
        "phase": state.phase.value,
        "message": f"stop: the box was held; the hold is released and the teardown goes ahead "
        f"now ({teardown})",
        "hold": _hold_view(state, now),
    }


def _release(state: RunState, now: float, action: str) -> None:
    assert state.hold is not None
    state.hold["released_at"] = now
    state.steering.append({"at": now, "action": action})
    held = format_duration(now - float(state.hold["at"]))
    log.info(
        "steering at %s: %s in phase %s after %s held: the teardown goes ahead",
        utc_iso(now),
        action,
        state.phase.value,
        held,
    )


def _nothing_held(state: RunState, now: float) -> str:
    h = state.hold
    if state.phase.terminal:
        return f"nothing to release: the run has ended ({state.phase.value})"
    if h is None:
        return "nothing to release: the box is not held (`hold` holds it)"
    if (released := h.get("released_at")) is not None:
        return f"nothing to release: the hold was already released at {utc_iso(released)}"
    return f"nothing to release: the hold timed out at {utc_iso(float(h['until']))}"


def hold_active(state: RunState, now: float) -> bool:
    """Whether the box is held at ``now``: a hold asked for, not released, not timed out, and
    the run not ended (DONE or FAILED hold nothing)."""
    h = state.hold
    if h is None or state.phase.terminal or h.get("released_at") is not None:
        return False
    return now < float(h["until"])


def hold_remaining_s(state: RunState, now: float) -> float | None:
    """Seconds left before the hold times out; None when the box is not held. What the daemon
    waits for in HELD (or for a release)."""
    if not hold_active(state, now):
        return None
    assert state.hold is not None
    return float(state.hold["until"]) - now


# --------------------------------------------------------------------------------------------
# /status


def steering_status(state: RunState, now: float) -> dict[str, Any]:
    """The ``steering`` part of ``/status``: seconds added to ``max_runtime``, the hold (with
    ``active`` and ``remaining_s``) and the latest actions, oldest first."""
    return {
        "extended_s": state.extended_s,
        "hold": _hold_view(state, now),
        "actions": state.steering[-STATUS_ACTIONS:],
    }


def _hold_view(state: RunState, now: float) -> dict[str, Any] | None:
    if state.hold is None:
        return None
    remaining = hold_remaining_s(state, now)
    return {**state.hold, "active": remaining is not None, "remaining_s": remaining or 0.0}


def _check_seconds(seconds: float) -> None:
    # The request's text was bounded by parse_request_duration; this is for callers in code.
    if not (math.isfinite(seconds) and seconds > 0):
        raise SteeringError(f"duration: {seconds!r} s is not a positive number of seconds")
