"""The job file: every mistake is a ConfigError naming its key, never another exception."""

from __future__ import annotations

import datetime as dt
import math
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.config.jobfile import (
    MAX_JOB_FILE_BYTES,
    job_from_dict,
    load_job,
    parse_job,
)
from agent.config.model import (
    DEFAULT_NOTIFY_EVENTS,
    NOTIFY_EVENTS,
    ConfigError,
    ConfigErrors,
    DataCheckSection,
    DatasetSection,
    Env,
    Job,
    JobSection,
    LimitsSection,
    NotifySection,
    PreflightSection,
    ServerSection,
    SyncSection,
    TeardownSection,
    TrainSection,
    parse_duration,
)
from agent.config.train import check_train_options
from agent.install.libreyolo import TrainOptions, installed_train_options
from agent.trainer.process import build_argv

# --------------------------------------------------------------------------------------------
# A tiny TOML writer: enough to turn any dict of TOML-representable values into a document.


def _toml_str(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, dt.datetime | dt.date | dt.time):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_str(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"not representable in TOML: {v!r}")


def to_toml(doc: dict[str, Any]) -> str:
    """Top-level scalars first, then one ``["section"]`` table per dict (nested dicts inline)."""
    lines = [
        f"{_toml_str(k)} = {_toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)
    ]
    for name, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"[{_toml_str(name)}]")
            lines.extend(f"{_toml_str(k)} = {_toml_value(v)}" for k, v in table.items())
    return "\n".join(lines) + "\n"


def test_toml_writer_round_trips_through_tomllib() -> None:
    doc = {
        "top": 1,
        "train": {
            "data": 'a "quoted"\\ path\n\x01',
            "x": [1, 2.5, "s", {"k": True}],
            "when": dt.datetime(2024, 1, 2, 3, 4, 5, 6),
            "neg": -0.5,
        },
        "empty": {},
    }
    assert tomllib.loads(to_toml(doc)) == doc


# --------------------------------------------------------------------------------------------
# Helpers

DATA = "/data/set/data.yaml"
BASE_DIR = Path("/jobs/example")


def base_doc() -> dict[str, Any]:
    """The smallest valid job."""
    return {"train": {"data": DATA}}


def with_section(section: str, values: dict[str, Any]) -> dict[str, Any]:
    doc = base_doc()
    doc.setdefault(section, {}).update(values)
    return doc


def parse(doc: dict[str, Any]) -> Job:
    return parse_job(to_toml(doc), source="job.toml", base_dir=BASE_DIR)


def config_error(doc: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(doc)
    return info.value


def assert_names_key(exc: ConfigError, key: str) -> None:
    assert exc.key == key, f"error {exc} names {exc.key!r}, expected {key!r}"
    assert key in str(exc)


VALID_DATASET = {"repo": "my-org/my-dataset", "file": "my-dataset.tar"}
VALID_SYNC = {"target": "file:///mnt/backup/run1"}

# --------------------------------------------------------------------------------------------
# Errors name their key


@pytest.mark.parametrize("section", ["trian", "Job", "limit", "notify_me", "tearDown"])
def test_unknown_section_is_named(section: str) -> None:
    doc = base_doc()
    doc[section] = {"x": 1}
    assert_names_key(config_error(doc), section)


def test_unknown_top_level_scalar_is_named() -> None:
    doc: dict[str, Any] = base_doc()
    doc["epochs"] = 10
    assert_names_key(config_error(doc), "epochs")


UNKNOWN_KEYS = [
    ("job", {"nmae": "run1"}, "job.nmae"),
    ("job", {"runs-dir": "runs"}, "job.runs-dir"),
    ("dataset", {**VALID_DATASET, "repo_id": "a/b"}, "dataset.repo_id"),
    ("sync", {**VALID_SYNC, "tagret": "x"}, "sync.tagret"),
    ("sync", {**VALID_SYNC, "every_epoch": 5}, "sync.every_epoch"),
    ("limits", {"max_run_time": "1h"}, "limits.max_run_time"),
    ("limits", {"budget": 5}, "limits.budget"),
    ("teardown", {"provder": "none"}, "teardown.provder"),
    ("server", {"port": 8421}, "server.port"),
    ("preflight", {"enable": True}, "preflight.enable"),
    ("notify", {"webhook": "https://hooks.example.com/x", "url": "y"}, "notify.url"),
]


@pytest.mark.parametrize(("section", "values", "key"), UNKNOWN_KEYS)
def test_unknown_key_in_each_section_is_named(
    section: str, values: dict[str, Any], key: str
) -> None:
    exc = config_error(with_section(section, values))
    assert_names_key(exc, key)
    assert "unknown key" in str(exc)


@pytest.mark.parametrize("key", ["bad-key", "1epochs", "a.b", "with space", ""])
def test_train_option_that_is_not_a_name_is_named(key: str) -> None:
    assert_names_key(config_error(with_section("train", {key: 1})), f"train.{key}")


WRONG_TYPES = [
    ("job", {"name": 5}, "job.name"),
    ("job", {"name": ""}, "job.name"),
    ("job", {"name": "a/b"}, "job.name"),
    ("job", {"name": ".."}, "job.name"),
    ("job", {"runs_dir": 5}, "job.runs_dir"),
    ("job", {"stop_trainer_on_exit": "yes"}, "job.stop_trainer_on_exit"),
    ("job", {"stop_trainer_on_exit": 1}, "job.stop_trainer_on_exit"),
    ("dataset", {**VALID_DATASET, "doctor": "no"}, "dataset.doctor"),
    ("dataset", {**VALID_DATASET, "revision": 3}, "dataset.revision"),
    ("dataset", {**VALID_DATASET, "dest": ["a"]}, "dataset.dest"),
    ("dataset", {"repo": "justaname", "file": "x.tar"}, "dataset.repo"),
    ("dataset", {"repo": "a/b/c", "file": "x.tar"}, "dataset.repo"),
    ("dataset", {"repo": "/a", "file": "x.tar"}, "dataset.repo"),
    ("sync", {**VALID_SYNC, "every_epochs": "10"}, "sync.every_epochs"),
    ("sync", {**VALID_SYNC, "every_epochs": 2.5}, "sync.every_epochs"),
    ("sync", {**VALID_SYNC, "every_epochs": True}, "sync.every_epochs"),
    ("sync", {**VALID_SYNC, "every_epochs": 0}, "sync.every_epochs"),
    ("sync", {**VALID_SYNC, "private": 1}, "sync.private"),
    ("sync", {"target": 5}, "sync.target"),
    ("limits", {"budget_usd": True, "price_usd_per_hour": 1}, "limits.budget_usd"),
    ("limits", {"budget_usd": "50", "price_usd_per_hour": 1}, "limits.budget_usd"),
    ("limits", {"budget_usd": 0, "price_usd_per_hour": 1}, "limits.budget_usd"),
    ("limits", {"budget_usd": -5, "price_usd_per_hour": 1}, "limits.budget_usd"),
    ("limits", {"budget_usd": math.inf, "price_usd_per_hour": 1}, "limits.budget_usd"),
    ("limits", {"price_usd_per_hour": False}, "limits.price_usd_per_hour"),
    ("limits", {"price_usd_per_hour": -1}, "limits.price_usd_per_hour"),
    ("limits", {"price_usd_per_hour": math.nan}, "limits.price_usd_per_hour"),
    ("teardown", {"on_success": "explode"}, "teardown.on_success"),
    ("teardown", {"on_failure": 1}, "teardown.on_failure"),
    ("teardown", {"on_preflight_failure": "Destroy"}, "teardown.on_preflight_failure"),
    ("teardown", {"require_verified_sync": "false"}, "teardown.require_verified_sync"),
    ("teardown", {"provider": 3}, "teardown.provider"),
    ("teardown", {"provider": "aws"}, "teardown.provider"),
    ("server", {"listen": 8421}, "server.listen"),
    ("preflight", {"enabled": "true"}, "preflight.enabled"),
    ("preflight", {"allow_cpu": 0}, "preflight.allow_cpu"),
    ("train", {"epochs": 0}, "train.epochs"),
    ("train", {"epochs": "10"}, "train.epochs"),
    ("train", {"epochs": 2.5}, "train.epochs"),
    ("train", {"epochs": True}, "train.epochs"),
    ("train", {"batch": [1, 2]}, "train.batch"),
    ("train", {"augment": {"mosaic": 1.0}}, "train.augment"),
    ("train", {"lr0": math.nan}, "train.lr0"),
    ("train", {"when": dt.date(2024, 1, 1)}, "train.when"),
    ("train", {"model": "two\nlines"}, "train.model"),
]


@pytest.mark.parametrize(("section", "values", "key"), WRONG_TYPES)
def test_wrong_type_or_value_is_named(section: str, values: dict[str, Any], key: str) -> None:
    assert_names_key(config_error(with_section(section, values)), key)


@pytest.mark.parametrize("section", ["job", "train", "dataset", "sync", "limits", "server"])
def test_section_that_is_not_a_table_is_named(section: str) -> None:
    doc: dict[str, Any] = {} if section == "train" else base_doc()
    doc[section] = "oops"
    assert_names_key(config_error(doc), section)


DURATION_KEYS = [
    ("limits", "max_runtime"),
    ("limits", "stall_timeout"),
    ("sync", "upload_timeout"),
    ("sync", "max_backoff"),
    ("sync", "finish_timeout"),
    ("preflight", "timeout"),
    ("train", "stop_grace"),
    ("train", "kill_grace"),
]
BAD_DURATIONS = ["12x", "-5m", "", "h", "0s", True, 0, -5, "1h30", "12 h", "5m-1s", math.inf]


@pytest.mark.parametrize("bad", BAD_DURATIONS, ids=repr)
@pytest.mark.parametrize(("section", "key"), DURATION_KEYS)
def test_bad_duration_is_named(section: str, key: str, bad: object) -> None:
    values: dict[str, Any] = {key: bad}
    if section == "sync":
        values.update(VALID_SYNC)
    assert_names_key(config_error(with_section(section, values)), f"{section}.{key}")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("12h", 43200.0),
        ("20m", 1200.0),
        ("1h30m", 5400.0),
        ("45s", 45.0),
        ("2d", 172800.0),
        ("1d2h3m4s", 93784.0),
        ("1.5h", 5400.0),
        (" 20M ", 1200.0),
        (90, 90.0),
        (2.5, 2.5),
    ],
)
def test_valid_durations_are_seconds(text: object, seconds: float) -> None:
    assert parse_duration("limits.max_runtime", text) == seconds
    job = parse(with_section("limits", {"max_runtime": text}))
    assert job.limits.max_runtime_s == seconds


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        ({}, "train.data"),
        ({"train": {"epochs": 3}}, "train.data"),
        ({"train": {"data": DATA}, "dataset": {"file": "x.tar"}}, "dataset.repo"),
        ({"train": {"data": DATA}, "dataset": {"repo": "a/b"}}, "dataset.file"),
        ({"train": {"data": DATA}, "sync": {"every_epochs": 2}}, "sync.target"),
        # A dataset without data_yaml does not say where the YAML is.
        ({"dataset": VALID_DATASET}, "train.data"),
    ],
)
def test_missing_required_value_is_named(doc: dict[str, Any], key: str) -> None:
    exc = config_error(doc)
    assert_names_key(exc, key)
    assert "required" in str(exc)


