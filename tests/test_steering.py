"""Steering an unattended run (extend, hold, release): the pure functions on RunState."""

from __future__ import annotations

import logging

import pytest

from agent.policy.steering import (
    MAX_REQUEST_S,
    STATUS_ACTIONS,
    SteeringError,
    deadline_at,
    extend,
    hold,
    hold_active,
    hold_remaining_s,
    parse_request_duration,
    release,
    steering_status,
    utc_iso,
)
from agent.state import Phase, RunState

#: 2025-06-01T00:00:00Z: the run's first boot.
T0 = 1748736000.0
H = 3600.0


def run(phase: Phase = Phase.TRAINING) -> RunState:
    return RunState(job_name="run1", job_source="job.toml", phase=phase, started_at=T0)


# ---- the request body --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "seconds"),
    [
        ("2h", 7200.0),
        ("90m", 5400.0),
        ("1h30m", 5400.0),
        ("3600", 3600.0),
        ("  2H\n", 7200.0),
        ("1.5", 1.5),
        ('{"duration": "2h"}', 7200.0),
        ('{"duration": 3600}', 3600.0),
        ('"45m"', 2700.0),
        ("30d", MAX_REQUEST_S),
    ],
)
def test_request_durations_in_text_or_json(body: str, seconds: float) -> None:
    assert parse_request_duration(body) == seconds


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("", "no duration given: send one as the request body"),
        ("   ", "no duration given"),
        ("{}", "no duration given"),
        ('{"duration": null}', "no duration given"),
        ("2x", "duration: '2x' is not a duration like"),
        ("0", "must be a positive duration"),
        ("-5", "must be a positive duration"),
        ("nan", "must be a positive duration"),
        ("0m", "must be a positive duration"),
        ('{"duration": true}', "duration: True is not a duration"),
        ('{"duration": "2h", "extra": 1}', "unknown key 'extra' in the body"),
        ('{"duration": ', "is not valid JSON"),
        ("[1]", "duration: '[1]' is not a duration"),
        ('{"duration": [1]}', "duration: [1] is not a duration"),
        ("31d", "is 31d, more than the 30d one request may ask for"),
        ("2000h", "more than the 30d one request may ask for"),
        (
            "99999999999999999999d",
            "duration: '99999999999999999999d' is more than the 30d one request may ask for",
        ),
        ('{"duration": 1e300}', "duration: 1e+300 is more than the 30d one request may ask for"),
    ],
)
def test_bad_request_durations_say_why(body: str, expected: str) -> None:
    with pytest.raises(SteeringError) as info:
        parse_request_duration(body)
    assert expected in str(info.value)
    assert info.value.status == 400


def test_an_empty_body_means_the_default_when_there_is_one() -> None:
    assert parse_request_duration("", default=12 * H) == 12 * H
    assert parse_request_duration('{"duration": null}', default=60.0) == 60.0
    assert parse_request_duration("1h", default=12 * H) == H


def test_a_body_with_control_characters_gives_a_one_line_message() -> None:
    with pytest.raises(SteeringError) as info:
        parse_request_duration("2h\x1b[31m\nrm -rf")
    message = str(info.value)
    assert "\n" not in message and "\x1b" not in message
    assert message.isprintable()


# ---- extend ------------------------------------------------------------------------------------


def test_extend_moves_the_deadline_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent.policy.steering")
    state = run()
    now = T0 + 10 * H  # max_runtime 12h: 2h left
    answer = extend(state, 2 * H, now=now, max_runtime_s=12 * H)
    assert state.extended_s == 2 * H
    assert answer["ok"] is True
    assert answer["deadline_at"] == T0 + 14 * H == deadline_at(state, 12 * H)
    assert answer["extended_s"] == 2 * H
    assert answer["message"] == (
        "deadline extended by 2h: max_runtime now ends the run at 2025-06-01T14:00:00Z (in 4h)"
    )
    assert state.steering == [
        {"at": now, "action": "extend", "seconds": 2 * H, "deadline_at": T0 + 14 * H}
    ]
    # A second extension adds up.
    answer = extend(state, 20 * 60, now=now + 40 * 60, max_runtime_s=12 * H)
    assert state.extended_s == 2 * H + 1200
    assert answer["message"].endswith("at 2025-06-01T14:20:00Z (in 3h40m)")
    (first, second) = [r for r in caplog.records if r.name == "agent.policy.steering"]
    assert first.levelno == logging.INFO
    assert first.getMessage() == (
        "steering at 2025-06-01T10:00:00Z: extend by 2h: max_runtime deadline now "
        "2025-06-01T14:00:00Z (in 4h; 2h added in all)"
    )
    assert "2h20m added in all" in second.getMessage()


