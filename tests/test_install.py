"""install.sh, through its --dry-run: which pip call gets the custom index, which extras go in."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
CUDA_INDEX = "--index-url https://download.pytorch.org/whl/cu128"


def dry_run(tmp_path: Path, *args: str, nvidia_smi: bool, pip_args: str = "") -> list[str]:
    """The pip command lines ``install.sh --dry-run`` would run, on a PATH of our choosing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("dirname", "sed"):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    if nvidia_smi:
        fake = bin_dir / "nvidia-smi"
        fake.write_text("#!/bin/sh\nexit 0\n", encoding="utf-8")
        fake.chmod(0o755)
    env = {"PATH": str(bin_dir), "PYTHON": sys.executable, "VENV": str(tmp_path / "venv")}
    if pip_args:
        env["PIP_ARGS"] = pip_args
    proc = subprocess.run(
        ["/bin/bash", str(REPO_ROOT / "install.sh"), "--dry-run", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "venv").exists()  # a dry run creates nothing
    return [line for line in proc.stdout.splitlines() if " -m pip " in line]


def test_a_custom_index_applies_to_torch_only(tmp_path: Path) -> None:
    torch, agent = dry_run(tmp_path, nvidia_smi=False, pip_args=CUDA_INDEX)
    assert CUDA_INDEX in torch and "torch==2.14.1 torchvision==0.29.1" in torch
    assert "--index-url" not in agent and "-e " in agent


@pytest.mark.parametrize(
    ("args", "nvidia_smi", "extras"),
    [
        ((), False, r"\[train\]"),
        (("--dev",), False, r"\[train\,dev\]"),
        ((), True, r"\[train\,gpu\]"),
        (("--dev",), True, r"\[train\,dev\,gpu\]"),
    ],
)
def test_the_gpu_extra_comes_with_nvidia_smi(
    tmp_path: Path, args: tuple[str, ...], nvidia_smi: bool, extras: str
) -> None:
    torch, agent = dry_run(tmp_path, *args, nvidia_smi=nvidia_smi)
    assert agent.endswith(extras), agent  # printf %q escapes the brackets and commas
    assert "--index-url" not in torch


def test_install_sh_is_valid_bash() -> None:
    proc = subprocess.run(["/bin/bash", "-n", str(REPO_ROOT / "install.sh")], capture_output=True)
    assert proc.returncode == 0, proc.stderr