@pytest.mark.parametrize(
    "target",
    [
        "http://example.com/backup",
        "https://huggingface.co/my-org/my-run",
        "file://relative/path",
        "file:relative/path",
        "file://host/abs/path",
        "hf://onlyorg",
        "hf://org/repo/extra",
        "s3://bucket/run1",
        "/mnt/backup/run1",
        " ",
    ],
)
def test_bad_sync_target_is_named(target: str) -> None:
    assert_names_key(config_error(with_section("sync", {"target": target})), "sync.target")


@pytest.mark.parametrize("target", ["file:///mnt/backup/run1", "hf://my-org/my-run"])
def test_good_sync_targets(target: str) -> None:
    job = parse(with_section("sync", {"target": target}))
    assert job.sync is not None and job.sync.target == target


def test_sync_target_location() -> None:
    hf = parse(with_section("sync", {"target": "hf://my-org/my-run"})).sync
    local = parse(with_section("sync", {"target": "file:///mnt/b/run1"})).sync
    assert hf is not None and (hf.scheme, hf.location) == ("hf", "my-org/my-run")
    assert local is not None and (local.scheme, local.location) == ("file", "/mnt/b/run1")


def test_sync_target_with_a_bracket_is_a_config_error_not_a_value_error() -> None:
    # urlparse raises ValueError ("Invalid IPv6 URL") on an unmatched '['.
    assert_names_key(
        config_error(with_section("sync", {"target": "hf://[org/repo"})), "sync.target"
    )


def test_sync_target_with_fullwidth_slash_is_a_config_error_not_a_value_error() -> None:
    # urlparse raises ValueError for a netloc that NFKC-normalizes to contain '/'.
    doc = with_section("sync", {"target": "hf://org\uff0frepo/x"})
    assert_names_key(config_error(doc), "sync.target")


@pytest.mark.parametrize("key", ["project", "name", "json"])
def test_reserved_train_keys_are_refused(key: str) -> None:
    exc = config_error(with_section("train", {key: "x"}))
    assert_names_key(exc, f"train.{key}")
    assert "set by the agent" in str(exc)


def test_budget_without_price_names_the_price() -> None:
    exc = config_error(with_section("limits", {"budget_usd": 50}))
    assert_names_key(exc, "limits.price_usd_per_hour")
    assert "budget_usd" in str(exc)


@pytest.mark.parametrize(
    "listen",
    [
        "8421",
        "localhost",
        "127.0.0.1:",
        ":8421",
        "127.0.0.1:70000",
        "127.0.0.1:http",
        "127.0.0.1:-1",
        "",
    ],
)
def test_bad_listen_is_named(listen: str) -> None:
    assert_names_key(config_error(with_section("server", {"listen": listen})), "server.listen")


def test_listen_with_a_non_ascii_digit_port_is_a_config_error_not_a_value_error() -> None:
    # "²".isdigit() is True but int("²") raises ValueError.
    doc = with_section("server", {"listen": "127.0.0.1:\u00b2"})
    assert_names_key(config_error(doc), "server.listen")


@pytest.mark.parametrize(
    ("listen", "host", "port"),
    [
        ("127.0.0.1:8421", "127.0.0.1", 8421),
        ("[::1]:0", "::1", 0),
        ("127.5.6.7:80", "127.5.6.7", 80),
        ("localhost:8421", "localhost", 8421),
    ],
)
def test_good_listen(listen: str, host: str, port: int) -> None:
    server = parse(with_section("server", {"listen": listen})).server
    assert server == ServerSection(host, port)
    assert server.loopback


# --------------------------------------------------------------------------------------------
# [teardown]: providers


@pytest.mark.parametrize("provider", ["vast", "runpod", "none"])
def test_providers_with_stop_take_the_defaults(provider: str) -> None:
    teardown = parse(with_section("teardown", {"provider": provider})).teardown
    assert teardown.provider == provider
    assert (teardown.on_success, teardown.on_failure) == ("destroy", "stop")
    assert teardown.can_stop


def test_unknown_provider_lists_the_built_ones() -> None:
    exc = config_error(with_section("teardown", {"provider": "aws"}))
    assert_names_key(exc, "teardown.provider")
    for name in ("vast", "runpod", "lambda", "command", "none"):
        assert name in str(exc)


@pytest.mark.parametrize("key", ["on_success", "on_failure", "on_preflight_failure"])
def test_lambda_refuses_stop_with_the_reason(key: str) -> None:
    values = {"provider": "lambda", "on_failure": "keep", key: "stop"}
    exc = config_error(with_section("teardown", values))
    assert_names_key(exc, f"teardown.{key}")
    assert "Lambda has no stop: use destroy (gated: an unverified sync keeps the box) or keep" in (
        str(exc)
    )


def test_lambda_refuses_the_default_on_failure_stop_saying_it_is_the_default() -> None:
    exc = config_error(with_section("teardown", {"provider": "lambda"}))
    assert_names_key(exc, "teardown.on_failure")
    assert "(the default)" in str(exc)


def test_lambda_with_destroy_and_keep() -> None:
    teardown = parse(
        with_section("teardown", {"provider": "lambda", "on_failure": "keep"})
    ).teardown
    assert teardown.provider == "lambda" and not teardown.can_stop


def test_command_provider() -> None:
    teardown = parse(
        with_section(
            "teardown",
            {
                "provider": "command",
                "command": ["gcloud", "compute", "instances", "delete", "vm 1", "--quiet"],
                "stop_command": ["gcloud", "compute", "instances", "stop", "vm 1"],
                "command_timeout": "90s",
            },
        )
    ).teardown
    assert teardown.command == ("gcloud", "compute", "instances", "delete", "vm 1", "--quiet")
    assert teardown.stop_command[3] == "stop"
    assert teardown.command_timeout_s == 90.0
    assert teardown.can_stop


def test_command_timeout_defaults_to_five_minutes() -> None:
    teardown = parse(
        with_section("teardown", {"provider": "command", "command": ["true"], "on_failure": "keep"})
    ).teardown
    assert teardown.command_timeout_s == 300.0
    assert not teardown.can_stop


@pytest.mark.parametrize(
    ("values", "key", "words"),
    [
        ({"provider": "command", "on_failure": "keep"}, "teardown.command", "is required"),
        (
            {"provider": "command", "command": "shutdown -h now", "on_failure": "keep"},
            "teardown.command",
            "list of strings",
        ),
        ({"provider": "command", "command": [], "on_failure": "keep"}, "teardown.command", "list"),
        (
            {"provider": "command", "command": ["ok", 3], "on_failure": "keep"},
            "teardown.command",
            "item 1",
        ),
        (
            {"provider": "command", "command": ["", "x"], "on_failure": "keep"},
            "teardown.command",
            "item 0",
        ),
        (
            {"provider": "command", "command": ["a\nb"], "on_failure": "keep"},
            "teardown.command",
            "single line",
        ),
        ({"provider": "command", "command": ["true"]}, "teardown.on_failure", "stop_command"),
        ({"provider": "vast", "command": ["true"]}, "teardown.command", "only used by"),
        ({"provider": "none", "stop_command": ["true"]}, "teardown.stop_command", "only used by"),
        ({"provider": "vast", "command_timeout": "1m"}, "teardown.command_timeout", "only used"),
        (
            {"provider": "command", "command": ["x"], "on_failure": "keep", "command_timeout": 0},
            "teardown.command_timeout",
            "positive",
        ),
        ({"provider": "vast", "instance_id": "../999"}, "teardown.instance_id", "letters"),
        ({"provider": "vast", "instance_id": "12/34"}, "teardown.instance_id", "letters"),
        ({"provider": "none", "instance_id": "1234"}, "teardown.instance_id", "only used by"),
        ({"provider": "vast", "api_url": "ftp://proxy"}, "teardown.api_url", "http"),
        ({"provider": "vast", "api_url": "http://"}, "teardown.api_url", "with a host"),
        ({"provider": "vast", "api_url": "https://h/x?y=1"}, "teardown.api_url", "query"),
        ({"provider": "vast", "api_url": "http://[::1"}, "teardown.api_url", "not a valid URL"),
        ({"provider": "vast", "api_url": "https://h:99999"}, "teardown.api_url", "valid URL"),
        (
            {"provider": "vast", "api_url": "https://proxy/api/v0/"},
            "teardown.api_url",
            "before /api/v0",
        ),
        ({"provider": "runpod", "api_url": "https://p/v2"}, "teardown.api_url", "before /v2"),
        (
            {"provider": "lambda", "api_url": "https://p/api/v1", "on_failure": "keep"},
            "teardown.api_url",
            "before /api/v1",
        ),
        ({"provider": "none", "api_url": "https://p"}, "teardown.api_url", "only used by"),
    ],
)
def test_bad_provider_settings_are_named(values: dict[str, Any], key: str, words: str) -> None:
    exc = config_error(with_section("teardown", values))
    assert_names_key(exc, key)
    assert words in str(exc)


