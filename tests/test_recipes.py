"""docs/recipes.md and its examples: every job file passes the real `libreyolo-agent check`,
every shell snippet parses, every cloud-init block is valid YAML holding the job file it names,
and the two serverless examples run their embedded CPU job to completion."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "docs" / "recipes.md"
JOBS = sorted((ROOT / "examples" / "jobs").glob("*.toml"))
SERVERLESS = ROOT / "examples" / "serverless"
BASH = shutil.which("bash")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", RECIPES.read_text(), flags=re.S | re.M)


def _bash_n(script: str) -> subprocess.CompletedProcess[str]:
    assert BASH is not None
    return subprocess.run([BASH, "-n"], input=script, capture_output=True, text=True, timeout=30)


def _inner_bash_c(script: str) -> list[str]:
    """The scripts of ``bash -c '...'`` one-liners (bash -n of the outer line skips them)."""
    inner = []
    for line in script.splitlines():
        words = shlex.split(line, comments=True) if line.lstrip().startswith("bash -c") else []
        if len(words) >= 3 and words[:2] == ["bash", "-c"]:
            inner.append(words[2])
    return inner


def test_every_provider_has_a_job_file() -> None:
    assert {p.stem for p in JOBS} >= {"vast", "runpod", "lambda", "aws", "gcp"}


@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.name)
def test_job_file_passes_check(job: Path, tmp_path: Path) -> None:
    env = dict(os.environ, LIBREYOLO_AGENT_STATE_DIR=str(tmp_path / "state"))
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli", "check", str(job)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{job}: ok" in out.stdout


def test_job_files_hold_no_secret() -> None:
    for job in JOBS:
        text = job.read_text()
        assert not re.search(r"hf_[A-Za-z0-9]{20,}|rpa_[A-Za-z0-9]{20,}|secret_[a-z0-9]{20,}", text)
        # No TOML key that would carry one (the job format has none; keys come from the env).
        assert not re.search(r"(?im)^\s*\w*(token|api_key|secret|password)\w*\s*=", text), job


def test_bash_blocks_parse() -> None:
    blocks = _blocks("bash")
    assert len(blocks) >= 8  # every recipe has at least one
    for block in blocks:
        for script in (block, *_inner_bash_c(block)):
            result = _bash_n(script)
            assert result.returncode == 0, f"{result.stderr}\n---\n{script}"


def test_runpod_start_command_is_one_line_that_forwards_sigterm() -> None:
    (start,) = [b for b in _blocks("bash") if "/start.sh" in b]
    assert start.count("\n") == 1  # RunPod's field: one line
    (inner,) = _inner_bash_c(start)
    assert "trap fwd TERM" in inner and "supervisor.pid" in inner


def test_cloud_init_blocks_are_valid_and_embed_their_job_file() -> None:
    blocks = _blocks("yaml")
    assert len(blocks) == 2  # Lambda and AWS
    embedded = []
    for block in blocks:
        assert block.startswith("#cloud-config\n")
        doc = yaml.safe_load(block)
        files = {f["path"]: f for f in doc["write_files"]}
        job = files["/etc/libreyolo-agent/job.toml"]["content"]
        embedded.append(job)
        (runcmd,) = doc["runcmd"]
        assert runcmd[:2] == ["bash", "-c"]
        result = _bash_n(runcmd[2])
        assert result.returncode == 0, result.stderr
        assert "secrets.env" in runcmd[2] and "bootstrap.sh" in runcmd[2]
    # The pasted job is exactly the checked example file, not a stale copy.
    assert embedded[0] == (ROOT / "examples" / "jobs" / "lambda.toml").read_text()
    assert embedded[1] == (ROOT / "examples" / "jobs" / "aws.toml").read_text()


def test_beam_image_lists_the_agents_requirements() -> None:
    import tomllib

    sys.path.insert(0, str(SERVERLESS))
    try:
        import beam_train
    finally:
        sys.path.remove(str(SERVERLESS))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["train"]]
    assert wanted == beam_train.AGENT_REQUIREMENTS
    assert beam_train.max_runtime_s() == beam_train.PLATFORM_TIMEOUT_S - 30 * 60


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", ["modal_train.py", "beam_train.py"])
def test_serverless_example_runs_the_demo_job(example: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    out = subprocess.run(
        [sys.executable, str(SERVERLESS / example), "--local", "--demo", "--workdir", str(work)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    state = json.loads((work / "state" / "state.json").read_text())
    assert state["reason"] == "completed"
    assert state["phase"] == "DONE"
    # The job it ran is the serverless shape: no teardown provider, a max_runtime, and the
    # checkpoints went to the sink.
    job = (work / "job.toml").read_text()
    assert 'provider = "none"' in job and "max_runtime = 1500" in job
    assert (work / "synced" / "weights" / "last.pt").is_file()