@pytest.mark.parametrize("phase", [Phase.BOOTING, Phase.PREFLIGHT, Phase.STAGING])
def test_extend_before_training_counts_too(phase: Phase) -> None:
    # max_runtime counts from the first boot: staging eats into it.
    state = run(phase)
    extend(state, H, now=T0 + 60, max_runtime_s=H)
    assert state.extended_s == H


@pytest.mark.parametrize(
    ("phase", "expected"),
    [
        (Phase.FINISHING, "training is over (phase FINISHING) and max_runtime no longer applies"),
        (Phase.TEARDOWN, "training is over (phase TEARDOWN)"),
        (Phase.HELD, "the box is held (HELD); `hold` renews the hold, `release` lets"),
        (Phase.DONE, "cannot extend: the run has ended (DONE)"),
        (Phase.FAILED, "cannot extend: the run has ended (FAILED)"),
    ],
)
def test_extend_past_training_is_a_conflict_and_changes_nothing(
    phase: Phase, expected: str
) -> None:
    state = run(phase)
    with pytest.raises(SteeringError) as info:
        extend(state, H, now=T0 + H, max_runtime_s=12 * H)
    assert expected in str(info.value)
    assert info.value.status == 409
    assert state.extended_s == 0.0 and state.steering == []


def test_extend_without_max_runtime_says_there_is_nothing_to_extend() -> None:
    state = run()
    with pytest.raises(SteeringError) as info:
        extend(state, H, now=T0 + H, max_runtime_s=None)
    assert str(info.value).startswith("nothing to extend: the job has no limits.max_runtime")
    assert info.value.status == 409
    assert state.extended_s == 0.0 and state.steering == []


def test_extend_that_leaves_the_deadline_in_the_past_is_refused() -> None:
    state = run()
    now = T0 + 12 * H + 30 * 60  # the 12h deadline passed 30 min ago (the daemon is finishing)
    with pytest.raises(SteeringError) as info:
        extend(state, 10 * 60, now=now, max_runtime_s=12 * H)
    assert "max_runtime passed at 2025-06-01T12:00:00Z, 30m ago" in str(info.value)
    assert "extend by more than 30m" in str(info.value)
    assert state.extended_s == 0.0
    extend(state, H, now=now, max_runtime_s=12 * H)
    assert deadline_at(state, 12 * H) == T0 + 13 * H


@pytest.mark.parametrize("seconds", [0.0, -60.0, float("inf"), float("nan")])
def test_extend_refuses_a_duration_that_is_not_positive(seconds: float) -> None:
    state = run()
    with pytest.raises(SteeringError) as info:
        extend(state, seconds, now=T0, max_runtime_s=H)
    assert info.value.status == 400
    assert state.extended_s == 0.0


# ---- hold / release ----------------------------------------------------------------------------


def test_hold_before_the_end_keeps_the_box_until_release(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="agent.policy.steering")
    state = run()
    now = T0 + H
    answer = hold(state, now=now, timeout_s=12 * H)
    assert state.hold == {"at": now, "until": now + 12 * H, "released_at": None}
    assert hold_active(state, now) and hold_active(state, now + 12 * H - 1)
    assert not hold_active(state, now + 12 * H)  # its own timeout
    assert hold_remaining_s(state, now + H) == 11 * H
    assert answer["ok"] is True and answer["hold"]["active"] is True
    assert answer["message"] == (
        "hold set: when the run ends the box stays up (phase HELD, nothing torn down) until "
        "2025-06-01T13:00:00Z (in 12h) unless released (`release`); the teardown goes ahead "
        "after that"
    )
    assert state.steering[-1] == {
        "at": now,
        "action": "hold",
        "seconds": 12 * H,
        "until": now + 12 * H,
        "renewed": False,
    }
    (line,) = [r.getMessage() for r in caplog.records if r.name == "agent.policy.steering"]
    assert line == (
        "steering at 2025-06-01T01:00:00Z: hold set in phase TRAINING: the box is kept until "
        "2025-06-01T13:00:00Z (in 12h) unless released"
    )

    answer = release(state, now=now + 2 * H)
    assert state.hold["released_at"] == now + 2 * H
    assert not hold_active(state, now + 2 * H)
    assert hold_remaining_s(state, now + 2 * H) is None
    assert answer["message"] == (
        "hold released: when the run ends, the teardown goes ahead as planned"
    )
    assert state.steering[-1] == {"at": now + 2 * H, "action": "release"}
    assert caplog.records[-1].getMessage() == (
        "steering at 2025-06-01T03:00:00Z: release in phase TRAINING after 2h held: the "
        "teardown goes ahead"
    )