def test_api_url_with_credentials_is_refused_without_echoing_them() -> None:
    exc = config_error(
        with_section("teardown", {"provider": "vast", "api_url": "https://me:s3cr3t@proxy"})
    )
    assert_names_key(exc, "teardown.api_url")
    assert "s3cr3t" not in str(exc)


@pytest.mark.parametrize(
    ("provider", "url"),
    [
        ("vast", "https://console.vast.ai"),
        ("runpod", "http://127.0.0.1:8080/runpod/"),
        ("lambda", "https://cloud.lambdalabs.com"),
    ],
)
def test_api_url_and_instance_id(provider: str, url: str) -> None:
    values = {"provider": provider, "api_url": url, "instance_id": "a1b2-c3.d4_e5"}
    if provider == "lambda":
        values["on_failure"] = "keep"
    teardown = parse(with_section("teardown", values)).teardown
    assert teardown.api_url == url.rstrip("/")
    assert teardown.instance_id == "a1b2-c3.d4_e5"


def test_env_reads_provider_variables_and_hides_the_keys() -> None:
    env = Env.from_environ(
        {
            "CONTAINER_ID": "1234",
            "CONTAINER_API_KEY": "ck-secret-1\n",
            "VAST_API_KEY": "vk-secret-2",
            "RUNPOD_POD_ID": "pod9",
            "RUNPOD_API_KEY": "rk-secret-3",
            "LAMBDA_API_KEY": "lk-secret-4",
            "HF_TOKEN": "hf_secret_5",
        }
    )
    assert (env.container_id, env.runpod_pod_id) == ("1234", "pod9")
    assert env.container_api_key == "ck-secret-1"  # a pasted newline would break the header
    assert dict(env.secrets()) == {
        "HF_TOKEN": "hf_secret_5",
        "CONTAINER_API_KEY": "ck-secret-1",
        "VAST_API_KEY": "vk-secret-2",
        "RUNPOD_API_KEY": "rk-secret-3",
        "LAMBDA_API_KEY": "lk-secret-4",
    }
    assert "secret" not in repr(env)
    empty = Env.from_environ({"CONTAINER_API_KEY": "  ", "RUNPOD_POD_ID": ""})
    assert empty.container_api_key is None and empty.runpod_pod_id is None
    assert empty.secrets() == ()


def test_huge_integer_budget_is_a_config_error_not_an_overflow() -> None:
    # tomllib accepts integers of any size; math.isfinite(10**400) raises OverflowError.
    doc = with_section("limits", {"budget_usd": 10**400, "price_usd_per_hour": 1})
    assert_names_key(config_error(doc), "limits.budget_usd")


def test_huge_integer_duration_is_a_config_error_not_an_overflow() -> None:
    # float(10**400) raises OverflowError.
    assert_names_key(
        config_error(with_section("limits", {"max_runtime": 10**400})), "limits.max_runtime"
    )


def test_runs_dir_with_unknown_user_tilde_is_a_config_error_not_a_runtime_error() -> None:
    # Path("~nosuchuser/x").expanduser() raises RuntimeError.
    doc = with_section("job", {"runs_dir": "~no-such-user-libreyolo/runs"})
    assert_names_key(config_error(doc), "job.runs_dir")


def test_deeply_nested_toml_is_a_config_error_not_a_recursion_error() -> None:
    # tomllib parses nested arrays recursively: 5000 levels raise RecursionError.
    with pytest.raises(ConfigError) as info:
        parse_job("x = " + "[" * 5000, source="job.toml")
    assert info.value.key == "job.toml"


def test_invalid_toml_names_the_file() -> None:
    with pytest.raises(ConfigError) as info:
        parse_job("[train\ndata = 1", source="/jobs/bad.toml")
    assert_names_key(info.value, "/jobs/bad.toml")
    assert "not valid TOML" in str(info.value)


# --------------------------------------------------------------------------------------------
# Every mistake at once


def test_three_independent_mistakes_are_reported_together_section_by_section() -> None:
    doc = base_doc()
    doc["sync"] = {**VALID_SYNC, "every_epochs": 0}
    doc["limits"] = {"max_runtime": "12x"}
    doc["teardown"] = {"on_success": "explode"}
    exc = config_error(doc)
    assert isinstance(exc, ConfigErrors)
    assert [e.key for e in exc.errors] == [
        "sync.every_epochs",
        "limits.max_runtime",
        "teardown.on_success",
    ]
    lines = str(exc).splitlines()
    assert "0 must be >= 1" in lines[0]
    assert "'12x' is not a duration" in lines[1]
    assert "'explode' is not one of destroy, stop, keep" in lines[2]
    assert exc.key == "sync.every_epochs"


def test_every_unknown_key_and_section_is_named() -> None:
    doc = with_section("limits", {"max_run_time": "1h", "budget": 5})
    doc["trian"] = {"epochs": 1}
    doc["alerts"] = {"webhook": "x"}
    keys = [e.key for e in config_error(doc).errors]
    assert keys == ["alerts", "trian", "limits.budget", "limits.max_run_time"]


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        # [train] that is not a table: train.data is not "missing" on top of it.
        ({"train": [1]}, "train"),
        ({"train": {"data": ["a.yaml"]}}, "train.data"),
        # A bad data_yaml: train.data, which it would give, is not "missing" on top of it.
        (
            {"dataset": {**VALID_DATASET, "data_yaml": "../x.yaml"}, "train": {"epochs": 1}},
            "dataset.data_yaml",
        ),
        ({"dataset": [1], "train": {"epochs": 1}}, "dataset"),
        # A wrong allow_remote: "not loopback" would only echo it.
        (
            with_section("server", {"listen": "0.0.0.0:8421", "allow_remote": "yes"}),
            "server.allow_remote",
        ),
        # A wrong price: "budget needs a price" is the same key.
        (
            with_section("limits", {"budget_usd": 5, "price_usd_per_hour": -1}),
            "limits.price_usd_per_hour",
        ),
        # A missing target: no second complaint that "" is not a URL.
        (with_section("sync", {"every_epochs": 2}), "sync.target"),
        (with_section("dataset", {"file": "x.tar"}), "dataset.repo"),
        (with_section("teardown", {"provider": 3}), "teardown.provider"),
    ],
)
def test_a_consequence_of_a_mistake_is_not_a_second_mistake(doc: dict[str, Any], key: str) -> None:
    exc = config_error(doc)
    assert [e.key for e in exc.errors] == [key], str(exc)


def test_train_option_mistakes_come_with_the_others() -> None:
    options = TrainOptions(names=frozenset({"data", "epochs"}), version="9")
    text = f"{MINIMAL}epoch = 1\nzzzz = 2\n[limits]\nstall_timeout = -1\n"
    with pytest.raises(ConfigErrors) as info:
        parse_job(text, source="job.toml", train_options=options)
    assert [e.key for e in info.value.errors] == [
        "train.epoch",
        "train.zzzz",
        "limits.stall_timeout",
    ]
    assert "did you mean epochs?" in str(info.value.errors[0])


def test_loader_defaults_are_the_dataclass_defaults() -> None:
    # Sections with a required key: everything else comes from the dataclass.
    job = parse(with_section("sync", dict(VALID_SYNC)) | {"dataset": dict(VALID_DATASET)})
    assert job.sync == SyncSection(target=VALID_SYNC["target"])
    assert job.dataset == DatasetSection(
        repo=VALID_DATASET["repo"],
        file=VALID_DATASET["file"],
        dest=BASE_DIR / DatasetSection.dest,
        doctor=DataCheckSection().doctor,
    )
    assert job.data_check == DataCheckSection()
    assert job.job == JobSection(runs_dir=BASE_DIR / JobSection.runs_dir)
    defaults = TrainSection()
    assert (job.train.stop_grace_s, job.train.kill_grace_s) == (
        defaults.stop_grace_s,
        defaults.kill_grace_s,
    )
    assert job.server == ServerSection()


# --------------------------------------------------------------------------------------------
# A valid job

FULL_JOB = """
[job]
name = "run1"
runs_dir = "runs"
stop_trainer_on_exit = true

[train]
model = "yolox-n"
epochs = 100
batch = -1
imgsz = 640
pretrained = false
lr0 = 0.01
device = "0"
save_period = 10
stop_grace = "2m"
kill_grace = 30

[dataset]
repo = "my-org/my-dataset"
file = "my-dataset.tar"
revision = "v1"
dest = "data"
doctor = true
data_yaml = "my-dataset/data.yaml"

[sync]
target = "hf://my-org/my-run"
every_epochs = 10
private = false
upload_timeout = "5m"
max_backoff = "1m"
finish_timeout = "30m"

[limits]
max_runtime = "12h"
stall_timeout = "20m"
budget_usd = 50
price_usd_per_hour = 3.48

[teardown]
provider = "none"
on_success = "destroy"
on_failure = "stop"
on_preflight_failure = "keep"
require_verified_sync = false

[server]
listen = "127.0.0.1:0"

[preflight]
enabled = true
allow_cpu = true
timeout = "90s"
"""


