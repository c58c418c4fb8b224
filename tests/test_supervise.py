"""Supervision that survives (agent/daemon/training.py, agent/policy/resume.py), daemon-level: the
whole agent
in-process, the scripted stand-in trainer as a real process (tests/fakes/scripted_launcher.py),
checkpoints synced to a ``file://`` target.

Each test drives the trainer to a known point with its scripted options (``pause_at`` is a
deterministic "now" inside a run: the trainer waits at the start of that epoch for ``RUN/.go``),
then asserts the exact outcome: reason, resumes, run dir, metrics and what reached the target.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import io
import json
import os
import signal
import sys
import time
import traceback
import zipfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent.config.model import Env, Job
from agent.daemon.spine import Daemon
from agent.state import Phase, Reason, StateStore
from agent.util import logutil
from agent.watch import disk as diskwatch
from tests.fakes.metadata import run_fake_imds
from tests.fakes.scripted_launcher import ScriptedLauncher
from tests.support import tiny_job, wait_for

#: Generous: a loaded 2-core machine; every wait is on a condition, never on a time.
WAIT_S = 60.0


@pytest.fixture(autouse=True)
def fresh_log_rate_limit() -> None:
    """Each test's agent.log says everything its own run logged: the rate limit on repeated
    warnings lives for the process, and an earlier test's identical line would hold it back."""
    logutil.rate_limit.reset()


