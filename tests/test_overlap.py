"""Preflight and staging overlap (issue 15, billed seconds): the dataset is staged while the
GPU probe runs, once the disk and the Hub checks have passed - and never before they have.

The real preflight runs here: its probe imports this machine's (CPU) torch in a child process,
which takes seconds; the real fake Hub answers the dataset questions."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from pathlib import Path

import psutil

from agent.config.model import Env, Job, PreflightSection
from agent.daemon.spine import Daemon
from agent.state import StateStore
from tests.fakes.hub import run_fake_hub
from tests.support import HANG_S, HeldStage, post_stop, tiny_job, wait_for


def with_preflight(tmp: Path, data: Path, *, allow_cpu: bool, sections: str = "") -> Job:
    job = tiny_job(tmp, data, sections=sections)
    return dataclasses.replace(
        job, preflight=PreflightSection(enabled=True, allow_cpu=allow_cpu, timeout_s=120.0)
    )


def history(state_dir: Path) -> list[dict[str, object]]:
    st = StateStore(state_dir).load()
    assert st is not None
    return [h for h in st.history if "to" in h]


def test_dataset_is_staged_while_the_gpu_probe_runs(tmp_path: Path) -> None:
    job = with_preflight(tmp_path, tmp_path / "data.yaml", allow_cpu=True)
    env = Env(state_dir=tmp_path / "state")
    started: list[float] = []
    # Held until the stop has landed: a staging of a fixed second could end, under load,
    # before the test's stop did, and the job went on to train.
    staging = HeldStage()

    def hook() -> None:
        started.append(time.time())
        staging()

    base: dict[str, str] = {}

    def ready(daemon: Daemon) -> None:
        assert daemon.state.server is not None
        base["url"] = f"http://127.0.0.1:{daemon.state.server['port']}"

    async def main() -> int:
        daemon = Daemon(job, env, stage_hook=hook, on_ready=ready)
        task = asyncio.create_task(daemon.run())
        try:
            await wait_for(staging.started.is_set)
            await post_stop(base["url"], env.state_dir)  # staging began; nothing is to be trained
        finally:
            staging.release()
        return await task

    assert asyncio.run(main()) == 0
    steps = history(env.state_dir)
    assert [h["to"] for h in steps] == ["PREFLIGHT", "STAGING", "TEARDOWN", "DONE"]
    preflight_end = next(float(h["at"]) for h in steps if h["to"] == "STAGING")  # type: ignore[arg-type]
    assert len(started) == 1  # staged once, not again after the probe
    assert started[0] < preflight_end  # it ran while the probe was still running
    log = (env.state_dir / "agent.log").read_text()
    assert "staged and checked while the GPU probe runs" in log
    assert "preflight passed" in log
    # Stopped before training: the warm trainer that ran the probe was called off, untrained.
    found = re.search(r"warm start: trainer pid=(\d+) runs the GPU probe", log)
    assert found is not None
    pid = int(found.group(1))
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert (env.state_dir / "trainer-result.json").read_text() == ""


def test_a_failed_probe_does_not_wait_for_the_staging(tmp_path: Path) -> None:
    """Storage is fine, so staging starts; the probe then fails (no GPU, CPU not allowed): the
    teardown decision is taken at once, not after the (slow) staging."""
    job = with_preflight(tmp_path, tmp_path / "data.yaml", allow_cpu=False)
    train = dataclasses.replace(
        job.train, args=tuple((k, v) for k, v in job.train.args if k != "device")
    )
    job = dataclasses.replace(job, train=train)
    env = Env(state_dir=tmp_path / "state")
    ended: list[float] = []

    def hook() -> None:
        # A staging that ends only once the job is DONE (a fixed 8 s lost the race to a probe
        # slowed by load): a daemon that waited for the staging would never get there, and the
        # cap (a hang) would end it after DONE failed to come.
        end = time.monotonic() + HANG_S
        while time.monotonic() < end:
            with contextlib.suppress(OSError, ValueError):
                state = StateStore(env.state_dir).load()
                if state is not None and state.phase.value == "DONE":
                    break
            time.sleep(0.05)
        ended.append(time.time())

    async def main() -> tuple[int, Daemon]:
        daemon = Daemon(job, env, stage_hook=hook)
        return await daemon.run(), daemon

    code, daemon = asyncio.run(main())
    assert code == 0
    assert daemon.state.reason is not None and daemon.state.reason.value == "preflight_failed"
    assert "cuda.available" in (daemon.state.cause or "")
    steps = history(env.state_dir)
    assert [h["to"] for h in steps] == ["PREFLIGHT", "TEARDOWN", "DONE"]
    done_at = float(steps[-1]["at"])  # type: ignore[arg-type]
    assert ended and done_at < ended[0]  # DONE came while the staging still ran
    # The probe ran warm, in the trainer's own Python, which was called off untrained.
    log = (env.state_dir / "agent.log").read_text()
    found = re.search(r"warm start: trainer pid=(\d+) runs the GPU probe", log)
    assert found is not None, log[-2000:]
    pid = int(found.group(1))
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert (env.state_dir / "trainer-result.json").read_text() == ""
    assert "started pid" not in log


def test_a_dataset_the_hub_does_not_have_is_never_downloaded(tmp_path: Path) -> None:
    with run_fake_hub() as hub:
        hub.add_file("dataset", "org/ds", "other.tar", b"not the file the job names")
        sections = (
            f'[dataset]\nrepo = "org/ds"\nfile = "ds.tar"\ndest = "{tmp_path / "ds"}"\n'
            "doctor = false\n"
        )
        job = with_preflight(
            tmp_path, tmp_path / "ds" / "data.yaml", allow_cpu=True, sections=sections
        )
        env = Env(state_dir=tmp_path / "state", hf_endpoint=hub.url)
        code = asyncio.run(Daemon(job, env).run())
        requests = hub.requests
    assert code == 0
    st = StateStore(env.state_dir).load()
    assert st is not None and st.reason is not None
    assert st.reason.value == "preflight_failed"
    assert "dataset.remote" in (st.cause or "")
    asked = [r.path for r in requests]
    assert any("paths-info" in p for p in asked)  # the Hub was asked about it
    assert not any("/resolve/" in p for p in asked), asked  # but nothing was downloaded
    assert not (tmp_path / "ds").exists()
