"""The child that looks inside one checkpoint for NaN and inf: the agent never imports torch.

    python -m agent.trainer.finite_entry CHECKPOINT

Prints one JSON line: how many floating-point tensors the checkpoint holds (the model, the EMA,
the training model, the optimizer's moments: every one), which are not all finite (the first
few by name, and how many), the epoch the checkpoint says it holds (LibreYOLO 1.6.0 stores the
0-based index, so ``epoch + 1``), and how long the load and the scan took. Exit 0 when it could
tell, 1 when it could not read the file (the line then says ``error``).

``torch.load(weights_only=True, mmap=True)``: only tensors and plain containers are rebuilt (a
checkpoint runs no code here), and the file is mapped rather than read, so a checkpoint of
gigabytes costs page cache, not this process's memory. One thread: the trainer keeps the CPU.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

#: Names of non-finite tensors given in the answer (the count is always whole).
MAX_NAMES = 5


def _tensors(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{path}.{key}" if path else str(key))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{path}[{i}]")


def check(path: str) -> dict[str, Any]:
    """The answer for the checkpoint at ``path`` (see the module docstring)."""
    import torch

    torch.set_num_threads(1)
    started = time.monotonic()
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # whatever torch raises for a file it cannot read
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    loaded = time.monotonic()
    tensors = 0
    bad: list[str] = []
    bad_count = 0
    for name, tensor in _tensors(ckpt, ""):
        if not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        tensors += 1
        if not bool(torch.isfinite(tensor).all()):
            bad_count += 1
            if len(bad) < MAX_NAMES:
                bad.append(name)
    epoch = ckpt.get("epoch") if isinstance(ckpt, dict) else None
    return {
        "tensors": tensors,
        "bad": bad,
        "bad_count": bad_count,
        "epoch": epoch + 1 if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
        "load_s": round(loaded - started, 4),
        "scan_s": round(time.monotonic() - loaded, 4),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(json.dumps({"error": "usage: python -m agent.trainer.finite_entry CHECKPOINT"}))
        return 2
    answer = check(argv[0])
    print(json.dumps(answer), flush=True)
    return 1 if "error" in answer else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
