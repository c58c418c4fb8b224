"""Issue 25 items 4 and 5 through the real CLI (``python -m agent.cli run JOB``) against the fake
providers on 127.0.0.1, ``[preflight] enabled = false`` in every job: a sync target that cannot
be written and a key that is refused end the job as ``preflight_failed`` before any trainer
starts; RunPod's ``"auto"`` price comes from the v2 pod's ``cost`` and the job trains to its end
(the real ``libreyolo train``), then the pod is terminated."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.guard.plan import guard_pid
from agent.state import Phase, Reason, RunState, StateStore
from tests.fakes.providers import run_fake_runpod, run_fake_vast
from tests.support import tiny_job_text
from tests.test_daemon import dataset, requires_libreyolo

__all__ = ["dataset"]

VAST_KEY = "vast-instance-key-cli-0123456789"
RUNPOD_KEY = "runpod-key-cli-0123456789"


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """The agent's state directory; the guard an agent left behind is ended, pass or fail."""
    path = tmp_path / "state"
    yield path
    with contextlib.suppress(OSError, ValueError):
        pid = guard_pid(path)
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def job_file(tmp_path: Path, data: Path, sections: str) -> Path:
    job = tmp_path / "job.toml"
    job.write_text(tiny_job_text(tmp_path, data, epochs=1, sections=sections))
    return job


def run_cli(job: Path, state_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "LIBREYOLO_AGENT_CRASHPOINT"}
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "run", str(job)],
        env=dict(base, LIBREYOLO_AGENT_STATE_DIR=str(state_dir), **env),
        capture_output=True,
        text=True,
        timeout=400,
    )


def ended_before_training(state_dir: Path, check: str) -> RunState:
    state = StateStore(state_dir).load()
    assert state is not None and state.phase == Phase.DONE
    assert state.reason == Reason.PREFLIGHT_FAILED, state.cause
    assert state.cause is not None and check in state.cause
    assert state.trainer is None and state.launch is None  # no trainer was ever started
    return state


def test_cli_a_file_target_under_a_file_ends_the_job_before_training(
    tmp_path: Path, state_dir: Path
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    sections = f'[sync]\ntarget = "file://{blocker}/sub"\n[teardown]\nprovider = "none"\n'
    job = job_file(tmp_path, tmp_path / "nothere" / "data.yaml", sections)
    done = run_cli(job, state_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    ended_before_training(state_dir, "target.canary")
    assert "target.canary" in done.stderr and "cannot write there" in done.stderr
    assert not (tmp_path / "runs").exists()


def test_cli_a_refused_key_ends_the_job_before_training_naming_the_variable(
    tmp_path: Path, state_dir: Path
) -> None:
    wrong = "wrong-vast-key-cli-9876543210"
    with run_fake_vast(keys=set(), instance_keys={VAST_KEY: "1234"}) as vast:
        vast.add_instance("1234")
        sections = (
            f'[teardown]\nprovider = "vast"\napi_url = "{vast.url}"\n'
            'on_preflight_failure = "keep"\n'
        )
        job = job_file(tmp_path, tmp_path / "nothere" / "data.yaml", sections)
        done = run_cli(job, state_dir, CONTAINER_ID="1234", CONTAINER_API_KEY=wrong)
        assert done.returncode == 0, done.stderr[-3000:]
        state = ended_before_training(state_dir, "provider.vast")
        assert "CONTAINER_API_KEY" in (state.cause or "")
        assert wrong not in done.stderr + done.stdout
        assert vast.calls("show") and vast.mutations() == []


@pytest.mark.training
@requires_libreyolo
def test_cli_runpod_auto_price_is_the_pods_cost_and_the_job_trains(
    tmp_path: Path, state_dir: Path, dataset: Path
) -> None:
    with run_fake_runpod(keys={RUNPOD_KEY}) as runpod:
        runpod.add_instance("pod0abc", cost=0.74)  # the REST v2 Pod: `cost`, no costPerHr
        runpod.add_instance("other0pod", cost=0.74)
        sections = (
            f'[sync]\ntarget = "file://{tmp_path / "synced"}"\n'
            '[limits]\nprice_usd_per_hour = "auto"\nbudget_usd = 20\n'
            f'[teardown]\nprovider = "runpod"\napi_url = "{runpod.url}"\n'
        )
        job = job_file(tmp_path, dataset, sections)
        done = run_cli(job, state_dir, RUNPOD_POD_ID="pod0abc", RUNPOD_API_KEY=RUNPOD_KEY)
        assert done.returncode == 0, done.stderr[-3000:]
        state = StateStore(state_dir).load()
        assert state is not None and state.phase == Phase.DONE
        assert state.reason == Reason.COMPLETED, state.cause
        assert state.price_usd_per_hour == pytest.approx(0.74)
        assert state.teardown is not None and state.teardown["confirmed"] is True
        assert runpod.mutations() == [("DELETE", "/v2/pods/pod0abc", None)]
        assert runpod.instance("pod0abc") is None and runpod.instance("other0pod") is not None
        assert RUNPOD_KEY not in done.stderr
