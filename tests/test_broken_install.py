"""A box whose Hugging Face client is broken (seen on a real GPU box: a dependency of the HTTP
client was missing): ``agent run`` says so with the fix and exits 2 (no restart), instead of
crashing in BOOTING with a traceback; a job that never talks to the Hub is not affected."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _shadow_truststore(tmp_path: Path) -> Path:
    """A folder that, first on PYTHONPATH, makes ``import truststore`` fail like a missing
    package: huggingface_hub's HTTP client imports it."""
    shadow = tmp_path / "shadow" / "truststore"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'truststore'\", name='truststore')\n"
    )
    return shadow.parent


def _run(tmp_path: Path, target: str) -> subprocess.CompletedProcess[str]:
    data = tmp_path / "data.yaml"
    data.write_text("train: images\nval: images\nnames:\n  0: box\n")
    job = tmp_path / "job.toml"
    job.write_text(
        f"""
[job]
name = "broken"
runs_dir = "{tmp_path / "runs"}"
[train]
model = "yolox-n"
data = "{data}"
epochs = 1
[preflight]
enabled = false
[server]
listen = "127.0.0.1:0"
[sync]
target = "{target}"
"""
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{_shadow_truststore(tmp_path)}{os.pathsep}{ROOT}",
        "LIBREYOLO_AGENT_STATE_DIR": str(tmp_path / "state"),
        "HF_ENDPOINT": "http://127.0.0.1:9",
    }
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "run", str(job)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_broken_hub_client_is_a_clear_exit_2_before_anything_starts(tmp_path: Path) -> None:
    run = _run(tmp_path, "hf://org/run")
    assert run.returncode == 2, run.stderr[-2000:]
    assert "the Hugging Face client cannot be loaded" in run.stderr
    assert "truststore" in run.stderr and "hf:// sync" in run.stderr
    assert "repair the install" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "state" / "state.json").exists()  # nothing started, nothing counted


@pytest.mark.parametrize("target", ["file://{tmp}/synced"])
def test_a_job_that_never_talks_to_the_hub_does_not_load_it(tmp_path: Path, target: str) -> None:
    """The same broken client, a file:// job: the check does not get in its way (the run goes
    on to its own end; the demo-sized job fails later for want of images, not of the Hub)."""
    run = _run(tmp_path, target.format(tmp=tmp_path))
    assert "the Hugging Face client cannot be loaded" not in run.stderr
    assert (tmp_path / "state" / "state.json").exists()
