"""Preflight's provider side against the fake Vast API on 127.0.0.1: the key can read THIS
instance (and nothing is changed), a wrong key or id fails naming the variable, the real price
is read for ``price_usd_per_hour = "auto"``, and a box over ``max_price_usd_per_hour`` fails."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from agent.preflight import PreflightReport
from agent.preflight.report import FAIL, PASS, WARN
from tests.fakes.providers import FakeRunPod, FakeVast, run_fake_runpod, run_fake_vast
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


# ------------------------------------------------------------------------------------ RunPod


def runpod_preflight(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake: FakeRunPod,
    limits: dict[str, Any],
) -> PreflightReport:
    sections: dict[str, dict[str, Any]] = {
        "preflight": {"allow_cpu": True},
        "teardown": {"provider": "runpod", "api_url": fake.url},
        "limits": limits,
    }
    job = make_job(tmp_path, **sections)
    env = dataclasses.replace(
        make_env(tmp_path), runpod_pod_id="pod0abc", runpod_api_key="runpod-key-0123456789"
    )
    return run(monkeypatch, job, env, NO_GPU)


@pytest.mark.parametrize("fields", [("cost",), ("costPerHr",), ("adjustedCostPerHr",)])
def test_runpod_auto_price_is_read_from_the_pod_whatever_its_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fields: tuple[str, ...]
) -> None:
    with run_fake_runpod() as fake:
        fake.add_instance("pod0abc", cost=0.74, price_fields=fields)
        report = runpod_preflight(
            tmp_path, monkeypatch, fake, {"price_usd_per_hour": "auto", "budget_usd": 10}
        )
        c = check(report, "provider.runpod")
        assert c.status == PASS, c
        assert c.details["price_usd_per_hour"] == pytest.approx(0.74)
        assert "$0.7400/h" in c.value
        assert fake.mutations() == []


def test_a_price_the_provider_does_not_give_is_a_warning_never_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with run_fake_runpod() as fake:
        fake.add_instance("pod0abc", price_fields=())
        limits = {"price_usd_per_hour": "auto", "budget_usd": 10, "max_price_usd_per_hour": 2}
        report = runpod_preflight(tmp_path, monkeypatch, fake, limits)
        c = check(report, "provider.runpod")
        assert c.status == WARN, c
        assert "reports no price" in c.value and "no budget_usd stop" in c.value
        assert "no max_price_usd_per_hour check" in c.value
        assert c.fix and "price_usd_per_hour" in c.fix
        assert c.details["price_usd_per_hour"] is None
        assert "provider.runpod" not in [f.name for f in report.failures()]
        assert fake.mutations() == []


def test_vast_reports_its_disk_and_storage_price_for_the_stopped_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with run_fake_vast(keys=set(), instance_keys={KEY: "1234"}) as fake:
        fake.add_instance("1234", dph_total=2.5, disk_space=120.0, storage_cost=0.15)
        c = check(preflight(tmp_path, monkeypatch, fake), "provider.vast")
        assert (c.details["disk_gb"], c.details["storage_usd_per_gb_month"]) == (120.0, 0.15)
        fake.add_instance("1234", dph_total=2.5, disk_space=None, storage_cost=None)
        c = check(preflight(tmp_path, monkeypatch, fake), "provider.vast")
        assert (c.details["disk_gb"], c.details["storage_usd_per_gb_month"]) == (None, None)