def test_full_job_round_trips_to_the_expected_dataclasses(tmp_path: Path) -> None:
    folder = tmp_path / "jobs"
    folder.mkdir()
    folder = folder.resolve()
    path = folder / "job.toml"
    path.write_text(FULL_JOB, encoding="utf-8")
    job = load_job(path)
    expected = Job(
        job=JobSection(name="run1", runs_dir=folder / "runs", stop_trainer_on_exit=True),
        train=TrainSection(
            args=(
                ("model", "yolox-n"),
                ("epochs", 100),
                ("batch", -1),
                ("imgsz", 640),
                ("pretrained", False),
                ("lr0", 0.01),
                ("device", "0"),
                ("save_period", 10),
                ("data", str(folder / "data" / "my-dataset" / "data.yaml")),
            ),
            stop_grace_s=120.0,
            kill_grace_s=30.0,
        ),
        dataset=DatasetSection(
            repo="my-org/my-dataset",
            file="my-dataset.tar",
            revision="v1",
            dest=folder / "data",
            doctor=True,
            data_yaml="my-dataset/data.yaml",
        ),
        sync=SyncSection(
            target="hf://my-org/my-run",
            every_epochs=10,
            private=False,
            upload_timeout_s=300.0,
            max_backoff_s=60.0,
            finish_timeout_s=1800.0,
        ),
        limits=LimitsSection(
            max_runtime_s=43200.0,
            stall_timeout_s=1200.0,
            budget_usd=50.0,
            price_usd_per_hour=3.48,
        ),
        teardown=TeardownSection(
            provider="none",
            on_success="destroy",
            on_failure="stop",
            on_preflight_failure="keep",
            require_verified_sync=False,
        ),
        server=ServerSection(host="127.0.0.1", port=0),
        preflight=PreflightSection(enabled=True, allow_cpu=True, timeout_s=90.0),
        source=str(path),
    )
    assert job == expected
    assert job.train.epochs == 100


def test_defaults_of_a_minimal_job() -> None:
    job = parse(base_doc())
    assert job.job == JobSection(name="run1", runs_dir=BASE_DIR / "runs")
    assert job.train.args == (("data", DATA),)
    assert (job.train.stop_grace_s, job.train.kill_grace_s) == (60.0, 10.0)
    assert job.dataset is None and job.sync is None
    assert job.limits == LimitsSection()
    assert job.teardown == TeardownSection()
    assert job.server == ServerSection("127.0.0.1", 8421)
    assert job.preflight == PreflightSection()


def test_relative_paths_resolve_against_the_job_files_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "jobs"
    folder.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    (folder / "job.toml").write_text(
        to_toml(
            {
                "job": {"runs_dir": "out/runs"},
                "train": {"data": DATA},
                "dataset": {**VALID_DATASET, "dest": "../datasets"},
            }
        ),
        encoding="utf-8",
    )
    job = load_job(Path("..") / "jobs" / "job.toml")
    assert job.job.runs_dir == folder.resolve() / "out" / "runs"
    assert job.job.runs_dir.is_absolute()
    assert job.dataset is not None
    assert job.dataset.dest.resolve() == (tmp_path / "datasets").resolve()
    assert job.dataset.dest.is_absolute()


def test_absolute_paths_are_kept() -> None:
    job = parse(with_section("job", {"runs_dir": "/root/runs"}))
    assert job.job.runs_dir == Path("/root/runs")


def test_relative_train_data_that_exists_beside_the_job_file_is_resolved(tmp_path: Path) -> None:
    # The trainer runs with cwd=job.runs_dir, so `data = "datasets/mine.yaml"` written next to
    # the job file would be looked up in the runs folder unless the agent resolves it.
    (tmp_path / "datasets").mkdir()
    (tmp_path / "datasets" / "mine.yaml").write_text("path: .\n", encoding="utf-8")
    (tmp_path / "job.toml").write_text(
        to_toml({"train": {"data": "datasets/mine.yaml"}}), encoding="utf-8"
    )
    job = load_job(tmp_path / "job.toml")
    assert job.train.get("data") == str(tmp_path / "datasets" / "mine.yaml")


def test_train_args_keep_job_file_order() -> None:
    keys = ["imgsz", "model", "zeta", "data", "alpha", "epochs", "batch"]
    doc = {"train": {k: (DATA if k == "data" else 1) for k in keys}}
    doc["train"]["stop_grace"] = "1m"  # agent options are not passed on
    job = parse(doc)
    assert [k for k, _ in job.train.args] == keys


def test_build_argv_formats_bools_and_appends_agent_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A `libreyolo` on PATH, in case the venv has none beside its Python.
    fake = tmp_path / "bin" / "libreyolo"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n", encoding="utf-8")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    job = parse(
        {
            "job": {"name": "exp", "runs_dir": "/root/runs"},
            "train": {
                "model": "yolox-n",
                "data": DATA,
                "pretrained": False,
                "amp": True,
                "lr0": 0.01,
                "epochs": 3,
            },
        }
    )
    argv = build_argv(job)
    assert Path(argv[0]).name == "libreyolo"
    assert argv[1:] == [
        "train",
        "model=yolox-n",
        f"data={DATA}",
        "pretrained=false",
        "amp=true",
        "lr0=0.01",
        "epochs=3",
        "project=/root/runs",
        "name=exp",
        "json=true",
    ]


# --------------------------------------------------------------------------------------------
# Files and environment


def test_missing_job_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert_names_key(info.value, str(path))
    assert "cannot read" in str(info.value)


def test_job_file_that_is_a_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_job(tmp_path)
    assert "cannot read" in str(info.value)


def test_job_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_bytes(b'[train]\ndata = "\xff\xfe"\n')
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert "UTF-8" in str(info.value)


def test_env_defaults_and_overrides() -> None:
    env = Env.from_environ({})
    assert env.state_dir == Path("/var/lib/libreyolo-agent")
    assert env.hf_endpoint == "https://huggingface.co"
    assert env.hf_token is None and env.hf_home is None
    env = Env.from_environ(
        {
            "LIBREYOLO_AGENT_STATE_DIR": "/tmp/state",
            "HF_ENDPOINT": "http://127.0.0.1:9999/",
            "HF_HOME": "/vol/hf",
            "HF_TOKEN": "hf_secret_value",
        }
    )
    assert env.state_dir == Path("/tmp/state")
    assert env.hf_endpoint == "http://127.0.0.1:9999"
    assert env.hf_home == Path("/vol/hf")
    assert env.hf_token == "hf_secret_value"
    assert "hf_secret_value" not in repr(env)


@pytest.mark.parametrize("endpoint", ["ftp://mirror", "127.0.0.1:9999", "http://[::1"])
def test_bad_hf_endpoint_names_the_variable(endpoint: str) -> None:
    with pytest.raises(ConfigError) as info:
        Env.from_environ({"HF_ENDPOINT": endpoint})
    assert_names_key(info.value, "HF_ENDPOINT")


# --------------------------------------------------------------------------------------------
# `libreyolo-agent check`


def run_check(path: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/bin:/bin",
        "LIBREYOLO_AGENT_STATE_DIR": str(tmp_path / "state"),
        "HOME": str(tmp_path),
        # check asks the Hub for a [dataset]'s size (agent/policy/rent.py): test traffic stays
        # local.
        "HF_ENDPOINT": "http://127.0.0.1:9",
    }
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "check", str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )


