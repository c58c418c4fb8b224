"""Preflight's provider side against the fake Vast API on 127.0.0.1: the key can read THIS
instance (and nothing is changed), a wrong key or id fails naming the variable, the real price
is read for ``price_usd_per_hour = "auto"``, and a box over ``max_price_usd_per_hour`` fails."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from agent.preflight import PreflightReport
from agent.preflight.report import FAIL, PASS
from tests.fakes.providers import FakeVast, run_fake_vast
from tests.test_preflight import NO_GPU, check, make_env, make_job, run

KEY = "vast-instance-key-abcdefghij"


@pytest.fixture
def vast() -> Any:
    with run_fake_vast(keys=set(), instance_keys={KEY: "1234"}) as fake:
        fake.add_instance("1234", dph_total=2.5)
        yield fake


def preflight(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake: FakeVast,
    *,
    key: str | None = KEY,
    container_id: str | None = "1234",
    limits: dict[str, Any] | None = None,
) -> PreflightReport:
    sections: dict[str, dict[str, Any]] = {
        "preflight": {"allow_cpu": True},
        "teardown": {"provider": "vast", "api_url": fake.url},
    }
    if limits:
        sections["limits"] = limits
    job = make_job(tmp_path, **sections)
    env = dataclasses.replace(make_env(tmp_path), container_id=container_id, container_api_key=key)
    return run(monkeypatch, job, env, NO_GPU)


def test_the_key_reads_this_instance_and_nothing_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vast: FakeVast
) -> None:
    report = preflight(tmp_path, monkeypatch, vast)
    c = check(report, "provider.vast")
    assert c.status == PASS, c
    assert "1234" in c.value and "$2.5000/h" in c.value
    assert c.details["price_usd_per_hour"] == 2.5
    assert vast.mutations() == []
    assert KEY not in str(report.to_dict())


@pytest.mark.parametrize(
    ("key", "container_id", "names"),
    [
        ("wrong-key-0000000000", "1234", "CONTAINER_API_KEY"),
        (None, "1234", "CONTAINER_API_KEY"),
        (KEY, None, "CONTAINER_ID"),
    ],
)
def test_a_key_or_id_that_cannot_act_fails_while_the_box_is_cheap(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    vast: FakeVast,
    key: str | None,
    container_id: str | None,
    names: str,
) -> None:
    report = preflight(tmp_path, monkeypatch, vast, key=key, container_id=container_id)
    c = check(report, "provider.vast")
    assert c.status == FAIL and not report.ok
    assert names in c.value
    assert "wrong-key" not in c.value
    assert vast.mutations() == []


def test_a_box_over_the_price_cap_fails_preflight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vast: FakeVast
) -> None:
    limits = {"price_usd_per_hour": "auto", "max_price_usd_per_hour": 2.0}
    report = preflight(tmp_path, monkeypatch, vast, limits=limits)
    c = check(report, "provider.vast")
    assert c.status == FAIL
    assert "over limits.max_price_usd_per_hour $2.0000/h" in c.value
    ok = preflight(
        tmp_path, monkeypatch, vast, limits={"price_usd_per_hour": 2.4, "max_price_usd_per_hour": 3}
    )
    assert check(ok, "provider.vast").status == PASS
