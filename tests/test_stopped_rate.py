"""/status's stopped-box rate (``money.stopped_usd_per_hour``): from the provider's own disk
figures where it gives them (Vast's ``disk_space`` and ``storage_cost``, read before training),
else an estimate from this filesystem's size, and ``money.stopped_rate_source`` says which.
Through the real daemon (scripted stand-in trainer) against the fake Vast API on 127.0.0.1."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from agent.config.model import Env
from agent.daemon.spine import Daemon
from agent.policy.cost import stopped_usd_per_hour
from agent.state import Reason
from agent.util.disk import nearest_existing
from tests.fakes.providers import run_fake_vast
from tests.fakes.scripted_launcher import ScriptedLauncher
from tests.support import tiny_job

KEY = "vast-instance-key-abcdefghij"


def money_after_run(tmp_path: Path, disk: dict[str, float | None], storage: str) -> dict[str, Any]:
    data = tmp_path / "data.yaml"
    data.write_text("train: images\nval: images\nnames:\n  0: box\n")
    with run_fake_vast(keys=set(), instance_keys={KEY: "1234"}) as vast:
        vast.add_instance("1234", **disk)  # type: ignore[arg-type]
        sections = (
            f'[sync]\ntarget = "file://{tmp_path / "synced"}"\n'
            f"[limits]\n{storage}\n"
            f'[teardown]\nprovider = "vast"\napi_url = "{vast.url}"\n'
        )
        job = tiny_job(tmp_path, data, sections=sections)
        env = Env(state_dir=tmp_path / "state", container_id="1234", container_api_key=KEY)
        daemon = Daemon(job, env, launcher=ScriptedLauncher(epoch_s=0.05), poll_interval_s=0.05)
        assert asyncio.run(asyncio.wait_for(daemon.run(), 240)) == 0
        assert daemon.state.reason == Reason.COMPLETED, daemon.state.cause
        money: dict[str, Any] = daemon.status_dict()["money"]
        return money


def test_the_stopped_rate_is_the_providers_own_disk_figures(tmp_path: Path) -> None:
    money = money_after_run(
        tmp_path, {"disk_space": 100.0, "storage_cost": 0.15}, "storage_usd_per_gb_month = 0.5"
    )
    assert money["stopped_rate_source"] == "provider"
    assert money["stopped_usd_per_hour"] == pytest.approx(stopped_usd_per_hour(100.0, 0.15))


def test_without_provider_figures_the_rate_is_an_estimate_and_says_so(tmp_path: Path) -> None:
    money = money_after_run(
        tmp_path, {"disk_space": None, "storage_cost": None}, "storage_usd_per_gb_month = 0.2"
    )
    assert money["stopped_rate_source"] == "estimate"
    total = shutil.disk_usage(nearest_existing(tmp_path / "runs")).total
    assert money["stopped_usd_per_hour"] == pytest.approx(stopped_usd_per_hour(total / 1e9, 0.2))


def test_the_providers_disk_with_the_jobs_storage_price(tmp_path: Path) -> None:
    money = money_after_run(
        tmp_path, {"disk_space": 80.0, "storage_cost": None}, "storage_usd_per_gb_month = 0.3"
    )
    assert money["stopped_rate_source"] == "provider"
    assert money["stopped_usd_per_hour"] == pytest.approx(stopped_usd_per_hour(80.0, 0.3))
