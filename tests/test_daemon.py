"""The daemon end to end on the real ``libreyolo train`` (tiny synthetic data, CPU).

Each test trains a real ``yolox-n`` from scratch for a few 64x64 epochs: a few seconds each.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import zipfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from agent import demo
from agent.config.model import Env, Job, PreflightSection
from agent.daemon.spine import Daemon
from agent.state import Phase, StateStore
from tests.support import (
    HANG_S,
    PAUSE_ENV,
    HeldStage,
    is_stopped,
    pause_after_epoch,
    post_stop,
    tiny_job,
    wait_for,
)

pytestmark = pytest.mark.training

requires_libreyolo = pytest.mark.skipif(
    shutil.which("libreyolo", path=str(Path(sys.executable).parent)) is None
    and shutil.which("libreyolo") is None,
    reason="the training stack (libreyolo) is not installed: run ./install.sh",
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.make_dataset(tmp_path_factory.mktemp("data") / "ds")


def make_job(tmp: Path, data: Path, *, epochs: int = 3, extra: str = "", sync: bool = True) -> Job:
    sections = f'[sync]\ntarget = "file://{tmp / "synced"}"\n' if sync else ""
    return tiny_job(tmp, data, epochs=epochs, train=extra, sections=sections)


def env_for(tmp: Path) -> Env:
    return Env(state_dir=tmp / "state")


class Probe:
    """Runs beside the daemon in its loop: records phases and /status answers."""

    def __init__(self) -> None:
        self.phases: list[str] = []
        self.statuses: list[dict[str, Any]] = []
        self.base: str | None = None

    def ready(self, daemon: Daemon) -> None:
        assert daemon.state.server is not None
        self.base = f"http://127.0.0.1:{daemon.state.server['port']}"


async def run_daemon(
    job: Job,
    env: Env,
    during: Callable[[Daemon, Probe, aiohttp.ClientSession], Awaitable[None]] | None = None,
    shutdown: asyncio.Event | None = None,
) -> tuple[int, Daemon, Probe]:
    probe = Probe()
    daemon = Daemon(job, env, on_ready=probe.ready, poll_interval_s=0.5)
    main = asyncio.create_task(daemon.run(shutdown_trigger=shutdown))

    async def watch_phases() -> None:
        while not main.done():
            phase = daemon.state.phase.value
            if not probe.phases or probe.phases[-1] != phase:
                probe.phases.append(phase)
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch_phases())
    if during is not None:
        async with aiohttp.ClientSession() as session:
            side = asyncio.create_task(during(daemon, probe, session))
            code = await main
            if not side.done():
                side.cancel()
            else:
                side.result()  # re-raise a failed side assertion
    else:
        code = await main
    await watcher
    final = daemon.state.phase.value
    if not probe.phases or probe.phases[-1] != final:
        probe.phases.append(final)
    return code, daemon, probe


def history_phases(state_dir: Path) -> list[str]:
    st = StateStore(state_dir).load()
    assert st is not None
    return [h["to"] for h in st.history if "to" in h]


@requires_libreyolo
def test_whole_job_completes_syncs_verified_checkpoints_and_answers_status(
    tmp_path: Path, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make_job(tmp_path, dataset, epochs=3, extra="save_period = 1")
    env = env_for(tmp_path)
    # The trainer stops itself after epoch 1 until /status has answered in TRAINING: three
    # tiny epochs could otherwise end before a loaded test's first request.
    pause_after_epoch(monkeypatch, 1)

    async def during(daemon: Daemon, probe: Probe, session: aiohttp.ClientSession) -> None:
        await wait_for(lambda: daemon.trainer is not None and is_stopped(daemon.trainer.pid))
        assert probe.base and daemon.trainer is not None
        async with session.get(f"{probe.base}/healthz") as r:
            assert r.status == 200
        async with session.get(f"{probe.base}/status") as r:
            assert r.status == 200
            probe.statuses.append(await r.json())
        os.kill(daemon.trainer.pid, signal.SIGCONT)
        while daemon.state.phase == Phase.TRAINING:
            async with session.get(f"{probe.base}/status") as r:
                assert r.status == 200
                probe.statuses.append(await r.json())
            await asyncio.sleep(0.1)

    code, daemon, probe = asyncio.run(run_daemon(job, env, during))

    assert code == 0
    assert history_phases(env.state_dir) == ["STAGING", "TRAINING", "FINISHING", "TEARDOWN", "DONE"]
    assert daemon.state.reason is not None and daemon.state.reason.value == "completed"
    # /status answered while training, with the documented fields.
    training = [s for s in probe.statuses if s["phase"] == "TRAINING"]
    assert training, "no /status answer during TRAINING"
    for key in ("phase", "reason", "epoch", "total_epochs", "eta_seconds", "last_synced_epoch"):
        assert key in training[-1]
    assert training[-1]["total_epochs"] == 3
    # The synced folder holds valid, final checkpoints.
    run_dir = daemon.run_dir
    assert run_dir is not None
    synced = tmp_path / "synced"
    for name in ("last.pt", "best.pt", "epoch_1.pt", "epoch_2.pt", "epoch_3.pt"):
        copy = synced / "weights" / name
        with zipfile.ZipFile(copy) as zf:
            assert zf.testzip() is None
        assert copy.read_bytes() == (run_dir / "weights" / name).read_bytes(), name
    lines = (synced / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [1, 2, 3]
    assert json.loads((synced / "status.json").read_text())["state"] == "completed"
    assert daemon.sync is not None and daemon.sync.verify_result is not None
    assert daemon.sync.verify_result.sync_verified
    assert daemon.sync.last_synced_epoch == 3
    # LibreYOLO's own torch.save checkpoints were copied while written (agent/sync/follow.py) and
    # those copies were what went up; nothing of them is left behind.
    assert daemon.sync.follower is not None and daemon.sync.follower.claimed >= 1
    assert not list((env.state_dir / "snapshots").glob("*"))
    # Teardown `none` recorded what it would do, and did nothing.
    td = daemon.state.teardown
    assert td is not None
    assert td["action"] == "destroy" and td["performed"] is False
    assert "would destroy" in td["detail"]
    log = (env.state_dir / "agent.log").read_text()
    assert "phase TRAINING -> FINISHING" in log
    assert "sync verified" in log


@requires_libreyolo
def test_trainer_killed_mid_run_is_reported_as_training_failed_with_cause(
    tmp_path: Path, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # limits.max_restarts = 0: the kill is not resumed (tests/test_supervise.py has the resumes).
    job = make_job(tmp_path, dataset, epochs=200)
    job = dataclasses.replace(job, limits=dataclasses.replace(job.limits, max_restarts=0))
    env = env_for(tmp_path)
    # Killed once epoch 1 is whole on disk: a kill sent when the agent had seen epoch 1 landed,
    # under load, while epoch 2 overwrote last.pt, before the agent had copied epoch 1's (the
    # sync then had no whole last.pt to send: a kill in that window loses the epoch).
    pause_after_epoch(monkeypatch, 1)

    async def during(daemon: Daemon, probe: Probe, session: aiohttp.ClientSession) -> None:
        await wait_for(lambda: daemon.status is not None and daemon.status.completed_epochs >= 1)
        assert daemon.trainer is not None
        pid = daemon.trainer.pid
        await wait_for(lambda: is_stopped(pid))
        os.killpg(os.getpgid(pid), signal.SIGKILL)

    code, daemon, _ = asyncio.run(run_daemon(job, env, during))

    assert code == 0  # the job ended as planned for the agent: the box still gets its teardown
    assert daemon.state.reason is not None
    assert daemon.state.reason.value == "training_failed"
    assert daemon.state.outcome is not None and daemon.state.outcome["kind"] == "killed"
    assert "SIGKILL" in (daemon.state.cause or "")
    # A failure keeps the box's disk rather than destroying it (default on_failure = stop).
    assert daemon.state.teardown is not None and daemon.state.teardown["action"] == "stop"
    # What was trained before the kill is off the box.
    assert (tmp_path / "synced" / "weights" / "last.pt").exists()


@requires_libreyolo
def test_stop_request_sends_sigint_and_the_trainer_ends_cleanly(
    tmp_path: Path, dataset: Path
) -> None:
    job = make_job(tmp_path, dataset, epochs=200)
    env = env_for(tmp_path)
    seen: dict[str, Any] = {}

    async def during(daemon: Daemon, probe: Probe, session: aiohttp.ClientSession) -> None:
        await wait_for(lambda: daemon.status is not None and daemon.status.completed_epochs >= 1)
        assert daemon.trainer is not None
        seen["pid"] = daemon.trainer.pid
        token = (env.state_dir / "token").read_text().strip()
        async with session.post(f"{probe.base}/stop") as r:
            assert r.status == 401  # no token, no stop
        headers = {"Authorization": f"Bearer {token}"}
        async with session.post(f"{probe.base}/stop", headers=headers) as r:
            assert r.status == 200
            assert (await r.json())["ok"] is True

    code, daemon, _ = asyncio.run(run_daemon(job, env, during))

    assert code == 0
    assert daemon.state.reason is not None and daemon.state.reason.value == "stopped_by_user"
    # SIGINT was enough: LibreYOLO's own clean stop (exit 130, KeyboardInterrupt in status.json).
    assert daemon.state.outcome == {
        "kind": "interrupted",
        "exit_code": 130,
        "message": "stopped with SIGINT",
    }
    assert daemon.run_dir is not None
    status = json.loads((daemon.run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["error"]["type"] == "KeyboardInterrupt"
    assert not psutil.pid_exists(seen["pid"]) or psutil.Process(seen["pid"]).status() == "zombie"
    log = (env.state_dir / "agent.log").read_text()
    assert "trainer stopped (SIGINT)" in log


@requires_libreyolo
def test_trainer_outlives_the_agent_and_a_new_agent_reattaches(
    tmp_path: Path, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make_job(tmp_path, dataset, epochs=4)
    env = env_for(tmp_path)
    shutdown = asyncio.Event()
    # The trainer stops itself after epoch 1 until the next agent has re-attached: it cannot
    # finish while no agent runs, however fast it trains or slowly the agents start.
    pause_after_epoch(monkeypatch, 1)

    async def during(daemon: Daemon, probe: Probe, session: aiohttp.ClientSession) -> None:
        await wait_for(lambda: daemon.status is not None and daemon.status.completed_epochs >= 1)
        shutdown.set()  # what SIGTERM to the agent does

    code, first, _ = asyncio.run(run_daemon(job, env, during, shutdown))
    monkeypatch.delenv(PAUSE_ENV)
    assert code == 0
    assert first.trainer is not None
    pid = first.trainer.pid
    assert first.state.phase == Phase.TRAINING  # left as it was: the job is not over
    assert psutil.pid_exists(pid), "the trainer must outlive the agent"

    async def reattached(daemon: Daemon, probe: Probe, session: aiohttp.ClientSession) -> None:
        await wait_for(lambda: daemon.trainer is not None)
        os.kill(pid, signal.SIGCONT)

    try:
        code, second, _ = asyncio.run(run_daemon(job, env, reattached))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert code == 0
    assert second.trainer is not None and second.trainer.pid == pid
    assert not second.trainer.is_child
    assert second.state.reason is not None and second.state.reason.value == "completed"
    assert second.state.outcome is not None and second.state.outcome["kind"] == "completed"
    assert second.sync is not None and second.sync.verify_result is not None
    assert second.sync.verify_result.sync_verified
    log = (env.state_dir / "agent.log").read_text()
    assert f"re-attached to trainer pid={pid}" in log

    # A third start finds the job over and does nothing (no second training, no second bill).
    code, third, _ = asyncio.run(run_daemon(job, env))
    assert code == 0 and third.trainer is None


@requires_libreyolo
def test_bad_training_option_ends_as_a_failed_preflight_with_libreyolo_message(
    tmp_path: Path, dataset: Path
) -> None:
    # LibreYOLO refuses the option before epoch 1 (a config failure): the box could not train
    # this job, so it ends as a failed preflight does (issue 25 item 10), with LibreYOLO's words.
    job = make_job(tmp_path, dataset, extra="bogus_option = 1", sync=False)
    code, daemon, _ = asyncio.run(run_daemon(job, env_for(tmp_path)))
    assert code == 0
    assert daemon.state.reason is not None and daemon.state.reason.value == "preflight_failed"
    assert daemon.state.outcome is not None and daemon.state.outcome["kind"] == "config"
    assert "bogus" in (daemon.state.cause or "")


@requires_libreyolo
def test_demo_job_from_the_command_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LIBREYOLO_AGENT_STATE_DIR"}
    proc = subprocess.run(
        [sys.executable, "-m", "agent.cli", "run", "--demo-dir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=HANG_S,  # a hang's cap: the demo trains for real (minutes at load ~10)
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # The demo allows CPU: on this machine preflight passes with the missing GPU shown.
    assert "preflight warning: cuda.available" in proc.stderr
    assert "preflight passed" in proc.stderr
    # Started warm: the process that ran the probe trained (no second torch import).
    assert "trainer started pid" in proc.stderr
    assert "(warm: its Python ran the probe)" in proc.stderr
    assert "reason:     completed" in proc.stdout
    assert "verified:   True" in proc.stdout
    synced = tmp_path / "demo" / "synced" / "weights"
    assert sorted(p.name for p in synced.glob("*.pt")) == [
        "best.pt",
        "epoch_1.pt",
        "epoch_2.pt",
        "epoch_3.pt",
        "last.pt",
    ]


def test_second_agent_on_the_same_state_dir_refuses_to_start(tmp_path: Path) -> None:
    # Two agents on one state directory would both drive (and stop) the same trainer.
    from agent.daemon.spine import AgentError

    state = tmp_path / "state"
    state.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(state / 'agent.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, f'{os.getpid()}\\n'.encode())\n"
            "print('locked', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        job = make_job(tmp_path, tmp_path / "data.yaml", sync=False)
        with pytest.raises(AgentError) as err:
            asyncio.run(Daemon(job, env_for(tmp_path)).run())
        assert f"another agent (pid {holder.pid})" in str(err.value)
        assert not (state / "state.json").exists()  # it touched nothing
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()


def test_stop_requested_during_staging_starts_no_trainer(tmp_path: Path) -> None:
    job = make_job(tmp_path, tmp_path / "data.yaml", sync=False)
    env = env_for(tmp_path)
    staging = HeldStage()

    async def main() -> tuple[int, Daemon]:
        probe = Probe()
        daemon = Daemon(job, env, stage_hook=staging, on_ready=probe.ready)
        task = asyncio.create_task(daemon.run())
        try:
            await wait_for(staging.started.is_set)
            assert probe.base is not None
            await post_stop(probe.base, env.state_dir)
        finally:
            staging.release()  # the stop came while the agent was staging
        return await task, daemon

    code, daemon = asyncio.run(main())
    assert code == 0
    assert daemon.trainer is None and daemon.state.trainer is None
    assert daemon.state.reason is not None and daemon.state.reason.value == "stopped_by_user"
    assert daemon.state.cause == "stop requested before training started"
    assert history_phases(env.state_dir) == ["STAGING", "TEARDOWN", "DONE"]


def test_failed_preflight_gets_its_report_off_the_box_then_destroys_it(tmp_path: Path) -> None:
    # This CPU machine fails a job that does not allow CPU: the box would be destroyed at once,
    # so the reason must be off it first.
    job = tiny_job(
        tmp_path,
        tmp_path / "data.yaml",
        sections=f'[sync]\ntarget = "file://{tmp_path / "synced"}"\n',
    )
    # Training on "the GPU" (no device=cpu), CPU not allowed.
    train = dataclasses.replace(
        job.train, args=tuple((k, v) for k, v in job.train.args if k != "device")
    )
    job = dataclasses.replace(
        job, train=train, preflight=PreflightSection(enabled=True, allow_cpu=False)
    )
    env = env_for(tmp_path)
    code, daemon, _ = asyncio.run(run_daemon(job, env))
    assert code == 0
    assert daemon.state.reason is not None and daemon.state.reason.value == "preflight_failed"
    assert daemon.trainer is None
    assert "cuda.available" in (daemon.state.cause or "")
    assert history_phases(env.state_dir) == ["PREFLIGHT", "TEARDOWN", "DONE"]
    report = json.loads((tmp_path / "synced" / "agent" / "preflight.json").read_text())
    assert report["ok"] is False
    assert any(c["name"] == "cuda.available" and c["status"] == "fail" for c in report["checks"])
    assert (tmp_path / "synced" / "agent" / "agent.log").exists()
    td = daemon.state.teardown
    assert td is not None and td["action"] == "destroy"
    assert "preflight failed" in td["why"]


def test_a_failed_preflight_without_hf_token_keeps_its_reports_and_does_not_wait_for_them(
    tmp_path: Path,
) -> None:
    # An hf:// target, no HF_TOKEN, the Hub not answering at the preflight (so its canary can
    # only warn): the preflight fails (hf_token, and this CPU machine's cuda.available). The
    # Hub takes no write without a token, so the reports are not queued for an upload that
    # cannot succeed (before: up to 120 s of retries on a billing box): they stay in the state
    # directory, the log says where, and the teardown follows.
    with socket.socket() as sock:  # a port on 127.0.0.1 that nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    job = tiny_job(tmp_path, tmp_path / "data.yaml", sections='[sync]\ntarget = "hf://org/run"\n')
    train = dataclasses.replace(
        job.train, args=tuple((k, v) for k, v in job.train.args if k != "device")
    )
    job = dataclasses.replace(
        job, train=train, preflight=PreflightSection(enabled=True, allow_cpu=False)
    )
    env = dataclasses.replace(env_for(tmp_path), hf_endpoint=f"http://127.0.0.1:{closed}")
    code, daemon, _ = asyncio.run(run_daemon(job, env))
    assert code == 0
    assert daemon.state.reason is not None and daemon.state.reason.value == "preflight_failed"
    assert "hf_token" in (daemon.state.cause or ""), daemon.state.cause
    assert history_phases(env.state_dir) == ["PREFLIGHT", "TEARDOWN", "DONE"]
    text = (env.state_dir / "agent.log").read_text()
    assert f"the reports stay on the box, in {env.state_dir}: hf://org/run takes no upload" in text
    assert "upload of" not in text and "could not be uploaded in time" not in text, text[-3000:]
    assert (env.state_dir / "preflight.json").is_file()
    assert (env.state_dir / "report.json").is_file()


def test_status_and_stop_commands_talk_to_the_running_agent(tmp_path: Path) -> None:
    job = make_job(tmp_path, tmp_path / "data.yaml", sync=False)
    env = env_for(tmp_path)
    staging = HeldStage()

    async def cli(*args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "agent.cli",
            *args,
            "--state-dir",
            str(env.state_dir),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async def main() -> tuple[int, list[tuple[int, str, str]]]:
        daemon = Daemon(job, env, stage_hook=staging)
        task = asyncio.create_task(daemon.run())
        try:
            await wait_for(staging.started.is_set)
            # Held in STAGING until the three commands have answered, however long each
            # takes to start on this machine.
            answers = [await cli("status", "--json"), await cli("status"), await cli("stop")]
        finally:
            staging.release()
        return await task, answers

    code, answers = asyncio.run(main())
    assert code == 0
    (rc_json, out_json, _), (rc_text, out_text, _), (rc_stop, out_stop, _) = answers
    assert rc_json == 0 and json.loads(out_json)["phase"] == "STAGING"
    assert rc_text == 0 and "phase              STAGING" in out_text
    assert rc_stop == 0 and "stop requested" in out_stop
    state = StateStore(env.state_dir).load()
    assert state is not None and state.reason is not None
    assert state.reason.value == "stopped_by_user"
    # With the agent gone, `status` answers from the state file: the record of an ended job.
    rc, out, err = asyncio.run(cli("status"))
    assert rc == 0 and "record of an ended job" in out and "DONE" in out and "Traceback" not in err
