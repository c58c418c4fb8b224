"""``torch.distributed`` of the stand-in: a real rendezvous through the ``file://`` store.

Each rank writes its tensor beside the store file and sums everyone's, so an all-reduce that
"passes" really combined the ranks' values; the scenario's ``nccl`` key makes it hang, fail with
NCCL's text, or sum wrongly.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import numpy as np

from torch import SCENARIO, Tensor

_group: dict[str, Any] = {}

#: What NCCL says when /dev/shm is too small (torch 2.x, NCCL 2.2x).
SHM_ERROR = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled "
    "system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
    "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or "
    "device error.\nLast error:\nError while creating shared memory segment "
    "/dev/shm/nccl-vzIpS6 (size 9637888)"
)


class DistBackendError(RuntimeError):
    pass


class ReduceOp:
    SUM = "sum"


def is_available() -> bool:
    return True


def is_nccl_available() -> bool:
    return SCENARIO.get("nccl", "ok") != "missing"


def init_process_group(
    backend: str,
    *,
    init_method: str,
    rank: int,
    world_size: int,
    timeout: timedelta = timedelta(minutes=10),
) -> None:
    if backend != "nccl":
        raise ValueError(f"stand-in knows only nccl, not {backend!r}")
    _group.update(
        dir=os.path.dirname(urlparse(init_method).path),
        rank=rank,
        world=world_size,
        timeout=timeout.total_seconds(),
    )


def all_reduce(tensor: Tensor, op: str = ReduceOp.SUM) -> None:
    mode = SCENARIO.get("nccl", "ok")
    if mode == "hang":
        time.sleep(3600)
    if mode == "error":
        raise DistBackendError(SCENARIO.get("nccl_error", SHM_ERROR))
    d, rank, world = _group["dir"], _group["rank"], _group["world"]
    tmp = os.path.join(d, f"tmp-{rank}.npy")
    np.save(tmp, tensor.data)
    os.replace(tmp, os.path.join(d, f"rank-{rank}.npy"))
    paths = [os.path.join(d, f"rank-{r}.npy") for r in range(world)]
    deadline = time.monotonic() + _group["timeout"]
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise DistBackendError("Watchdog caught collective operation timeout")
        time.sleep(0.01)
    total = sum(np.load(p) for p in paths)
    tensor.data[:] = total + (1.0 if mode == "wrong" else 0.0)


def destroy_process_group() -> None:
    _group.clear()
