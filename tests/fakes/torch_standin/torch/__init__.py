"""A stand-in ``torch`` for preflight tests: GPU failures that cannot happen on a CPU machine.

Placed first on the probe's import path (``run_preflight(..., extra_pythonpath=[STANDIN])``), it
answers the calls ``agent/preflight/probe.py`` makes the way a real CUDA build does, failing with
the real
error texts where the scenario says so. The scenario is JSON in ``LIBREYOLO_AGENT_FAKE_TORCH``
(see ``_scenario.py`` for the keys). Tensors are numpy arrays, so the matmuls are real and the
probe's comparison with the CPU reference is real too.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

from torch import _scenario

SCENARIO = _scenario.load()

if SCENARIO.get("pid_file"):
    with open(SCENARIO["pid_file"], "a") as f:
        f.write(f"{os.getpid()}\n")

if SCENARIO.get("chatter"):
    # What a library prints on import, on stdout: it must never reach a result file.
    print("stand-in torch: chatter on stdout", flush=True)

_import = SCENARIO.get("import", "ok")
if _import == "error":
    raise ImportError(
        SCENARIO.get(
            "import_error",
            "libcudnn.so.9: cannot open shared object file: No such file or directory",
        )
    )
if _import == "hang":
    time.sleep(3600)
if _import == "segv":
    os.kill(os.getpid(), signal.SIGSEGV)

__version__ = SCENARIO.get("version", "2.5.1+cu124")


class AcceleratorError(RuntimeError):
    """torch >= 2.8 raises CUDA errors as this RuntimeError subclass."""


class OutOfMemoryError(RuntimeError):
    pass


class Generator:
    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def manual_seed(self, seed: int) -> Generator:
        self.rng = np.random.default_rng(seed)
        return self


class Size(tuple):  # type: ignore[type-arg]
    pass


class Tensor:
    def __init__(self, data: Any, device: str = "cpu") -> None:
        self.data = np.asarray(data)
        self.device = device

    @property
    def shape(self) -> Size:
        return Size(self.data.shape)

    def to(self, device: str) -> Tensor:
        from torch import cuda

        cuda._device(device)
        return Tensor(self.data.copy(), device)

    def cpu(self) -> Tensor:
        from torch import cuda

        if self.device != "cpu":
            cuda.synchronize(cuda._device(self.device)["index"])
        return Tensor(self.data, "cpu")

    def _binary(self, other: Any, op: Any) -> Tensor:
        if isinstance(other, Tensor):
            if other.device != self.device:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two "
                    f"devices, {self.device} and {other.device}!"
                )
            other = other.data
        return Tensor(op(self.data, other), self.device)

    def __mul__(self, other: Any) -> Tensor:
        return self._binary(other, np.multiply)

    __rmul__ = __mul__

    def __add__(self, other: Any) -> Tensor:
        return self._binary(other, np.add)

    def __sub__(self, other: Any) -> Tensor:
        return self._binary(other, np.subtract)

    def __matmul__(self, other: Tensor) -> Tensor:
        from torch import cuda

        out = self._binary(other, np.matmul)
        if self.device != "cpu":
            mode = cuda._device(self.device).get("matmul", "ok")
            if mode == "no_kernel":
                raise AcceleratorError(cuda.NO_KERNEL_TEXT)
            if mode == "busy":
                raise AcceleratorError(cuda.BUSY_TEXT)
            if mode == "oom":
                raise OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate 16.00 MiB. GPU 0 has a total capacity "
                    "of 79.19 GiB of which 2.06 MiB is free. Process 4242 has 79.18 GiB memory "
                    "in use."
                )
            if mode == "hang":
                time.sleep(3600)
            if mode == "nan":
                out.data[:] = np.nan
            if mode == "wrong":
                out.data += 1.0
        return out

    def abs(self) -> Tensor:
        return Tensor(np.abs(self.data), self.device)

    def max(self) -> Tensor:
        return Tensor(self.data.max(), self.device)

    def min(self) -> Tensor:
        return Tensor(self.data.min(), self.device)

    def all(self) -> Tensor:
        return Tensor(self.data.all(), self.device)

    def item(self) -> Any:
        return self.data.item()


def rand(*size: int, generator: Generator | None = None) -> Tensor:
    rng = (generator or Generator()).rng
    return Tensor(rng.random(size, dtype=np.float32))


def full(size: tuple[int, ...], value: float, device: str = "cpu") -> Tensor:
    from torch import cuda

    if device != "cpu":
        cuda._device(device)
    return Tensor(np.full(size, value, dtype=np.float32), device)


def isfinite(t: Tensor) -> Tensor:
    return Tensor(np.isfinite(t.data), t.device)


from torch import cuda, version  # noqa: E402 - they read the module above

__all__ = ["AcceleratorError", "Tensor", "cuda", "full", "isfinite", "rand", "version"]
