"""The warm start (agent/trainer/warmstart.py, agent/trainer/warm_entry.py): the trainer's own
Python runs the torch probe, waits at a gate, and trains when the agent hands it the command line.

Real processes throughout: the probe runs against the stand-in ``torch`` (GPU scenarios on a
CPU machine) with the stand-in ``libreyolo.cli`` as the trainer, so that what this process had
imported when it trained can be asserted; ``test_daemon``'s demo job runs the real
``libreyolo train`` through the same path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent import demo
from agent.config.jobfile import job_from_dict
from agent.config.model import PreflightSection
from agent.daemon.spine import Daemon
from agent.install.libreyolo import find_libreyolo
from agent.preflight import FAIL, PASS, run_preflight
from agent.preflight.cuda import warm_probe_config
from agent.preflight.plan import plan_for
from agent.trainer.process import ProcessLauncher
from agent.trainer.warm_entry import CALLED_OFF
from agent.trainer.warmstart import WarmStart, for_job, trainer_python
from tests.fakes.scripted_launcher import ScriptedLauncher
from tests.support import wait_for
from tests.test_daemon import env_for, requires_libreyolo, run_daemon
from tests.test_daemon import make_job as daemon_job
from tests.test_preflight import (
    FAKE_TORCH_ENV,
    H100,
    REPO_ROOT,
    STANDIN,
    assert_gone,
    check,
    make_env,
    make_job,
    with_devices,
)

pytestmark = pytest.mark.skipif(
    trainer_python() is None, reason="needs the `libreyolo` command (a Python script)"
)


def scenario(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **values: Any) -> Path:
    pid_file = tmp_path / "pids"
    values.setdefault("devices", [H100, H100])
    monkeypatch.setenv(FAKE_TORCH_ENV, json.dumps({"pid_file": str(pid_file), **values}))
    return pid_file


def warm(tmp_path: Path, device: str = "0") -> WarmStart:
    job = make_job(tmp_path, train={"device": device})
    config = warm_probe_config(plan_for(job))
    assert config is not None
    return WarmStart(
        config,
        log_path=tmp_path / "state" / "trainer.log",
        result_path=tmp_path / "state" / "trainer-result.json",
        cwd=tmp_path / "runs",
        python=sys.executable,
        extra_pythonpath=[STANDIN],
    )


def files(ws: WarmStart) -> dict[str, Any]:
    return {"log_path": ws.log_path, "result_path": ws.result_path, "cwd": ws.cwd}


def libreyolo() -> str:
    found = find_libreyolo()
    assert found is not None
    return found


def test_the_process_that_probed_is_the_one_that_trains(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    scenario(monkeypatch, tmp_path, chatter=True, train_exit=3)
    ws = warm(tmp_path, device="1")

    async def main() -> tuple[Any, Any, int | None]:
        probe = await ws.probe(30.0)
        pid = ws.pid
        assert ws.launch_id is not None
        argv = [libreyolo(), "train", "model=yolox-n", "json=true"]
        trainer = await ws.go(argv, launch_id=ws.launch_id, **files(ws))
        assert trainer is not None and trainer.pid == pid
        assert trainer.record.argv == argv
        return probe, trainer, await trainer.wait()

    probe, trainer, code = asyncio.run(main())
    assert probe.doc is not None and probe.error is None
    first, second = probe.doc["devices"]
    # Only the job's GPU got a context: the trainer keeps its contexts for the whole run.
    assert first["skipped"] == "not used by this job" and "matmul" not in first
    assert "free_memory" not in first
    assert second["matmul"]["ok"] is True
    assert code == 3  # the trainer's own exit code, collected by its parent, the agent
    result = ws.result_path.read_text()
    # stdout is the result alone: the probe's chatter went to the log.
    doc = json.loads(result)
    assert len(result.splitlines()) == 1
    assert doc["pid"] == trainer.pid
    assert doc["torch_loaded"] is True  # it trained with the torch the probe imported
    assert doc["safepath"] is None  # what it starts sees the environment as a bare trainer's
    assert doc["argv"] == [libreyolo(), "train", "model=yolox-n", "json=true"]
    log = ws.log_path.read_text()
    assert "stand-in torch: chatter on stdout" in log
    assert "warm start: the trainer's Python runs the GPU probe" in log
    assert "warm start: training:" in log


def test_the_preflight_verdicts_of_a_warm_probe(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pid_file = scenario(monkeypatch, tmp_path)
    job = make_job(tmp_path, train={"device": 1})
    ws = warm(tmp_path, device="1")

    async def main() -> Any:
        try:
            return await run_preflight(job, make_env(tmp_path), probe_runner=ws.probe)
        finally:
            await ws.abort()

    report = asyncio.run(main())
    assert check(report, "gpu0").status == PASS
    assert "not used by this job" in check(report, "gpu0").value
    assert report.get("gpu0.matmul") is None
    assert check(report, "gpu1.matmul").status == PASS
    assert check(report, "gpu.count").status != FAIL
    assert_gone(pid_file)


def test_an_agent_that_dies_before_the_go_leaves_nothing_training(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pid_file = scenario(monkeypatch, tmp_path)
    script = (
        "import asyncio, json, sys, time\n"
        "from pathlib import Path\n"
        "from agent.preflight.cuda import warm_probe_config\n"
        "from agent.preflight.plan import plan_for\n"
        "from agent.trainer.warmstart import WarmStart\n"
        "from tests.test_preflight import STANDIN, make_job\n"
        "tmp = Path(sys.argv[1])\n"
        "job = make_job(tmp, train={'device': 0})\n"
        "ws = WarmStart(warm_probe_config(plan_for(job)), log_path=tmp / 'trainer.log',\n"
        "               result_path=tmp / 'result.json', cwd=tmp, python=sys.executable,\n"
        "               extra_pythonpath=[STANDIN])\n"
        "probe = asyncio.run(ws.probe(30.0))\n"
        "print(json.dumps({'pid': ws.pid, 'ok': probe.doc is not None}), flush=True)\n"
        "time.sleep(600)\n"
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stdout is not None
        told = json.loads(agent.stdout.readline())
        assert told["ok"] is True
        warm_proc = psutil.Process(told["pid"])
        assert warm_proc.is_running()
        agent.send_signal(signal.SIGKILL)  # no clean-up code of the agent runs
        agent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not warm_proc.is_running() or warm_proc.status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.05)
    finally:
        agent.kill()
        agent.wait(10)
        if agent.stdout is not None:
            agent.stdout.close()
    assert_gone(pid_file)
    assert (tmp_path / "result.json").read_text() == ""  # nothing was trained


def test_a_hung_probe_is_killed_and_its_stage_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pid_file = scenario(monkeypatch, tmp_path, hang_at="is_available")
    ws = warm(tmp_path)

    async def main() -> Any:
        probe = await ws.probe(3.0)
        argv = [libreyolo(), "train", "json=true"]
        return probe, await ws.go(argv, launch_id="x", **files(ws))

    probe, trainer = asyncio.run(main())
    assert probe.timed_out and probe.doc is None
    assert probe.last_stage == "cuda.is_available"
    assert trainer is None and ws.launch_id is None
    assert_gone(pid_file)


def test_a_probe_process_that_dies_reports_its_exit_and_log(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    scenario(monkeypatch, tmp_path, **{"import": "segv"})
    ws = warm(tmp_path)
    probe = asyncio.run(ws.probe(30.0))
    assert probe.doc is None and not probe.timed_out
    assert probe.returncode == -signal.SIGSEGV
    assert probe.error == f"no report (exit code {-signal.SIGSEGV})"
    assert probe.last_stage == "import torch"
    assert "warm start" in probe.stderr_tail  # the log's tail, from this start on


@pytest.mark.parametrize("what", ["another command", "another launch id", "other files"])
def test_a_launch_it_does_not_fit_calls_it_off(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, what: str
) -> None:
    pid_file = scenario(monkeypatch, tmp_path)
    ws = warm(tmp_path)

    async def main() -> Any:
        await ws.probe(30.0)
        assert ws.launch_id is not None
        argv, launch_id, paths = [libreyolo(), "train"], ws.launch_id, files(ws)
        if what == "another command":
            argv = [sys.executable, "scripted_trainer.py"]
        elif what == "another launch id":
            launch_id = "0" * 32
        else:
            paths["result_path"] = tmp_path / "elsewhere.json"
        return await ws.go(argv, launch_id=launch_id, **paths)

    assert asyncio.run(main()) is None  # the launcher then starts the trainer cold
    assert_gone(pid_file)
    assert ws.result_path.read_text() == ""


def test_called_off_after_its_report_it_leaves_by_itself(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pid_file = scenario(monkeypatch, tmp_path)
    ws = warm(tmp_path)

    async def main() -> int | None:
        await ws.probe(30.0)
        first = await ws.abort()
        assert await ws.abort() is None  # twice is harmless
        return first

    assert asyncio.run(main()) == CALLED_OFF
    assert_gone(pid_file)
    assert ws.result_path.read_text() == ""


@pytest.mark.parametrize(
    ("device", "expected"),
    [("0", [0]), ("cuda:1", [1]), ("auto", [0]), ("cpu", []), ("0,1", None), ("mps", None)],
)
def test_which_jobs_start_warm(tmp_path: Path, device: str, expected: list[int] | None) -> None:
    job = make_job(tmp_path, train={"device": device})
    if "," in device:
        job = with_devices(job, device)
    config = warm_probe_config(plan_for(job))
    assert (config or {}).get("context_devices") == expected
    if config is not None:
        assert config["libreyolo_deep"] is True  # the trainer needs the whole stack next
    assert warm_probe_config(plan_for(None)) is None  # the generic check: every GPU


def test_the_job_file_can_turn_it_off(tmp_path: Path) -> None:
    def warm_for(
        *, profile: bool = False, launcher: ProcessLauncher | None = None, **preflight: Any
    ) -> WarmStart | None:
        doc = {
            "job": {"name": "t", "runs_dir": str(tmp_path / "runs")},
            "train": {"data": "data.yaml", "model": "yolox-n", "epochs": 1},
            "preflight": preflight,
            "profile": {"enabled": profile},
        }
        job = job_from_dict(doc, base_dir=tmp_path)
        paths = {"log_path": tmp_path / "trainer.log", "result_path": tmp_path / "result.json"}
        return for_job(job, launcher or ProcessLauncher(), **paths)

    on = warm_for()
    assert isinstance(on, WarmStart)
    assert on.result_path == tmp_path / "result.json" and on.cwd == tmp_path / "runs"
    assert warm_for(warm_start=False) is None
    assert warm_for(profile=True) is None  # nothing may hold the card the profiler measures
    assert warm_for(launcher=ScriptedLauncher()) is None  # its trainer is not libreyolo's


def test_the_warm_process_runs_under_the_python_of_the_libreyolo_command(tmp_path: Path) -> None:
    def script(first_line: str) -> str:
        path = tmp_path / f"libreyolo-{len(list(tmp_path.iterdir()))}"
        path.write_text(f"{first_line}\nfrom libreyolo.cli import entrypoint\n")
        return str(path)

    assert trainer_python(script(f"#!{sys.executable}")) == sys.executable
    found = trainer_python(script("#!/usr/bin/env python3"))
    assert found is not None and Path(found).name.startswith("python")
    # Not a plain Python script: pip's long-path shell trick, another program, no #! at all.
    assert trainer_python(script("#!/bin/sh")) is None
    assert trainer_python(script("#!/usr/bin/perl")) is None
    assert trainer_python(script("import sys")) is None
    assert trainer_python(script(f"#!{sys.executable} -E")) is None  # options: run it cold
    assert trainer_python(str(tmp_path / "missing")) is None
    installed = trainer_python()  # this venv's own command
    assert installed is not None and Path(installed).parent == Path(libreyolo()).parent


def test_the_launcher_starts_cold_when_its_warm_trainer_died_waiting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The OOM killer (here SIGKILL) took the waiting process: the launch still happens, cold,
    with the command line asked for, under the id the intent recorded."""
    scenario(monkeypatch, tmp_path)
    ws = warm(tmp_path)
    launcher = ProcessLauncher()

    async def main() -> tuple[int, Any, int | None]:
        await ws.probe(30.0)
        assert ws.pid is not None
        waiting = ws.pid
        os.kill(waiting, signal.SIGKILL)
        await wait_for(lambda: psutil.Process(waiting).status() == psutil.STATUS_ZOMBIE)
        launcher.warm = ws
        launch_id = launcher.reserved_launch_id
        assert launch_id is not None
        trainer = await launcher.launch(
            [libreyolo(), "train", "json=true"], launch_id=launch_id, **files(ws)
        )
        return waiting, trainer, await trainer.wait()

    waiting, trainer, code = asyncio.run(main())
    assert launcher.warm is None
    assert trainer.pid != waiting  # a new process: the cold start
    assert trainer.record.argv == [libreyolo(), "train", "json=true"]
    assert code is not None  # the real `libreyolo train` ran (and refused: no model, no data)
    assert "warm start" in ws.log_path.read_text()


