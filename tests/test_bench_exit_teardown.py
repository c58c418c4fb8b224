"""Smoke test of bench/exit_teardown.py: a whole job ends in a DELETE at the fake Vast API, and
the breakdown names every step, the read-back counts and the requests on the path. Without a
pidfd (``--no-pidfd``) the agent's fallback notices the exit too. Nothing about timing is
asserted: the figures belong to the bench's report (docs/benchmarks.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS = (
    "noticed",
    "acted",
    "queued",
    "drained",
    "verified",
    "decision",
    "provider read",
    "report written",
    "report sent",
    "DELETE",
    "total",
)


@pytest.mark.parametrize("extra", [[], ["--no-pidfd"]], ids=["pidfd", "no-pidfd"])
def test_the_bench_runs_a_job_to_the_delete_and_names_each_step(extra: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "exit_teardown.py"), "--runs", "1", *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "run 1: " in out and "no DELETE" not in out, out
    for step in STEPS:
        assert re.search(rf"^  {re.escape(step)} +\d+\.\d{{3}} +\d+\.\d{{3}}", out, re.M), step
    # The checkpoints were verified after their upload and are unchanged: trusted, not re-read.
    trusted = re.search(r"final verification: read back \[0\], trusted \[(\d+)\]", out)
    assert trusted is not None and int(trusted[1]) >= 4, out  # last.pt, best.pt, status, metrics
    assert "requests to the provider between the exit and the DELETE: [1] per run (GET show)" in out
    assert ("pidfd NOT available here" in out) == bool(extra)
    assert re.search(r"goal 0\.3 s: p50 \d+\.\d\dx", out)