def test_check_bad_job_exits_2_with_one_line_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(to_toml(with_section("limits", {"max_runtime": "12x"})), encoding="utf-8")
    proc = run_check(path, tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "limits.max_runtime" in lines[0]
    assert "'12x'" in lines[0]
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_check_valid_job_exits_0(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(FULL_JOB, encoding="utf-8")
    proc = run_check(path, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_check_missing_file_exits_2_with_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "missing.toml"
    proc = run_check(path, tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(path) in lines[0]
    assert "cannot read" in lines[0]
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------------------
# Property: any document gives a Job or a ConfigError, never another exception

KNOWN_KEYS: dict[str, list[str]] = {
    "job": ["name", "runs_dir", "stop_trainer_on_exit"],
    "train": ["data", "model", "epochs", "batch", "device", "stop_grace", "kill_grace", "project"],
    "dataset": ["repo", "file", "revision", "dest", "doctor", "data_yaml", "allow_outside_paths"],
    "sync": [
        "target",
        "every_epochs",
        "private",
        "upload_timeout",
        "max_backoff",
        "finish_timeout",
    ],
    "limits": ["max_runtime", "stall_timeout", "budget_usd", "price_usd_per_hour"],
    "teardown": [
        "provider",
        "on_success",
        "on_failure",
        "on_preflight_failure",
        "api_url",
        "instance_id",
        "command",
        "stop_command",
        "command_timeout",
    ],
    "server": ["listen", "allow_remote"],
    "preflight": ["enabled", "allow_cpu", "timeout"],
    "notify": ["webhook", "events", "every_epochs", "timeout"],
}
INTERESTING_STRINGS = [
    "vast",
    "lambda",
    "command",
    "stop",
    "https://proxy/api/v0",
    "",
    " ",
    "12h",
    "1h30m",
    "0s",
    "-5m",
    "h",
    "90",
    "run1",
    "a/b",
    "..",
    "~",
    "~/runs",
    "~no-such-user-libreyolo/x",
    "org/repo",
    "my-org/my-dataset",
    "hf://org/repo",
    "hf://onlyorg",
    "hf://[org/repo",
    "hf://org\uff0frepo/x",
    "file:///abs",
    "file://rel",
    "http://x",
    "127.0.0.1:8421",
    "[::1]:0",
    "127.0.0.1:\u00b2",
    ":",
    "none",
    "vast",
    "destroy",
    "stop",
    "keep",
    "0,1",
    "a\x00b",
    "line\nbreak",
    "a\u202eb",
    "hf://org/run@dev",
    "hf://../x",
    "org/",
    "0.0.0.0:8421",
    "[::]:8421",
    "*:8421",
    "epoch",
]
scalars = st.one_of(
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.sampled_from([2**63, -(2**63) - 1, 2**63 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(INTERESTING_STRINGS),
    st.dates(),
    st.datetimes(),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
section_names = st.sampled_from([*KNOWN_KEYS, "notify", "trian"]) | st.text(max_size=8)


@st.composite
def key_for(draw: st.DrawFn, section: str) -> str:
    known = KNOWN_KEYS.get(section, [])
    if known and draw(st.booleans()):
        return draw(st.sampled_from(known))
    return draw(st.text(max_size=8))


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for name in draw(st.lists(section_names, max_size=6, unique=True)):
        if draw(st.integers(0, 9)) == 0:
            doc[name] = draw(scalars)  # a section that is not a table
            continue
        table: dict[str, Any] = {}
        for _ in range(draw(st.integers(0, 5))):
            table[draw(key_for(name))] = draw(values)
        doc[name] = table
    return doc


def assert_one_line_per_mistake(exc: ConfigError) -> None:
    """`check` prints ``str(exc)``: one printable line per mistake, each naming its key."""
    assert isinstance(exc.key, str) and exc.key in str(exc)
    lines = str(exc).split("\n")
    assert len(lines) == len(exc.errors) >= 1
    for line, one in zip(lines, exc.errors, strict=True):
        assert line == str(one) and line.startswith(f"{one.key}: ")
        assert line.isprintable(), repr(line)
    assert len({one.key for one in exc.errors}) == len(exc.errors)  # one mistake per key


def check_outcome(text: str) -> None:
    try:
        job = parse_job(text, source="job.toml", base_dir=BASE_DIR)
    except ConfigError as exc:
        assert_one_line_per_mistake(exc)
        return
    assert isinstance(job, Job)
    assert job.train.get("data") is not None
    assert not {k for k, _ in job.train.args} & {"project", "name", "json"}
    for seconds in (
        job.limits.max_runtime_s,
        job.limits.stall_timeout_s,
        job.train.stop_grace_s,
        job.preflight.timeout_s,
    ):
        assert seconds is None or (math.isfinite(seconds) and seconds > 0)


HYPOTHESIS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@HYPOTHESIS
@given(documents())
def test_random_documents_give_a_job_or_a_config_error(doc: dict[str, Any]) -> None:
    check_outcome(to_toml(doc))


@HYPOTHESIS
@given(
    st.sampled_from([(s, k) for s, keys in KNOWN_KEYS.items() for k in keys]),
    values,
)
def test_random_value_for_each_known_key_gives_a_job_or_a_config_error(
    section_key: tuple[str, str], value: Any
) -> None:
    section, key = section_key
    doc: dict[str, Any] = {
        "train": {"data": DATA},
        "dataset": dict(VALID_DATASET),
        "sync": dict(VALID_SYNC),
        "limits": {"budget_usd": 10, "price_usd_per_hour": 1.0},
    }
    doc.setdefault(section, {})[key] = value
    check_outcome(to_toml(doc))


@HYPOTHESIS
@given(st.text(max_size=200))
def test_random_text_gives_a_job_or_a_config_error(text: str) -> None:
    check_outcome(text)


def test_job_from_dict_refuses_non_table_sections() -> None:
    with pytest.raises(ConfigError) as info:
        job_from_dict({"train": {"data": DATA}, "limits": [1, 2]})
    assert_names_key(info.value, "limits")


# --------------------------------------------------------------------------------------------
# Issue 8: bad input that `check` accepted or crashed on. Each case crashed or passed before.

REPO_ROOT = Path(__file__).resolve().parent.parent
LIBREYOLO = installed_train_options()
requires_libreyolo = pytest.mark.skipif(
    not LIBREYOLO.available, reason=f"needs LibreYOLO's train options: {LIBREYOLO.reason}"
)


def write_job(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text, encoding="utf-8")
    return path


def assert_check_refuses(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """`check` exited 2 with one printable line on stderr holding every needle, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].isprintable(), repr(lines[0])
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert proc.stdout == ""
    return lines[0]


MINIMAL = '[train]\ndata = "/data/set/data.yaml"\n'
HUGE = "1" * 5000


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (f"{MINIMAL}epochs = {HUGE}\n", 3),
        (f"{MINIMAL}[limits]\nbudget_usd = {HUGE}\n", 4),
        (f"{MINIMAL}[job]\nx = [1, [{HUGE}]]\n", 4),
        (f"n = 1_{HUGE}\n{MINIMAL}", 1),
    ],
)
def test_integer_over_4300_digits_is_a_config_error_not_a_value_error(text: str, line: int) -> None:
    # tomllib's int() refuses more than 4,300 digits with a plain ValueError.
    with pytest.raises(ConfigError) as info:
        parse_job(text, source="job.toml")
    assert_names_key(info.value, "job.toml")
    assert "4300 digits" in str(info.value) and f"line {line}" in str(info.value)
    assert "set_int_max_str_digits" not in str(info.value)  # no advice to change Python


def test_listen_port_over_4300_digits_is_a_config_error_not_a_value_error() -> None:
    doc = with_section("server", {"listen": f"127.0.0.1:{HUGE}"})
    exc = config_error(doc)
    assert_names_key(exc, "server.listen")
    assert "port" in str(exc)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        # Hexadecimal reads at any size, then str()/repr() of it raises ValueError.
        (f"{MINIMAL}x = 0x{'f' * 5000}\n", "train.x"),
        (f"{MINIMAL}[limits]\nbudget_usd = {2**63}\n", "limits.budget_usd"),
        (f"{MINIMAL}[job]\nname = {-(2**63) - 1}\n", "job.name"),
        (f"{MINIMAL}[job]\nx = {{ y = [0, {2**64}] }}\n", "job.x.y[1]"),
    ],
)
def test_integer_outside_64_bits_is_named(text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_job(text, source="job.toml")
    assert_names_key(info.value, key)
    assert "64-bit" in str(info.value)


def test_integers_at_the_64_bit_limits_are_fine() -> None:
    job = parse(with_section("train", {"seed": 2**63 - 1, "shift": -(2**63)}))
    assert job.train.get("seed") == 2**63 - 1


@pytest.mark.parametrize(
    "text",
    [
        f"{MINIMAL}epochs = {HUGE}\n",
        f'{MINIMAL}[server]\nlisten = "127.0.0.1:{HUGE}"\n',
        f"{MINIMAL}x = 0x{'f' * 5000}\n",
    ],
    ids=["toml-int", "listen-port", "hex-int"],
)
def test_check_huge_integer_exits_2_with_one_line(tmp_path: Path, text: str) -> None:
    assert_check_refuses(run_check(write_job(tmp_path, text), tmp_path))


NUL_CASES = [
    ("job", {"name": "run\x001"}, "job.name"),
    ("job", {"runs_dir": "/root/ru\x00ns"}, "job.runs_dir"),
    ("sync", {"target": "file:///mnt/b\x00ackup"}, "sync.target"),
    ("sync", {"target": "hf://org/ru\x00n"}, "sync.target"),
    ("dataset", {**VALID_DATASET, "repo": "org/d\x00s"}, "dataset.repo"),
    ("dataset", {**VALID_DATASET, "file": "ds\x00.tar"}, "dataset.file"),
    ("dataset", {**VALID_DATASET, "dest": "/data\x00"}, "dataset.dest"),
    ("dataset", {**VALID_DATASET, "revision": "ma\x00in"}, "dataset.revision"),
    ("dataset", {**VALID_DATASET, "data_yaml": "d\x00.yaml"}, "dataset.data_yaml"),
    ("train", {"model": "yolox\x00-n"}, "train.model"),
    ("train", {"data": "/d\x00.yaml"}, "train.data"),
    ("train", {"classes": ["0", "\x00"]}, "train.classes[1]"),
    ("teardown", {"provider": "no\x00ne"}, "teardown.provider"),
    ("server", {"listen": "127.0.0.1:8421\x00"}, "server.listen"),
    ("limits", {"max_runtime": "1h\x00"}, "limits.max_runtime"),
]


@pytest.mark.parametrize(("section", "values", "key"), NUL_CASES)
def test_nul_anywhere_is_refused_with_its_key(
    section: str, values: dict[str, Any], key: str
) -> None:
    exc = config_error(with_section(section, values))
    assert_names_key(exc, key)
    assert "NUL" in str(exc)
    assert "\x00" not in str(exc) and "\\x00" in str(exc)


@pytest.mark.parametrize("section", ["train", "job", "notify"])
def test_nul_in_a_key_is_refused(section: str) -> None:
    exc = config_error(with_section(section, {"ep\x00ochs": 1}))
    assert "NUL" in str(exc) and "\x00" not in str(exc)
    assert exc.key.startswith(section) and str(exc).isprintable()


@pytest.mark.parametrize(
    ("section", "values", "key"),
    [
        ("job", {"name": "run1"}, "job.name"),
        ("job", {"runs_dir": "/root/runs"}, "job.runs_dir"),
        ("sync", {"target": "file:///mnt/backup/run1"}, "sync.target"),
    ],
)
def test_check_refuses_nul_in_names_and_paths(
    tmp_path: Path, section: str, values: dict[str, Any], key: str
) -> None:
    # Before: accepted by `check`, then `run` crashed at every restart while the box billed.
    ((k, v),) = values.items()
    doc = with_section(section, {k: v[:3] + "\x00" + v[3:]})
    line = assert_check_refuses(run_check(write_job(tmp_path, to_toml(doc)), tmp_path), key)
    assert "NUL" in line


@pytest.mark.parametrize(
    ("section", "values", "key"),
    [
        ("job", {"name": "run\n1"}, "job.name"),
        ("job", {"name": "run\u202e1"}, "job.name"),  # right-to-left override: a spoof
        ("job", {"runs_dir": "/root/\truns"}, "job.runs_dir"),
        ("job", {"runs_dir": "/root/runs\x1b[2J"}, "job.runs_dir"),
        ("sync", {"target": "file:///mnt/back\nup"}, "sync.target"),
        ("dataset", {**VALID_DATASET, "dest": "/data\r"}, "dataset.dest"),
        ("dataset", {**VALID_DATASET, "file": "ds\u2028.tar"}, "dataset.file"),
        ("train", {"model": "yolox\t-n"}, "train.model"),
        ("train", {"data": "/data\u2029.yaml"}, "train.data"),
        ("train", {"device": "\x7f0"}, "train.device"),
    ],
)
def test_control_characters_in_names_paths_and_arguments_are_refused(
    section: str, values: dict[str, Any], key: str
) -> None:
    exc = config_error(with_section(section, values))
    assert_names_key(exc, key)
    assert "unprintable character" in str(exc) and str(exc).isprintable()


def test_printable_non_ascii_text_is_fine() -> None:
    job = parse(
        {
            "job": {"name": "exp-données", "runs_dir": "/root/实验"},
            "train": {"data": "/data/jeu de données/data.yaml", "model": "yolox-n"},
        }
    )
    assert job.job.name == "exp-données"
    assert job.train.get("data") == "/data/jeu de données/data.yaml"


def test_an_unknown_key_with_a_newline_is_shown_on_one_line() -> None:
    exc = config_error(with_section("job", {"na\nme": "x"}))
    assert exc.key == "job.na\\nme"
    assert "\n" not in str(exc)


def test_job_name_longer_than_a_directory_name_is_refused() -> None:
    assert_names_key(config_error(with_section("job", {"name": "r" * 201})), "job.name")
    assert parse(with_section("job", {"name": "r" * 200})).job.name == "r" * 200


BAD_REPO_IDS = [
    "org/run@dev",
    "../x",
    "a/b/c",
    "org/",
    "/run",
    "org",
    "my org/run",
    "org/my run",
    "-org/run",
    "org/run-",
    ".org/run",
    "org/run.",
    "org/ru--n",
    "org/ru..n",
    "org/run.git",
    "org/" + "r" * 97,
    "o" * 97 + "/run",
    "org/rün",
    "org/run?x=1",
    "org/run#main",
    "user:pw@org/run",
    "org\\run",
]
GOOD_REPO_IDS = [
    "my-org/my-run",
    "Org_1/run.v2",
    "_org/_run",
    "o/r",
    "org/" + "r" * 96,
    "123/456",
]


@pytest.mark.parametrize("repo", BAD_REPO_IDS)
def test_bad_hf_target_is_refused_at_check_time(repo: str) -> None:
    # Before: `hf://org/run@dev` and `hf://../x` passed, then every upload failed as transient.
    exc = config_error(with_section("sync", {"target": f"hf://{repo}"}))
    assert_names_key(exc, "sync.target")
    assert "namespace/name" in str(exc)


@pytest.mark.parametrize("repo", BAD_REPO_IDS)
def test_bad_dataset_repo_is_refused(repo: str) -> None:
    exc = config_error(with_section("dataset", {**VALID_DATASET, "repo": repo}))
    assert_names_key(exc, "dataset.repo")
    assert "Hub repo id" in str(exc)


@pytest.mark.parametrize("repo", GOOD_REPO_IDS)
def test_good_repo_ids(repo: str) -> None:
    sync = parse(with_section("sync", {"target": f"hf://{repo}"})).sync
    assert sync is not None and sync.location == repo
    dataset = parse(with_section("dataset", {**VALID_DATASET, "repo": repo})).dataset
    assert dataset is not None and dataset.repo == repo


def test_hf_target_with_a_trailing_slash_is_the_same_repo() -> None:
    sync = parse(with_section("sync", {"target": "hf://my-org/my-run/"})).sync
    assert sync is not None and sync.location == "my-org/my-run"


def test_revision_at_sign_gets_a_hint() -> None:
    exc = config_error(with_section("sync", {"target": "hf://org/run@dev"}))
    assert "'@revision' is not part of a repo id" in str(exc)


@pytest.mark.parametrize("revision", ["dev branch", "v1 ", "\tmain", "ma\u3000in"])
def test_revision_with_whitespace_is_refused(revision: str) -> None:
    exc = config_error(with_section("dataset", {**VALID_DATASET, "revision": revision}))
    assert_names_key(exc, "dataset.revision")


def test_revision_may_be_a_ref_path() -> None:
    ds = parse(with_section("dataset", {**VALID_DATASET, "revision": "refs/pr/1"})).dataset
    assert ds is not None and ds.revision == "refs/pr/1"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("file", "../x.tar"),
        ("file", "/abs/x.tar"),
        ("file", "a/../../x.tar"),
        ("data_yaml", "../other/data.yaml"),
        ("data_yaml", "/etc/data.yaml"),
        ("data_yaml", "~/data.yaml"),
    ],
)
def test_dataset_paths_must_stay_inside(key: str, value: str) -> None:
    exc = config_error(with_section("dataset", {**VALID_DATASET, key: value}))
    assert_names_key(exc, f"dataset.{key}")
    assert "relative path inside" in str(exc)


@pytest.mark.parametrize(
    "target", ["file:///mnt/backup?x", "file:///mnt/backup#1", "file:///mnt/a?b/run1"]
)
def test_file_target_with_query_or_fragment_is_refused(target: str) -> None:
    # urlsplit cuts the path at '?' or '#': the checkpoints would go to another folder.
    assert_names_key(config_error(with_section("sync", {"target": target})), "sync.target")


def test_file_target_keeps_a_semicolon_in_the_path() -> None:
    sync = parse(with_section("sync", {"target": "file:///mnt/a;b/run1"})).sync
    assert sync is not None and sync.location == "/mnt/a;b/run1"


NON_LOOPBACK = ["0.0.0.0:8421", "[::]:8421", "192.168.1.5:8421", "10.0.0.1:0", "myhost:8421"]


@pytest.mark.parametrize("listen", NON_LOOPBACK)
def test_non_loopback_listen_needs_allow_remote(listen: str) -> None:
    exc = config_error(with_section("server", {"listen": listen}))
    assert_names_key(exc, "server.listen")
    assert "allow_remote" in str(exc) and "/status" in str(exc)


@pytest.mark.parametrize("listen", NON_LOOPBACK)
def test_non_loopback_listen_with_allow_remote(listen: str) -> None:
    server = parse(with_section("server", {"listen": listen, "allow_remote": True})).server
    assert server.allow_remote and not server.loopback
    assert listen.endswith(f":{server.port}") and server.host in listen


@pytest.mark.parametrize("allow_remote", [False, True])
def test_listen_star_is_not_a_host(allow_remote: bool) -> None:
    doc = with_section("server", {"listen": "*:8421", "allow_remote": allow_remote})
    exc = config_error(doc)
    assert_names_key(exc, "server.listen")
    assert "'*' is not a host" in str(exc) and "0.0.0.0" in str(exc)


@pytest.mark.parametrize(
    "listen",
    ["::1:8421", "[nothost]:1", "[127.0.0.1]:1", "127.1:1", "999.1.1.1:1", "a b:1", "-x:1", ".:1"],
)
def test_listen_host_that_is_not_an_address_is_named(listen: str) -> None:
    doc = with_section("server", {"listen": listen, "allow_remote": True})
    assert_names_key(config_error(doc), "server.listen")


def test_allow_remote_must_be_a_boolean() -> None:
    doc = with_section("server", {"listen": "0.0.0.0:1", "allow_remote": "yes"})
    assert_names_key(config_error(doc), "server.allow_remote")


def test_check_refuses_a_public_listen_address(tmp_path: Path) -> None:
    text = f'{MINIMAL}[server]\nlisten = "0.0.0.0:8421"\n'
    assert_check_refuses(run_check(write_job(tmp_path, text), tmp_path), "server.listen")


@pytest.mark.parametrize("price", [0, 0.0, None])
def test_budget_needs_a_positive_price(price: float | None) -> None:
    # Before: price 0 was accepted, and a budget at $0/h never fires.
    limits: dict[str, Any] = {"budget_usd": 50}
    if price is not None:
        limits["price_usd_per_hour"] = price
    exc = config_error(with_section("limits", limits))
    assert_names_key(exc, "limits.price_usd_per_hour")
    assert "budget_usd needs price_usd_per_hour > 0" in str(exc)


def test_price_without_budget_may_be_zero() -> None:
    limits = parse(with_section("limits", {"price_usd_per_hour": 0})).limits
    assert limits.price_usd_per_hour == 0.0 and limits.budget_usd is None


# ---------------------------------------------------------------- [train] keys against LibreYOLO


@requires_libreyolo
def test_misspelt_train_key_is_refused_with_the_closest_valid_one(tmp_path: Path) -> None:
    path = write_job(tmp_path, f"{MINIMAL}epoch = 1\n")
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert_names_key(info.value, "train.epoch")
    assert "did you mean epochs?" in str(info.value)
    assert LIBREYOLO.label in str(info.value)


@requires_libreyolo
def test_check_refuses_every_misspelt_train_key(tmp_path: Path) -> None:
    proc = run_check(write_job(tmp_path, f"{MINIMAL}epoch = 1\nsave_perod = 2\n"), tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2, proc.stderr
    assert "train.epoch:" in lines[0] and "did you mean epochs" in lines[0]
    assert "train.save_perod:" in lines[1] and "did you mean save_period" in lines[1]


@requires_libreyolo
def test_check_says_what_the_train_keys_were_checked_against(tmp_path: Path) -> None:
    proc = run_check(write_job(tmp_path, FULL_JOB), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"checked against {LIBREYOLO.label}" in proc.stdout


@requires_libreyolo
def test_agent_keys_and_libreyolo_keys_pass_load_job(tmp_path: Path) -> None:
    text = (
        f"{MINIMAL}stop_grace = '1m'\nkill_grace = 5\nmosaic = 0.5\nno_aug_epochs = 2\n"
        "amp = false\nclass_balanced = true\ncache = 'ram'\n"
    )
    job = load_job(write_job(tmp_path, text))
    assert job.train.stop_grace_s == 60.0 and job.train.get("mosaic") == 0.5


@requires_libreyolo
def test_demo_and_test_jobs_use_only_libreyolo_train_options(tmp_path: Path) -> None:
    from agent import demo
    from tests.support import tiny_job

    jobs = [
        demo.demo_job(tmp_path / "demo"),
        tiny_job(tmp_path, tmp_path / "data.yaml", train="save_period = 1"),
        parse_job(FULL_JOB, base_dir=tmp_path),
    ]
    for job in jobs:
        check_train_options(job.train, LIBREYOLO)  # raises on an unknown key
    used = {k for job in jobs for k, _ in job.train.args}
    assert {"model", "pretrained", "data", "epochs", "imgsz", "batch", "workers"} <= used
    assert {"device", "save_period", "lr0"} <= used


def test_train_keys_are_not_checked_when_the_options_are_unknown() -> None:
    train = parse(with_section("train", {"epoch": 1})).train
    check_train_options(train, TrainOptions(reason="libreyolo is not installed for this Python"))
    with pytest.raises(ConfigError) as info:
        check_train_options(train, TrainOptions(names=frozenset({"data", "epochs"}), version="9"))
    assert "did you mean epochs?" in str(info.value) and "LibreYOLO 9" in str(info.value)


def test_unknown_train_key_with_nothing_close_points_at_the_help() -> None:
    train = parse(with_section("train", {"zzzz": 1})).train
    with pytest.raises(ConfigError) as info:
        check_train_options(train, TrainOptions(names=frozenset({"data", "epochs"})))
    assert_names_key(info.value, "train.zzzz")
    assert "libreyolo train --help" in str(info.value)


def test_agent_only_install_skips_the_train_key_check(tmp_path: Path) -> None:
    # -S: no site-packages, so neither libreyolo nor any other dependency is importable.
    path = write_job(tmp_path, f"{MINIMAL}epoch = 1\n")
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(REPO_ROOT)!r})\n"
        "from agent.cli import main\n"
        f"sys.exit(main(['check', {str(path)!r}]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "LIBREYOLO_AGENT_STATE_DIR": str(tmp_path / "state")},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "not checked" in proc.stdout and "libreyolo is not installed" in proc.stdout


@pytest.mark.parametrize("key", ["dry_run", "help_json"])
def test_train_options_that_do_not_train_are_refused(key: str) -> None:
    exc = config_error(with_section("train", {key: True}))
    assert_names_key(exc, f"train.{key}")
    assert "without training" in str(exc)


# ---------------------------------------------------------------------- [dataset] data checks


def test_data_checks_default_on_for_every_job() -> None:
    job = parse(base_doc())
    assert job.dataset is None
    assert job.data_check == DataCheckSection(doctor=True, allow_outside_paths=False)


def test_staged_dataset_runs_the_doctor_by_default() -> None:
    job = parse(with_section("dataset", VALID_DATASET))
    assert job.dataset is not None and job.dataset.doctor
    assert job.data_check.doctor and not job.data_check.allow_outside_paths


@pytest.mark.parametrize(
    ("values", "check"),
    [
        ({"doctor": False}, DataCheckSection(doctor=False)),
        ({"allow_outside_paths": True}, DataCheckSection(allow_outside_paths=True)),
        ({}, DataCheckSection()),
    ],
)
def test_dataset_table_without_a_repo_only_sets_the_checks(
    values: dict[str, Any], check: DataCheckSection
) -> None:
    job = parse(with_section("dataset", values))
    assert job.dataset is None  # nothing to stage: train.data is a local file
    assert job.data_check == check


def test_doctor_false_reaches_the_staged_dataset_too() -> None:
    job = parse(with_section("dataset", {**VALID_DATASET, "doctor": False}))
    assert job.dataset is not None and not job.dataset.doctor and not job.data_check.doctor


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"doctor": False, "revision": "v1"}, "dataset.repo"),
        ({"data_yaml": "d/data.yaml"}, "dataset.repo"),
        ({"dest": "/data"}, "dataset.repo"),
        ({"repo": "org/ds", "doctor": False}, "dataset.file"),
        ({"allow_outside_paths": "yes"}, "dataset.allow_outside_paths"),
        ({"doctor": 1}, "dataset.doctor"),
    ],
)
def test_dataset_table_mistakes_are_named(values: dict[str, Any], key: str) -> None:
    assert_names_key(config_error(with_section("dataset", values)), key)


def test_unknown_key_in_a_checks_only_dataset_table_lists_every_key() -> None:
    exc = config_error(with_section("dataset", {"docter": False}))
    assert_names_key(exc, "dataset.docter")
    for key in ("doctor", "allow_outside_paths", "repo", "file", "data_yaml"):
        assert key in str(exc)


# ------------------------------------------------------------------- load_job: only ConfigError


def test_job_file_larger_than_the_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_bytes(MINIMAL.encode() + b"#" * MAX_JOB_FILE_BYTES)
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert_names_key(info.value, str(path))
    assert "larger than" in str(info.value)


def test_job_file_with_a_utf8_bom_is_read(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_bytes(b"\xef\xbb\xbf" + MINIMAL.encode())
    assert load_job(path).train.get("data") == "/data/set/data.yaml"


TOML_FRAGMENTS = [
    "[job]\n",
    "[train]\n",
    "[dataset]\n",
    "[sync]\n",
    "[server]\n",
    "[limits]\n",
    "[[train]]\n",
    "[job.x]\n",
    'data = "/d.yaml"\n',
    'name = "a\\u0000b"\n',
    'runs_dir = "/r\\nx"\n',
    '"\\u0000" = 1\n',
    'listen = "0.0.0.0:1"\n',
    'listen = "*:1"\n',
    f'listen = "127.0.0.1:{HUGE}"\n',
    "allow_remote = true\n",
    f"epochs = {HUGE}\n",
    f"x = 0x{'f' * 5000}\n",
    f"x = {2**63}\n",
    "epochs = 3\n",
    "epoch = 1\n",
    "dry_run = true\n",
    'target = "hf://a/b@c"\n',
    'target = "hf://../x"\n',
    'target = "file:///a?b"\n',
    'repo = "a/b"\n',
    'file = "x.tar"\n',
    'data_yaml = "../d.yaml"\n',
    "doctor = false\n",
    "allow_outside_paths = true\n",
    "budget_usd = 5\n",
    "price_usd_per_hour = 0\n",
    "a.b.c = 1\n",
    "x = [[[1]]]\n",
    "t = 1979-05-27T07:32:00Z\n",
    "x = 1e999\n",
    "x = nan\n",
    "x = {a = [1, {b = 2}]}\n",
    '"" = ""\n',
    "\ufeff",
    "=",
    '"',
]


@st.composite
def toml_ish(draw: st.DrawFn) -> str:
    parts = draw(st.lists(st.sampled_from(TOML_FRAGMENTS) | st.text(max_size=12), max_size=14))
    return "".join(parts)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def check_load(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        job = load_job(path)
    except ConfigError as exc:
        assert_one_line_per_mistake(exc)
        return
    assert isinstance(job, Job) and job.train.get("data") is not None
    assert job.server.loopback or job.server.allow_remote
    assert not (job.limits.budget_usd and not job.limits.price_usd_per_hour)


@HYPOTHESIS
@given(toml_ish())
def test_load_job_raises_only_config_error_for_toml_ish_text(fuzz_dir: Path, text: str) -> None:
    check_load(fuzz_dir / "job.toml", text.encode("utf-8", "surrogatepass"))


@HYPOTHESIS
@given(documents())
def test_load_job_raises_only_config_error_for_random_documents(
    fuzz_dir: Path, doc: dict[str, Any]
) -> None:
    check_load(fuzz_dir / "job.toml", to_toml(doc).encode("utf-8", "surrogatepass"))


@HYPOTHESIS
@given(st.binary(max_size=300))
def test_load_job_raises_only_config_error_for_random_bytes(fuzz_dir: Path, data: bytes) -> None:
    check_load(fuzz_dir / "job.toml", data)


# ---------------------------------------------------------------------- the real price


def test_auto_price_is_read_from_the_provider() -> None:
    doc = with_section("limits", {"price_usd_per_hour": "auto", "budget_usd": 20})
    doc["teardown"] = {"provider": "vast"}
    limits = parse(doc).limits
    assert limits.price_auto and limits.price_usd_per_hour is None and limits.budget_usd == 20


def test_auto_price_needs_a_provider_that_reports_one() -> None:
    exc = config_error(with_section("limits", {"price_usd_per_hour": "auto"}))
    assert_names_key(exc, "limits.price_usd_per_hour")
    assert "'auto' needs a provider that reports the price" in str(exc)


def test_a_price_cap_needs_a_price_and_a_price_that_is_not_a_word_is_refused() -> None:
    exc = config_error(with_section("limits", {"max_price_usd_per_hour": 3}))
    assert_names_key(exc, "limits.max_price_usd_per_hour")
    exc = config_error(with_section("limits", {"price_usd_per_hour": "cheap"}))
    assert_names_key(exc, "limits.price_usd_per_hour")
    exc = config_error(with_section("limits", {"storage_usd_per_gb_month": -1}))
    assert_names_key(exc, "limits.storage_usd_per_gb_month")


# ---------------------------------------------------------------------- [notify]

SLACK = "https://hooks.slack.com/services/T0FAKE/B0FAKE/xoxFAKEtoken123"


def test_no_notify_table_means_no_notices() -> None:
    assert parse(base_doc()).notify is None


def test_notify_reads_every_key() -> None:
    doc = with_section(
        "notify",
        {
            "webhook": SLACK,
            "events": ["failure", "done", "failure", "teardown"],
            "every_epochs": 10,
            "timeout": "30s",
        },
    )
    notify = parse(doc).notify
    assert notify == NotifySection(
        webhook=SLACK, events=("failure", "done", "teardown"), every_epochs=10, timeout_s=30.0
    )
    assert "xoxFAKE" not in repr(parse(doc))


def test_notify_defaults_are_the_important_events() -> None:
    notify = parse(with_section("notify", {"webhook": SLACK})).notify
    assert notify is not None
    assert notify.events == DEFAULT_NOTIFY_EVENTS and notify.every_epochs == 0
    assert notify.timeout_s == 10.0
    assert set(notify.events) <= set(NOTIFY_EVENTS)
    assert {"job_started", "best", "stall", "teardown", "teardown_confirmed", "failure"} <= set(
        notify.events
    )


@pytest.mark.parametrize(
    "url",
    [
        "https://user:xoxFAKEpass@hooks.example.com/hook",
        "https://discord.com/api/webhooks/123/xoxFAKEtoken?thread_id=9",
        "http://127.0.0.1:8080/hook",
    ],
)
def test_a_webhook_may_carry_its_secret(url: str) -> None:
    notify = parse(with_section("notify", {"webhook": url})).notify
    assert notify is not None and notify.webhook == url
    assert "xoxFAKE" not in notify.shown and notify.shown.endswith("/...")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("ftp://files.example.com/xoxFAKEtoken", "http:// or https://"),
        ("https:///xoxFAKEtoken", "with a host"),
        ("hooks.slack.com/services/xoxFAKEtoken", "http:// or https://"),
        ("https://hooks.example.com:99999/xoxFAKEtoken", "not a valid URL"),
        ("https://[::1/xoxFAKEtoken", "not a valid URL"),
        ("https://hooks.example.com/xoxFAKEtoken#frag", "fragment"),
        ("https://hooks.example.com/xoxFAKE token", "space"),
        ("", "empty"),
        (5, "not a URL"),
    ],
)
def test_a_bad_webhook_is_named_without_echoing_it(url: object, words: str) -> None:
    exc = config_error(with_section("notify", {"webhook": url}))
    assert_names_key(exc, "notify.webhook")
    assert words in str(exc)
    assert "xoxFAKE" not in str(exc)


def test_a_notify_table_without_a_webhook_is_refused() -> None:
    exc = config_error(with_section("notify", {"events": ["done"]}))
    assert_names_key(exc, "notify.webhook")
    assert "required" in str(exc)


def test_notify_that_is_not_a_table_is_one_mistake() -> None:
    doc = base_doc()
    doc["notify"] = SLACK
    exc = config_error(doc)
    assert [e.key for e in exc.errors] == ["notify"]
    assert "must be a table" in str(exc)


def test_an_unknown_event_is_refused_with_the_valid_ones() -> None:
    exc = config_error(
        with_section("notify", {"webhook": SLACK, "events": ["done", "finished", "boom"]})
    )
    assert_names_key(exc, "notify.events")
    assert "'finished', 'boom'" in str(exc)
    assert all(name in str(exc) for name in NOTIFY_EVENTS)


@pytest.mark.parametrize(
    ("values", "key", "words"),
    [
        ({"events": ["epoch"]}, "notify.events", "every_epochs"),
        ({"events": "done"}, "notify.events", "must be a list"),
        ({"events": ["done", 3]}, "notify.events", "must be a list"),
        ({"events": []}, "notify.events", "selects nothing"),
        ({"every_epochs": -1}, "notify.every_epochs", ">= 0"),
        ({"every_epochs": 2.5}, "notify.every_epochs", "not an integer"),
        ({"timeout": 0}, "notify.timeout", "positive"),
        ({"timeout": "soon"}, "notify.timeout", "duration"),
    ],
)
def test_bad_notify_settings_are_named(values: dict[str, Any], key: str, words: str) -> None:
    exc = config_error(with_section("notify", {"webhook": SLACK, **values}))
    assert_names_key(exc, key)
    assert words in str(exc)


def test_only_epoch_notices_is_a_choice() -> None:
    notify = parse(
        with_section("notify", {"webhook": SLACK, "events": [], "every_epochs": 5})
    ).notify
    assert notify is not None and notify.events == () and notify.every_epochs == 5


# --------------------------------------------------------------------------------------------
# [profile]


def test_profile_defaults_off() -> None:
    from agent.config.model import ProfileSection

    job = parse(base_doc())
    assert job.profile == ProfileSection()
    assert job.profile.enabled is False
    assert (job.profile.steps, job.profile.warmup, job.profile.timeout_s) == (20, 3, 300.0)
    assert job.profile.on_verdict == "warn"


def test_profile_values_are_read() -> None:
    job = parse(
        with_section(
            "profile",
            {"enabled": True, "steps": 5, "warmup": 0, "timeout": "2m", "on_verdict": "stop"},
        )
    )
    assert job.profile.enabled is True
    assert (job.profile.steps, job.profile.warmup, job.profile.timeout_s) == (5, 0, 120.0)
    assert job.profile.on_verdict == "stop"


@pytest.mark.parametrize(
    ("values", "key", "words"),
    [
        ({"on_verdict": "halt"}, "profile.on_verdict", "not one of warn, stop"),
        ({"steps": 0}, "profile.steps", "must be >= 1"),
        ({"warmup": -1}, "profile.warmup", "must be >= 0"),
        ({"timeout": "soon"}, "profile.timeout", "not a duration"),
        ({"enabled": "yes"}, "profile.enabled", "not a boolean"),
        ({"stepz": 3}, "profile.stepz", "unknown key"),
    ],
)
def test_profile_mistakes_are_named(values: dict[str, Any], key: str, words: str) -> None:
    exc = config_error(with_section("profile", values))
    assert_names_key(exc, key)
    assert words in str(exc)


def test_profile_and_notify_sections_both_accepted() -> None:
    doc = with_section("profile", {"enabled": True})
    doc["notify"] = {"webhook": "https://hooks.example.com/x"}
    job = parse(doc)
    assert job.profile.enabled and job.notify is not None


# --------------------------------------------------------------------------------------------
# Every duration has one bound (agent/config/jobvalues.py parse_duration): a year, 30 days for a
# hold

EVERY_DURATION_KEY = [
    *DURATION_KEYS,
    ("limits", "restart_backoff"),
    ("limits", "first_epoch_timeout"),
    ("limits", "finish_reserve"),
    ("limits", "exit_grace"),
    ("preemption", "poll_interval"),
    ("profile", "timeout"),
    ("teardown", "hold_timeout"),
]


def _with_duration(section: str, key: str, value: object) -> dict[str, Any]:
    values: dict[str, Any] = {key: value}
    if section == "sync":
        values.update(VALID_SYNC)
    return with_section(section, values)


@pytest.mark.parametrize("huge", ["99999999999999999999d", "366d", 10**12, "8761h"], ids=repr)
@pytest.mark.parametrize(("section", "key"), EVERY_DURATION_KEY)
def test_no_duration_is_longer_than_a_year(section: str, key: str, huge: object) -> None:
    exc = config_error(_with_duration(section, key, huge))
    assert_names_key(exc, f"{section}.{key}")
    bound = "30d" if key == "hold_timeout" else "365d"
    assert f"more than {bound}, the longest this duration may be" in str(exc)
    assert "\n" not in str(exc)


@pytest.mark.parametrize(("section", "key"), EVERY_DURATION_KEY)
def test_the_longest_duration_is_accepted(section: str, key: str) -> None:
    longest = "30d" if key == "hold_timeout" else "365d"
    job = parse(_with_duration(section, key, longest))
    assert job is not None


def test_a_hold_timeout_longer_than_30_days_is_refused_with_the_bound() -> None:
    exc = config_error(with_section("teardown", {"hold_timeout": "31d"}))
    assert str(exc) == (
        "teardown.hold_timeout: '31d' is 31d, more than 30d, the longest this duration may be; "
        "give a shorter one"
    )


def test_check_refuses_an_endless_max_runtime_in_one_line(tmp_path: Path) -> None:
    # The reproduction: `check` accepted it, then /hold and /extend failed with 500.
    path = write_job(tmp_path, f'{MINIMAL}[limits]\nmax_runtime = "99999999999999999999d"\n')
    proc = run_check(path, tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "libreyolo-agent: error: limits.max_runtime: '99999999999999999999d' is more than 365d, "
        "the longest this duration may be; give a shorter one"
    ]


# --------------------------------------------------------------------------------------------
# [train] values of the type LibreYOLO's option takes


@requires_libreyolo
def test_check_names_every_train_value_of_the_wrong_type_at_once(tmp_path: Path) -> None:
    text = (
        f'{MINIMAL}batch = "big"\namp = "yes"\ncls_pw = 2\nlr0 = "abc"\nworkers = 2.5\n'
        'imgsz = 640\nmosaic = "0.5"\nepochs = 3\nsave_period = "10"\n'
    )
    proc = run_check(write_job(tmp_path, text), tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert "Traceback" not in proc.stderr
    label = LIBREYOLO.label
    assert proc.stderr.strip().splitlines() == [
        f"libreyolo-agent: error: train.batch: 'big' is not an integer: `libreyolo train` of "
        f"{label} takes an integer, e.g. batch = 16",
        f"libreyolo-agent: error: train.amp: 'yes' is not a boolean (true or false): "
        f"`libreyolo train` of {label} takes a boolean (true or false), e.g. amp = true",
        f"libreyolo-agent: error: train.cls_pw: 2 is out of range: `libreyolo train` of {label} "
        "takes a number from 0 to 1, e.g. cls_pw = 0.0",
        f"libreyolo-agent: error: train.lr0: 'abc' is not a number: `libreyolo train` of {label} "
        "takes a number, e.g. lr0 = 0.01",
        f"libreyolo-agent: error: train.workers: 2.5 is not an integer: `libreyolo train` of "
        f"{label} takes an integer, e.g. workers = 4",
    ]


def test_typed_train_values_are_checked_with_the_given_options() -> None:
    from agent.install.libreyolo import OptionType

    options = TrainOptions(
        names=frozenset({"data", "batch", "amp", "frac"}),
        version="9",
        types={
            "batch": OptionType("int", default=16),
            "amp": OptionType("bool", default=True),
            "frac": OptionType("float", minimum=0.0, maximum=1.0),
            "data": OptionType("str"),
        },
    )
    good = parse(with_section("train", {"batch": "16", "amp": 1, "frac": "0.5"})).train
    check_train_options(good, options)
    bad = parse(with_section("train", {"batch": True, "amp": 2, "frac": -0.1})).train
    with pytest.raises(ConfigError) as info:
        check_train_options(bad, options)
    assert [e.key for e in info.value.errors] == ["train.batch", "train.amp", "train.frac"]
    assert (
        "train.frac: -0.1 is out of range: `libreyolo train` of LibreYOLO 9 takes a number "
        "from 0 to 1" in str(info.value)
    )
