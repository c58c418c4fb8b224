"""The NVIDIA driver, read through NVML in an NVML host process (no torch), else ``nvidia-smi``.

Its version and the newest CUDA it supports decide whether torch's CUDA build runs on it, and
which PyTorch wheel index to recommend when it does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
from dataclasses import dataclass

from agent.gpu.nvml import NVMLError
from agent.gpu.nvmlhost import NvmlHost
from agent.preflight.report import FAIL, PASS, WARN, Check, first_line, make_check
from agent.preflight.runner import kill_group
from agent.util.threads import in_thread

#: Seconds the driver query (NVML, else nvidia-smi) may take.
DRIVER_TIMEOUT_S = 15.0
#: Oldest Linux driver per CUDA major version (CUDA's minor-version compatibility floor).
_MIN_DRIVER = {11: "450.80", 12: "525.60", 13: "580"}
#: CUDA versions PyTorch publishes wheels for (download.pytorch.org/whl/cuXYZ), newest first.
_WHEEL_CUDA = ((13, 0), (12, 8), (12, 6), (12, 4), (12, 1), (11, 8))


@dataclass(frozen=True)
class DriverInfo:
    """The NVIDIA driver: its version and the newest CUDA it supports (``"12.4"``)."""

    version: str | None = None
    cuda: str | None = None
    #: ``nvml`` or ``nvidia-smi``: where the facts came from.
    source: str | None = None
    #: Why there are no facts (both ways tried), when ``version`` is None.
    error: str | None = None


def _nvml_driver(timeout_s: float) -> DriverInfo:
    """The driver's version and the CUDA it supports, asked of NVML in an NVML host process
    (:mod:`agent.gpu.nvmlhost`: the driver's libraries never enter the agent), ended afterwards."""
    host = NvmlHost(timeout_s=timeout_s, init_timeout_s=timeout_s)
    try:
        host.nvmlInit()
        try:
            version = host.nvmlSystemGetDriverVersion()
            cuda_int = int(host.nvmlSystemGetCudaDriverVersion())
        finally:
            with contextlib.suppress(NVMLError):
                host.nvmlShutdown()
        cuda = f"{cuda_int // 1000}.{cuda_int % 1000 // 10}"
        return DriverInfo(version=str(version), cuda=cuda, source="nvml")
    except NVMLError as exc:
        return DriverInfo(error=f"NVML: {exc}")
    finally:
        host.close()


async def read_driver(timeout_s: float) -> DriverInfo:
    """The driver through NVML, else ``nvidia-smi``; each gets ``timeout_s``. Never raises."""
    try:
        info = await in_thread(lambda: _nvml_driver(timeout_s), timeout_s + 5, "preflight-nvml")
    except TimeoutError:
        info = DriverInfo(error=f"NVML: no answer within {timeout_s:.0f} s")
    if info.version is not None:
        return info
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return DriverInfo(error=f"{info.error}; nvidia-smi: not found")
    try:
        proc = await asyncio.create_subprocess_exec(
            smi,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        return DriverInfo(error=f"{info.error}; nvidia-smi: {exc}")
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        kill_group(proc.pid)
        return DriverInfo(error=f"{info.error}; nvidia-smi: no answer within {timeout_s:.0f} s")
    text = out.decode("utf-8", "replace")
    version = re.search(r"Driver Version:\s*([\d.]+)", text)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", text)
    if version is None:
        return DriverInfo(error=f"{info.error}; nvidia-smi: {first_line(text) or 'no output'}")
    return DriverInfo(
        version=version.group(1), cuda=cuda.group(1) if cuda else None, source="nvidia-smi"
    )


def evaluate_driver(
    driver: DriverInfo, *, cuda_available: bool, cpu_ok: bool, hip: str | None = None
) -> Check:
    """The driver check: found (pass), or missing (a failure only when a GPU is needed).

    ``cpu_ok``: the job may train on the CPU, so a missing driver is said to be no problem.
    """
    details = {"version": driver.version, "cuda": driver.cuda, "source": driver.source}
    if driver.version is not None:
        supports = f" (supports CUDA {driver.cuda})" if driver.cuda else ""
        return make_check("driver", PASS, f"{driver.version}{supports}", **details)
    details["error"] = driver.error
    value = f"no NVIDIA driver found ({driver.error})"
    if hip:
        return make_check("driver", WARN, value, "ROCm box: the NVIDIA driver check does not apply")
    if cuda_available:
        return make_check(
            "driver",
            WARN,
            value + ", yet torch sees CUDA",
            "torch works, so only the driver checks are skipped; for them, make NVML "
            "(libnvidia-ml.so.1) or nvidia-smi available",
            **details,
        )
    if cpu_ok:
        # Not "use a GPU instance": the CPU demo's first words to a new user must not be a fix.
        return make_check(
            "driver",
            WARN,
            "no NVIDIA driver; none needed: training will run on the CPU, as the job allows",
            **details,
        )
    return make_check(
        "driver",
        FAIL,
        value,
        "use a GPU instance; in a container, start it with `--gpus all` (NVIDIA Container Toolkit)",
        **details,
    )


def _version_tuple(text: str) -> tuple[int, int]:
    major, minor = [*(int(p) for p in re.findall(r"\d+", text)[:2]), 0, 0][:2]
    return major, minor


def evaluate_cuda_compat(driver_cuda: str | None, torch_cuda: str | None) -> Check | None:
    """Whether the driver runs torch's CUDA build; None when either side is unknown.

    Same major version, older minor: CUDA's minor-version compatibility runs it (warn: PTX JIT
    and a few features need the newer driver). Older major version: it cannot run (fail).
    """
    if not driver_cuda or not torch_cuda:
        return None
    drv, built = _version_tuple(driver_cuda), _version_tuple(torch_cuda)
    details = {"driver_cuda": driver_cuda, "torch_cuda": torch_cuda}
    if drv >= built:
        return make_check(
            "driver.cuda_compat",
            PASS,
            f"driver supports CUDA {driver_cuda} >= torch's CUDA {torch_cuda}",
            **details,
        )
    minimum = _MIN_DRIVER.get(built[0], "the latest")
    fix = f"update the NVIDIA driver (>= {minimum} for CUDA {built[0]})"
    index = wheel_index(None, driver_cuda)
    if index is not None:
        fix += (
            f", or install torch built for CUDA <= {driver_cuda}: pip install --force-reinstall "
            f"torch torchvision --index-url {index}"
        )
    if drv[0] == built[0]:
        return make_check(
            "driver.cuda_compat",
            WARN,
            f"driver supports CUDA {driver_cuda}, torch was built for {torch_cuda}: runs by "
            "minor-version compatibility only",
            fix,
            **details,
        )
    return make_check(
        "driver.cuda_compat",
        FAIL,
        f"driver supports CUDA {driver_cuda} but torch was built for CUDA {torch_cuda}",
        fix,
        **details,
    )


def wheel_index(capability: tuple[int, int] | None, driver_cuda: str | None) -> str | None:
    """The newest PyTorch wheel index that runs on this driver and has kernels for this GPU.

    CUDA 12.8 builds are the first with Blackwell (10.x, 12.x) kernels and the first without
    Maxwell, Pascal and Volta (< 7.5) ones.
    """
    driver = _version_tuple(driver_cuda) if driver_cuda else None
    for cuda in _WHEEL_CUDA:
        if driver is not None and cuda > driver:
            continue
        if capability is not None and capability < (7, 5) and cuda >= (12, 8):
            continue
        if capability is not None and capability >= (10, 0) and cuda < (12, 8):
            continue
        return f"https://download.pytorch.org/whl/cu{cuda[0]}{cuda[1]}"
    return None
