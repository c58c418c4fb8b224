"""The dataset doctor beside the trainer (agent/daemon/doctor.py), with the real daemon, the real
``libreyolo doctor`` and the real ``libreyolo train`` on a tiny synthetic dataset."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from agent import demo
from agent.daemon.spine import Daemon
from agent.state import Reason
from tests.support import tiny_job, wait_for
from tests.test_daemon import env_for, history_phases, requires_libreyolo, run_daemon

pytestmark = pytest.mark.training


@requires_libreyolo
def test_by_default_the_doctor_runs_beside_the_trainer_and_its_errors_stop_it(
    tmp_path: Path,
) -> None:
    """The default (doctor_first = false): the trainer does not wait for the doctor's torch
    import; the doctor's errors stop it (or, if LibreYOLO fails first on the same broken data,
    explain its failure): reason preflight_failed, the doctor's findings in staging.json, one
    launch and no resume of a run that can only fail again."""
    data = demo.make_dataset(tmp_path / "ds")
    shutil.rmtree(tmp_path / "ds" / "images" / "val")
    job = tiny_job(tmp_path, data, sections="[dataset]\n", doctor=True, epochs=50)
    assert job.data_check.doctor and not job.data_check.doctor_first
    env = env_for(tmp_path)
    code, daemon, _ = asyncio.run(run_daemon(job, env))
    assert code == 0
    assert daemon.state.launch is not None  # the trainer did not wait for the doctor
    assert daemon.state.reason == Reason.PREFLIGHT_FAILED
    cause = daemon.state.cause or ""
    assert "libreyolo doctor found 1 error(s)" in cause
    assert "'val' path(s) do not exist" in cause
    phases = history_phases(env.state_dir)
    assert phases[:2] == ["STAGING", "TRAINING"] and phases[-2:] == ["TEARDOWN", "DONE"]
    assert not daemon.state.resumes
    report = json.loads((env.state_dir / "staging.json").read_text())
    assert report["ok"] is False
    assert any(f["check_id"] == "config.path_not_found" for f in report["findings"])
    log = (env.state_dir / "agent.log").read_text()
    assert "libreyolo doctor runs once the trainer has started" in log
    assert "libreyolo doctor started beside the trainer" in log
    assert log.count("trainer started pid=") == 1


@requires_libreyolo
def test_a_passing_doctor_beside_the_trainer_leaves_the_run_alone(tmp_path: Path) -> None:
    data = demo.make_dataset(tmp_path / "ds")
    job = tiny_job(tmp_path, data, sections="[dataset]\n", doctor=True, epochs=4)
    env = env_for(tmp_path)

    async def hold_until_the_doctor_passed(daemon: Daemon, *_: object) -> None:
        # The trainer waits (SIGSTOP) after its first epoch until the doctor's verdict is on
        # record: with one torch thread four tiny epochs outran the doctor's 5 s.
        await wait_for(lambda: daemon.status is not None and daemon.status.completed_epochs >= 1)
        assert daemon.trainer is not None
        os.kill(daemon.trainer.pid, signal.SIGSTOP)
        try:
            await wait_for(lambda: "doctor passed" in (env.state_dir / "agent.log").read_text())
        finally:
            os.kill(daemon.trainer.pid, signal.SIGCONT)

    code, daemon, _ = asyncio.run(run_daemon(job, env, hold_until_the_doctor_passed))
    assert code == 0
    assert daemon.state.reason == Reason.COMPLETED
    log = (env.state_dir / "agent.log").read_text()
    assert "libreyolo doctor runs once the trainer has started" in log
    # Started once the trainer's status.json was there (the run directory is found by it), so
    # the two never import torch at the same time.
    found = log.index("run directory: ")
    assert log.index("trainer started pid=") < found < log.index("libreyolo doctor started")
    # The doctor passed while the trainer ran (held above, so it could not end first).
    assert "doctor passed" in log
    report = json.loads((env.state_dir / "staging.json").read_text())
    assert report["ok"] is True
    assert report["data_check"]["doctor_status"] == "passed"


@requires_libreyolo
def test_a_doctor_still_running_when_the_job_ends_is_killed_not_left_behind(
    tmp_path: Path,
) -> None:
    """`agent stop` while the doctor still checks: the stop wins (stopped_by_user), and the
    doctor's process group is killed with the job, not left running on the box."""
    import aiohttp

    from tests.test_daemon import Probe

    data = demo.make_dataset(tmp_path / "ds")
    job = tiny_job(tmp_path, data, sections="[dataset]\n", doctor=True, epochs=50)
    env = env_for(tmp_path)
    seen: list[int] = []

    async def during(daemon: Daemon, probe: Probe, session: aiohttp.ClientSession) -> None:
        del probe, session
        await wait_for(lambda: daemon.doctor.procs, timeout=60)
        proc = daemon.doctor.procs[0]
        seen.append(proc.pid)
        assert proc.poll() is None  # still checking: the doctor imports torch first
        assert daemon.flags is not None
        daemon.flags.stop_job.set()

    code, daemon, _ = asyncio.run(run_daemon(job, env, during=during))
    assert code == 0
    assert seen
    assert daemon.state.reason == Reason.STOPPED_BY_USER
    assert daemon.doctor.procs[0].poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(seen[0], 0)  # the group is gone


def test_a_queued_doctor_starts_at_the_trainers_first_status_or_at_the_cap() -> None:
    """When the doctor starts (the decision alone; the real runs are above): at the trainer's
    first status.json, or DOCTOR_START_CAP_S after its launch for a trainer that has none yet,
    and once."""
    from agent.daemon.doctor import DOCTOR_START_CAP_S, DoctorBeside

    class Recorder(DoctorBeside):
        """Records the starts instead of starting ``libreyolo doctor`` (no run context used)."""

        def __init__(self) -> None:
            super().__init__(None)  # type: ignore[arg-type]
            self.started: list[object] = []

        def start(self, report: dict[str, object] | None) -> None:
            self.due = False
            self.started.append(report)

    slow = Recorder()
    slow.queue({"ok": True})
    slow.when_started(status_seen=False, since_launch_s=DOCTOR_START_CAP_S - 1)
    assert slow.started == []
    slow.when_started(status_seen=False, since_launch_s=DOCTOR_START_CAP_S)
    assert slow.started == [{"ok": True}]
    slow.when_started(status_seen=True, since_launch_s=0.0)
    assert len(slow.started) == 1
    quick = Recorder()
    quick.when_started(status_seen=True, since_launch_s=99.0)
    assert quick.started == []  # nothing queued: nothing starts
    quick.queue(None)
    quick.when_started(status_seen=True, since_launch_s=0.0)
    assert quick.started == [None]