def test_a_second_hold_renews_until_and_keeps_when_it_began() -> None:
    state = run(Phase.HELD)
    hold(state, now=T0, timeout_s=H)
    answer = hold(state, now=T0 + 30 * 60, timeout_s=2 * H)
    assert state.hold == {"at": T0, "until": T0 + 30 * 60 + 2 * H, "released_at": None}
    assert answer["message"].startswith(
        "hold renewed: the box stays up until 2025-06-01T02:30:00Z (in 2h)"
    )
    assert [a["renewed"] for a in state.steering] == [False, True]


def test_a_hold_after_a_release_or_a_timeout_is_a_new_hold() -> None:
    state = run()
    hold(state, now=T0, timeout_s=H)
    release(state, now=T0 + 60)
    hold(state, now=T0 + 120, timeout_s=H)
    assert state.hold == {"at": T0 + 120, "until": T0 + 120 + H, "released_at": None}
    hold(state, now=T0 + 10 * H, timeout_s=H)  # the previous one timed out
    assert state.hold["at"] == T0 + 10 * H
    assert [a.get("renewed") for a in state.steering] == [False, None, False, False]


def test_hold_during_teardown_says_a_teardown_under_way_goes_on() -> None:
    state = run(Phase.TEARDOWN)
    answer = hold(state, now=T0, timeout_s=H)
    assert "a teardown already under way goes on" in answer["message"]
    assert hold_active(state, T0)


@pytest.mark.parametrize("phase", [Phase.DONE, Phase.FAILED])
def test_hold_after_the_run_ended_is_a_conflict(phase: Phase) -> None:
    state = run(phase)
    with pytest.raises(SteeringError) as info:
        hold(state, now=T0, timeout_s=H)
    assert str(info.value) == (
        f"cannot hold: the run has ended ({phase.value}) and its teardown is done"
    )
    assert info.value.status == 409
    assert state.hold is None and state.steering == []


def test_no_hold_lasts_more_than_30_days_whoever_asks() -> None:
    # A job built in code with a longer hold_timeout gets the same bound as a request (the job
    # file's teardown.hold_timeout is refused by `check` past 30 days).
    state = run()
    with pytest.raises(SteeringError) as info:
        hold(state, now=T0, timeout_s=40 * 86400.0)
    assert str(info.value) == (
        "cannot hold for 40d: a hold lasts at most 30d from the request (hold again later to "
        "renew it)"
    )
    assert state.hold is None and state.steering == []
    hold(state, now=T0, timeout_s=MAX_REQUEST_S)
    assert hold_active(state, T0 + 29 * 86400.0)


def test_extensions_add_up_to_at_most_30_days_and_a_refusal_changes_nothing() -> None:
    state = run()
    for i in range(3):
        extend(state, 10 * 86400.0, now=T0 + i, max_runtime_s=H)
    assert state.extended_s == MAX_REQUEST_S
    before = (state.extended_s, list(state.steering))
    with pytest.raises(SteeringError) as info:
        extend(state, 60.0, now=T0 + 10, max_runtime_s=H)
    assert info.value.status == 409
    assert str(info.value) == (
        "cannot extend by 1m: a run's extensions add up to at most 30d and 30d were already "
        "added; nothing more may be added (to train longer, raise limits.max_runtime in the job "
        "file for the next run)"
    )
    assert (state.extended_s, state.steering) == before

    state = run()
    extend(state, 29 * 86400.0, now=T0, max_runtime_s=H)
    with pytest.raises(SteeringError) as info:
        extend(state, 2 * 86400.0, now=T0, max_runtime_s=H)
    assert "29d were already added; at most 1d more may be added" in str(info.value)
    assert state.extended_s == 29 * 86400.0


