"""Preflight's entry point, ``run_preflight``, end to end; and the helpers the other
``test_preflight_*`` files share (one file per part of ``agent/preflight/``).

GPU failures that cannot happen on a CPU machine (no kernel image, NaN matmul, wrong device
count, hung kernel, NCCL trouble) come from running the real probe against the stand-in ``torch``
in ``tests/fakes/torch_standin``, put first on the child's import path; the probe, the process
handling and the parsing are the real code. The Hub is a tiny real HTTP server on loopback that
the real ``huggingface_hub`` client talks to (``test_preflight_hub.py``).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent.config.jobfile import job_from_dict
from agent.config.model import Env, Job
from agent.preflight import FAIL, PASS, WARN, Check, PreflightReport, format_table, run_preflight

STANDIN = str(Path(__file__).parent / "fakes" / "torch_standin")
FAKE_TORCH_ENV = "LIBREYOLO_AGENT_FAKE_TORCH"
REPO_ROOT = Path(__file__).resolve().parents[1]

H100: dict[str, Any] = {"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "memory_gib": 80}
GTX1080: dict[str, Any] = {"name": "NVIDIA GeForce GTX 1080", "capability": [6, 1]}
#: torch 2.x+cu128's arch list: no Pascal.
CU128_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
#: A box without a GPU (for the stand-in torch).
NO_GPU: dict[str, Any] = {"devices": []}

# --------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------
# Helpers


def make_job(tmp_path: Path, **sections: dict[str, Any]) -> Job:
    doc: dict[str, Any] = {
        "job": {"name": "t", "runs_dir": str(tmp_path / "runs")},
        "train": {"data": "data.yaml", "model": "yolox-n", "epochs": 10, "workers": 0},
    }
    for name, values in sections.items():
        doc[name] = {**doc.get(name, {}), **values}
    return job_from_dict(doc, base_dir=tmp_path)


def with_devices(job: Job, device: str) -> Job:
    """A job that trains on a device list. The job file refuses lists until the agent can launch
    them (LibreYOLO's CLI cannot), but preflight already checks them: build the Job directly."""
    args = (*((k, v) for k, v in job.train.args if k != "device"), ("device", device))
    return replace(job, train=replace(job.train, args=args))


def make_env(
    tmp_path: Path, *, endpoint: str = "http://127.0.0.1:9", token: str | None = None
) -> Env:
    return Env(
        state_dir=tmp_path / "state",
        hf_endpoint=endpoint,
        hf_home=tmp_path / "hf",
        hf_token=token,
    )


def run(
    monkeypatch: pytest.MonkeyPatch,
    job: Job | None,
    env: Env,
    scenario: dict[str, Any] | None,
    **kwargs: Any,
) -> PreflightReport:
    """run_preflight with the stand-in torch playing ``scenario`` (None: the real torch)."""
    if scenario is not None:
        monkeypatch.setenv(FAKE_TORCH_ENV, json.dumps(scenario))
        kwargs.setdefault("extra_pythonpath", [STANDIN])
    return asyncio.run(run_preflight(job, env, **kwargs))


def check(report: PreflightReport, name: str) -> Check:
    found = report.get(name)
    assert found is not None, f"no check {name!r} in {[c.name for c in report.checks]}"
    return found


def assert_gone(pid_file: Path) -> None:
    pids = [int(p) for p in pid_file.read_text().split()]
    assert pids, "the stand-in never started"
    for pid in pids:
        alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        assert not alive, f"probe process {pid} survived"


# --------------------------------------------------------------------------------------------
# The real torch of this machine


def test_real_torch_cpu_allowed_warns_and_generic_check_fails(tmp_path: Path) -> None:
    """Both real-torch paths of this CPU machine, run at once in a fresh interpreter: a job
    that allows the CPU passes with a warning, the generic check (no job) fails with a fix. And
    the daemon's side never imports torch."""
    job_doc = {
        "job": {"runs_dir": str(tmp_path / "runs")},
        "train": {"data": "d.yaml", "model": "yolox-n", "epochs": 2, "workers": 0},
        "preflight": {"allow_cpu": True},
    }
    script = (
        "import asyncio, json, sys\n"
        "from pathlib import Path\n"
        "from agent.config.model import Env\n"
        "from agent.config.jobfile import job_from_dict\n"
        "from agent.preflight import format_table, run_preflight\n"
        "job = job_from_dict(json.loads(sys.argv[1]))\n"
        "env = Env(hf_home=Path(sys.argv[2]), hf_endpoint='http://127.0.0.1:9')\n"
        "async def both():\n"
        "    return await asyncio.gather(run_preflight(job, env), run_preflight(None, env))\n"
        "allowed, generic = asyncio.run(both())\n"
        "print(json.dumps({'allowed': allowed.to_dict(), 'generic': generic.to_dict(),\n"
        "                  'table': format_table(generic), 'torch': 'torch' in sys.modules}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != FAKE_TORCH_ENV}
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(job_doc), str(tmp_path / "hf")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout)
    assert result["torch"] is False, "preflight imported torch in the agent's process"
    allowed = {c["name"]: c for c in result["allowed"]["checks"]}
    generic = {c["name"]: c for c in result["generic"]["checks"]}
    # The wheel's metadata says 2.14.1, torch.__version__ adds the local part: 2.14.1+cu130.
    torch_version = allowed["torch.version"]["value"]
    assert torch_version.split("+")[0] == importlib.metadata.version("torch")
    assert allowed["libreyolo"]["value"] == importlib.metadata.version("libreyolo")
    if allowed["cuda.available"]["status"] == PASS:  # a GPU box: the real GPUs must pass
        for report in (allowed, generic):
            gpu_checks = [c for n, c in report.items() if n.startswith("gpu")]
            assert gpu_checks and all(c["status"] != FAIL for c in gpu_checks), gpu_checks
        return
    assert allowed["cuda.available"]["status"] == WARN
    assert "training will run on the CPU" in allowed["cuda.available"]["value"]
    assert result["allowed"]["ok"] is True, result["allowed"]
    cuda = generic["cuda.available"]
    assert cuda["status"] == FAIL and cuda["fix"], cuda
    assert generic["driver"]["status"] == FAIL
    assert result["generic"]["ok"] is False
    assert "FAIL  cuda.available" in result["table"]


# --------------------------------------------------------------------------------------------
# What a CPU job is told


def test_cpu_demo_is_told_it_trains_on_the_cpu_not_to_rent_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo allows the CPU: its preflight must not greet a new user with "no NVIDIA driver
    ... use a GPU instance", but say plainly that training runs on the CPU as the job allows."""
    job = make_job(tmp_path, preflight={"allow_cpu": True})
    report = run(monkeypatch, job, make_env(tmp_path), NO_GPU)
    assert report.ok, format_table(report)
    cuda = check(report, "cuda.available")
    assert cuda.status == WARN  # the daemon logs "preflight warning: cuda.available"
    assert cuda.value == (
        "no GPU; training will run on the CPU, as the job allows (preflight.allow_cpu)"
    )
    driver = check(report, "driver")
    assert driver.value.endswith("training will run on the CPU, as the job allows")
    assert driver.fix is None and "nvidia-smi: not found" in driver.details["error"]
    said = format_table(report) + json.dumps(report.to_dict())
    assert "GPU instance" not in said and "--gpus all" not in said
    # A job that needs the GPU still gets the fix.
    generic = run(monkeypatch, None, make_env(tmp_path), NO_GPU)
    assert check(generic, "driver").status == FAIL
    assert "use a GPU instance" in (check(generic, "driver").fix or "")


def test_report_statuses_are_plain_strings_in_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """preflight.json is read by users: ``"status": "pass"``, exactly as before the enum."""
    report = run(monkeypatch, make_job(tmp_path), make_env(tmp_path), NO_GPU)
    statuses = {c["status"] for c in report.to_dict()["checks"]}
    assert statuses <= {"pass", "warn", "fail"} and "fail" in statuses
    assert all(type(c["status"]) is str for c in report.to_dict()["checks"])
    assert '"status": "fail"' in json.dumps(report.to_dict())


# --------------------------------------------------------------------------------------------
# The package's layers


#: ``agent/preflight/``'s modules, lowest first: each may import only those before it.
LAYERS = [
    "probe",
    "report",
    "plan",
    "runner",
    "driver",
    "cuda",
    "host",
    "hub_access",
    "cloud",
    "guardplan_check",
    "canary",
]


def test_preflight_parts_import_only_lower_parts_and_config() -> None:
    package = REPO_ROOT / "agent" / "preflight"
    assert sorted(p.stem for p in package.glob("*.py")) == sorted([*LAYERS, "__init__"])
    for i, name in enumerate([*LAYERS, "__init__"]):
        tree = ast.parse((package / f"{name}.py").read_text())
        imported = {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
        } | {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        ours = {m for m in imported if m == "agent" or m.startswith("agent.")}
        # agent.hub is the one home of the Hub client (a base module: it imports config and text);
        # agent.util.threads, agent.util.text, agent.util.disk and agent.util.procs are base
        # helpers that import nothing of ours;
        # agent.gpu.nvml and agent.gpu.nvmlhost (the NVML host process) import only each other;
        # agent.sinks (and its make_sink, in agent.sinks.target) is where checkpoints go (an
        # outside system, a lower layer: the canary).
        allowed = {
            "agent.config.model",
            "agent.hub",
            "agent.gpu.nvml",
            "agent.gpu.nvmlhost",
            "agent.providers",
            "agent.sinks",
            "agent.sinks.target",
            "agent.util.threads",
            "agent.util.text",
            "agent.util.disk",
            "agent.util.procs",
        } | {f"agent.preflight.{lower}" for lower in LAYERS[:i]}
        assert ours <= allowed, f"agent/preflight/{name}.py imports {sorted(ours - allowed)}"
        assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))
