"""``libreyolo-agent preflight JOB`` proves what ``run`` proves before training: a sync target
that cannot take a write fails it (the canary), as it would fail the run's own check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def preflight(tmp_path: Path, target: str) -> subprocess.CompletedProcess[str]:
    job = tmp_path / "job.toml"
    job.write_text(
        f"""[job]
name = "canary"
runs_dir = "{tmp_path / "runs"}"
[train]
model = "yolox-n"
pretrained = false
data = "{tmp_path / "data.yaml"}"
epochs = 1
device = "cpu"
[sync]
target = "{target}"
[preflight]
allow_cpu = true
""",
        encoding="utf-8",
    )
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "preflight", str(job), "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
            "LIBREYOLO_AGENT_STATE_DIR": str(tmp_path / "state"),
            "HF_ENDPOINT": "http://127.0.0.1:9",
            "NO_PROXY": "127.0.0.1,localhost",
        },
        timeout=170,
    )


def canary_of(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    doc = json.loads(proc.stdout)
    [check] = [c for c in doc["checks"] if c["name"] == "target.canary"]
    return dict(check)


def test_preflight_fails_a_target_that_cannot_take_a_write(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n", encoding="utf-8")
    proc = preflight(tmp_path, f"file://{blocker}/synced")
    check = canary_of(proc)
    assert check["status"] == "fail", check
    assert "cannot write there" in str(check["value"])
    assert proc.returncode == 1, proc.stderr[-2000:]


def test_preflight_passes_the_canary_of_a_writable_target_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    synced = tmp_path / "synced"
    proc = preflight(tmp_path, f"file://{synced}")
    check = canary_of(proc)
    assert check["status"] == "pass", check
    assert not (synced / "agent" / ".canary").exists()
