"""Benchmark: from a spot notice appearing to the watcher's ``on_notice``, for AWS and GCP.

The issue's goal: the last.pt upload starts within a few seconds of the notice (AWS gives two
minutes, GCP about thirty seconds). The watcher's share is measured here, against the fake
metadata servers on 127.0.0.1 (tests/fakes/metadata.py): each trial starts a watcher (AWS polls
every ``--interval`` seconds; GCP holds a long poll), flips the fake at a random moment, and
times the flip to ``on_notice``. Figures only; nothing is asserted.

    .venv/bin/python bench/preemption_notice.py [--trials 10] [--interval 1]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.config.model import PreemptionSection
from agent.watch.preemption import Notice, PreemptionWatcher
from tests.fakes.metadata import FakeGCE, FakeIMDS, run_fake_gce, run_fake_imds


async def trial(
    source: str, fake: FakeIMDS | FakeGCE, interval_s: float, rng: random.Random
) -> float:
    """Seconds from the flip to ``on_notice`` in one run of a fresh watcher."""
    fake.clear()
    cfg = PreemptionSection(
        aws=source == "aws",
        gcp=source == "gcp",
        aws_url=fake.url,
        gcp_url=fake.url,
        poll_interval_s=interval_s,
    )
    seen = asyncio.Event()
    seen_at = 0.0

    def on_notice(notice: Notice) -> None:
        nonlocal seen_at
        seen_at = time.perf_counter()
        seen.set()

    watcher = PreemptionWatcher(cfg, (source,), on_notice=on_notice)
    task = asyncio.create_task(watcher.run())
    # Past the first poll, then anywhere within a few poll intervals.
    await asyncio.sleep(0.5 + rng.uniform(0, 3 * interval_s))
    flipped_at = time.perf_counter()
    fake.notice()
    await asyncio.wait_for(seen.wait(), 30 + interval_s)
    await task
    return seen_at - flipped_at


def line(source: str, latencies: list[float]) -> str:
    ms = sorted(x * 1000 for x in latencies)
    return (
        f"{source}: median {statistics.median(ms):7.1f} ms  max {ms[-1]:7.1f} ms  "
        f"min {ms[0]:6.1f} ms  ({len(ms)} trials)"
    )


async def bench(trials: int, interval_s: float, seed: int | None) -> None:
    rng = random.Random(seed)
    results: dict[str, list[float]] = {"aws": [], "gcp": []}
    with run_fake_imds() as imds, run_fake_gce() as gce:
        fakes: dict[str, FakeIMDS | FakeGCE] = {"aws": imds, "gcp": gce}
        for i in range(trials):
            for source, fake in fakes.items():
                latency = await trial(source, fake, interval_s, rng)
                results[source].append(latency)
                print(f"trial {i + 1:2d} {source}: {latency * 1000:7.1f} ms", flush=True)
    print(f"flip -> on_notice, AWS polled every {interval_s:g}s, GCP by long poll:")
    for source, latencies in results.items():
        print("  " + line(source, latencies))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--interval", type=float, default=1.0, help="poll_interval_s (default 1)")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the watcher's notice lines: not figures
    asyncio.run(bench(args.trials, args.interval, args.seed))


if __name__ == "__main__":
    main()
