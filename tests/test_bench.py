"""Smoke test of the benchmark harness: ``bench/run.py`` runs a fast subset and writes its
RESULTS file with the machine and the expected table rows; and P2's trainer, whose checkpoints
are written by the real torch.save, and the bench's reading of their epoch without torch.
Nothing about timing is asserted: the figures belong to the bench's report, not to the test
suite."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

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


def _bench_common() -> ModuleType:
    """bench/common.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_common", REPO / "bench" / "common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Reads each path given and prints their epochs, with torch made unimportable first.
_READ_WITHOUT_TORCH = """
import json, sys
from pathlib import Path
sys.modules["torch"] = None  # `import torch` now raises ImportError
sys.path.insert(0, "bench")
from common import checkpoint_epoch
print(json.dumps([checkpoint_epoch(Path(p)) for p in sys.argv[1:]]))
"""


# Writes a plain torch.save checkpoint and one by the bench's own writer. torch runs in a child:
# imported into the test runner, its deprecation shims warn when other tests scan every object.
_WRITE_WITH_TORCH = """
import sys, torch
from pathlib import Path
sys.path.insert(0, "bench")
from common import torch_checkpoints
torch.save({"epoch": 7, "w": torch.randn(1000)}, sys.argv[1])
torch_checkpoints()(Path(sys.argv[2]), 12, 64)
"""


def test_checkpoint_epoch_reads_a_torch_save_checkpoint_without_torch(tmp_path: Path) -> None:
    plain = tmp_path / "plain.pt"
    bench = tmp_path / "weights" / "last.pt"  # the bench's writer: torch.save
    subprocess.run(
        [sys.executable, "-c", _WRITE_WITH_TORCH, str(plain), str(bench)],
        check=True,
        timeout=120,
        cwd=REPO,
    )
    torn = tmp_path / "torn.pt"
    torn.write_bytes(bench.read_bytes()[: bench.stat().st_size // 2])  # a copy made mid-write
    proc = subprocess.run(
        [sys.executable, "-c", _READ_WITHOUT_TORCH, str(plain), str(bench), str(torn)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [7, 12, None]


def test_checkpoint_epoch_reads_a_scripted_trainer_checkpoint(tmp_path: Path) -> None:
    from tests.fakes.scripted_trainer import write_checkpoint

    common = _bench_common()
    ckpt = tmp_path / "last.pt"
    write_checkpoint(ckpt, 4, payload_kb=8)
    assert common.checkpoint_epoch(ckpt) == 4
    other = tmp_path / "notes.pt"
    other.write_text("not a checkpoint")
    assert common.checkpoint_epoch(other) is None
    assert common.checkpoint_epoch(tmp_path / "missing.pt") is None


# What the timed trainer's checkpoints hold, read back by torch.load in a child.
_LOAD = """
import json, sys, torch
last = torch.load(sys.argv[1], weights_only=True)
best = torch.load(sys.argv[2], weights_only=True)
tensors = list(last["model"].values())
print(json.dumps({
    "epoch": last["epoch"],
    "tensors": len(tensors),
    "float32": all(t.dtype == torch.float32 for t in tensors),
    "bytes": sum(t.numel() for t in tensors) * 4,
    "best_equal": all(
        torch.equal(a, b) for a, b in zip(tensors, best["model"].values(), strict=True)
    ),
}))
"""


def test_timed_trainer_writes_its_checkpoints_with_torch_save(tmp_path: Path) -> None:
    log = tmp_path / "times.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "common.py"),
            "trainer",
            f"bench_log={log}",
            "torch_save=1",
            "epochs=2",
            "epoch_s=0",
            "ckpt_kb=64",
            f"project={tmp_path / 'runs'}",
            "name=t",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    written = [(r["name"], r["epoch"]) for r in rows if "name" in r]
    assert written == [("last.pt", 1), ("best.pt", 1), ("last.pt", 2), ("best.pt", 2)]
    assert all(r["write_s"] >= 0 and r["t"] > 0 for r in rows if "name" in r)
    assert "exit" in rows[-1]
    weights = tmp_path / "runs" / "t" / "weights"
    loaded = subprocess.run(
        [sys.executable, "-c", _LOAD, str(weights / "last.pt"), str(weights / "best.pt")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    held = json.loads(loaded.stdout)
    assert held == {
        "epoch": 2,
        "tensors": _bench_common().CKPT_TENSORS,
        "float32": True,
        "bytes": 64 * 1024,
        "best_equal": True,
    }
    # A zip whose first entry's sizes follow its data (general purpose flag bit 3), as torch
    # writes it, not the scripted trainer's zipfile.
    header = (weights / "last.pt").read_bytes()[:8]
    assert header[:4] == b"PK\x03\x04" and int.from_bytes(header[6:8], "little") & 0x08


def test_firstbox_clones_a_relative_local_repo_by_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench/firstbox.py --repo .gpu/repo.bundle` (relative, as typed in the repository root)
    failed every agent round with git's exit 128 on an H100: the start line clones from another
    folder. The path is made absolute; a URL and a path that does not exist pass unchanged."""
    spec = importlib.util.spec_from_file_location("bench_firstbox", REPO / "bench" / "firstbox.py")
    assert spec is not None and spec.loader is not None
    firstbox = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(firstbox)
    bundle = tmp_path / "sub" / "repo.bundle"
    bundle.parent.mkdir()
    bundle.write_bytes(b"# v2 git bundle\n")
    monkeypatch.chdir(tmp_path)
    assert firstbox.start_line_repo("sub/repo.bundle") == str(bundle.resolve())
    assert firstbox.start_line_repo("sub/../sub/repo.bundle") == str(bundle.resolve())
    assert (
        firstbox.start_line_repo("https://example.invalid/x.git") == "https://example.invalid/x.git"
    )
    assert firstbox.start_line_repo("missing.bundle") == "missing.bundle"
    assert firstbox.start_line_repo("") in (
        str(REPO / ".gpu" / "repo.bundle"),
        str(REPO),
    )