class Clock:
    """The daemon's one clock, moved by hand (starts at the real time: the trainer's files and
    records carry real times)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def make_job(
    tmp: Path,
    *,
    epochs: int = 5,
    limits: str = "",
    sections: str = "",
    sync: bool = True,
    backoff: str = "0.01s",
) -> Job:
    data = tmp / "data.yaml"
    data.write_text("train: images\nval: images\nnames:\n  0: box\n")
    text = f'[sync]\ntarget = "file://{tmp / "synced"}"\n' if sync else ""
    # A resume waits (almost) nothing unless a test says otherwise: the job file refuses "0s".
    text += f'[limits]\nrestart_backoff = "{backoff}"\n{limits}\n{sections}'
    if "[teardown]" not in sections:
        # The scripted trainer's checkpoints are bytes, not models: a restore drill would fail
        # them and turn every destroy into a stop (tests/test_restore_drill.py drills real ones).
        text += "\n[teardown]\nrequire_restore_drill = false\n"
    return tiny_job(tmp, data, epochs=epochs, sections=text)


def where_it_waits() -> str:
    """Every asyncio task's stack and every thread's, for a run that hung."""
    out = io.StringIO()
    for t in asyncio.all_tasks():
        out.write(f"--- task {t.get_name()}\n")
        t.print_stack(limit=8, file=out)
    for ident, frame in sys._current_frames().items():
        out.write(f"--- thread {ident}\n{''.join(traceback.format_stack(frame, limit=8))}")
    return out.getvalue()


class Run:
    """One agent, in this loop, with the scripted launcher."""

    def __init__(
        self,
        tmp: Path,
        job: Job,
        launcher: ScriptedLauncher,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.tmp = tmp
        self.env = Env(state_dir=tmp / "state")
        self.launcher = launcher
        self.base = ""
        self.shutdown = asyncio.Event()
        self.daemon = Daemon(
            job,
            self.env,
            launcher=launcher,
            clock=clock,
            poll_interval_s=0.1,
            on_ready=self._ready,
        )

    def _ready(self, daemon: Daemon) -> None:
        assert daemon.state.server is not None
        self.base = f"http://127.0.0.1:{daemon.state.server['port']}"

    @property
    def run_dir(self) -> Path:
        return self.tmp / "runs" / "run1"

    async def main(self, during: Callable[[Run], Coroutine[Any, Any, None]] | None = None) -> int:
        task = asyncio.create_task(self.daemon.run(shutdown_trigger=self.shutdown))
        side = asyncio.create_task(during(self)) if during is not None else None
        try:
            try:
                code = await asyncio.wait_for(asyncio.shield(task), WAIT_S)
            except TimeoutError:
                # A run that should take a second hung: say where each task and thread waits
                # (seen once under load: test_new_box, epoch 5's milestone never queued).
                raise TimeoutError(f"the run took over {WAIT_S:.0f}s\n{where_it_waits()}") from None
        finally:
            if side is not None and not side.done():
                side.cancel()
            if not task.done():
                self.shutdown.set()
                await asyncio.wait_for(task, WAIT_S)
        if side is not None and side.done() and not side.cancelled():
            side.result()  # a failed assertion beside the daemon fails the test
        return code

    def go(self, during: Callable[[Run], Coroutine[Any, Any, None]] | None = None) -> int:
        return asyncio.run(self.main(during))

    def trainer_pid(self) -> int:
        assert self.daemon.trainer is not None
        return self.daemon.trainer.pid

    async def paused(self) -> None:
        """The trainer waits at the start of its ``pause_at`` epoch."""
        await wait_for(lambda: (self.run_dir / ".paused").exists(), WAIT_S)

    def resume_trainer(self) -> None:
        (self.run_dir / ".go").write_text("go\n")

    async def post(self, action: str, body: str = "") -> dict[str, Any]:
        token = (self.env.state_dir / "token").read_text().strip()
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{self.base}/{action}", data=body, headers={"Authorization": f"Bearer {token}"}
            ) as r,
        ):
            answer: dict[str, Any] = await r.json()
            assert r.status == 200, answer
            return answer

    async def get_status(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as session, session.get(f"{self.base}/status") as r:
            assert r.status == 200
            doc: dict[str, Any] = await r.json()
            return doc

    def log(self) -> str:
        return (self.env.state_dir / "agent.log").read_text()


def ckpt_epoch(path: Path) -> int:
    with zipfile.ZipFile(path) as zf:
        return int(json.loads(zf.read("archive/data.pkl"))["epoch"])


def metrics_epochs(path: Path) -> list[int]:
    return [json.loads(line)["epoch"] for line in path.read_text().splitlines() if line.strip()]


def resumes(daemon: Daemon) -> list[tuple[str, int]]:
    return [(r["kind"], r["epoch"]) for r in daemon.state.resumes]


def history(state_dir: Path) -> list[str]:
    state = StateStore(state_dir).load()
    assert state is not None
    return [h["to"] for h in state.history if "to" in h]


def assert_completed_in_one_run_dir(run: Run, epochs: int) -> None:
    """Completed in ``runs/run1`` (no ``run12``), every epoch once, the final last.pt synced."""
    daemon = run.daemon
    assert daemon.state.reason == Reason.COMPLETED, daemon.state.cause
    assert daemon.state.phase == Phase.DONE
    assert sorted(p.name for p in (run.tmp / "runs").iterdir()) == ["run1"]
    assert daemon.run_dir == run.run_dir
    assert metrics_epochs(run.run_dir / "metrics.jsonl") == list(range(1, epochs + 1))
    synced = run.tmp / "synced"
    assert metrics_epochs(synced / "metrics.jsonl") == list(range(1, epochs + 1))
    assert ckpt_epoch(synced / "weights" / "last.pt") == epochs
    assert (synced / "weights" / "last.pt").read_bytes() == (
        run.run_dir / "weights" / "last.pt"
    ).read_bytes()
    assert json.loads((synced / "status.json").read_text())["state"] == "completed"
    assert daemon.sync is not None and daemon.sync.verify_result is not None
    assert daemon.sync.verify_result.sync_verified


def assert_resumed_from_last_pt(run: Run, launches: int) -> None:
    """Every launch after the first resumed ``runs/run1`` from its own last.pt, in place."""
    argvs = run.launcher.launched
    assert len(argvs) == launches
    assert "resume=true" not in argvs[0]
    for argv in argvs[1:]:
        assert "resume=true" in argv
        assert f"model={run.run_dir / 'weights' / 'last.pt'}" in argv
        assert f"project={run.run_dir.parent}" in argv and "name=run1" in argv
        assert "exist_ok=true" in argv and "epochs=5" in argv


# ------------------------------------------------------------------------------ crashes


def test_a_transient_crash_is_resumed_from_last_pt_in_the_same_run_dir(tmp_path: Path) -> None:
    run = Run(tmp_path, make_job(tmp_path), ScriptedLauncher(epoch_s=0.1, fail_once_at=3))
    assert run.go() == 0
    daemon = run.daemon
    assert resumes(daemon) == [("runtime", 2)]
    assert daemon.state.resumes[0]["message"] == "Training failed: boom"
    assert_resumed_from_last_pt(run, launches=2)
    assert_completed_in_one_run_dir(run, 5)
    # The resumed trainer is followed as this agent's child: its own exit code, not a guess.
    assert daemon.state.outcome == {
        "kind": "completed",
        "exit_code": 0,
        "message": "training completed",
    }
    assert "resume 1/3 after runtime at epoch 2: relaunching in 0s" in run.log()


def test_the_same_failure_at_the_same_epoch_twice_is_deterministic_and_not_retried(
    tmp_path: Path,
) -> None:
    run = Run(tmp_path, make_job(tmp_path), ScriptedLauncher(epoch_s=0.1, fail_at=3))
    assert run.go() == 0
    daemon = run.daemon
    assert daemon.state.reason == Reason.TRAINING_FAILED
    assert resumes(daemon) == [("runtime", 2)]
    assert_resumed_from_last_pt(run, launches=2)
    cause = daemon.state.cause or ""
    assert "the same failure at the same epoch twice (runtime at epoch 2" in cause
    assert "deterministic, not retrying" in cause
    assert daemon.state.outcome == {
        "kind": "runtime",
        "exit_code": 1,
        "message": "Training failed: boom",
    }
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["run1"]
    assert metrics_epochs(run.run_dir / "metrics.jsonl") == [1, 2]
    assert ckpt_epoch(tmp_path / "synced" / "weights" / "last.pt") == 2
    assert daemon.state.teardown is not None and daemon.state.teardown["action"] == "stop"


def test_a_config_error_is_never_resumed(tmp_path: Path) -> None:
    run = Run(tmp_path, make_job(tmp_path), ScriptedLauncher(epoch_s=0.1, fail_at=2, exit_code=2))
    assert run.go() == 0
    daemon = run.daemon
    assert daemon.state.reason == Reason.TRAINING_FAILED
    assert daemon.state.resumes == []
    assert len(run.launcher.launched) == 1
    assert daemon.state.outcome is not None and daemon.state.outcome["kind"] == "config"
    assert "not resumed: a restart cannot fix a config error" in (daemon.state.cause or "")
    assert ckpt_epoch(tmp_path / "synced" / "weights" / "last.pt") == 1


def test_max_restarts_zero_means_no_resume(tmp_path: Path) -> None:
    job = make_job(tmp_path, limits="max_restarts = 0")
    run = Run(tmp_path, job, ScriptedLauncher(epoch_s=0.1, fail_once_at=3))
    assert run.go() == 0
    daemon = run.daemon
    assert daemon.state.reason == Reason.TRAINING_FAILED
    assert daemon.state.resumes == []
    assert len(run.launcher.launched) == 1
    assert "not resumed: gave up after 0 resume(s) (limits.max_restarts = 0)" in (
        daemon.state.cause or ""
    )
    assert metrics_epochs(run.run_dir / "metrics.jsonl") == [1, 2]


def test_a_trainer_that_dies_before_its_run_dir_exists_is_relaunched_by_the_jobs_launcher(
    tmp_path: Path,
) -> None:
    # Seen in review: a trainer that died before its first status.json was started over with
    # `libreyolo train` (build_argv) whatever the launcher was.
    run = Run(tmp_path, make_job(tmp_path), ScriptedLauncher(epoch_s="not-a-number"))
    assert run.go() == 0
    daemon = run.daemon
    assert daemon.state.reason == Reason.TRAINING_FAILED
    assert resumes(daemon) == [("runtime", 0)]
    first, second = run.launcher.launched
    assert second == first
    assert "deterministic, not retrying" in (daemon.state.cause or "")
    assert not (tmp_path / "runs" / "run1").exists()


def test_a_run_dir_left_with_no_checkpoint_is_trained_in_not_beside(tmp_path: Path) -> None:
    # A trainer of this job that ended before its first save and was never read back (its
    # pid unrecorded) leaves runs/run1 with a log and no weights: the next launch trains in
    # it (exist_ok=true) instead of LibreYOLO making run12 beside it.
    left = tmp_path / "runs" / "run1"
    (left / "weights").mkdir(parents=True)
    (left / "train.log").write_text("started\n")
    run = Run(tmp_path, make_job(tmp_path), ScriptedLauncher(epoch_s=0.05))
    assert run.go() == 0
    (argv,) = run.launcher.launched
    assert "name=run1" in argv and "exist_ok=true" in argv and "resume=true" not in argv
    assert_completed_in_one_run_dir(run, 5)
    log = (tmp_path / "state" / "agent.log").read_text()
    assert "already there with no checkpoint" in log


def test_a_run_dir_holding_checkpoints_is_never_trained_over(tmp_path: Path) -> None:
    # Another run's checkpoints in runs/run1 (no record of it in this state dir): the launch
    # is the plain one, and LibreYOLO's own rule puts the new run beside it.
    kept = tmp_path / "runs" / "run1" / "weights" / "last.pt"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"an earlier run's weights")
    run = Run(tmp_path, make_job(tmp_path), ScriptedLauncher(epoch_s=0.05))
    assert run.go() == 0
    (argv,) = run.launcher.launched
    assert "exist_ok=true" not in argv
    assert kept.read_bytes() == b"an earlier run's weights"


def wait_for_first_crash(run: Run) -> Coroutine[Any, Any, None]:
    async def crashed() -> None:
        await wait_for(
            lambda: run.daemon.trainer is not None and run.daemon.trainer.exit_code == 1, WAIT_S
        )

    return crashed()


def test_a_stop_request_during_the_backoff_ends_the_run_without_a_relaunch(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, backoff="1h")
    run = Run(tmp_path, job, ScriptedLauncher(epoch_s=0.1, fail_once_at=3))

    async def during(run: Run) -> None:
        await wait_for_first_crash(run)
        await run.post("stop")

    assert run.go(during) == 0
    daemon = run.daemon
    assert daemon.state.reason == Reason.STOPPED_BY_USER
    assert daemon.state.resumes == []
    assert len(run.launcher.launched) == 1
    assert (daemon.state.cause or "").endswith("; stop requested before the resume")
    assert ckpt_epoch(tmp_path / "synced" / "weights" / "last.pt") == 2


def test_an_agent_stopped_during_the_backoff_leaves_the_resume_to_the_next_agent(
    tmp_path: Path,
) -> None:
    # Seen in review: an agent asked to exit while it waited to resume ended the run as
    # training_failed and tore the box down; the next agent would have trained from scratch.
    first = Run(
        tmp_path,
        make_job(tmp_path, backoff="1h"),
        ScriptedLauncher(epoch_s=0.1, fail_once_at=3),
    )

    async def during(run: Run) -> None:
        await wait_for_first_crash(run)
        run.shutdown.set()

    assert first.go(during) == 0
    state = StateStore(first.env.state_dir).load()
    assert state is not None
    assert state.phase == Phase.TRAINING and state.reason is None and state.teardown is None
    assert state.resumes == []
    assert state.trainer is not None and state.trainer.run_dir == str(first.run_dir)

    second = Run(tmp_path, make_job(tmp_path), ScriptedLauncher(epoch_s=0.1))
    assert second.go() == 0
    assert resumes(second.daemon) == [("runtime", 2)]
    assert len(second.launcher.launched) == 1 and "resume=true" in second.launcher.launched[0]
    assert_completed_in_one_run_dir(second, 5)


def test_a_trainer_killed_with_sigkill_is_resumed(tmp_path: Path) -> None:
    run = Run(tmp_path, make_job(tmp_path), ScriptedLauncher(epoch_s=0.1, pause_at=3))
    seen: dict[str, int] = {}

    async def during(run: Run) -> None:
        await run.paused()  # epochs 1 and 2 done, epoch 3 not begun
        seen["pid"] = run.trainer_pid()
        os.kill(seen["pid"], signal.SIGKILL)  # the OOM killer, or a person
        run.resume_trainer()  # the resumed trainer does not pause again

    assert run.go(during) == 0
    daemon = run.daemon
    assert resumes(daemon) == [("killed", 2)]
    assert "SIGKILL" in daemon.state.resumes[0]["message"]
    assert_resumed_from_last_pt(run, launches=2)
    assert_completed_in_one_run_dir(run, 5)
    assert daemon.state.trainer is not None and daemon.state.trainer.pid != seen["pid"]


def test_a_sigint_sent_by_someone_else_is_a_stop_and_not_resumed(tmp_path: Path) -> None:
    run = Run(tmp_path, make_job(tmp_path), ScriptedLauncher(epoch_s=0.1, pause_at=3))

    async def during(run: Run) -> None:
        await run.paused()
        os.kill(run.trainer_pid(), signal.SIGINT)  # Ctrl-C in the trainer's terminal

    assert run.go(during) == 0
    daemon = run.daemon
    assert daemon.state.resumes == []
    assert len(run.launcher.launched) == 1
    assert daemon.state.outcome == {
        "kind": "interrupted",
        "exit_code": 130,
        "message": "stopped with SIGINT",
    }
    assert "not resumed: the trainer was stopped with SIGINT by someone else: a stop" in (
        daemon.state.cause or ""
    )
    assert daemon.state.phase == Phase.DONE
    assert ckpt_epoch(tmp_path / "synced" / "weights" / "last.pt") == 2


# ------------------------------------------------------------------------------ stalls


def test_a_stall_is_caught_resumed_and_a_second_stall_at_the_same_epoch_ends_the_run(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, limits='stall_timeout = "2s"\nfirst_epoch_timeout = "5s"')
    run = Run(tmp_path, job, ScriptedLauncher(epoch_s=0.1, hang_at=3))
    assert run.go() == 0
    daemon = run.daemon
    assert daemon.state.reason == Reason.STALLED
    assert resumes(daemon) == [("stalled", 2)]
    assert_resumed_from_last_pt(run, launches=2)
    cause = daemon.state.cause or ""
    assert cause.startswith("stalled: no training progress for ")
    assert "not resumed: the same failure at the same epoch twice (stalled at epoch 2" in cause
    # Stopped by the agent (SIGINT, LibreYOLO's clean stop), not killed.
    assert daemon.state.outcome == {
        "kind": "interrupted",
        "exit_code": 130,
        "message": "stopped with SIGINT",
    }
    assert daemon.trainer is not None and daemon.trainer.exit_code == 130
    log = run.log()
    assert log.count("uploading what exists, then stopping the trainer") == 2
    assert log.count("trainer stopped (SIGINT)") == 2
    assert ckpt_epoch(tmp_path / "synced" / "weights" / "last.pt") == 2
    assert metrics_epochs(run.run_dir / "metrics.jsonl") == [1, 2]


def test_a_slow_trainer_whose_log_moves_is_never_stalled(tmp_path: Path) -> None:
    # Each epoch takes longer than the stall threshold; only the progress bar (trainer.log)
    # shows it is working, as tqdm does. stall_epoch_factor = 1: the steady threshold is the
    # mean epoch itself, so the second epoch relies on the log too.
    job = make_job(
        tmp_path,
        epochs=2,
        limits='stall_timeout = "2s"\nfirst_epoch_timeout = "2s"\nstall_epoch_factor = 1',
    )
    run = Run(tmp_path, job, ScriptedLauncher(epoch_s=2.5, log_every_s=0.2))
    assert run.go() == 0
    daemon = run.daemon
    assert daemon.state.reason == Reason.COMPLETED, daemon.state.cause
    assert daemon.state.resumes == []
    assert len(run.launcher.launched) == 1
    assert "stalled" not in run.log()
    assert "epoch 2/2:" in (run.env.state_dir / "trainer.log").read_text()
    assert daemon.progress is not None
    assert daemon.progress.snapshot()["signals"]["log"]["moved_at"] is not None
    assert metrics_epochs(run.run_dir / "metrics.jsonl") == [1, 2]


# ------------------------------------------------------------------------------ preemption


def preemption_job(tmp: Path, url: str) -> Job:
    # last.pt is a milestone only at the end (every_epochs = 10): what reaches the target
    # after a notice was sent because of the notice.
    return make_job(
        tmp,
        sections=f'[preemption]\naws = true\ngcp = false\naws_url = "{url}"\n'
        'poll_interval = "1s"\n',
    )


def every_10(job: Job) -> Job:
    assert job.sync is not None
    return dataclasses.replace(job, sync=dataclasses.replace(job.sync, every_epochs=10))


def last_pt_verified(run: Run) -> bool:
    sync = run.daemon.sync
    assert sync is not None
    return sync.is_verified(run.run_dir / "weights" / "last.pt")


def test_a_preemption_notice_saves_last_pt_stops_the_trainer_and_the_survivor_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agent.daemon.preempted.PREEMPT_SURVIVAL_S", 0.5)
    seen: dict[str, Any] = {}
    with run_fake_imds() as imds:
        job = every_10(preemption_job(tmp_path, imds.url))
        run = Run(tmp_path, job, ScriptedLauncher(epoch_s=0.1, pause_at=3))

        async def during(run: Run) -> None:
            await run.paused()
            assert not (tmp_path / "synced" / "weights" / "last.pt").exists()
            # The action time long past and the box still here: it survived the notice.
            imds.notice("terminate", time="2020-01-01T00:00:00Z")
            await wait_for(lambda: run.daemon.state.preempted is not None, WAIT_S)
            seen["preempted"] = dict(run.daemon.state.preempted or {})
            seen["phase"] = run.daemon.state.phase
            trainer = run.daemon.trainer
            assert trainer is not None
            await wait_for(lambda: trainer.exit_code is not None, WAIT_S)
            seen["exit_code"] = trainer.exit_code
            await wait_for(lambda: last_pt_verified(run), WAIT_S)
            seen["synced_epoch"] = ckpt_epoch(tmp_path / "synced" / "weights" / "last.pt")
            run.resume_trainer()

        assert run.go(during) == 0
    daemon = run.daemon
    assert seen["preempted"]["source"] == "aws"
    assert "AWS spot instance-action: terminate" in seen["preempted"]["message"]
    assert seen["phase"] == Phase.TRAINING  # not torn down
    assert seen["exit_code"] == 130  # stopped cleanly with SIGINT
    assert seen["synced_epoch"] == 2
    assert resumes(daemon) == [("preempted", 2)]
    assert daemon.state.preempted is None  # handled: the resumed run is a plain run again
    assert_resumed_from_last_pt(run, launches=2)
    assert_completed_in_one_run_dir(run, 5)
    log = run.log()
    assert "preempted: last.pt saved (epoch 2, verified on the target)" in log
    assert "the box survived the preemption notice; resuming training on it" in log


def test_an_agent_stopped_after_a_notice_leaves_a_resumable_state_and_the_next_resumes(
    tmp_path: Path,
) -> None:
    with run_fake_imds() as imds:
        job = every_10(preemption_job(tmp_path, imds.url))
        first = Run(tmp_path, job, ScriptedLauncher(epoch_s=0.1, pause_at=3))

        async def during(run: Run) -> None:
            await run.paused()
            imds.notice("terminate")  # two minutes from now: the agent waits for the end
            await wait_for(lambda: run.daemon.state.preempted is not None, WAIT_S)
            await wait_for(lambda: last_pt_verified(run), WAIT_S)
            run.shutdown.set()  # the box is going: the agent is stopped meanwhile

        assert first.go(during) == 0
        state = StateStore(first.env.state_dir).load()
        assert state is not None
        assert state.phase == Phase.TRAINING and state.reason is None
        assert state.preempted is not None and state.preempted["source"] == "aws"
        assert state.outcome == {
            "kind": "interrupted",
            "exit_code": 130,
            "message": "stopped with SIGINT",
        }
        assert state.teardown is None
        assert ckpt_epoch(tmp_path / "synced" / "weights" / "last.pt") == 2

        imds.clear()  # the next boot: no notice
        second = Run(tmp_path, job, ScriptedLauncher(epoch_s=0.1))
        assert second.go() == 0
    assert resumes(second.daemon) == [("preempted", 2)]
    assert [argv for argv in second.launcher.launched if "resume=true" in argv] == (
        second.launcher.launched
    )
    assert len(second.launcher.launched) == 1
    assert_completed_in_one_run_dir(second, 5)


def test_sigterm_declared_a_notice_saves_last_pt_and_exits_and_the_next_agent_resumes(
    tmp_path: Path,
) -> None:
    job = every_10(
        make_job(tmp_path, sections="[preemption]\naws = false\ngcp = false\nsigterm = true\n")
    )
    first = Run(tmp_path, job, ScriptedLauncher(epoch_s=0.1, pause_at=3))

    async def during(run: Run) -> None:
        await run.paused()
        run.daemon.control.sigterm_notice()  # what the SIGTERM handler calls

    assert first.go(during) == 0  # the agent exits by itself
    state = StateStore(first.env.state_dir).load()
    assert state is not None
    assert state.phase == Phase.TRAINING and state.reason is None
    assert state.preempted is not None and state.preempted["source"] == "sigterm"
    assert state.outcome is not None and state.outcome["exit_code"] == 130
    assert ckpt_epoch(tmp_path / "synced" / "weights" / "last.pt") == 2
    log = first.log()
    assert "preempted: last.pt saved (epoch 2, verified on the target)" in log
    assert "preempted: the agent exits and the next boot resumes" in log

    second = Run(tmp_path, job, ScriptedLauncher(epoch_s=0.1))
    assert second.go() == 0
    assert resumes(second.daemon) == [("preempted", 2)]
    assert_completed_in_one_run_dir(second, 5)


def test_a_save_now_labels_last_pt_with_the_epoch_status_json_says_now(tmp_path: Path) -> None:
    """A notice or a stall saves last.pt as it is on disk: its label is the epoch status.json
    says at that moment, not the agent's last poll of it (seen in the suite: a trainer that had
    written epoch 2 while the poll still said 1 was saved, verified and reported as epoch 1)."""
    job = every_10(make_job(tmp_path))
    run = Run(tmp_path, job, ScriptedLauncher(epoch_s=0.1, pause_at=3))
    seen: dict[str, Any] = {}

    async def during(run: Run) -> None:
        await run.paused()  # epoch 2's last.pt and status.json are written
        sync = run.daemon.sync
        assert sync is not None and run.daemon.status is not None
        # The poll that has not read epoch 2 yet, which the scheduler makes now and then.
        run.daemon.status = dataclasses.replace(run.daemon.status, completed_epochs=1)
        await run.daemon.ctx.save_now()
        await sync.drain(WAIT_S)
        seen["saved"] = sync.verified_remote("weights/last.pt")
        run.resume_trainer()

    assert run.go(during) == 0
    saved = seen["saved"]
    assert saved is not None, "last.pt was not verified on the target after the save"
    assert saved.epoch == 2
    assert ckpt_epoch(tmp_path / "synced" / "weights" / "last.pt") == 5  # the final sync's


# ------------------------------------------------------------------------------ hung at exit


def test_a_trainer_hung_after_completing_is_killed_and_the_run_counts_as_completed(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, epochs=2, limits='exit_grace = "2s"')
    run = Run(tmp_path, job, ScriptedLauncher(epoch_s=0.1, hang_after_complete=True))
    assert run.go() == 0
    daemon = run.daemon
    assert daemon.state.reason == Reason.COMPLETED, daemon.state.cause
    assert daemon.state.resumes == []
    assert daemon.training.hung_at_exit
    assert daemon.state.outcome is not None
    assert daemon.state.outcome["kind"] == "completed"
    assert daemon.state.outcome["message"] == "training completed; killed while hung at exit"
    assert daemon.trainer is not None and daemon.trainer.exit_code is not None
    assert "has not exited in 2s: killing it (hung at exit)" in run.log()
    assert ckpt_epoch(tmp_path / "synced" / "weights" / "last.pt") == 2


# ------------------------------------------------------------------------------ steering


def test_hold_during_training_parks_the_run_in_held_until_release(tmp_path: Path) -> None:
    clock = Clock()
    run = Run(tmp_path, make_job(tmp_path), ScriptedLauncher(epoch_s=0.1, pause_at=3), clock=clock)
    seen: dict[str, Any] = {}

    async def during(run: Run) -> None:
        await run.paused()
        answer = await run.post("hold")
        assert answer["phase"] == "TRAINING" and answer["hold"]["active"] is True
        run.resume_trainer()
        await wait_for(lambda: run.daemon.state.phase == Phase.HELD, WAIT_S)
        seen["held"] = await run.get_status()
        seen["teardown_while_held"] = run.daemon.state.teardown
        await run.post("release")

    assert run.go(during) == 0
    daemon = run.daemon
    assert seen["held"]["phase"] == "HELD"
    assert seen["held"]["reason"] == "completed"
    assert seen["teardown_while_held"] is None  # nothing torn down while held
    assert history(run.env.state_dir)[-5:] == ["FINISHING", "TEARDOWN", "HELD", "TEARDOWN", "DONE"]
    assert [h.get("note") for h in daemon.state.history if h.get("from") == "HELD"] == ["released"]
    assert daemon.state.teardown is not None and daemon.state.teardown["action"] == "destroy"
    assert_completed_in_one_run_dir(run, 5)


def test_a_hold_ends_by_itself_at_its_timeout(tmp_path: Path) -> None:
    clock = Clock()
    run = Run(tmp_path, make_job(tmp_path), ScriptedLauncher(epoch_s=0.1, pause_at=3), clock=clock)

    async def during(run: Run) -> None:
        await run.paused()
        answer = await run.post("hold", "1s")
        assert answer["hold"]["until"] == clock.now + 1.0
        run.resume_trainer()
        await wait_for(lambda: run.daemon.state.phase == Phase.HELD, WAIT_S)
        assert run.daemon.state.teardown is None
        clock.now += 1.5  # the hold's second passes

    assert run.go(during) == 0
    daemon = run.daemon
    assert history(run.env.state_dir)[-4:] == ["TEARDOWN", "HELD", "TEARDOWN", "DONE"]
    assert [h.get("note") for h in daemon.state.history if h.get("from") == "HELD"] == [
        "hold timed out"
    ]
    assert daemon.state.reason == Reason.COMPLETED
    assert daemon.state.teardown is not None and daemon.state.teardown["action"] == "destroy"


@pytest.mark.parametrize("extended", [True, False])
def test_extend_moves_the_deadline_and_the_run_goes_past_the_old_one(
    tmp_path: Path, extended: bool
) -> None:
    # The control (not extended) proves the clock really passed the old deadline.
    clock = Clock()
    job = make_job(tmp_path, limits='max_runtime = "1h"\nfinish_reserve = "1m"')
    run = Run(tmp_path, job, ScriptedLauncher(epoch_s=0.1, pause_at=2), clock=clock)
    seen: dict[str, Any] = {}

    async def during(run: Run) -> None:
        await run.paused()
        old = (await run.get_status())["limits"]["max_runtime_at"]
        assert old == run.daemon.state.started_at + 3600.0
        if extended:
            answer = await run.post("extend", "1h")
            assert answer["deadline_at"] == old + 3600.0
        seen["limits"] = (await run.get_status())["limits"]
        clock.now = old + 60.0  # a minute past the old deadline
        if not extended:
            return
        turns = run.daemon.training.loop_turns
        await wait_for(lambda: run.daemon.training.loop_turns >= turns + 5, WAIT_S)
        assert run.daemon.state.phase == Phase.TRAINING
        assert run.daemon.trainer is not None and run.daemon.trainer.exit_code is None
        assert run.daemon.breach_message is None
        run.resume_trainer()

    assert run.go(during) == 0
    daemon = run.daemon
    started = daemon.state.started_at
    if extended:
        assert seen["limits"]["max_runtime_at"] == started + 7200.0
        assert seen["limits"]["stop_training_at"] == started + 7200.0 - 60.0
        assert daemon.state.extended_s == 3600.0
        assert_completed_in_one_run_dir(run, 5)
    else:
        assert seen["limits"]["max_runtime_at"] == started + 3600.0
        assert daemon.state.reason == Reason.TIMEOUT
        assert (daemon.state.cause or "").startswith("max_runtime 1h reached after 1h1m")
        assert metrics_epochs(run.run_dir / "metrics.jsonl") == [1]


# ------------------------------------------------------------------------------ disk


LOW = 1 << 20  # 1 MiB: under what the next checkpoint needs (at least 64 MiB)
PLENTY = 1 << 40


class FakeDisk:
    """The free space the run's disk check reads (a full disk cannot be made without root);
    the pruning and the verdict around it are the real ones. ``full`` says when it is full."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, full: Callable[[], bool]) -> None:
        self.on = False
        #: The completed epochs of the status each read followed (None: read before the run
        #: was known here): the daemon checks the disk once per status change it sees, and two
        #: epochs done between two of its reads are one change.
        self.checked: list[int | None] = []
        self.run: Run | None = None
        self._full = full
        real = diskwatch.check_disk
        monkeypatch.setattr(diskwatch, "check_disk", functools.partial(real, free_bytes=self.free))

    def free(self, _path: Path) -> int:
        status = self.run.daemon.ctx.status if self.run is not None else None
        self.checked.append(None if status is None else status.completed_epochs)
        return LOW if self.on and self._full() else PLENTY

    async def fill_after_epoch_2(self, run: Run) -> None:
        """Full from epoch 3 on, once epoch_2.pt (save_period = 2) is verified off the box."""
        self.run = run
        await run.paused()  # epochs 1 and 2 done, epoch 3 waits
        sync = run.daemon.sync
        assert sync is not None
        await wait_for(lambda: sync.is_verified(run.run_dir / "weights" / "epoch_2.pt"), WAIT_S)
        # The check after epoch 2 is over (seen under load: epochs 1 and 2 as one change, one
        # check): the next one is after epoch 3.
        await wait_for(lambda: 2 in self.checked, WAIT_S)
        assert max(epoch or 0 for epoch in self.checked) == 2
        self.on = True
        run.resume_trainer()


