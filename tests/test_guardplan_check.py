"""``guard.plan`` (agent/preflight/guardplan_check.py): a box the guard would KEEP rather than
stop (Lambda, ``command`` without ``stop_command``) is said at preflight, before training."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent.config.jobfile import parse_job
from agent.preflight.guardplan_check import guard_plan_check


def job(teardown: str) -> object:
    return parse_job(f'[train]\ndata = "/d/data.yaml"\n[teardown]\n{teardown}\n', source="t")


@pytest.mark.parametrize(
    ("teardown", "said"),
    [
        ('provider = "lambda"\non_failure = "destroy"', "provider lambda has no stop"),
        (
            'provider = "command"\ncommand = ["true"]\non_failure = "destroy"',
            "no teardown.stop_command",
        ),
    ],
)
def test_a_provider_without_a_stop_is_a_warning_naming_the_kept_box(
    teardown: str, said: str
) -> None:
    check = guard_plan_check(job(teardown))  # type: ignore[arg-type]
    assert check is not None and check.status == "warn" and check.name == "guard.plan"
    assert said in check.value and "KEEPS this box" in check.value and check.fix


@pytest.mark.parametrize(
    "teardown",
    [
        'provider = "vast"',
        'provider = "runpod"',
        'provider = "none"',
        'provider = "command"\ncommand = ["true"]\nstop_command = ["true"]',
    ],
)
def test_a_provider_that_can_stop_says_nothing(teardown: str) -> None:
    assert guard_plan_check(job(teardown)) is None  # type: ignore[arg-type]


def test_the_warning_is_in_the_preflight_report_of_a_real_run(tmp_path: Path) -> None:
    # Full preflight off: the checks that always run are the report; the job then fails at
    # staging (no data YAML), and its teardown (the command `true`) ends it in seconds.
    job_file = tmp_path / "job.toml"
    job_file.write_text(
        f"""
[job]
name = "run1"
runs_dir = "{tmp_path / "runs"}"
[train]
data = "{tmp_path / "nothere" / "data.yaml"}"
epochs = 1
device = "cpu"
[dataset]
doctor = false
[preflight]
enabled = false
[server]
listen = "127.0.0.1:0"
[teardown]
provider = "command"
command = ["true"]
on_failure = "destroy"
"""
    )
    env = {k: v for k, v in os.environ.items() if k != "LIBREYOLO_AGENT_CRASHPOINT"}
    env["LIBREYOLO_AGENT_STATE_DIR"] = str(tmp_path / "state")
    env["LIBREYOLO_AGENT_GUARD_STALE_AFTER"] = "1h"
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli", "run", str(job_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert out.returncode == 0, out.stderr[-3000:]
        assert "preflight warning: guard.plan: provider command has no" in out.stderr
        report = json.loads((tmp_path / "state" / "preflight.json").read_text())
        checks = {c["name"]: c for c in report["checks"]}
        assert checks["guard.plan"]["status"] == "warn"
    finally:
        from agent.guard.plan import guard_pid

        pid = guard_pid(tmp_path / "state")
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
