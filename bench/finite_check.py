"""What the divergence check costs per checkpoint (issues 29 and 26): the agent's check
(:func:`agent.trainer.finite.check_weights`: the checkpoint's bytes read without torch, in a
thread of the agent) against the way of the round before, a child Python that imports torch,
``torch.load(weights_only=True, mmap=True)`` and ``torch.isfinite`` on every floating tensor
(run here from this file, as the agent ran it: one thread, CPU).

    python -m bench.finite_check [--repeat 3] [CHECKPOINT ...]

Figures only, nothing asserted. Each row: the checkpoint's size and floating tensors, then the
medians over ``--repeat`` runs of the agent's check (seconds, and the growth of the agent's
peak RSS over the whole bench so far), the torch child's wall time and its peak RSS, the
ratio of the two times, and whether both gave the same answer. Without arguments it writes
synthetic LibreYOLO-shaped checkpoints (model, EMA and the optimizer's two moments: four copies
of the weights) of the sizes of ``yolox-n``, ``yolo9-t`` and a 500 MB model, each once with
finite weights and once with one NaN in the EMA; real ones can be named instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent.trainer.finite import WeightsCheck, check_weights  # noqa: E402

#: The round before's child, verbatim in what it did (for the comparison only).
TORCH_CHILD = """
import json, sys, torch
torch.set_num_threads(1)
ckpt = torch.load(sys.argv[1], map_location="cpu", weights_only=True, mmap=True)
def walk(o):
    if isinstance(o, torch.Tensor):
        yield o
    elif isinstance(o, dict):
        for v in o.values():
            yield from walk(v)
    elif isinstance(o, (list, tuple)):
        for v in o:
            yield from walk(v)
bad = sum(1 for t in walk(ckpt) if (t.is_floating_point() or t.is_complex())
          and not bool(torch.isfinite(t).all()))
print(json.dumps({"bad": bad}))
"""
#: (name, parameters in float32, tensors per copy of the weights): the first two as LibreYOLO
#: 1.6.0's checkpoints of those models count them.
SYNTHETIC = (
    ("yolox-n-like", 720_000, 486),
    ("yolo9-t-like", 2_200_000, 1333),
    ("500MB", 31_000_000, 1500),
)


def write_synthetic(path: Path, params: int, tensors: int, *, nan: bool = False) -> None:
    import torch

    per = max(1, params // tensors)

    def copy() -> dict[str, torch.Tensor]:
        return {f"layer{i}.weight": torch.randn(per) for i in range(tensors)}

    ema = copy()
    if nan:
        ema[f"layer{tensors // 2}.weight"][per // 2] = float("nan")
    optimizer = {"state": {0: {"exp_avg": copy(), "exp_avg_sq": copy()}}}
    torch.save({"model": copy(), "ema": ema, "optimizer": optimizer, "epoch": 0}, path)


def torch_child(path: Path) -> tuple[float, float, int]:
    """The round before's check: wall seconds, the child's peak RSS MiB, NaN/inf tensors."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", TORCH_CHILD, str(path)], stdout=subprocess.PIPE, text=True
    )
    out, _ = proc.communicate()
    wall = time.monotonic() - started
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the peak of all children so far
    return wall, usage.ru_maxrss / 1024, int(json.loads(out.strip().splitlines()[-1])["bad"])


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(paths: list[Path], repeat: int) -> None:
    head = (
        ("MB", 7),
        ("tensors", 7),
        ("agent_s", 8),
        ("+rss_MiB", 8),
        ("torch_s", 8),
        ("child_MiB", 9),
        ("ratio", 6),
        ("same", 5),
    )
    print(f"{'checkpoint':<20} " + " ".join(f"{name:>{width}}" for name, width in head))
    for path in paths:
        before = rss_mib()
        checks: list[WeightsCheck] = [asyncio.run(check_weights(path)) for _ in range(repeat)]
        grew = rss_mib() - before
        if any(c.finite is None for c in checks):
            print(f"{path.name:<20} cannot tell: {checks[0].error}")
            continue
        ours = statistics.median(c.seconds for c in checks)
        children = [torch_child(path) for _ in range(repeat)]
        theirs = statistics.median(c[0] for c in children)
        child_rss = max(c[1] for c in children)
        same = all(c[2] == checks[0].bad_count for c in children)
        mb = path.stat().st_size / 1e6
        print(
            f"{path.stem:<20} {mb:>7.1f} {checks[0].tensors:>7} {ours:>8.3f} {grew:>8.1f} "
            f"{theirs:>8.2f} {child_rss:>9.0f} {theirs / max(ours, 1e-6):>6.0f} "
            f"{'yes' if same else 'NO':>5}"
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
            for nan in (False, True):
                path = Path(tmp) / f"{name}{'-nan' if nan else ''}.pt"
                write_synthetic(path, params, tensors, nan=nan)
                paths.append(path)
        run(paths, args.repeat)


if __name__ == "__main__":
    main()