def test_a_full_disk_is_made_room_on_by_pruning_verified_epoch_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = tmp_path / "runs" / "run1" / "weights"
    disk = FakeDisk(monkeypatch, lambda: (weights / "epoch_2.pt").exists())  # full until pruned
    launcher = ScriptedLauncher(epoch_s=0.1, save_period=2, pause_at=3)
    run = Run(tmp_path, make_job(tmp_path), launcher)
    assert run.go(disk.fill_after_epoch_2) == 0
    assert disk.on
    assert not (weights / "epoch_2.pt").exists()
    assert ckpt_epoch(tmp_path / "synced" / "weights" / "epoch_2.pt") == 2  # still off the box
    assert ckpt_epoch(weights / "epoch_4.pt") == 4
    assert "disk: removed epoch_2.pt (epoch 2" in run.log()
    assert run.daemon.disk_stop is None
    assert_completed_in_one_run_dir(run, 5)


def test_a_disk_still_full_after_pruning_stops_the_run_as_disk_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = FakeDisk(monkeypatch, lambda: True)
    # hang_at = 4: epoch 4 never ends by itself, so only the agent's stop ends the run there.
    launcher = ScriptedLauncher(epoch_s=0.1, save_period=2, pause_at=3, hang_at=4)
    run = Run(tmp_path, make_job(tmp_path), launcher)
    assert run.go(disk.fill_after_epoch_2) == 0
    daemon = run.daemon
    weights = run.run_dir / "weights"
    assert daemon.state.reason == Reason.DISK_FULL
    assert daemon.state.resumes == []
    assert len(launcher.launched) == 1
    cause = daemon.state.cause or ""
    assert cause.startswith("disk full: 1.0 MiB free on the disk of ")
    assert "removed 1 verified epoch_N.pt, kept last.pt and best.pt" in cause
    assert not (weights / "epoch_2.pt").exists()
    assert ckpt_epoch(tmp_path / "synced" / "weights" / "epoch_2.pt") == 2
    # The resume point and the result are never pruned; training stopped after epoch 3.
    assert ckpt_epoch(weights / "last.pt") == 3 and (weights / "best.pt").exists()
    assert metrics_epochs(run.run_dir / "metrics.jsonl") == [1, 2, 3]
    assert ckpt_epoch(tmp_path / "synced" / "weights" / "last.pt") == 3
    assert daemon.state.outcome is not None and daemon.state.outcome["kind"] == "interrupted"
