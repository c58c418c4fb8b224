"""``libreyolo-agent check`` says what to rent (agent/policy/rent.py): the real CLI in a
subprocess, the fake Hub with the real huggingface_hub client, and no torch imported."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.policy.rent import (
    BYTES_PER_PARAM_ADAM,
    BYTES_PER_PARAM_SGD,
    INSTALL_BYTES,
    model_params,
)
from tests.fakes.hub import FakeHub, run_fake_hub

REPO = Path(__file__).resolve().parents[1]
ARCHIVE = 3_000_000
KEY = "containerKEY-rent-0123456789"
TOKEN = "hf_rentGOODtoken0123456789"
CLEARED = (
    "HF_TOKEN",
    "VAST_API_KEY",
    "CONTAINER_API_KEY",
    "CONTAINER_ID",
    "RUNPOD_API_KEY",
    "RUNPOD_POD_ID",
    "LAMBDA_API_KEY",
    "HF_HUB_OFFLINE",
)


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with run_fake_hub(tokens={TOKEN}) as fake:
        fake.add_file("dataset", "org/data", "data.tar", b"\0" * ARCHIVE)
        fake.add_file("dataset", "org/secret", "data.zip", b"PK" * 1000, private=True)
        yield fake


def write_job(tmp_path: Path, *, dataset: str = 'repo = "org/data"\nfile = "data.tar"') -> Path:
    job = tmp_path / "job.toml"
    job.write_text(
        f"""
[job]
name = "rent"
runs_dir = "{tmp_path / "runs"}"
[dataset]
{dataset}
data_yaml = "data.yaml"
dest = "{tmp_path / "data"}"
[train]
model = "yolox-s"
epochs = 30
save_period = 10
optimizer = "sgd"
[sync]
target = "file://{tmp_path / "synced"}"
[teardown]
provider = "vast"
"""
    )
    return job


def check(
    tmp_path: Path, endpoint: str, *args: str, **env_extra: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(tmp_path / "hf"),
        LIBREYOLO_AGENT_STATE_DIR=str(tmp_path / "state"),
        **env_extra,
    )
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "check", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parts(doc: dict[str, Any]) -> dict[str, Any]:
    return {p["what"]: p for p in doc["rent"]["parts"]}


def test_the_disk_to_rent_adds_the_hubs_archive_size_checkpoints_and_install(
    tmp_path: Path, hub: FakeHub
) -> None:
    job = write_job(tmp_path)
    got = check(tmp_path, hub.url, str(job), "--json", CONTAINER_API_KEY=KEY)
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    by = parts(doc)
    assert by["dataset archive"]["bytes"] == ARCHIVE  # the Hub's listing, exactly
    assert by["dataset unpacked"]["bytes"] == ARCHIVE  # a .tar: x1.0, said to be an estimate
    assert "estimate" in by["dataset unpacked"]["basis"]
    per = int(8.97e6 * BYTES_PER_PARAM_SGD)  # yolox-s, SGD
    # last, best, epoch_10/20/30, two upload snapshots ([sync] is set)
    assert by["checkpoints"]["bytes"] == 7 * per
    assert by["pretrained weights"]["bytes"] == int(8.97e6 * 4)
    assert by["install"]["bytes"] == INSTALL_BYTES
    total = sum(p["bytes"] for p in by.values())
    assert doc["rent"]["total_bytes"] == total and doc["rent"]["complete"] is True
    assert doc["rent"]["rent_disk_gb"] == math.ceil(total * 1.3 / 1e9)
    assert doc["rent"]["hub_problem"] is None
    variables = doc["rent"]["teardown"]["variables"]
    assert variables[0]["names"] == ["CONTAINER_API_KEY", "VAST_API_KEY"]
    assert variables[0]["present"] == "CONTAINER_API_KEY"
    assert variables[1]["names"] == ["CONTAINER_ID"] and variables[1]["present"] is None
    assert KEY not in got.stdout + got.stderr  # names only, never values
    assert any(r.route == "paths_info" for r in hub.requests)


def test_the_text_names_the_total_and_each_part(tmp_path: Path, hub: FakeHub) -> None:
    got = check(tmp_path, hub.url, str(write_job(tmp_path)))
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    assert lines[0].endswith(")") and ": ok (" in lines[0]
    rent = next(line for line in lines if line.startswith("rent: "))
    assert "GB of disk" in rent and "+ 30 %" in rent
    assert any("dataset archive" in line and "3 MB" in line for line in lines)
    assert any("yolox-s: 8.97 M parameters" in line for line in lines)
    assert any(line.startswith("teardown vast: ") and "not set here" in line for line in lines)


def test_a_hub_that_cannot_be_reached_is_one_line_and_the_rest_is_given(tmp_path: Path) -> None:
    got = check(tmp_path, f"http://127.0.0.1:{closed_port()}", str(write_job(tmp_path)))
    assert got.returncode == 0, got.stderr  # the job is valid
    hub_lines = [line for line in got.stdout.splitlines() if "the Hub" in line]
    assert len(hub_lines) == 1 and "not counted" in hub_lines[0]
    assert any("checkpoints" in line for line in got.stdout.splitlines())
    down = f"http://127.0.0.1:{closed_port()}"
    doc = json.loads(check(tmp_path, down, str(write_job(tmp_path)), "--json").stdout)
    assert parts(doc)["dataset archive"]["bytes"] is None
    assert doc["rent"]["complete"] is False and doc["rent"]["hub_problem"]


def test_a_private_dataset_needs_the_token_and_the_token_is_never_shown(
    tmp_path: Path, hub: FakeHub
) -> None:
    job = write_job(tmp_path, dataset='repo = "org/secret"\nfile = "data.zip"')
    refused = json.loads(check(tmp_path, hub.url, str(job), "--json").stdout)
    assert parts(refused)["dataset archive"]["bytes"] is None
    wrong = "hf_wrongTOKEN0123456789"
    refused = check(tmp_path, hub.url, str(job), "--json", HF_TOKEN=wrong)
    assert wrong not in refused.stdout + refused.stderr
    got = check(tmp_path, hub.url, str(job), "--json", HF_TOKEN=TOKEN)
    doc = json.loads(got.stdout)
    by = parts(doc)
    assert by["dataset archive"]["bytes"] == 2000
    assert by["dataset unpacked"]["bytes"] == int(2000 * 1.2)  # compressed: x1.2
    assert TOKEN not in got.stdout + got.stderr


def test_offline_asks_nothing(tmp_path: Path, hub: FakeHub) -> None:
    hub.clear_requests()
    got = check(tmp_path, hub.url, str(write_job(tmp_path)), "--offline")
    assert got.returncode == 0 and "--offline" in got.stdout
    assert hub.requests == []


NO_TORCH = """
import runpy, sys
sys.argv = ["libreyolo-agent", *sys.argv[1:]]
try:
    runpy.run_module("agent.cli", run_name="__main__")
