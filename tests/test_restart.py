"""Restarts and failure-safety of the daemon, on the real ``libreyolo train`` (tiny data, CPU).

Every test here is named after a failure seen on an earlier version: a restart that started over
at PREFLIGHT, a kill just after launch that started a second trainer, a destroy that skipped the
verified-sync gate, a demo that wiped a real job's state, an agent spinning while it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil
import pytest

from agent.config.model import Env, PreflightSection
from agent.daemon.spine import Daemon
from agent.policy.restart import MAX_CRASHES
from agent.sinks.digests import sha256_file
from agent.state import Phase, Reason, RunState, StateStore
from tests.support import (
    HANG_S,
    PAUSE_ENV,
    end_guard,
    is_stopped,
    pause_after_epoch,
    tiny_job,
    wait_for,
)
from tests.test_daemon import (
    Probe,
    dataset,
    env_for,
    history_phases,
    make_job,
    requires_libreyolo,
    run_daemon,
)

__all__ = ["dataset"]  # the module-scoped fixture, shared with test_daemon


#: Epochs of the restart tests' runs: enough for an agent's death mid-run (after epoch 1 or 2,
#: the trainer frozen with SIGSTOP until the test moves on) and a resume that trains more.
EPOCHS = 4


def job_toml(
    tmp: Path,
    data: Path,
    *,
    epochs: int,
    extra: str = "",
    imgsz: int = 64,
    save_period: int = 1,
    train: str = "",
) -> Path:
    """The tiny CPU job as a file, for the agent run as a real process (``libreyolo-agent run``).
    ``train`` adds lines to [train], ``extra`` to [sync]. As :func:`tests.support.tiny_job`,
    the dataset doctor and the restore drill (each a LibreYOLO start-up in a child, on for
    users) are off: their own tests turn them on."""
    path = tmp / "job.toml"
    path.write_text(
        f"""
[job]
name = "run1"
runs_dir = "{tmp / "runs"}"
[train]
model = "yolox-n"
pretrained = false
data = "{data}"
epochs = {epochs}
imgsz = {imgsz}
batch = 4
workers = 0
device = "cpu"
save_period = {save_period}
{train}
stop_grace = "30s"
kill_grace = "5s"
[preflight]
enabled = false
[server]
listen = "127.0.0.1:0"
[sync]
target = "file://{tmp / "synced"}"
{extra}
[dataset]
doctor = false
[teardown]
require_restore_drill = false
"""
    )
    return path


def agent_env(state_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LIBREYOLO_AGENT_CRASHPOINT"}
    env.update(LIBREYOLO_AGENT_STATE_DIR=str(state_dir), **extra)
    return env


def run_agent(
    job: Path, state_dir: Path, timeout: float = HANG_S, **extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "run", str(job)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=agent_env(state_dir, **extra),
    )


def trainers_of(runs: Path) -> list[psutil.Process]:
    """Live processes training into ``runs`` (their command line names it as project=)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if f"project={runs}" in cmd and "train" in cmd:
            found.append(p)
    return found


def run_dirs(runs: Path) -> list[str]:
    return sorted(p.name for p in runs.iterdir() if p.is_dir()) if runs.exists() else []


def kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


# ------------------------------------------------------------------------------------ restarts


