"""The CUDA side (agent/preflight/cuda.py, driver.py, runner.py): the verdicts alone, then the
real probe run in a child against the stand-in ``torch``."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from agent import preflight as pf
from agent.preflight import FAIL, PASS, WARN, DeviceSpec, format_table, run_preflight
from tests.test_preflight import (
    CU128_ARCHS,
    FAKE_TORCH_ENV,
    GTX1080,
    H100,
    STANDIN,
    assert_gone,
    check,
    make_env,
    make_job,
    run,
    with_devices,
)

# --------------------------------------------------------------------------------------------
# Pure verdicts


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


#: Past the probe's own timeout, what a loaded machine may add (a Python start-up, a kill and a
#: reap); the stand-in's hangs last an hour, so "within the timeout" still tells them apart.
#: The hang tests' timeouts (5-15 s) leave a loaded machine the time to reach the hung stage
#: (with 2 s, a slow start-up was still in "import torch" when the timeout fired).
SLACK_S = 60.0


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
    job = make_job(tmp_path, preflight={"timeout": 10})
    scenario = {"devices": [{**H100, "matmul": "hang"}], "pid_file": str(pid_file)}
    t0 = time.monotonic()
    report = run(monkeypatch, job, make_env(tmp_path), scenario)
    assert time.monotonic() - t0 < 10 + SLACK_S  # not the hang's hour
    probe = check(report, "probe")
    assert probe.status == FAIL
    assert probe.value == "no answer within 10 s (hung at gpu0.matmul); killed"
    assert probe.fix is not None and "Xid" in probe.fix
    assert [c.name for c in report.failures()] == ["probe"]
    assert_gone(pid_file)


def test_hung_torch_import_fails_within_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make_job(tmp_path, preflight={"timeout": 5})
    report = run(monkeypatch, job, make_env(tmp_path), {"import": "hang"})
    probe = check(report, "probe")
    assert probe.status == FAIL and "(hung at import torch)" in probe.value
    assert report.wall_s < 5 + SLACK_S


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
    job = with_devices(make_job(tmp_path, preflight={"timeout": 15}), "0,1")
    t0 = time.monotonic()
    report = run(monkeypatch, job, make_env(tmp_path), scenario)
    assert time.monotonic() - t0 < 15 + SLACK_S
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