except SystemExit as exc:
    code = exc.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "torchvision", "cv2", "numpy"})
print("HEAVY", heavy, file=sys.stderr)
sys.exit(code)
"""


def test_check_imports_no_torch(tmp_path: Path, hub: FakeHub) -> None:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(HF_ENDPOINT=hub.url, LIBREYOLO_AGENT_STATE_DIR=str(tmp_path / "state"))
    got = subprocess.run(
        [sys.executable, "-c", NO_TORCH, "check", str(write_job(tmp_path))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 0, got.stderr
    assert "rent: " in got.stdout  # the estimate ran, Hub call included
    assert "HEAVY []" in got.stderr, got.stderr


@pytest.mark.parametrize(
    ("model", "params"),
    [
        ("yolox-s", 8.97),
        ("yolo9-t", 2.04),
        ("LibreYOLOXn.pt", 0.91),
        ("deimv2-atto", 0.51),
        ("dfine_x", 62.62),
        ("rtdetrv2-r50", 42.89),
    ],
)
def test_model_names_find_their_family_and_size(model: str, params: float) -> None:
    assert model_params(model)[0] == params


def test_an_unknown_model_falls_back_on_the_guess_and_says_so(tmp_path: Path) -> None:
    from agent.config.jobfile import job_from_dict
    from agent.config.model import Env
    from agent.policy.rent import estimate

    job = job_from_dict(
        {"train": {"data": "d.yaml", "model": "mystery-net", "epochs": 10}}, base_dir=tmp_path
    )
    est = estimate(job, Env(state_dir=tmp_path / "s"), offline=True)
    ckpt = next(p for p in est.parts if p.what == "checkpoints")
    assert ckpt.basis.startswith("guess: ") and "not in the table" in ckpt.basis
    assert ckpt.bytes is not None and ckpt.bytes > 0
    assert BYTES_PER_PARAM_ADAM > BYTES_PER_PARAM_SGD
    assert next(p for p in est.parts if p.what == "dataset").bytes is None
    assert est.complete is False


def test_a_zips_unpacked_size_is_read_from_its_central_directory(
    tmp_path: Path, hub: FakeHub
) -> None:
    import io
    import random
    import zipfile

    members = {
        "images/a.jpg": random.Random(0).randbytes(5000),
        "labels/a.txt": b"0 0.5 0.5 0.1 0.1\n" * 4000,  # compresses well: unpacked >> packed
        "data.yaml": b"path: .\n",
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    hub.add_file("dataset", "org/zipped", "ds.zip", buf.getvalue())
    hub.clear_requests()
    job = write_job(tmp_path, dataset='repo = "org/zipped"\nfile = "ds.zip"')
    got = check(tmp_path, hub.url, str(job), "--json")
    assert got.returncode == 0, got.stderr
    by = parts(json.loads(got.stdout))
    assert by["dataset archive"]["bytes"] == len(buf.getvalue())
    assert by["dataset unpacked"]["bytes"] == sum(len(d) for d in members.values())
    assert "central directory" in by["dataset unpacked"]["basis"]
    reads = [r for r in hub.requests if r.route == "resolve"]
    assert 1 <= len(reads) <= 6  # the end of the file, not the archive
