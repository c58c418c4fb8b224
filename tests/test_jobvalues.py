"""Single job-file values: the error types, the error list, the table reader, the value checks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.config import jobvalues
from agent.config import model as config
from agent.config.jobvalues import (
    ConfigError,
    ConfigErrors,
    ErrorList,
    Table,
    format_duration,
    parse_listen,
    repo_id_problem,
)

# --------------------------------------------------------------------------------------------
# Errors


def test_config_errors_is_one_line_per_mistake_and_keys_the_first() -> None:
    exc = ConfigErrors([ConfigError("a.x", "bad x"), ConfigError("b.y", "bad y")])
    assert isinstance(exc, ConfigError)
    assert str(exc) == "a.x: bad x\nb.y: bad y"
    assert exc.key == "a.x"
    assert [e.key for e in exc.errors] == ["a.x", "b.y"]


def test_config_errors_of_config_errors_is_flat() -> None:
    inner = ConfigErrors([ConfigError("a", "1"), ConfigError("b", "2")])
    outer = ConfigErrors([inner, ConfigError("c", "3")])
    assert [e.key for e in outer.errors] == ["a", "b", "c"]
    assert str(outer).splitlines() == ["a: 1", "b: 2", "c: 3"]


def test_a_single_config_error_stands_for_itself() -> None:
    exc = ConfigError("job.name", "bad\nname")
    assert exc.errors == (exc,)
    assert str(exc) == "job.name: bad\\nname"  # one line, escaped


def test_error_list_keeps_the_first_mistake_of_each_key() -> None:
    errors = ErrorList()
    errors.add(ConfigError("sync.target", "is required but missing"))
    errors.add(ConfigError("sync.target", "must start with file:/// or hf://"))
    errors.add(ConfigError("limits.budget_usd", "must be > 0"))
    assert [str(e) for e in errors.items] == [
        "sync.target: is required but missing",
        "limits.budget_usd: must be > 0",
    ]
    assert errors.named("limits.budget_usd") and not errors.named("limits")


def test_raise_if_any_raises_nothing_the_one_error_or_all_of_them() -> None:
    errors = ErrorList()
    errors.raise_if_any()  # nothing recorded: no error
    first = ConfigError("a", "1")
    errors.add(first)
    with pytest.raises(ConfigError) as one:
        errors.raise_if_any()
    assert one.value is first and not isinstance(one.value, ConfigErrors)
    errors.add(ConfigError("b", "2"))
    with pytest.raises(ConfigErrors) as several:
        errors.raise_if_any()
    assert str(several.value) == "a: 1\nb: 2"


def test_catch_records_a_config_error_and_lets_others_through() -> None:
    errors = ErrorList()
    with errors.catch():
        raise ConfigError("a", "1")
    assert errors.named("a")
    with pytest.raises(ValueError), errors.catch():
        raise ValueError("a bug, not a mistake in the file")


# --------------------------------------------------------------------------------------------
# The table reader


def test_table_readers_record_each_mistake_and_return_the_default() -> None:
    errors = ErrorList()
    t = Table(
        "s",
        {"n": "x", "b": "yes", "i": 0, "d": "12x", "c": "maybe", "ok": "fine", "typo": 1},
        errors,
    )
    assert t.number("n", 1.5) == 1.5
    assert t.bool_("b", True) is True
    assert t.int_("i", 3, minimum=1) == 3
    assert t.duration("d", 60.0) == 60.0
    assert t.choice("c", "stop", ("stop", "keep")) == "stop"
    assert t.req_str("missing") is None
    assert t.str_("ok") == "fine"
    t.finish()
    assert [e.key for e in errors.items] == [
        "s.n",
        "s.b",
        "s.i",
        "s.d",
        "s.c",
        "s.missing",
        "s.typo",
    ]
    assert "unknown key" in str(errors.items[-1])


def test_finish_names_every_unknown_key() -> None:
    errors = ErrorList()
    t = Table("limits", {"max_run_time": "1h", "budget": 5}, errors)
    t.duration("max_runtime", None)
    t.finish()
    assert [e.key for e in errors.items] == ["limits.budget", "limits.max_run_time"]


def test_a_table_that_is_not_a_table_is_one_mistake_and_reads_empty() -> None:
    errors = ErrorList()
    t = Table("limits", [1, 2], errors)
    assert t.duration("max_runtime", None) is None
    t.finish()
    assert [e.key for e in errors.items] == ["limits"]
    assert "must be a table ([limits])" in str(errors.items[0])


# --------------------------------------------------------------------------------------------
# Values


@pytest.mark.parametrize(
    ("seconds", "text"), [(5400, "1h30m"), (45, "45s"), (0, "0s"), (90000, "1d1h"), (60, "1m")]
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(
    ("listen", "parsed"),
    [
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::1]:8421", ("::1", 8421)),
        ("localhost:1", ("localhost", 1)),
    ],
)
def test_parse_listen_splits_host_and_port(listen: str, parsed: tuple[str, int]) -> None:
    assert parse_listen("server.listen", listen, allow_remote=False) == parsed


def test_parse_listen_names_the_key_it_is_given() -> None:
    with pytest.raises(ConfigError) as info:
        parse_listen("server.listen", "0.0.0.0:8421", allow_remote=False)
    assert info.value.key == "server.listen" and "allow_remote" in str(info.value)


@settings(max_examples=400, deadline=None)
@given(
    st.tuples(
        st.text(alphabet="aZ09-_.@ /é", max_size=100),
        st.text(alphabet="aZ09-_.@ é", max_size=100),
    ).map("/".join)
)
def test_repo_id_rule_agrees_with_huggingface_hub(repo_id: str) -> None:
    # huggingface_hub also accepts a bare "name"; the agent needs "namespace/name".
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
        hub_ok = repo_id.count("/") == 1
    except HFValidationError:
        hub_ok = False
    assert (repo_id_problem(repo_id) is None) == hub_ok, repo_id


def test_config_still_exports_what_moved_here() -> None:
    # Other modules and scripts import these from agent.config.model.
    for name in ("ConfigError", "ConfigErrors", "parse_duration", "format_duration"):
        assert getattr(config, name) is getattr(jobvalues, name)
    assert config.repo_id_problem is jobvalues.repo_id_problem


# --------------------------------------------------------------------------------------------
# The one bound on durations


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("366d", "'366d' is 366d, more than 365d, the longest this duration may be"),
        ("8785h", "'8785h' is 366d1h, more than 365d"),
        (31_622_400, "31622400 is 366d, more than 365d"),
        ("99999999999999999999d", "'99999999999999999999d' is more than 365d"),
        (1e300, "1e+300 is more than 365d"),
    ],
)
def test_no_duration_is_longer_than_a_year(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        jobvalues.parse_duration("limits.max_runtime", value)
    assert str(info.value).startswith(f"limits.max_runtime: {message}")
    assert "\n" not in str(info.value)


def test_a_year_is_the_longest_and_a_key_may_have_a_tighter_bound() -> None:
    assert jobvalues.parse_duration("k", "365d") == jobvalues.MAX_DURATION_S
    assert jobvalues.parse_duration("k", "30d", maximum=jobvalues.MAX_STEERING_S) == 30 * 86400.0
    with pytest.raises(ConfigError, match="'30d1s' is 30d1s, more than 30d"):
        jobvalues.parse_duration("k", "30d1s", maximum=jobvalues.MAX_STEERING_S)
    errors = ErrorList()
    t = Table("teardown", {"hold_timeout": "31d"}, errors)
    assert t.duration("hold_timeout", 60.0, maximum=jobvalues.MAX_STEERING_S) == 60.0
    assert [e.key for e in errors.items] == ["teardown.hold_timeout"]


def test_the_guards_variables_have_the_same_bound() -> None:
    from agent.guard import plan as guardplan

    guardplan.check_environ({guardplan.MARGIN_ENV: "365d"})
    with pytest.raises(ConfigError) as info:
        guardplan.check_environ({guardplan.MARGIN_ENV: "99999999999999999999d"})
    assert str(info.value) == (
        "LIBREYOLO_AGENT_GUARD_MARGIN: '99999999999999999999d' is more than 365d, the longest "
        "this duration may be; give a shorter one"
    )
