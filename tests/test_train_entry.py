"""The Python-API launcher for device lists (``agent.trainer.train_entry``), on the real LibreYOLO.

A real multi-GPU run needs several GPUs (docs/gpu-validation.md says what ran where). On this
CPU machine the tests prove the plumbing: the list reaches ``model.train(device=...)``, where
LibreYOLO's own DDP launcher takes it, and everything else still goes through the real CLI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent import demo
from agent.config.jobfile import parse_job
from agent.trainer.process import build_argv, uses_python_api
from agent.trainer.train_entry import _with_devices, split_device
from tests.support import HANG_S


def test_split_device_builds_on_the_cpu_and_keeps_the_list() -> None:
    args, devices = split_device(["model=yolox-n", "device=0,1,3", "epochs=2"])
    assert args == ["model=yolox-n", "device=cpu", "epochs=2"]
    assert devices == "0,1,3"
    assert split_device(["device=0", "batch=8"]) == (["device=0", "batch=8"], None)


def test_the_built_models_train_gets_the_whole_device_list() -> None:
    calls: list[dict[str, Any]] = []

    class Model:
        def train(self, **kw: Any) -> str:
            calls.append(kw)
            return "ok"

    factory = _with_devices(lambda **_: Model(), "0,1")
    assert factory(device="cpu").train(data="d.yaml", device="cpu") == "ok"
    assert calls == [{"data": "d.yaml", "device": "0,1"}]


def test_device_lists_launch_through_the_python_api(tmp_path: Path) -> None:
    job = parse_job('[train]\ndata = "d.yaml"\ndevice = "0,1"\n', base_dir=tmp_path)
    assert uses_python_api(job)
    argv = build_argv(job, python="/venv/bin/python")
    assert argv[:3] == ["/venv/bin/python", "-m", "agent.trainer.train_entry"]
    assert "device=0,1" in argv and argv[-1] == "json=true"
    single = parse_job('[train]\ndata = "d.yaml"\ndevice = "0"\n', base_dir=tmp_path)
    assert not uses_python_api(single)
    assert build_argv(single)[1] == "train"


def _entry(tmp_path: Path, device: str) -> subprocess.CompletedProcess[str]:
    data = demo.make_dataset(tmp_path / "data", train=4, val=2)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "agent.trainer.train_entry",
            "model=yolox-n",
            "pretrained=false",
            f"data={data}",
            "epochs=1",
            "imgsz=64",
            "batch=2",
            "workers=0",
            f"device={device}",
            f"project={tmp_path / 'runs'}",
            "name=run1",
            "json=true",
        ],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=tmp_path,
    )


def test_a_device_list_reaches_libreyolos_ddp_launcher(tmp_path: Path) -> None:
    # On a machine without CUDA, LibreYOLO's DDP path itself refuses the list: proof that the
    # list got past the CLI's model construction (which dies on "0,1") into model.train().
    proc = _entry(tmp_path, "0,1")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Multi-GPU DDP requires CUDA" in result["message"]
    assert "device='0,1'" in result["message"]


@pytest.mark.training
def test_the_launcher_trains_like_the_cli_for_a_single_device(tmp_path: Path) -> None:
    proc = _entry(tmp_path, "cpu")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["status"] == "complete" and result["device"] == "cpu"
    assert Path(result["last_weights"]).is_file()
