"""Benchmark: the whole preflight against the bare recipe it must stay close to.

The bare recipe is what a careful person types on a fresh box: import torch, one 2000x2000
matmul (on the GPU when there is one). Goal (issue 4): preflight within 1.5x of it. Both are
timed alternately in one run, so the ratio holds on a noisy shared machine.

    .venv/bin/python bench/preflight_ratio.py [--rounds 3] [JOB.toml]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

BARE = (
    "import torch\n"
    "dev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
    "a = torch.randn(2000, 2000, device=dev)\n"
    "b = a @ a\n"
    "torch.cuda.synchronize() if dev == 'cuda' else None\n"
    "print(float(b.abs().sum()))\n"
)


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("job", nargs="?")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    preflight = [sys.executable, "-m", "agent.cli", "preflight", "--json"]
    if args.job:
        preflight.append(args.job)
    timed([sys.executable, "-c", BARE])  # warm the file cache for both
    bare, full = [], []
    for i in range(args.rounds):
        b = timed([sys.executable, "-c", BARE])
        p = timed(preflight)
        bare.append(b)
        full.append(p)
        print(f"round {i + 1}: bare {b:.2f}s  preflight {p:.2f}s  ratio {p / b:.2f}")
    mb, mp = statistics.median(bare), statistics.median(full)
    print(f"median: bare {mb:.2f}s  preflight {mp:.2f}s  ratio {mp / mb:.2f}  (goal <= 1.5)")


if __name__ == "__main__":
    main()