@requires_libreyolo
@pytest.mark.training
def test_a_warm_started_trainer_outlives_the_agent_and_is_reattached(tmp_path: Path) -> None:
    """The real `libreyolo train`, started warm (the CPU probe ran in its process): the agent
    exits mid-run, the trainer trains on, a new agent re-attaches to that same process."""
    dataset = demo.make_dataset(tmp_path / "data" / "ds")
    job = daemon_job(tmp_path, dataset, epochs=8)
    job = dataclasses.replace(job, preflight=PreflightSection(enabled=True, allow_cpu=True))
    env = env_for(tmp_path)
    shutdown = asyncio.Event()
    probed: list[int] = []

    async def during(daemon: Daemon, probe: Any, session: Any) -> None:
        await wait_for(lambda: daemon.status is not None and daemon.status.completed_epochs >= 1)
        log = (env.state_dir / "agent.log").read_text()
        found = re.search(r"warm start: trainer pid=(\d+) runs the GPU probe", log)
        assert found is not None
        probed.append(int(found.group(1)))
        shutdown.set()  # what SIGTERM to the agent does

    code, first, _ = asyncio.run(run_daemon(job, env, during, shutdown))
    assert code == 0 and first.trainer is not None
    pid = first.trainer.pid
    assert probed == [pid]  # the process that probed is the one training
    assert psutil.pid_exists(pid), "the trainer must outlive the agent"
    code, second, _ = asyncio.run(run_daemon(job, env))
    assert code == 0
    assert second.trainer is not None and second.trainer.pid == pid
    assert second.state.reason is not None and second.state.reason.value == "completed"
    log = (env.state_dir / "agent.log").read_text()
    assert f"re-attached to trainer pid={pid}" in log
    assert log.count("trainer started pid=") == 1


