"""The child that proves a checkpoint loads: the restore drill's loader (the agent never imports
torch).

    python -m agent.trainer.loadcheck_entry CHECKPOINT

Prints one JSON line and exits 0 when the checkpoint loaded whole, 1 when it did not (the line
says ``error``). "Loaded" is what a person who fetched it would do: ``LibreYOLO(CHECKPOINT,
device="cpu")`` builds the model its metadata names and loads its weights; no training, no GPU.

LibreYOLO 1.6.0 loads some families (YOLOX) with ``strict=False`` and only logs the keys it
dropped: a checkpoint missing half its tensors "loads" and predicts with random weights. So the
drill compares the built model's own ``state_dict`` with the weights the checkpoint holds: a key
the model has and the checkpoint lacks, or a tensor of another shape, is a failure.

The file is first read with ``torch.load(weights_only=True)``: only tensors and plain
containers are rebuilt, so a checkpoint whose pickle would run code fails here, before LibreYOLO
(which has its own safe loader) sees it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

#: Missing or mismatched keys named in the answer (the counts are always whole).
MAX_NAMES = 5


def _weights(loaded: Any) -> dict[str, Any]:
    """The state dict LibreYOLO loads from ``loaded`` (its own unwrapping: EMA, model...)."""
    from libreyolo.models import _unwrap_state_dict

    unwrapped = _unwrap_state_dict(loaded) if isinstance(loaded, dict) else {}
    return unwrapped if isinstance(unwrapped, dict) else {}


def _epoch(loaded: Any) -> int | None:
    epoch = loaded.get("epoch") if isinstance(loaded, dict) else None
    return epoch + 1 if isinstance(epoch, int) and not isinstance(epoch, bool) else None


def check(path: str) -> dict[str, Any]:
    """The answer for the checkpoint at ``path`` (see the module docstring)."""
    started = time.monotonic()
    import torch

    torch.set_num_threads(1)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # whatever torch raises for a file it cannot read
        return {"error": f"torch.load: {type(exc).__name__}: {exc}"[:400]}
    imported = time.monotonic()
    try:
        from libreyolo import LibreYOLO

        model = LibreYOLO(path, device="cpu")
    except Exception as exc:  # whatever LibreYOLO raises for a checkpoint it cannot build
        return {"error": f"LibreYOLO: {type(exc).__name__}: {exc}"[:400]}
    built = time.monotonic()
    net = getattr(model, "model", None)
    if not isinstance(net, torch.nn.Module):
        return {"error": f"LibreYOLO built {type(model).__name__}, which holds no torch model"}
    given = _weights(loaded)
    expected = net.state_dict()
    missing = [k for k in expected if k not in given]
    wrong = [
        k
        for k, v in expected.items()
        if k in given
        and isinstance(given[k], torch.Tensor)
        and tuple(given[k].shape) != tuple(v.shape)
    ]
    answer: dict[str, Any] = {
        "family": type(model).__name__,
        "size": getattr(model, "size", None),
        "tensors": len(expected),
        # LibreYOLO 1.6.0 stores the 0-based index: the epoch it holds is one more.
        "epoch": _epoch(loaded),
        "load_s": round(built - imported, 3),
        "seconds_in_child": round(time.monotonic() - started, 3),
    }
    if missing or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the model's {len(expected)} tensors missing")
        if wrong:
            parts.append(f"{len(wrong)} of another shape")
        names = ", ".join((missing + wrong)[:MAX_NAMES])
        answer["error"] = f"{' and '.join(parts)} (first: {names})"
    return answer


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(json.dumps({"error": "usage: python -m agent.trainer.loadcheck_entry CHECKPOINT"}))
        return 2
    answer = check(argv[0])
    print(json.dumps(answer), flush=True)
    return 1 if "error" in answer else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
