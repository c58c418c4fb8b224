"""Preflight: every check's pass and fail paths.

GPU failures that cannot happen on a CPU machine (no kernel image, NaN matmul, wrong device
count, hung kernel, NCCL trouble) come from running the real probe against the stand-in ``torch``
in ``tests/fakes/torch_standin``, put first on the child's import path; the probe, the process
handling and the parsing are the real code. The Hub is a tiny real HTTP server on loopback that
the real ``huggingface_hub`` client talks to.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest
from aiohttp import web

from agent import preflight as pf
from agent.config import Env, Job, job_from_dict
from agent.preflight import (
    FAIL,
    PASS,
    WARN,
    Check,
    DeviceSpec,
    DiskNeed,
    FsUsage,
    MountInfo,
    PreflightReport,
    format_table,
    run_preflight,
)

STANDIN = str(Path(__file__).parent / "fakes" / "torch_standin")
FAKE_TORCH_ENV = "LIBREYOLO_AGENT_FAKE_TORCH"
REPO_ROOT = Path(__file__).resolve().parents[1]

H100: dict[str, Any] = {"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "memory_gib": 80}
GTX1080: dict[str, Any] = {"name": "NVIDIA GeForce GTX 1080", "capability": [6, 1]}
#: torch 2.x+cu128's arch list: no Pascal.
CU128_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


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
# The report


def test_report_ok_failures_json_and_table() -> None:
    report = PreflightReport(
        (
            Check("shm", PASS, "16.0 GiB at /dev/shm"),
            Check("cpu", WARN, "2 CPUs", "set train.workers=1"),
            Check("gpu0.matmul", FAIL, "CUDA error: no kernel image", "install torch", {"n": 2}),
        ),
        wall_s=1.25,
    )
    assert not report.ok
    assert [c.name for c in report.failures()] == ["gpu0.matmul"]
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is False and data["wall_s"] == 1.25
    assert data["checks"][2] == {
        "name": "gpu0.matmul",
        "status": "fail",
        "value": "CUDA error: no kernel image",
        "fix": "install torch",
        "details": {"n": 2},
    }
    table = format_table(report)
    assert "FAIL  gpu0.matmul  CUDA error: no kernel image" in table
    assert "fix: install torch" in table
    assert "fix: set train.workers=1" in table
    assert table.splitlines()[-1].startswith("preflight FAILED: 1 of 3 checks failed (gpu0.matmul)")
    ok = PreflightReport((Check("shm", PASS, "x"),), wall_s=0.1)
    assert ok.ok and format_table(ok).splitlines()[-1].startswith("preflight passed")


# --------------------------------------------------------------------------------------------
# Pure verdicts


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, DeviceSpec("auto")),
        ("auto", DeviceSpec("auto", text="auto")),
        ("cpu", DeviceSpec("cpu", text="cpu")),
        (0, DeviceSpec("gpus", (0,), "0")),
        ("0,1,2,3", DeviceSpec("gpus", (0, 1, 2, 3), "0,1,2,3")),
        ("cuda:1", DeviceSpec("gpus", (1,), "cuda:1")),
        ("[0, 1]", DeviceSpec("gpus", (0, 1), "[0, 1]")),
        ("gpu", DeviceSpec("invalid", text="gpu")),
        ("0,0", DeviceSpec("invalid", text="0,0")),
    ],
)
def test_parse_device_reads_libreyolo_forms(value: Any, expected: DeviceSpec) -> None:
    assert pf.parse_device(value) == expected


@pytest.mark.parametrize(
    ("capability", "archs", "status", "text"),
    [
        ((9, 0), CU128_ARCHS, PASS, "sm_90 is in torch's arch list"),
        ((8, 9), ["sm_80", "sm_86"], PASS, "runs torch's sm_86 kernels"),
        ((6, 1), CU128_ARCHS, FAIL, "torch has no kernels for sm_61"),
        ((12, 0), ["sm_90", "compute_90"], WARN, "PTX JIT from compute_90"),
        ((9, 0), ["sm_90a"], PASS, "sm_90 runs torch's sm_90a"),
        ((10, 0), ["sm_90a"], FAIL, "no kernels for sm_100"),
        ((12, 0), ["sm_100"], FAIL, "no kernels for sm_120"),
    ],
)
def test_arch_support_follows_cuda_compatibility_rules(
    capability: tuple[int, int], archs: list[str], status: str, text: str
) -> None:
    got_status, got_text = pf.arch_support(capability, archs)
    assert got_status == status
    assert text in got_text


def test_driver_cuda_compat_pass_warn_fail() -> None:
    assert pf.evaluate_cuda_compat("12.4", "12.1").status == PASS  # type: ignore[union-attr]
    minor = pf.evaluate_cuda_compat("12.2", "12.8")
    assert minor is not None and minor.status == WARN and "minor-version" in minor.value
    major = pf.evaluate_cuda_compat("12.4", "13.0")
    assert major is not None and major.status == FAIL
    assert major.fix is not None and "whl/cu124" in major.fix and ">= 580" in major.fix
    assert pf.evaluate_cuda_compat(None, "12.4") is None


@pytest.mark.parametrize(
    ("capability", "driver", "tag"),
    [
        ((9, 0), None, "cu130"),
        ((9, 0), "12.5", "cu124"),  # there is no cu125 build
        ((6, 1), None, "cu126"),  # 12.8+ builds dropped Pascal
        ((12, 0), "12.9", "cu128"),  # Blackwell needs 12.8+
        ((12, 0), "12.4", None),  # no build runs a Blackwell GPU on that driver
    ],
)
def test_wheel_index_fits_gpu_and_driver(
    capability: tuple[int, int], driver: str | None, tag: str | None
) -> None:
    index = pf.wheel_index(capability, driver)
    assert index == (None if tag is None else f"https://download.pytorch.org/whl/{tag}")


def test_driver_missing_fails_only_when_a_gpu_is_needed() -> None:
    found = pf.DriverInfo(version="550.54.15", cuda="12.4", source="nvml")
    ok = pf.evaluate_driver(found, cuda_available=True, cpu_ok=False)
    assert ok.status == PASS and ok.value == "550.54.15 (supports CUDA 12.4)"
    missing = pf.DriverInfo(error="NVML: NVML Shared Library Not Found; nvidia-smi: not found")
    assert pf.evaluate_driver(missing, cuda_available=False, cpu_ok=True).status == WARN
    failed = pf.evaluate_driver(missing, cuda_available=False, cpu_ok=False)
    assert failed.status == FAIL and failed.fix is not None and "--gpus all" in failed.fix


def test_gpu_count_against_train_device() -> None:
    assert pf.evaluate_gpu_count(DeviceSpec("all"), 8).status == PASS
    assert pf.evaluate_gpu_count(DeviceSpec("gpus", (0, 1), "0,1"), 2).status == PASS
    short = pf.evaluate_gpu_count(DeviceSpec("gpus", (0, 1, 2, 3), "0,1,2,3"), 2)
    assert short.status == FAIL and "wants GPUs 0,1,2,3 but 2 are visible" in short.value
    idle = pf.evaluate_gpu_count(DeviceSpec("auto"), 4)
    assert idle.status == WARN and "3 idle but billed" in idle.value
    assert idle.fix is not None and "train.device='0,1,2,3'" in idle.fix
    assert pf.evaluate_gpu_count(DeviceSpec("invalid", text="gpu"), 1).status == FAIL
    assert pf.evaluate_gpu_count(DeviceSpec("cpu", text="cpu"), 2).status == WARN


def test_matmul_verdicts() -> None:
    good = {"n": 2000, "finite": True, "max_abs_err": 1e-5, "ref_max_abs": 80.0, "seconds": 0.01}
    assert pf.evaluate_matmul(0, good, (9, 0)).status == PASS
    tf32 = {**good, "max_abs_err": 0.08}  # 1e-3 relative: TF32 territory, still fine
    assert pf.evaluate_matmul(0, tf32, (9, 0)).status == PASS
    wrong = pf.evaluate_matmul(0, {**good, "max_abs_err": 8.0}, (9, 0))
    assert wrong.status == FAIL and "disagrees with the CPU" in wrong.value
    nan = pf.evaluate_matmul(1, {**good, "finite": False}, (9, 0))
    assert nan.status == FAIL and nan.name == "gpu1.matmul" and "NaN" in nan.value
    oom = pf.evaluate_matmul(0, {"error": "OutOfMemoryError: CUDA out of memory."}, (9, 0))
    assert oom.status == FAIL and oom.fix is not None and "nvidia-smi" in oom.fix


def test_checkpoint_estimate_reads_the_size_letter() -> None:
    small, note = pf.checkpoint_estimate("LibreYOLO9s.pt", 100, 10)
    assert small == (2 + 10 + 2) * 10_000_000 * pf.CHECKPOINT_BYTES_PER_PARAM
    assert "size 's'" in note and "10 epoch_N" in note
    nano, _ = pf.checkpoint_estimate("yolox-n", 100, 0)
    assert nano == 4 * 3_000_000 * pf.CHECKPOINT_BYTES_PER_PARAM  # save_period=0: no epoch_N
    unknown, note = pf.checkpoint_estimate("runs/x/weights/last.pt", None, None)
    assert "size unknown" in note
    assert unknown == (4 + pf.DEFAULT_EPOCHS // 10) * 60_000_000 * pf.CHECKPOINT_BYTES_PER_PARAM


def _needs(archive: int | None, ckpt: int, unknown: str | None = None) -> list[DiskNeed]:
    return pf.disk_needs(
        runs_dir=Path("/r"),
        checkpoints=(ckpt, "note"),
        hf_home=Path("/h"),
        dataset_dest=Path("/d"),
        archive_name="ds.tar",
        archive_bytes=archive,
        unknown=unknown,
    )


def test_disk_needs_add_up_on_a_shared_file_system_with_30_percent_headroom() -> None:
    gib = pf.GiB
    needs = _needs(archive=10 * gib, ckpt=5 * gib)  # 10 archive + 10 unpacked + 5 = 25 GiB
    one_fs = {p: FsUsage(1, "/", int(25 * gib * 1.3)) for p in (Path("/r"), Path("/h"), Path("/d"))}
    assert {c.status for c in pf.evaluate_disk(needs, one_fs)} == {PASS}
    short = {p: FsUsage(1, "/", int(25 * gib * 1.3) - 1) for p in one_fs}
    checks = pf.evaluate_disk(needs, short)
    assert [c.name for c in checks] == ["disk.hf_home", "disk.dataset", "disk.runs"]
    assert {c.status for c in checks} == {FAIL}
    assert "shared with disk.dataset, disk.runs" in checks[0].value
    assert checks[2].details["required_bytes"] == int(25 * gib * 1.3)
    # On separate file systems each location only needs its own share.
    split = {
        Path("/h"): FsUsage(1, "/", 14 * gib),
        Path("/d"): FsUsage(2, "/data", 12 * gib),
        Path("/r"): FsUsage(3, "/runs", 6 * gib),
    }
    statuses = {c.name: c.status for c in pf.evaluate_disk(needs, split)}
    assert statuses == {"disk.hf_home": PASS, "disk.dataset": FAIL, "disk.runs": FAIL}


def test_disk_with_unknown_dataset_size_warns_and_guesses_only_warn() -> None:
    needs = _needs(archive=None, ckpt=pf.GiB, unknown="dataset size unknown (Hub down)")
    big = {p: FsUsage(1, "/", 100 * pf.GiB) for p in (Path("/r"), Path("/h"), Path("/d"))}
    checks = pf.evaluate_disk(needs, big)
    assert {c.status for c in checks} == {WARN}
    assert "dataset size unknown" in checks[0].value
    tiny = {p: FsUsage(1, "/", 1) for p in big}
    assert {c.status for c in pf.evaluate_disk(needs, tiny, strict=False)} == {WARN}


def test_disk_check_on_a_real_directory(tmp_path: Path) -> None:
    where = tmp_path / "not" / "yet" / "created"
    usage = pf.fs_usage(where)
    assert usage.free > 0 and usage.device == os.stat(tmp_path).st_dev
    fits = [DiskNeed("runs", where, (("checkpoints", 1),))]
    huge = [DiskNeed("runs", where, (("checkpoints", usage.free * 2),))]
    assert pf.evaluate_disk(fits, {where: usage})[0].status == PASS
    failed = pf.evaluate_disk(huge, {where: usage})[0]
    assert failed.status == FAIL and failed.fix is not None and "30 %" in failed.fix


OVERLAY_BOX = [
    MountInfo("/", "overlay", "overlay"),
    MountInfo("/proc", "proc", "proc"),
    MountInfo("/dev/shm", "tmpfs", "shm"),
    MountInfo("/etc/hosts", "ext4", "/dev/nvme0n1p1"),  # Docker's single-file bind mount
    MountInfo("/usr/bin/nvidia-smi", "ext4", "/dev/nvme0n1p1"),
    MountInfo("/workspace", "ext4", "/dev/nvme1n1"),
]


def test_hf_home_on_overlay_while_a_volume_exists_warns() -> None:
    def is_dir(path: str) -> bool:
        return path == "/workspace"

    warn = pf.evaluate_hf_home(Path("/root/.cache/huggingface"), OVERLAY_BOX, is_dir=is_dir)
    assert warn.status == WARN and "/workspace is a volume" in warn.value
    assert warn.fix == "export HF_HOME=/workspace/huggingface so downloads survive a restart"
    on_volume = pf.evaluate_hf_home(Path("/workspace/hf"), OVERLAY_BOX, is_dir=is_dir)
    assert on_volume.status == PASS and "persistent volume" in on_volume.value
    no_volume = [m for m in OVERLAY_BOX if m.mountpoint != "/workspace"]
    alone = pf.evaluate_hf_home(Path("/root/.cache/huggingface"), no_volume, is_dir=is_dir)
    assert alone.status == PASS and "no separate volume" in alone.value
    # The file bind mounts above are not volumes even where they are directories.
    assert [m.mountpoint for m in pf.find_volumes(OVERLAY_BOX, lambda p: True)] == ["/workspace"]


def test_shm_docker_default_fails_with_workers() -> None:
    docker = 64 * pf.MiB
    failed = pf.evaluate_shm(docker, workers=8, ranks=1, batch=16, imgsz=640)
    assert failed.status == FAIL and "64.0 MiB" in failed.value
    assert failed.fix is not None and "--shm-size" in failed.fix
    assert pf.evaluate_shm(docker, workers=0, ranks=1, batch=16, imgsz=640).status == WARN
    nccl = pf.evaluate_shm(docker, workers=0, ranks=2, batch=16, imgsz=640)
    assert nccl.status == FAIL and "NCCL" in nccl.value
    assert pf.evaluate_shm(None, workers=4, ranks=1, batch=16, imgsz=640).status == FAIL
    # 8 GPUs x 8 workers x 2 batches of 64 images at 640 px: about 60 GiB in flight.
    tight = pf.evaluate_shm(2 * pf.GiB, workers=8, ranks=8, batch=512, imgsz=640)
    assert tight.status == WARN and "may be short" in tight.value
    assert pf.evaluate_shm(64 * pf.GiB, workers=8, ranks=1, batch=-1, imgsz=640).status == PASS


def test_ram_and_cpu_verdicts() -> None:
    gib = pf.GiB
    assert pf.evaluate_ram(64 * gib, 128 * gib, workers=8, ranks=1).status == PASS
    assert pf.evaluate_ram(5 * gib, 128 * gib, workers=8, ranks=1).status == WARN
    failed = pf.evaluate_ram(64 * gib, 128 * gib, workers=8, ranks=4, limit=6 * gib)
    assert failed.status == FAIL and "container limit 6.0 GiB" in failed.value
    assert pf.evaluate_cpu(16, workers=8, ranks=1).status == PASS
    warn = pf.evaluate_cpu(16, workers=8, ranks=4)
    assert (
        warn.status == WARN and warn.fix == "set train.workers=3 to avoid oversubscribing the CPUs"
    )
    assert "LibreYOLO's default" in pf.evaluate_cpu(4, workers=None, ranks=1).value


def test_cgroup_limits_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "kubepods" / "pod1").mkdir(parents=True)
    (v2 / "kubepods" / "cpu.max").write_text("800000 100000\n")
    (v2 / "kubepods" / "pod1" / "cpu.max").write_text("max 100000\n")
    (v2 / "kubepods" / "pod1" / "memory.max").write_text(f"{8 * pf.GiB}\n")
    (tmp_path / "self-v2").write_text("0::/kubepods/pod1\n")
    limits = pf.cgroup_limits(v2, tmp_path / "self-v2")
    assert limits == pf.CgroupLimits(cpus=8.0, memory_bytes=8 * pf.GiB)

    v1 = tmp_path / "v1"
    (v1 / "cpu" / "docker").mkdir(parents=True)
    (v1 / "cpu" / "docker" / "cpu.cfs_quota_us").write_text("250000\n")
    (v1 / "cpu" / "docker" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "memory").mkdir()
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
    (tmp_path / "self-v1").write_text("4:memory:/docker\n3:cpu,cpuacct:/docker\n0::/\n")
    assert pf.cgroup_limits(v1, tmp_path / "self-v1") == pf.CgroupLimits(cpus=2.5)
    assert pf.cgroup_limits(tmp_path / "none", tmp_path / "missing") == pf.CgroupLimits()


# --------------------------------------------------------------------------------------------
# The real probe against the stand-in torch


def test_standin_healthy_gpu_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = make_job(tmp_path, train={"device": "0"})
    scenario = {"devices": [H100], "arch_list": CU128_ARCHS, "cuda": "12.8"}
    report = run(monkeypatch, job, make_env(tmp_path), scenario)
    assert report.ok, format_table(report)
    assert check(report, "torch.version").value == "2.5.1+cu124"
    assert check(report, "torch.cuda_build").value == "CUDA 12.8"
    assert check(report, "cuda.available").value == "yes, 1 GPU"
    assert check(report, "gpu.count").status == PASS
    gpu0 = check(report, "gpu0")
    assert gpu0.status == PASS and gpu0.value.startswith("NVIDIA H100 80GB HBM3, 80.0 GiB, sm_90")
    assert check(report, "gpu0.arch").status == PASS
    matmul = check(report, "gpu0.matmul")
    assert matmul.status == PASS and matmul.details["max_abs_err"] == 0.0
    assert check(report, "libreyolo").value == "1.6.0"
    assert report.get("nccl") is None  # one GPU: nothing to all-reduce
    assert check(report, "probe").details["timings_s"]["import_torch"] < 5


def test_no_kernel_image_is_reported_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scenario = {
        "devices": [{**GTX1080, "matmul": "no_kernel"}],
        "arch_list": CU128_ARCHS,
        "cuda": "12.8",
    }
    report = run(monkeypatch, make_job(tmp_path), make_env(tmp_path), scenario)
    assert not report.ok
    arch = check(report, "gpu0.arch")
    assert arch.status == FAIL and "torch has no kernels for sm_61" in arch.value
    matmul = check(report, "gpu0.matmul")
    assert matmul.status == FAIL
    assert matmul.value == "CUDA error: no kernel image is available for execution on the device"
    assert matmul.fix is not None and "sm_61" in matmul.fix and "whl/cu126" in matmul.fix
    assert "AcceleratorError" in matmul.details["error"]


@pytest.mark.parametrize(
    ("mode", "value"),
    [
        ("nan", "2000x2000 matmul result holds NaN/Inf"),
        ("wrong", "2000x2000 matmul disagrees with the CPU"),
        ("busy", "CUDA error: CUDA-capable device(s) is/are busy or unavailable"),
    ],
)
def test_bad_matmul_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, value: str
) -> None:
    scenario = {"devices": [H100, {**H100, "matmul": mode}]}
    report = run(monkeypatch, None, make_env(tmp_path), scenario)
    assert check(report, "gpu0.matmul").status == PASS
    bad = check(report, "gpu1.matmul")
    assert bad.status == FAIL and bad.value.startswith(value)
    assert report.get("nccl") is None  # a broken GPU is not all-reduced across
    assert [c.name for c in report.failures()] == ["gpu1.matmul"]


def test_wrong_device_count_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = make_job(tmp_path, train={"device": "cuda:3"})
    report = run(monkeypatch, job, make_env(tmp_path), {"devices": [H100, H100]})
    count = check(report, "gpu.count")
    listed = run(monkeypatch, with_devices(job, "0,1,2,3"), make_env(tmp_path), {"devices": [H100]})
    assert check(listed, "gpu.count").value == (
        "train.device='0,1,2,3' wants GPUs 0,1,2,3 but 1 is visible"
    )
    assert listed.get("nccl") is None
    assert count.status == FAIL
    assert count.value == "train.device='cuda:3' wants GPU 3 but 2 are visible"
    assert count.fix is not None and "train.device='0,1'" in count.fix


def test_gpu_in_use_warns_and_unreadable_gpu_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = {"properties_error": "CUDA error: unspecified launch failure"}
    scenario = {"devices": [{**H100, "free_gib": 10}, broken]}
    report = run(monkeypatch, make_job(tmp_path), make_env(tmp_path), scenario)
    gpu0 = check(report, "gpu0")
    assert gpu0.status == WARN and "another process holds 70.0 GiB" in gpu0.value
    gpu1 = check(report, "gpu1")
    assert gpu1.status == FAIL
    assert gpu1.value == "cannot read its properties: CUDA error: unspecified launch failure"
    assert report.get("gpu1.matmul") is None


def test_hung_gpu_fails_within_the_timeout_and_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_file = tmp_path / "pids"
    job = make_job(tmp_path, preflight={"timeout": 2})
    scenario = {"devices": [{**H100, "matmul": "hang"}], "pid_file": str(pid_file)}
    t0 = time.monotonic()
    report = run(monkeypatch, job, make_env(tmp_path), scenario)
    assert time.monotonic() - t0 < 2 + 3
    probe = check(report, "probe")
    assert probe.status == FAIL
    assert probe.value == "no answer within 2 s (hung at gpu0.matmul); killed"
    assert probe.fix is not None and "Xid" in probe.fix
    assert [c.name for c in report.failures()] == ["probe"]
    assert_gone(pid_file)


def test_hung_torch_import_fails_within_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make_job(tmp_path, preflight={"timeout": 1.5})
    report = run(monkeypatch, job, make_env(tmp_path), {"import": "hang"})
    probe = check(report, "probe")
    assert probe.status == FAIL and "(hung at import torch)" in probe.value
    assert report.wall_s < 1.5 + 3


def test_two_gpus_all_reduce_through_nccl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pid_file = tmp_path / "pids"
    scenario = {"devices": [H100, H100, H100], "pid_file": str(pid_file)}
    job = with_devices(make_job(tmp_path), "0,2")
    report = run(monkeypatch, job, make_env(tmp_path), scenario)
    assert check(report, "gpu.count").status == WARN  # GPU 1 idle but billed
    nccl = check(report, "nccl")
    assert nccl.status == PASS and nccl.value.startswith("all-reduce across 2 GPUs")
    assert nccl.details["values"] == [3.0, 3.0] and nccl.details["devices"] == [0, 2]
    assert len(pid_file.read_text().split()) == 3  # the probe and one worker per GPU
    assert_gone(pid_file)


def test_hung_nccl_is_reported_within_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_file = tmp_path / "pids"
    scenario = {"devices": [H100, H100], "nccl": "hang", "pid_file": str(pid_file)}
    job = with_devices(make_job(tmp_path, preflight={"timeout": 4}), "0,1")
    t0 = time.monotonic()
    report = run(monkeypatch, job, make_env(tmp_path), scenario)
    assert time.monotonic() - t0 < 4 + 2
    assert check(report, "probe").status == PASS  # the probe itself gave up on NCCL in time
    nccl = check(report, "nccl")
    assert nccl.status == FAIL and "hung" in nccl.value
    assert nccl.fix is not None and "NCCL_P2P_DISABLE=1" in nccl.fix
    assert_gone(pid_file)


def test_nccl_errors_name_their_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = None  # no job: all visible GPUs
    report = run(monkeypatch, job, make_env(tmp_path), {"devices": [H100, H100], "nccl": "error"})
    nccl = check(report, "nccl")
    assert nccl.status == FAIL and nccl.value.startswith("NCCL error in:")
    assert nccl.fix is not None and "--shm-size" in nccl.fix
    monkeypatch.setenv(FAKE_TORCH_ENV, json.dumps({"devices": [H100, H100], "nccl": "wrong"}))
    report = asyncio.run(run_preflight(job, make_env(tmp_path), extra_pythonpath=[STANDIN]))
    wrong = check(report, "nccl")
    assert wrong.status == FAIL and wrong.value == "all-reduce gave [4.0, 4.0], expected 3.0"


def test_torch_import_error_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report = run(monkeypatch, make_job(tmp_path), make_env(tmp_path), {"import": "error"})
    torch_check = check(report, "torch.version")
    assert torch_check.status == FAIL
    assert torch_check.value == (
        "cannot import torch: ImportError: libcudnn.so.9: cannot open shared object file: "
        "No such file or directory"
    )
    assert check(report, "libreyolo").status == PASS  # still looked at
    assert report.get("cuda.available") is None


def test_cpu_only_torch_build_fails_unless_cpu_is_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scenario = {"version": "2.5.1+cpu", "cuda": None}
    report = run(monkeypatch, make_job(tmp_path), make_env(tmp_path), scenario)
    build = check(report, "torch.cuda_build")
    assert build.status == FAIL and build.value == "CPU-only build (torch 2.5.1+cpu)"
    assert build.fix is not None and "download.pytorch.org/whl/cu" in build.fix
    assert check(report, "cuda.available").status == FAIL
    allowed = make_job(tmp_path, preflight={"allow_cpu": True})
    report = run(monkeypatch, allowed, make_env(tmp_path), scenario)
    assert check(report, "torch.cuda_build").status == WARN
    assert check(report, "cuda.available").status == WARN


def test_allow_cpu_does_not_excuse_a_job_that_names_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make_job(tmp_path, train={"device": "0"}, preflight={"allow_cpu": True})
    report = run(monkeypatch, job, make_env(tmp_path), {"devices": []})
    cuda = check(report, "cuda.available")
    assert cuda.status == FAIL and cuda.fix is not None and "allow_cpu does not apply" in cuda.fix


def test_driver_too_old_warning_is_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warning = (
        "CUDA initialization: The NVIDIA driver on your system is too old (found version "
        "11040). Please update your GPU driver by downloading and installing a new version."
    )
    scenario = {"devices": [H100], "available": False, "init_warning": warning}
    report = run(monkeypatch, make_job(tmp_path), make_env(tmp_path), scenario)
    cuda = check(report, "cuda.available")
    assert cuda.status == FAIL and cuda.value == f"no: {warning}"
    assert cuda.fix is not None and "driver is too old" in cuda.fix


@pytest.mark.parametrize(
    ("mode", "value"),
    [
        ("missing", "not installed"),
        ("broken", "not importable: RuntimeError: operator torchvision::nms does not exist"),
    ],
)
def test_libreyolo_not_importable_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, value: str
) -> None:
    scenario = {"devices": [H100], "libreyolo": mode}
    job = make_job(tmp_path, preflight={"deep_import": True})
    report = run(monkeypatch, job, make_env(tmp_path), scenario)
    lib = check(report, "libreyolo")
    assert lib.status == FAIL and lib.value == value and lib.fix is not None


def test_probe_that_dies_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report = run(monkeypatch, make_job(tmp_path), make_env(tmp_path), {"import": "segv"})
    probe = check(report, "probe")
    assert probe.status == FAIL
    assert probe.value.startswith("the torch probe died at import torch (")
    assert probe.details["returncode"] == -11
    report = run(monkeypatch, None, make_env(tmp_path), None, python=str(tmp_path / "nope"))
    assert check(report, "probe").value.startswith("the torch probe died at start-up (cannot start")


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
        "from agent.config import Env, job_from_dict\n"
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
# The Hub: dataset size and access, HF_TOKEN


class TinyHub:
    """The two Hub endpoints preflight calls, over real HTTP on loopback."""

    def __init__(self, *, size: int = 50 * pf.MiB, private: bool = False) -> None:
        self.size = size
        self.private = private
        self.tokens = {"hf_good": "write", "hf_readonly": "read"}
        self.auth_seen: list[str] = []
        self.url = ""

    def _token(self, request: web.Request) -> str | None:
        auth = request.headers.get("Authorization", "")
        self.auth_seen.append(auth)
        return auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None

    async def whoami(self, request: web.Request) -> web.Response:
        token = self._token(request)
        if token not in self.tokens:
            return web.json_response(
                {"error": "Invalid credentials in Authorization header"}, status=401
            )
        role = self.tokens[token]
        return web.json_response(
            {"type": "user", "name": "alice", "auth": {"accessToken": {"role": role}}}
        )

    async def paths_info(self, request: web.Request) -> web.Response:
        token = self._token(request)
        repo = f"{request.match_info['ns']}/{request.match_info['name']}"
        if repo != "org/ds" or (self.private and token not in self.tokens):
            return web.json_response(
                {"error": "Repository not found"},
                status=401,
                headers={"X-Error-Code": "RepoNotFound"},
            )
        if request.match_info["rev"] != "main":
            return web.json_response(
                {"error": "Invalid rev id"},
                status=404,
                headers={"X-Error-Code": "RevisionNotFound"},
            )
        form = await request.post()
        found = [p for p in form.getall("paths") if p == "ds.tar"]
        return web.json_response(
            [{"type": "file", "path": p, "size": self.size, "oid": "0" * 40} for p in found]
        )

    async def serve(self, body: Callable[[str], Awaitable[PreflightReport]]) -> PreflightReport:
        app = web.Application()
        app.router.add_get("/api/whoami-v2", self.whoami)
        app.router.add_post("/api/datasets/{ns}/{name}/paths-info/{rev}", self.paths_info)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            host, port = runner.addresses[0][:2]
            return await body(f"http://{host}:{port}")
        finally:
            await runner.cleanup()


NO_GPU = {"devices": []}


def hub_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hub: TinyHub,
    *,
    token: str | None,
    file: str = "ds.tar",
    revision: str = "main",
    sync: str | None = "hf://org/run1",
) -> PreflightReport:
    sections: dict[str, dict[str, Any]] = {
        "dataset": {"repo": "org/ds", "file": file, "revision": revision, "dest": "data"},
        "preflight": {"allow_cpu": True},
    }
    if sync:
        sections["sync"] = {"target": sync}
    job = make_job(tmp_path, **sections)
    monkeypatch.setenv(FAKE_TORCH_ENV, json.dumps(NO_GPU))

    async def body(url: str) -> PreflightReport:
        env = make_env(tmp_path, endpoint=url, token=token)
        return await run_preflight(job, env, extra_pythonpath=[STANDIN])

    return asyncio.run(hub.serve(body))


def test_hub_dataset_size_and_valid_write_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = TinyHub(private=True)
    report = hub_run(tmp_path, monkeypatch, hub, token="hf_good")
    remote = check(report, "dataset.remote")
    assert remote.status == PASS and remote.value == "org/ds@main: ds.tar, 50.0 MiB"
    token = check(report, "hf_token")
    assert token.status == PASS and token.value == "valid (user alice, role write)"
    disk = check(report, "disk.dataset")
    assert disk.status == PASS and "unpacked (estimate: archive x1) 50.0 MiB" in disk.value
    assert report.ok, format_table(report)
    assert "Bearer hf_good" in hub.auth_seen  # it really went over HTTP with the token
    assert "hf_good" not in json.dumps(report.to_dict()) + format_table(report)


def test_hub_huge_dataset_fails_the_disk_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = TinyHub(size=10 * 1024**5)  # 10 PiB
    report = hub_run(tmp_path, monkeypatch, hub, token=None, sync=None)
    assert check(report, "dataset.remote").status == PASS
    for name in ("disk.hf_home", "disk.dataset"):
        disk = check(report, name)
        assert disk.status == FAIL and "dataset archive 10240.0 TiB" in disk.value
    assert check(report, "hf_token").value == "not set, not needed (dataset is public)"


def test_hub_private_dataset_without_token_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = hub_run(tmp_path, monkeypatch, TinyHub(private=True), token=None, sync=None)
    remote = check(report, "dataset.remote")
    assert remote.status == FAIL
    assert remote.value == "org/ds not found or private (HF_TOKEN is not set)"
    token = check(report, "hf_token")
    assert token.status == FAIL and token.fix is not None and "HF_TOKEN" in token.fix
    assert check(report, "disk.dataset").status == WARN  # size unknown


@pytest.mark.parametrize(
    ("token", "value"),
    [
        (None, "HF_TOKEN is not set; sync to hf://org/run1 needs a write token"),
        ("hf_bad", "rejected by"),
        ("hf_readonly", "valid but read-only (user alice); sync to hf://org/run1 needs write"),
    ],
)
def test_hub_token_problems_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, token: str | None, value: str
) -> None:
    report = hub_run(tmp_path, monkeypatch, TinyHub(), token=token)
    check_ = check(report, "hf_token")
    assert check_.status == FAIL and check_.value.startswith(value)
    assert "hf_bad" not in json.dumps(report.to_dict())


@pytest.mark.parametrize(
    ("file", "revision", "value"),
    [
        ("other.tar", "main", "no file 'other.tar' in org/ds@main"),
        ("ds.tar", "v9", "no revision 'v9' in org/ds"),
    ],
)
def test_hub_missing_file_or_revision_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file: str, revision: str, value: str
) -> None:
    report = hub_run(
        tmp_path, monkeypatch, TinyHub(), token=None, file=file, revision=revision, sync=None
    )
    remote = check(report, "dataset.remote")
    assert remote.status == FAIL and remote.value == value


def test_hub_unreachable_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = make_job(
        tmp_path,
        dataset={"repo": "org/ds", "file": "ds.tar"},
        sync={"target": "hf://org/run1"},
        preflight={"allow_cpu": True},
    )
    env = make_env(tmp_path, endpoint="http://127.0.0.1:9", token="hf_secret")  # nothing there
    report = run(monkeypatch, job, env, NO_GPU)
    remote = check(report, "dataset.remote")
    assert remote.status == WARN and remote.value.startswith(
        "Hub unreachable at http://127.0.0.1:9"
    )
    assert check(report, "hf_token").status == WARN
    assert {check(report, n).status for n in ("disk.hf_home", "disk.dataset")} == {WARN}
    assert report.ok
    assert "hf_secret" not in json.dumps(report.to_dict()) + format_table(report)