@pytest.mark.training
@requires_libreyolo
def test_the_warm_trainer_starts_before_the_agent_is_up(tmp_path: Path) -> None:
    """The probe is the longest step before the first epoch: the agent starts its process
    before its own start-up (the sync target's recovery, the HTTP server, the provider and
    target checks), and that same process trains."""
    dataset = demo.make_dataset(tmp_path / "data" / "ds")
    job = daemon_job(tmp_path, dataset, epochs=1)
    job = dataclasses.replace(job, preflight=PreflightSection(enabled=True, allow_cpu=True))
    env = env_for(tmp_path)
    code, daemon, _ = asyncio.run(run_daemon(job, env))
    assert code == 0 and daemon.trainer is not None
    log = (env.state_dir / "agent.log").read_text()
    found = re.search(r"warm start: trainer pid=(\d+) runs the GPU probe", log)
    assert found is not None and int(found.group(1)) == daemon.trainer.pid
    assert found.start() < log.index("http listening") < log.index("phase BOOTING -> PREFLIGHT")
    assert daemon.state.reason is not None and daemon.state.reason.value == "completed"


@requires_libreyolo
def test_a_job_that_fails_the_target_check_calls_the_early_warm_trainer_off(
    tmp_path: Path,
) -> None:
    """Started before the provider and target checks, the warm trainer is called off when they
    fail: nothing trains, and nothing of it is left while the box is torn down."""
    dataset = demo.make_dataset(tmp_path / "data" / "ds")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    job = daemon_job(tmp_path, dataset, epochs=1, sync=False)
    job = dataclasses.replace(
        job,
        preflight=PreflightSection(enabled=True, allow_cpu=True),
        sync=job_from_dict(
            {
                "train": {"data": str(dataset)},
                "sync": {"target": f"file://{blocker}/sub"},
            }
        ).sync,
    )
    env = env_for(tmp_path)
    code, daemon, _ = asyncio.run(run_daemon(job, env))
    assert code == 0
    assert daemon.state.reason is not None and daemon.state.reason.value == "preflight_failed"
    assert "target.canary" in (daemon.state.cause or "")
    assert daemon.state.trainer is None and daemon.state.launch is None
    log = (env.state_dir / "agent.log").read_text()
    found = re.search(r"warm start: trainer pid=(\d+) runs the GPU probe", log)
    assert found is not None, log[-3000:]
    pid = int(found.group(1))
    gone = not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert gone, f"the warm trainer {pid} was left running"
    assert "phase BOOTING -> PREFLIGHT" not in log  # it never got to preflight
