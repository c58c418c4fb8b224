"""The teardown decision and its execution: the verified-sync gate on every destroy, a provider
without a stop, and the durable record requested -> sent -> confirmed across an agent's death.

The end-to-end cases run the real agent (and the real ``libreyolo train``) against the fake Vast
API on 127.0.0.1 (tests/fakes/providers.py), which records every request it gets.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent.config.model import Env, TeardownSection
from agent.daemon.spine import Daemon
from agent.events import Event
from agent.policy.teardown import decide
from agent.state import Phase, Reason, StateStore
from tests.fakes.providers import FakeVast, run_fake_vast
from tests.support import HANG_S, end_guard, tiny_job
from tests.test_daemon import dataset, requires_libreyolo

__all__ = ["dataset"]

KEY = "vast-instance-key-abcdefghij"


def cfg(**kw: object) -> TeardownSection:
    return TeardownSection(**kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ decide


@pytest.mark.parametrize(
    ("reason", "verified", "anything", "can_stop", "action"),
    [
        (Reason.COMPLETED, True, True, True, "destroy"),
        (Reason.COMPLETED, False, True, True, "stop"),  # the gate
        (Reason.COMPLETED, False, True, False, "keep"),  # no stop here: keep, never destroy
        (Reason.TRAINING_FAILED, False, True, True, "stop"),
        (Reason.TRAINING_FAILED, False, True, False, "keep"),
        (Reason.PREFLIGHT_FAILED, False, False, True, "destroy"),  # nothing to save
        (Reason.PREFLIGHT_FAILED, False, True, True, "stop"),  # a checkpoint exists
        (Reason.AGENT_FAILED, False, True, True, "stop"),
    ],
)
def test_every_destroy_passes_the_gate(
    reason: Reason, verified: bool, anything: bool, can_stop: bool, action: str
) -> None:
    d = decide(reason, cfg(), sync_verified=verified, anything_to_save=anything, can_stop=can_stop)
    assert d.action == action, d.why
    if action == "keep" and reason == Reason.COMPLETED:
        assert "KEPT" in d.why and "still billing" in d.why


def test_keep_stays_keep_and_a_verified_destroy_is_a_destroy() -> None:
    keep = cfg(on_success="keep")
    assert (
        decide(Reason.COMPLETED, keep, sync_verified=False, anything_to_save=True).action == "keep"
    )
    off = cfg(require_verified_sync=False)
    d = decide(Reason.COMPLETED, off, sync_verified=False, anything_to_save=True)
    assert d.action == "destroy"


# ------------------------------------------------------------------------------------ end to end


def vast_sections(fake: FakeVast, sync_target: str, extra_sync: str = "") -> str:
    return f"""
[sync]
target = "{sync_target}"
finish_timeout = "3s"
upload_timeout = "2s"
{extra_sync}
[teardown]
provider = "vast"
api_url = "{fake.url}"
require_restore_drill = false
"""


@pytest.mark.training
@requires_libreyolo
def test_an_unverifiable_sync_never_sends_a_destroy_and_stops_the_box(
    tmp_path: Path, dataset: Path
) -> None:
    # The target cannot be written once training starts (its folder becomes a file; the
    # canary before training found it writable): nothing can be verified, so the completed
    # run's destroy must become a stop, and the fake must never see a DELETE.
    blocker = tmp_path / "not-a-folder"
    blocker.mkdir()

    def block(event: Event) -> None:
        if event.kind == "phase" and event.data.get("to") == "STAGING":
            shutil.rmtree(blocker)
            blocker.write_text("x")

    with run_fake_vast(keys=set(), instance_keys={KEY: "1234"}) as fake:
        fake.add_instance("1234")
        fake.add_instance("999")
        job = tiny_job(
            tmp_path, dataset, epochs=1, sections=vast_sections(fake, f"file://{blocker}/sub")
        )
        env = Env(state_dir=tmp_path / "state", container_id="1234", container_api_key=KEY)
        daemon = Daemon(job, env, poll_interval_s=0.5)
        daemon.events.listen(block)
        code = asyncio.run(daemon.run())
        assert blocker.read_text() == "x"
        assert code == 0
        state = StateStore(env.state_dir).load()
        assert state is not None and state.reason == Reason.COMPLETED
        td = state.teardown
        assert td is not None and td["action"] == "stop", td
        assert "not verified" in td["why"]
        assert td["confirmed"] is True and td["instance_id"] == "1234"
        methods = [m for m, _, _ in fake.mutations()]
        assert "DELETE" not in methods
        assert methods == ["PUT"]
        assert all("/1234/" in path for _, path, _ in fake.mutations())
        assert fake.instance("999") is not None
        # The key is in no file the agent wrote (state, log, ledger, reports, guard plan).
        for path in env.state_dir.rglob("*"):
            if path.is_file():
                assert KEY not in path.read_text(errors="replace"), path


@pytest.mark.training
@requires_libreyolo
def test_agent_killed_between_sent_and_confirmed_never_sends_a_second_destroy(
    tmp_path: Path, dataset: Path, request: pytest.FixtureRequest
) -> None:
    with run_fake_vast(keys=set(), instance_keys={KEY: "1234"}) as fake:
        fake.add_instance("1234")
        fake.linger(3)  # accepted, still running for a few reads
        job = tmp_path / "job.toml"
        job.write_text(
            f"""
[job]
name = "run1"
runs_dir = "{tmp_path / "runs"}"
[train]
model = "yolox-n"
pretrained = false
data = "{dataset}"
epochs = 1
imgsz = 64
batch = 4
workers = 0
device = "cpu"
[dataset]
doctor = false
[preflight]
enabled = false
[server]
listen = "127.0.0.1:0"
{vast_sections(fake, f"file://{tmp_path / 'synced'}")}
"""
        )
        base = {k: v for k, v in os.environ.items() if k != "LIBREYOLO_AGENT_CRASHPOINT"}
        env = dict(
            base,
            LIBREYOLO_AGENT_STATE_DIR=str(tmp_path / "state"),
            CONTAINER_ID="1234",
            CONTAINER_API_KEY=KEY,
        )
        cmd = [sys.executable, "-m", "agent.cli", "run", str(job)]
        request.addfinalizer(lambda: end_guard(tmp_path / "state"))
        first = subprocess.run(
            cmd,
            env=dict(env, LIBREYOLO_AGENT_CRASHPOINT="teardown-sent"),
            capture_output=True,
            text=True,
            timeout=HANG_S,  # a hang's cap: the job trains for real (minutes at load ~10)
        )
        assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
        state = StateStore(tmp_path / "state").load()
        assert state is not None and state.phase == Phase.TEARDOWN
        assert state.teardown is not None and state.teardown.get("sent_at")
        assert state.teardown["action"] == "destroy"
        assert [m for m, _, _ in fake.mutations()] == ["DELETE"]

        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)
        assert second.returncode == 0, second.stderr[-3000:]
        assert "reading back only" in second.stderr
        assert KEY not in second.stderr + first.stderr
        state = StateStore(tmp_path / "state").load()
        assert state is not None and state.phase == Phase.DONE
        assert state.teardown is not None and state.teardown["confirmed"] is True
        assert [m for m, _, _ in fake.mutations()] == ["DELETE"]  # never a second one
        assert fake.instance("1234") is None
