"""What the divergence check costs per checkpoint (issue 29): the child that reads a
checkpoint's tensors for NaN/inf (``python -m agent.trainer.finite_entry``), timed as the agent
runs it (:func:`agent.trainer.finite.check_weights`).

    python -m bench.finite_check [--repeat 3] [CHECKPOINT ...]

Figures only, nothing asserted. Each row: the checkpoint's size and floating tensors, then the
median over ``--repeat`` runs of the whole check (start to answer, what the agent waits), the
child's ``torch.load`` (mapped) and its scan, and the rest (interpreter and ``import torch``,
which does not grow with the checkpoint). Without arguments it writes synthetic LibreYOLO-shaped
checkpoints (model, EMA and the optimizer's two moments: four copies of the weights) of the
sizes of ``yolox-n``, ``yolo9-t`` and a 500 MB model; real ones can be named instead.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent.trainer.finite import WeightsCheck, check_weights  # noqa: E402

#: (name, parameters in float32, tensors per copy of the weights): the first two as LibreYOLO
#: 1.6.0's checkpoints of those models count them.
SYNTHETIC = (
    ("yolox-n-like", 720_000, 486),
    ("yolo9-t-like", 2_200_000, 1333),
    ("500MB", 31_000_000, 1500),
)


def write_synthetic(path: Path, params: int, tensors: int) -> None:
    import torch

    per = max(1, params // tensors)

    def copy() -> dict[str, torch.Tensor]:
        return {f"layer{i}.weight": torch.randn(per) for i in range(tensors)}

    optimizer = {"state": {0: {"exp_avg": copy(), "exp_avg_sq": copy()}}}
    torch.save({"model": copy(), "ema": copy(), "optimizer": optimizer, "epoch": 0}, path)


def run(paths: list[Path], repeat: int) -> None:
    head = ("MB", 7), ("tensors", 7), ("check_s", 8), ("load_s", 7), ("scan_s", 7), ("startup_s", 9)
    print(f"{'checkpoint':<16} " + " ".join(f"{name:>{width}}" for name, width in head))
    for path in paths:
        checks: list[WeightsCheck] = [asyncio.run(check_weights(path)) for _ in range(repeat)]
        if any(c.finite is None for c in checks):
            print(f"{path.name:<16} cannot tell: {checks[0].error}")
            continue
        total = statistics.median(c.seconds for c in checks)
        load = statistics.median(c.load_s or 0.0 for c in checks)
        scan = statistics.median(c.scan_s or 0.0 for c in checks)
        mb = path.stat().st_size / 1e6
        print(
            f"{path.stem:<16} {mb:>7.1f} {checks[0].tensors:>7} {total:>8.2f} {load:>7.2f} "
            f"{scan:>7.2f} {total - load - scan:>9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("checkpoints", nargs="*", type=Path)
    args = parser.parse_args()
    if args.checkpoints:
        run(args.checkpoints, args.repeat)
        return
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for name, params, tensors in SYNTHETIC:
            path = Path(tmp) / f"{name}.pt"
            write_synthetic(path, params, tensors)
            paths.append(path)
        run(paths, args.repeat)


if __name__ == "__main__":
    main()