@pytest.mark.training
@requires_libreyolo
def test_restart_during_training_resumes_training_and_never_reruns_a_failing_preflight(
    tmp_path: Path, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seen: a restarted agent always started over at PREFLIGHT; its disk check failed (the live
    # trainer's checkpoints had filled the disk), and the failure path chose "destroy, nothing
    # to save" while the trainer kept training unsupervised.
    job = make_job(tmp_path, dataset, epochs=EPOCHS, extra="save_period = 1")
    env = env_for(tmp_path)
    shutdown = asyncio.Event()
    # The trainer stops itself once epoch 1 is written, until the next agent has adopted it: a
    # fast trainer cannot end in between, nor run ahead of a loaded agent's SIGSTOP.
    pause_after_epoch(monkeypatch, 1)

    async def during(daemon: Daemon, probe: Probe, session: aiohttp.ClientSession) -> None:
        await wait_for(lambda: daemon.status is not None and daemon.status.completed_epochs >= 1)
        assert daemon.trainer is not None
        pid = daemon.trainer.pid
        await wait_for(lambda: is_stopped(pid))
        shutdown.set()

    code, first, _ = asyncio.run(run_daemon(job, env, during, shutdown))
    monkeypatch.delenv(PAUSE_ENV)
    assert code == 0 and first.trainer is not None and first.state.phase == Phase.TRAINING
    pid = first.trainer.pid

    async def adopted(daemon: Daemon, probe: Probe, session: aiohttp.ClientSession) -> None:
        await wait_for(lambda: daemon.trainer is not None)
        os.kill(pid, signal.SIGCONT)

    # The same job restarted with a preflight that fails on this machine (no GPU, no CPU
    # allowed): a restart in TRAINING must not run it at all.
    failing = dataclasses.replace(job, preflight=PreflightSection(enabled=True, allow_cpu=False))
    try:
        code, second, _ = asyncio.run(run_daemon(failing, env, adopted))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert code == 0
    assert second.trainer is not None and second.trainer.pid == pid
    assert second.state.reason == Reason.COMPLETED
    assert second.preflight_report is None
    state = StateStore(env.state_dir).load()
    assert state is not None
    restarts = [h for h in state.history if h.get("event") == "agent restarted"]
    assert restarts and restarts[-1]["was"] == "TRAINING"
    assert "PREFLIGHT" not in history_phases(env.state_dir)
    assert state.teardown is not None and state.teardown["action"] == "destroy"
    synced = {p.name for p in (tmp_path / "synced" / "weights").glob("*.pt")}
    assert {f"epoch_{n}.pt" for n in range(1, EPOCHS + 1)} <= synced


@pytest.mark.training
@requires_libreyolo
@pytest.mark.parametrize("run_dir_recorded", [True, False])
def test_agent_and_trainer_killed_then_a_reboot_resumes_from_last_pt_to_every_epoch(
    tmp_path: Path, dataset: Path, run_dir_recorded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seen: after a kill of both (as in a reboot) the cause said "trainer lost: left no
    # status.json" although status.json existed, and 6 of 11 epoch files plus last/best never
    # reached the target. Now the run resumes from its own last.pt in the same run dir.
    job = make_job(tmp_path, dataset, epochs=EPOCHS, extra="save_period = 1")
    env = env_for(tmp_path)
    shutdown = asyncio.Event()
    seen: dict[str, int] = {}
    # The trainer stops itself once epoch 2 is written, until the kill below: it dies mid-run
    # at a known epoch however fast this machine trains. (A SIGSTOP sent once the agent had
    # seen epoch 2 lost the race under load: the trainer had written epoch 4's last.pt, and a
    # resume from it had nothing left to train.)
    pause_after_epoch(monkeypatch, 2)

    async def during(daemon: Daemon, probe: Probe, session: aiohttp.ClientSession) -> None:
        await wait_for(lambda: daemon.status is not None and daemon.status.completed_epochs >= 2)
        assert daemon.trainer is not None
        seen["pid"] = daemon.trainer.pid
        await wait_for(lambda: is_stopped(seen["pid"]))
        shutdown.set()

    code, _first, _ = asyncio.run(run_daemon(job, env, during, shutdown))
    assert code == 0
    kill_tree(seen["pid"])
    monkeypatch.delenv(PAUSE_ENV)
    if not run_dir_recorded:
        # An agent killed before it had read the run dir: the state knows only the pid.
        state_path = env.state_dir / "state.json"
        data = json.loads(state_path.read_text())
        data["trainer"]["run_dir"] = None
        state_path.write_text(json.dumps(data))
    run_dir = tmp_path / "runs" / "run1"
    killed_at = json.loads((run_dir / "status.json").read_text())["completed_epochs"]
    assert killed_at == 2

    monkeypatch.setenv("LIBREYOLO_AGENT_BOOT_ID", "another-boot")  # a simulated reboot
    code, second, _ = asyncio.run(run_daemon(job, env))
    assert code == 0
    assert second.state.reason == Reason.COMPLETED, second.state.cause
    assert [r["kind"] for r in second.state.resumes] == ["reboot"]
    assert second.state.resumes[0]["epoch"] >= 2
    # The same run dir, every epoch trained once and in order, nothing started over.
    assert run_dirs(tmp_path / "runs") == ["run1"]
    assert second.run_dir == run_dir
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed" and status["start_epoch"] >= 3
    assert second.status is not None and second.status.completed_epochs == EPOCHS
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    epochs = [json.loads(line)["epoch"] for line in rows]
    assert epochs == list(range(1, EPOCHS + 1))
    # Everything the run wrote is off the box, and the target's last.pt is the final one.
    synced_dir = tmp_path / "synced" / "weights"
    synced = {p.name for p in synced_dir.glob("*.pt")}
    assert {f"epoch_{n}.pt" for n in range(1, EPOCHS + 1)} <= synced
    on_disk = {p.name for p in (run_dir / "weights").glob("*.pt")}
    assert "last.pt" in on_disk and on_disk <= synced, on_disk - synced
    assert sha256_file(synced_dir / "last.pt") == sha256_file(run_dir / "weights" / "last.pt")
    assert second.sync is not None and second.sync.verify_result is not None
    assert second.sync.verify_result.sync_verified, second.sync.verify_result.missing


@pytest.mark.training
@requires_libreyolo
def test_a_new_box_with_the_same_target_resumes_from_the_remote_last_pt(
    tmp_path: Path, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The old box is gone with its disk: a fresh state dir and an empty runs dir, the same job
    # and sync target. Training from scratch would overwrite the target's checkpoints.
    old, new = tmp_path / "old", tmp_path / "new"
    synced = tmp_path / "synced"
    sections = f'[sync]\ntarget = "file://{synced}"\n'
    job_old = tiny_job(old, dataset, epochs=EPOCHS, sections=sections)
    shutdown = asyncio.Event()
    # The trainer stops itself once epoch 2 is written (tests/support.pause_after_epoch), and
    # stays frozen while epoch 2 goes off the box: the box dies mid-run at a known epoch
    # however fast it trains. (A SIGSTOP sent once the agent had seen epoch 2 raced it.)
    pause_after_epoch(monkeypatch, 2)

    async def during(daemon: Daemon, probe: Probe, session: aiohttp.ClientSession) -> None:
        await wait_for(lambda: daemon.status is not None and daemon.status.completed_epochs >= 2)
        assert daemon.trainer is not None
        pid = daemon.trainer.pid
        await wait_for(lambda: is_stopped(pid))
        await wait_for(
            lambda: daemon.sync is not None and (daemon.sync.last_synced_epoch or 0) >= 2
        )
        kill_tree(pid)  # the box dies: trainer and agent at once
        shutdown.set()

    asyncio.run(run_daemon(job_old, Env(state_dir=old / "state"), during, shutdown))
    monkeypatch.delenv(PAUSE_ENV)
    remote_epoch = json.loads((synced / "status.json").read_text())["completed_epochs"]
    assert remote_epoch == 2

    job_new = tiny_job(new, dataset, epochs=EPOCHS, sections=sections)
    code, daemon, _ = asyncio.run(run_daemon(job_new, Env(state_dir=new / "state")))
    assert code == 0
    assert daemon.state.reason == Reason.COMPLETED, daemon.state.cause
    assert [r["kind"] for r in daemon.state.resumes] == ["new_box"]
    run_dir = new / "runs" / "run1"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["start_epoch"] > 1, "resumed, not trained from scratch"
    assert daemon.status is not None and daemon.status.completed_epochs == EPOCHS
    assert sha256_file(synced / "weights" / "last.pt") == sha256_file(
        run_dir / "weights" / "last.pt"
    )


@pytest.mark.training
@requires_libreyolo
def test_agent_killed_right_after_launch_never_starts_a_second_trainer(
    tmp_path: Path, dataset: Path, request: pytest.FixtureRequest
) -> None:
    # Seen: TRAINING was saved before the launch and the pid only after it; an agent killed in
    # between launched again: two trainers (run1 and run12), one unsupervised.
    job = job_toml(tmp_path, dataset, epochs=6)
    state_dir = tmp_path / "state"
    request.addfinalizer(lambda: end_guard(state_dir))
    first = run_agent(job, state_dir, LIBREYOLO_AGENT_CRASHPOINT="after-launch")
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    state = StateStore(state_dir).load()
    assert state is not None and state.trainer is None and state.launch is not None
    orphans = trainers_of(tmp_path / "runs")
    assert len(orphans) == 1
    orphan = orphans[0].pid

    second = run_agent(job, state_dir)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    assert f"adopted trainer pid={orphan}" in second.stderr
    assert run_dirs(tmp_path / "runs") == ["run1"]
    state = StateStore(state_dir).load()
    assert state is not None and state.reason == Reason.COMPLETED
    assert state.trainer is not None and state.trainer.pid == orphan
    assert not trainers_of(tmp_path / "runs")


@pytest.mark.training
@requires_libreyolo
def test_agent_killed_while_sending_teardown_resumes_it_with_the_same_decision(
    tmp_path: Path, dataset: Path, request: pytest.FixtureRequest
) -> None:
    job = job_toml(tmp_path, dataset, epochs=2)
    state_dir = tmp_path / "state"
    request.addfinalizer(lambda: end_guard(state_dir))
    first = run_agent(job, state_dir, LIBREYOLO_AGENT_CRASHPOINT="teardown-sending")
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    state = StateStore(state_dir).load()
    assert state is not None and state.phase == Phase.TEARDOWN
    assert state.teardown is not None and "finished_at" not in state.teardown
    decided = state.teardown["action"]

    second = run_agent(job, state_dir)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"teardown resumed: {decided} was decided" in second.stderr
    state = StateStore(state_dir).load()
    assert state is not None and state.phase == Phase.DONE
    assert state.teardown is not None and state.teardown["action"] == decided
    assert state.teardown["confirmed"] is True
    assert "PREFLIGHT" not in [h.get("to") for h in state.history[-3:]]
    # The state files of a whole run (two agents) are private (was test_state_files_are_private,
    # a run of its own).
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    for name in ("state.json", "agent.log", "sync-ledger.json", "token", "trainer.log"):
        mode = stat.S_IMODE((state_dir / name).stat().st_mode)
        assert mode == 0o600, (name, oct(mode))


def test_a_crash_loop_ends_in_a_gated_teardown_instead_of_another_restart(tmp_path: Path) -> None:
    # The agent crashed MAX_CRASHES times in TRAINING with nothing verified off the box: the
    # next start must not try again (a loop that bills), and must not destroy the checkpoints.
    job = make_job(tmp_path, tmp_path / "data.yaml", epochs=3)
    env = env_for(tmp_path)
    env.state_dir.mkdir(parents=True)
    weights = tmp_path / "runs" / "run1" / "weights"
    weights.mkdir(parents=True)
    (weights / "last.pt").write_bytes(b"PK\x05\x06" + b"\0" * 18)
    state = RunState(job_name="run1", job_source="test", phase=Phase.TRAINING)
    state.crashes = [
        {"at": time.time(), "phase": "TRAINING", "error": "OSError: boom"}
        for _ in range(MAX_CRASHES)
    ]
    StateStore(env.state_dir).save(state)

    code, daemon, _ = asyncio.run(run_daemon(job, env))
    assert code == 0
    assert daemon.trainer is None
    assert daemon.state.reason == Reason.AGENT_FAILED
    assert f"crashed {MAX_CRASHES} times" in (daemon.state.cause or "")
    assert daemon.state.teardown is not None and daemon.state.teardown["action"] == "stop"


def test_a_real_crash_is_counted_in_the_state_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Inject the one fault nothing else produces here: a bug in a collaborator.
    job = make_job(tmp_path, tmp_path / "data.yaml", epochs=3, sync=False)
    env = env_for(tmp_path)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr("agent.daemon.prepare.Preparation.staging", broken)
    with pytest.raises(RuntimeError):
        asyncio.run(Daemon(job, env).run())
    state = StateStore(env.state_dir).load()
    assert state is not None and len(state.crashes) == 1
    assert state.crashes[0]["phase"] == "STAGING"


# ------------------------------------------------------------------------------------ the gate


def test_a_preflight_failure_with_checkpoints_on_disk_is_not_nothing_to_save(
    tmp_path: Path,
) -> None:
    # Every destroy passes the verified-sync gate: a preflight/staging failure of a box whose
    # runs already hold checkpoints (a re-run of the job, a restart) keeps the disk.
    job = make_job(tmp_path, tmp_path / "data.yaml")
    train = dataclasses.replace(
        job.train, args=tuple((k, v) for k, v in job.train.args if k != "device")
    )
    job = dataclasses.replace(
        job, train=train, preflight=PreflightSection(enabled=True, allow_cpu=False)
    )
    weights = tmp_path / "runs" / "run1" / "weights"
    weights.mkdir(parents=True)
    (weights / "last.pt").write_bytes(b"PK\x05\x06" + b"\0" * 18)
    code, daemon, _ = asyncio.run(run_daemon(job, env_for(tmp_path)))
    assert code == 0
    assert daemon.state.reason == Reason.PREFLIGHT_FAILED
    td = daemon.state.teardown
    assert td is not None and td["action"] == "stop", td
    assert "not verified" in td["why"]


# ------------------------------------------------------------------------------------ stop


@pytest.mark.training
@requires_libreyolo
def test_stop_does_not_spin_the_agent_while_the_trainer_winds_down(
    tmp_path: Path, dataset: Path
) -> None:
    # Seen on the H200: after `stop`, 26.5 s of agent CPU in a 47 s life: the wait included an
    # Event that was already set. The loop must wake on events and its poll, not spin.
    job = make_job(tmp_path, dataset, epochs=200)
    env = env_for(tmp_path)
    turns: dict[str, int] = {}

    async def during(daemon: Daemon, probe: Probe, session: aiohttp.ClientSession) -> None:
        await wait_for(lambda: daemon.status is not None and daemon.status.completed_epochs >= 1)
        assert daemon.trainer is not None
        # The trainer ignores SIGINT for the whole stop grace (as a hung one would).
        os.kill(daemon.trainer.pid, signal.SIGSTOP)
        before = daemon.training.loop_turns
        cpu0 = time.process_time()
        assert daemon.flags is not None
        daemon.flags.stop_job.set()
        await asyncio.sleep(3.0)
        turns["turns"] = daemon.training.loop_turns - before
        turns["cpu_ms"] = int((time.process_time() - cpu0) * 1000)
        os.kill(daemon.trainer.pid, signal.SIGCONT)

    code, daemon, _ = asyncio.run(run_daemon(job, env, during))
    assert code == 0
    assert daemon.state.reason == Reason.STOPPED_BY_USER
    # poll_interval is 0.5 s: a few turns in 3 s, not thousands.
    assert turns["turns"] < 40, turns


# ------------------------------------------------------------------------------------ the demo


def test_the_demo_never_touches_the_state_dir_the_environment_names(tmp_path: Path) -> None:
    # Seen: `libreyolo-agent run` with no job deleted the folder LIBREYOLO_AGENT_STATE_DIR names
    # (the README tells users to export it), before any lock.
    real = tmp_path / "real-state"
    real.mkdir()
    (real / "state.json").write_text("{}")
    demo_root = tmp_path / "demo"
    (demo_root / "state").mkdir(parents=True)
    (demo_root / "runs" / "keep").mkdir(parents=True)
    # Another demo agent holds the demo's lock: this one must refuse before deleting anything.
    lock = os.open(demo_root / "state" / "agent.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "agent.cli", "run", "--demo-dir", str(demo_root)],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, LIBREYOLO_AGENT_STATE_DIR=str(real)),
            cwd=tmp_path,
        )
    finally:
        os.close(lock)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "another agent" in proc.stderr
    assert (demo_root / "runs" / "keep").is_dir()
    assert (real / "state.json").read_text() == "{}"


# ------------------------------------------------------------------------------------ files


def test_an_unreadable_state_file_is_a_clear_error_not_a_guess(tmp_path: Path) -> None:
    from agent.daemon.spine import AgentError

    job = make_job(tmp_path, tmp_path / "data.yaml", sync=False)
    env = Env(state_dir=tmp_path / "state")
    env.state_dir.mkdir()
    (env.state_dir / "state.json").write_text('{"job_name": "run1", "phase": "NOPE"}')
    with pytest.raises(AgentError) as err:
        asyncio.run(Daemon(job, env).run())
    assert "state.json is unreadable" in str(err.value)
    assert "second trainer" in str(err.value)


# ------------------------------------------------------------------------------------ dataset


@requires_libreyolo
def test_a_broken_local_dataset_is_found_by_the_doctor_before_any_trainer_starts(
    tmp_path: Path,
) -> None:
    # Seen: the doctor ran only for Hub-staged datasets and only when asked, so a broken local
    # dataset was found by the GPU at epoch 0. It now runs for every job by default; with
    # doctor_first = true, before any trainer starts (tests/test_doctor_beside.py: the default).
    import shutil

    from agent import demo
    from tests.support import tiny_job

    data = demo.make_dataset(tmp_path / "ds")
    shutil.rmtree(tmp_path / "ds" / "images" / "val")
    job = tiny_job(tmp_path, data, sections="[dataset]\ndoctor_first = true\n", doctor=True)
    assert job.data_check.doctor and job.data_check.doctor_first
    env = env_for(tmp_path)
    code, daemon, _ = asyncio.run(run_daemon(job, env))
    assert code == 0
    assert daemon.trainer is None and daemon.state.launch is None
    assert daemon.state.reason == Reason.PREFLIGHT_FAILED
    assert "dataset check failed" in (daemon.state.cause or "")
    assert history_phases(env.state_dir) == ["STAGING", "TEARDOWN", "DONE"]
    report = json.loads((env.state_dir / "staging.json").read_text())
    assert report["ok"] is False
