"""``torch.cuda`` of the stand-in: devices come from the scenario."""

from __future__ import annotations

import time
import warnings
from types import SimpleNamespace
from typing import Any

from torch import SCENARIO, AcceleratorError

#: The real texts (torch 2.x on a GPU its build has no kernels for; exclusive-mode GPU in use).
NO_KERNEL_TEXT = (
    "CUDA error: no kernel image is available for execution on the device\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)
BUSY_TEXT = (
    "CUDA error: CUDA-capable device(s) is/are busy or unavailable\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
)

_DEVICES: list[dict[str, Any]] = list(SCENARIO.get("devices", []))
_current = 0


def is_available() -> bool:
    if SCENARIO.get("hang_at") == "is_available":
        time.sleep(3600)
    if SCENARIO.get("init_warning"):
        # stacklevel=1: torch raises it from C++ inside torch/cuda/__init__.py, so the warning
        # is attributed to torch's own file (the probe keeps only torch's warnings).
        warnings.warn(SCENARIO["init_warning"], UserWarning, stacklevel=1)
    default = bool(_DEVICES) and SCENARIO.get("cuda", "12.4") is not None
    return bool(SCENARIO.get("available", default))


def device_count() -> int:
    return len(_DEVICES) if is_available() else 0


def get_arch_list() -> list[str]:
    return list(SCENARIO.get("arch_list", ["sm_80", "sm_86", "sm_90"]))


def _device(device: Any) -> dict[str, Any]:
    text = str(device)
    index = int(text.split(":", 1)[1]) if ":" in text else _current
    if not text.startswith("cuda") and not isinstance(device, int):
        raise RuntimeError(
            f"Expected one of cpu, cuda device type at start of device string: {text}"
        )
    if isinstance(device, int):
        index = device
    if not 0 <= index < len(_DEVICES):
        raise AcceleratorError("CUDA error: invalid device ordinal")
    return {"index": index, **_DEVICES[index]}


def get_device_properties(index: int) -> SimpleNamespace:
    dev = _device(index)
    if dev.get("properties_error"):
        raise AcceleratorError(dev["properties_error"])
    major, minor = dev.get("capability", [9, 0])
    return SimpleNamespace(
        name=dev.get("name", "NVIDIA H100 80GB HBM3"),
        total_memory=int(dev.get("memory_gib", 80) * 1024**3),
        major=major,
        minor=minor,
    )


def mem_get_info(index: int) -> tuple[int, int]:
    dev = _device(index)
    total = int(dev.get("memory_gib", 80) * 1024**3)
    free = int(dev.get("free_gib", dev.get("memory_gib", 80) * 0.99) * 1024**3)
    return free, total


def set_device(index: int) -> None:
    global _current
    _current = _device(index)["index"]


def synchronize(index: int | None = None) -> None:
    _device(_current if index is None else index)
