"""The training loop alone, in milliseconds: a fake launcher and trainer, one injected clock.

The real-training tests (test_daemon.py, test_restart.py) prove the loop against LibreYOLO; these
prove its limit and stop logic exhaustively, with time moved by hand (supervisor's DummyOptions).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.config.model import Env, Job
from agent.daemon.spine import Daemon
from agent.state import Phase, Reason, TrainerRecord
from tests.support import tiny_job, wait_for

FAKE_PID = 4_000_001  # above any pid this box hands out: never alive, never matched by psutil


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class FakeTrainer:
    """Writes nothing by itself: the test writes status.json and decides when it exits."""

    def __init__(self, run_dir: Path, *, obeys_stop: bool = True) -> None:
        self.record = TrainerRecord(pid=FAKE_PID, create_time=1.0, started_at=0.0, argv=["fake"])
        self.is_child = True
        self.exit_code: int | None = None
        self.run_dir = run_dir
        self.obeys_stop = obeys_stop
        self.stops: list[tuple[float, float]] = []
        self._exited = asyncio.Event()

    @property
    def pid(self) -> int:
        return FAKE_PID

    def pids(self) -> set[int]:
        return {FAKE_PID}

    async def wait(self) -> int | None:
        await self._exited.wait()
        return self.exit_code

    async def stop(self, *, stop_grace_s: float, kill_grace_s: float) -> str:
        self.stops.append((stop_grace_s, kill_grace_s))
        if self.obeys_stop:
            write_status(self.run_dir, "failed", self.epochs_done(), error="KeyboardInterrupt")
            self.exit(130)
            return "SIGINT"
        self.exit(-9)
        return "SIGKILL"

    def epochs_done(self) -> int:
        doc = json.loads((self.run_dir / "status.json").read_text())
        return int(doc.get("completed_epochs") or 0)

    def exit(self, code: int) -> None:
        self.exit_code = code
        self._exited.set()


class FakeLauncher:
    def __init__(self, trainer: FakeTrainer) -> None:
        self.trainer = trainer
        self.launches = 0

    def argv(self, job: Job) -> list[str]:
        return ["fake-train", f"name={job.job.name}"]

    async def launch(
        self, argv: list[str], *, log_path: Path, result_path: Path, cwd: Path, launch_id: str
    ) -> FakeTrainer:
        self.launches += 1
        write_status(self.trainer.run_dir, "running", 0)
        return self.trainer

    def attach(self, record: TrainerRecord) -> FakeTrainer | None:
        return None

    def find_launched(self, launch_id: str, argv: list[str]) -> FakeTrainer | None:
        return None


def write_status(run_dir: Path, state: str, done: int, *, error: str | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "state": state,
        "pid": FAKE_PID,
        "save_dir": str(run_dir),
        "completed_epochs": done,
        "total_epochs": 10,
        "current_epoch": done + 1,
    }
    if error:
        doc["error"] = {"type": error, "message": ""}
    tmp = run_dir / ".status.tmp"
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, run_dir / "status.json")


def make(
    tmp: Path, limits: str = "", *, obeys_stop: bool = True, extra: str = ""
) -> tuple[Daemon, FakeTrainer, FakeLauncher, Clock]:
    data = tmp / "data.yaml"
    data.write_text("train: images\nval: images\nnames:\n  0: box\n")
    job = tiny_job(tmp, data, sections=(f"[limits]\n{limits}\n" if limits else "") + extra)
    trainer = FakeTrainer(tmp / "runs" / "run1", obeys_stop=obeys_stop)
    launcher = FakeLauncher(trainer)
    clock = Clock()
    daemon = Daemon(
        job,
        Env(state_dir=tmp / "state"),
        launcher=launcher,
        clock=clock,
        poll_interval_s=0.01,
    )
    return daemon, trainer, launcher, clock


async def started(daemon: Daemon) -> None:
    await wait_for(lambda: daemon.status is not None, timeout=10)


def tracked_epochs(daemon: Daemon) -> int | None:
    """The completed epochs the stall watch (the progress tracker) has seen."""
    progress = daemon.progress
    return None if progress is None else progress.snapshot()["completed_epochs"]


@pytest.mark.parametrize(
    ("limits", "advance", "reason", "words"),
    [
        ('max_runtime = "1h"', 3600.5, Reason.TIMEOUT, "max_runtime 1h reached"),
        ("budget_usd = 1\nprice_usd_per_hour = 3.6", 1000.5, Reason.BUDGET, "budget $1.00"),
        ('stall_timeout = "10m"', 600.5, Reason.STALLED, "no training progress"),
    ],
)
def test_a_breached_limit_stops_the_trainer_once_and_names_itself(
    tmp_path: Path, limits: str, advance: float, reason: Reason, words: str
) -> None:
    daemon, trainer, launcher, clock = make(tmp_path, limits)

    async def main() -> int:
        task = asyncio.create_task(daemon.run())
        await started(daemon)
        # The progress tracker reads status.json on its own turn, after the daemon's status:
        # the clock moves only once it saw epoch 0 and then epoch 1 (an epoch it first saw
        # after the jump would be timed at 599.5 s and would move the threshold with it).
        await wait_for(lambda: tracked_epochs(daemon) == 0)
        write_status(trainer.run_dir, "running", 1)
        await wait_for(lambda: tracked_epochs(daemon) == 1)
        clock.now += advance - 1.0
        await asyncio.sleep(0.1)
        assert not trainer.stops, "nothing fires a second early"
        clock.now += 1.0
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(main()) == 0
    assert trainer.stops == [(30.0, 5.0)]
    assert launcher.launches == 1
    assert daemon.state.reason == reason
    assert words in (daemon.state.cause or "")
    assert daemon.state.phase == Phase.DONE
    assert daemon.state.teardown is not None and daemon.state.teardown["action"] == "stop"


def test_progress_resets_the_stall_clock_and_a_clean_exit_completes(tmp_path: Path) -> None:
    daemon, trainer, _, clock = make(tmp_path, 'stall_timeout = "10m"')

    async def main() -> int:
        task = asyncio.create_task(daemon.run())
        await started(daemon)
        for epoch in range(1, 4):
            clock.now += 500.0  # each epoch 500 s: under the 600 s stall limit
            write_status(trainer.run_dir, "running", epoch)
            await wait_for(
                lambda e=epoch: daemon.status is not None and daemon.status.completed_epochs == e
            )
        write_status(trainer.run_dir, "completed", 10)
        trainer.exit(0)
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(main()) == 0
    assert trainer.stops == []
    assert daemon.state.reason == Reason.COMPLETED


def test_the_trainers_exit_is_acted_on_at_once_not_at_the_next_poll(tmp_path: Path) -> None:
    # An hour between polls, and no file changes: only the exit itself can wake the loop, and
    # the job must go on from it to its end (FINISHING, TEARDOWN, DONE) without a poll tick.
    daemon, trainer, _, _ = make(tmp_path)
    daemon.poll_interval_s = 3600.0

    async def main() -> int:
        task = asyncio.create_task(daemon.run())
        await started(daemon)
        turns = daemon.training.loop_turns
        trainer.exit(0)
        code = await asyncio.wait_for(task, 60)
        assert daemon.training.loop_turns == turns + 1  # the one turn the exit woke
        return code

    assert asyncio.run(main()) == 0
    assert daemon.state.reason == Reason.COMPLETED
    assert daemon.state.phase == Phase.DONE


class HungGpu:
    """A GpuMonitor whose health read hangs, as an NVML call can in a driver that is tearing a
    CUDA context down (the NVML host waits 30 s for an answer), until ``release``; then it
    reports ``found``."""

    def __init__(self, found: list[str] | None = None) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.found = [SimpleNamespace(message=m) for m in found or []]

    def faults(self) -> list[Any]:
        self.entered.set()
        self.release.wait(120)
        return self.found

    def samples(self) -> list[Any]:
        return []

    def close(self) -> None:
        pass


XID = "GPU 0 (GPU-fake-0): Xid 79 (GPU has fallen off the bus)"


def test_a_clean_exit_during_a_hung_gpu_read_is_acted_on_without_waiting_for_the_read(
    tmp_path: Path,
) -> None:
    daemon, trainer, _, _ = make(tmp_path)
    gpu = HungGpu(found=[XID])
    daemon.gpu = gpu  # type: ignore[assignment]
    daemon.poll_interval_s = 3600.0

    async def main() -> tuple[int, bool]:
        task = asyncio.create_task(daemon.run())
        try:
            await started(daemon)
            await wait_for(gpu.entered.is_set, timeout=60)  # the turn waits on the GPU read
            trainer.exit(0)
            code = await asyncio.wait_for(asyncio.shield(task), 60)
            return code, gpu.release.is_set()
        finally:
            gpu.release.set()  # the abandoned read ends; what it found is still recorded
            await asyncio.wait_for(task, 60)
            await wait_for(lambda: daemon.box_fault is not None, timeout=60)

    code, released = asyncio.run(main())
    assert code == 0
    assert not released  # the job ended while the read still hung
    assert daemon.state.reason == Reason.COMPLETED
    assert daemon.state.phase == Phase.DONE
    assert daemon.box_fault == XID


def test_a_failed_exit_during_a_gpu_read_waits_for_it_and_a_fault_is_not_resumed_here(
    tmp_path: Path,
) -> None:
    # A trainer that died (exit 1) while the GPU read was under way: the read may say why (an
    # Xid), and whether this box may run it again, so the agent waits for it.
    daemon, trainer, launcher, _ = make(tmp_path)
    gpu = HungGpu(found=[XID])
    daemon.gpu = gpu  # type: ignore[assignment]
    daemon.poll_interval_s = 3600.0

    async def main() -> int:
        task = asyncio.create_task(daemon.run())
        try:
            await started(daemon)
            await wait_for(gpu.entered.is_set, timeout=60)
            trainer.exit(1)
            await asyncio.sleep(0.3)
            assert not task.done()  # waiting for the read
            gpu.release.set()
            return await asyncio.wait_for(task, 60)
        finally:
            gpu.release.set()
            if not task.done():
                task.cancel()

    assert asyncio.run(main()) == 0
    assert daemon.box_fault == XID
    assert launcher.launches == 1  # a box fault: not resumed on this box
    assert daemon.state.reason == Reason.TRAINING_FAILED
    assert XID in (daemon.state.cause or "")


def test_a_stop_request_stops_once_however_often_the_loop_turns(tmp_path: Path) -> None:
    daemon, trainer, _, _ = make(tmp_path, obeys_stop=False)

    async def main() -> int:
        task = asyncio.create_task(daemon.run())
        await started(daemon)
        assert daemon.flags is not None
        daemon.flags.stop_job.set()
        daemon.flags.stop_job.set()  # a second request changes nothing
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(main()) == 0
    assert len(trainer.stops) == 1
    assert daemon.state.reason == Reason.STOPPED_BY_USER
    assert daemon.state.outcome is not None and daemon.state.outcome["kind"] == "killed"


def test_the_agent_exiting_leaves_the_trainer_running_and_the_phase_as_it_was(
    tmp_path: Path,
) -> None:
    daemon, trainer, _, _ = make(tmp_path)
    shutdown = asyncio.Event()

    async def main() -> int:
        task = asyncio.create_task(daemon.run(shutdown_trigger=shutdown))
        await started(daemon)
        shutdown.set()
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(main()) == 0
    assert trainer.stops == []
    assert daemon.state.phase == Phase.TRAINING
    assert daemon.state.trainer is not None and daemon.state.trainer.pid == FAKE_PID


def test_the_job_clock_is_the_injected_clock(tmp_path: Path) -> None:
    # One clock for everything compared: the job's start comes from it, not from time.time().
    daemon, _, _, clock = make(tmp_path)
    assert daemon.state.started_at == clock.now


def test_a_long_staging_does_not_count_as_a_stall(tmp_path: Path) -> None:
    # Seen in review: the stall clock started when the Daemon was built, so a staging longer
    # than stall_timeout ended the job as "stalled" before the trainer wrote anything.
    daemon, trainer, _, clock = make(tmp_path, 'stall_timeout = "10m"')

    def slow_staging() -> None:
        clock.now += 3600.0  # an hour of download

    daemon.stage_hook = slow_staging

    async def main() -> int:
        task = asyncio.create_task(daemon.run())
        await started(daemon)
        await asyncio.sleep(0.2)
        assert not trainer.stops
        write_status(trainer.run_dir, "completed", 10)
        trainer.exit(0)
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(main()) == 0
    assert daemon.state.reason == Reason.COMPLETED


class PricedProvider:
    """A provider stand-in that only reports a price and records what it is asked to do."""

    name = "vast"
    can_stop = True

    def __init__(self, price: float) -> None:
        self.price = price
        self.actions: list[str] = []

    async def identify(self) -> Any:
        from agent.providers import Identity

        return Identity("vast", "1234", "CONTAINER_ID", "running", "vast instance 1234", self.price)

    async def teardown(self, action: str, reason: str, *, on_sent: Any = None) -> Any:
        from agent.providers import TeardownResult

        self.actions.append(action)
        if on_sent is not None:
            on_sent(f"{action} sent")
        return TeardownResult(action, True, True, f"{action} confirmed")  # type: ignore[arg-type]

    async def confirm(self, action: str) -> Any:
        raise AssertionError("nothing was sent before")

    async def read_back(self, action: str) -> Any:
        return None

    async def price_usd_per_hour(self) -> float | None:
        return self.price


def test_an_auto_price_from_the_provider_drives_the_budget_and_the_money_in_status(
    tmp_path: Path,
) -> None:
    daemon, trainer, _, clock = make(
        tmp_path,
        "budget_usd = 1\nprice_usd_per_hour = 'auto'",
        extra='[teardown]\nprovider = "vast"\n',
    )
    provider = PricedProvider(3.6)
    daemon.provider_factory = lambda cfg, env: provider  # type: ignore[assignment,return-value]
    seen: dict[str, Any] = {}

    async def main() -> int:
        task = asyncio.create_task(daemon.run())
        await started(daemon)
        write_status(trainer.run_dir, "running", 1)
        await wait_for(lambda: daemon.status is not None and daemon.status.completed_epochs == 1)
        clock.now += 500.0
        seen["money"] = daemon.status_dict()["money"]
        clock.now += 500.5  # $1.00 at $3.60/h: 1000 s
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(main()) == 0
    assert daemon.state.price_usd_per_hour == 3.6
    assert daemon.state.reason == Reason.BUDGET
    assert seen["money"]["price_usd_per_hour"] == 3.6
    assert seen["money"]["price_from_provider"] is True
    assert abs(seen["money"]["spent_usd"] - 0.5) < 1e-6
    assert provider.actions == ["stop"]
    assert daemon.state.teardown is not None and daemon.state.teardown["instance_id"] == "1234"