def test_extend_while_a_stop_is_under_way_is_a_conflict_and_changes_nothing() -> None:
    state = run()
    with pytest.raises(SteeringError) as info:
        extend(state, H, now=T0, max_runtime_s=H, stopping="a stop was requested")
    assert info.value.status == 409
    assert str(info.value) == (
        "cannot extend: the run is already stopping (a stop was requested); an extension "
        "cannot call the stop back"
    )
    assert state.extended_s == 0.0 and state.steering == []


def test_hold_once_the_teardown_is_decided_is_a_conflict() -> None:
    state = run(Phase.TEARDOWN)
    state.teardown = {"action": "destroy", "provider": "vast"}
    with pytest.raises(SteeringError) as info:
        hold(state, now=T0, timeout_s=H)
    assert info.value.status == 409
    assert str(info.value) == (
        "cannot hold: the teardown is under way (destroy, decided already) and a hold cannot "
        "call it back"
    )
    assert state.hold is None and state.steering == []


def test_a_time_no_calendar_shows_is_given_in_epoch_seconds() -> None:
    # A state file from before the duration bound must not make a message raise.
    assert utc_iso(1e24) == "999999999999999983222784 (epoch seconds)"


def test_release_in_held_lets_the_teardown_go_ahead_now() -> None:
    state = run(Phase.HELD)
    hold(state, now=T0, timeout_s=H)
    answer = release(state, now=T0 + 60)
    assert answer["message"] == "released: the teardown goes ahead now"
    assert answer["hold"]["active"] is False and answer["hold"]["remaining_s"] == 0.0


def test_release_with_nothing_held_says_why() -> None:
    state = run()
    with pytest.raises(SteeringError) as info:
        release(state, now=T0)
    assert str(info.value) == "nothing to release: the box is not held (`hold` holds it)"
    assert info.value.status == 409

    hold(state, now=T0, timeout_s=H)
    release(state, now=T0 + 60)
    with pytest.raises(SteeringError) as info:
        release(state, now=T0 + 120)
    assert str(info.value) == (
        "nothing to release: the hold was already released at 2025-06-01T00:01:00Z"
    )

    hold(state, now=T0 + 180, timeout_s=60)
    with pytest.raises(SteeringError) as info:
        release(state, now=T0 + 300)
    assert str(info.value) == "nothing to release: the hold timed out at 2025-06-01T00:04:00Z"
    assert state.hold is not None and state.hold["released_at"] is None
    assert [a["action"] for a in state.steering] == ["hold", "release", "hold"]


def test_an_ended_run_holds_nothing() -> None:
    state = run()
    hold(state, now=T0, timeout_s=H)
    state.phase = Phase.DONE
    assert not hold_active(state, T0 + 60)
    with pytest.raises(SteeringError) as info:
        release(state, now=T0 + 60)
    assert str(info.value) == "nothing to release: the run has ended (DONE)"


# ---- /status -----------------------------------------------------------------------------------


def test_status_shows_the_extension_the_hold_and_the_last_actions() -> None:
    state = run()
    assert steering_status(state, T0) == {"extended_s": 0.0, "hold": None, "actions": []}
    for i in range(STATUS_ACTIONS + 5):
        extend(state, 60, now=T0 + i, max_runtime_s=H)
    hold(state, now=T0 + 100, timeout_s=H)
    s = steering_status(state, T0 + 100 + 600)
    assert s["extended_s"] == (STATUS_ACTIONS + 5) * 60
    assert s["hold"] == {
        "at": T0 + 100,
        "until": T0 + 100 + H,
        "released_at": None,
        "active": True,
        "remaining_s": H - 600,
    }
    assert len(s["actions"]) == STATUS_ACTIONS
    assert s["actions"][-1]["action"] == "hold"
    assert s["actions"][0]["at"] == T0 + 6  # oldest shown: the 7th of 26
    assert len(state.steering) == STATUS_ACTIONS + 6  # the state file keeps every action
    # Timed out: shown, not active.
    s = steering_status(state, T0 + 100 + H)
    assert s["hold"]["active"] is False and s["hold"]["remaining_s"] == 0.0


def test_the_log_survives_the_state_file() -> None:
    state = run()
    extend(state, H, now=T0, max_runtime_s=H)
    hold(state, now=T0, timeout_s=H)
    again = RunState.from_dict(state.to_dict())
    assert again.extended_s == H
    assert again.steering == state.steering
    assert hold_active(again, T0 + 1)


def test_utc_iso() -> None:
    assert utc_iso(T0 + 3723) == "2025-06-01T01:02:03Z"
