"""Smoke test of the benchmark harness: ``bench/run.py`` runs a fast subset and writes its
RESULTS file with the machine and the expected table rows. Nothing about timing is asserted:
the figures belong to the bench's report, not to the test suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_quick_subset_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "run.py"),
            "--quick",
            "--repeat",
            "1",
            "--only",
            "P5,P6",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out.read_text()
    assert text.startswith("# Benchmark results")
    for key in ("python:", "torch:", "libreyolo:", "huggingface_hub:", "cores", "ram:"):
        assert key in text
    rows = [line for line in text.splitlines() if line.startswith("| P")]
    figures = [line.split("|")[1].strip() for line in rows]
    assert figures == ["P1", "P2", "P3", "P4", "P5", "P6", "P7"]
    p5 = next(line for line in rows if line.startswith("| P5 "))
    cells = [c.strip() for c in p5.split("|")[1:-1]]
    assert cells[5] == ">= 1.0" and cells[6] in ("yes", "within noise", "**no**")
    assert "n=" in cells[2] and "n=" in cells[3]  # medians and spreads written, not timings
    assert "not run (--only)" in next(line for line in rows if line.startswith("| P1 "))
    p6 = next(line for line in rows if line.startswith("| P6 "))
    assert "not measured: no GPU" in p6 or "<= 1.5" in p6


def test_bench_refuses_an_unknown_figure(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--only", "P9", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 2 and "P9" in proc.stderr
