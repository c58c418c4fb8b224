"""Benchmark: memory of the agent process (its pid only, not the trainer) supervising a real run.

Two figures:

- import: RSS of a fresh interpreter after ``import agent.daemon.spine`` (what ``libreyolo-agent
run`` loads before it starts anything), and which heavy libraries that pulled in;
- run: ``libreyolo-agent run job.toml`` as a real process (as tests/test_restart.py runs it) on
  the tiny CPU job (``yolox-n``, a demo dataset from :func:`agent.demo.make_dataset`, a
  ``file://`` sync target), its ``VmRSS`` sampled every 50 ms and its ``VmHWM`` (peak) read from
  ``/proc/PID/status`` until it exits. The trainer's memory is not counted.

Figures only; nothing is asserted.

    .venv/bin/python bench/agent_footprint.py [--epochs 3] [--model yolox-n] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEAVY = (
    "huggingface_hub",
    "httpx",
    "httpx2",
    "prometheus_client",
    "pynvml",
    "torch",
    "numpy",
    "yaml",
    "watchdog",
    "psutil",
    "aiohttp",
)

_IMPORT_PROBE = f"""
import json, sys
import agent.daemon.spine
status = open('/proc/self/status').read()
kib = lambda key: int(status.split(key + ':')[1].split()[0])
print(json.dumps({{"rss_kib": kib("VmRSS"), "hwm_kib": kib("VmHWM"),
                  "loaded": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def import_figures() -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE], cwd=ROOT, capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _status_kib(pid: int) -> tuple[int, int] | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    if len(fields) < 2:
        return None
    return fields["VmRSS"], fields["VmHWM"]


def run_figures(work: Path, *, epochs: int, model: str) -> dict[str, object]:
    from agent.demo import make_dataset

    data = make_dataset(work / "data")
    job = work / "job.toml"
    job.write_text(
        f"""
[job]
name = "run1"
runs_dir = "{work / "runs"}"
[train]
model = "{model}"
pretrained = false
data = "{data}"
epochs = {epochs}
imgsz = 64
batch = 4
workers = 0
device = "cpu"
save_period = 1
stop_grace = "30s"
kill_grace = "5s"
[preflight]
enabled = false
[server]
listen = "127.0.0.1:0"
[sync]
target = "file://{work / "synced"}"
"""
    )
    env = {k: v for k, v in os.environ.items() if k != "LIBREYOLO_AGENT_CRASHPOINT"}
    env["LIBREYOLO_AGENT_STATE_DIR"] = str(work / "state")
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "run", str(job)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    samples: list[int] = []
    hwm = 0
    while proc.poll() is None:
        got = _status_kib(proc.pid)
        if got is not None:
            samples.append(got[0])
            hwm = max(hwm, got[1])
        time.sleep(0.05)
    output = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    ckpts = sorted((work / "runs").rglob("*.pt"))
    return {
        "rc": proc.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "vmhwm_kib": hwm,
        "rss_max_sampled_kib": max(samples, default=0),
        "rss_median_kib": sorted(samples)[len(samples) // 2] if samples else 0,
        "samples": len(samples),
        "checkpoints": len(ckpts),
        "checkpoint_bytes": max((p.stat().st_size for p in ckpts), default=0),
        "tail": output.strip().splitlines()[-3:] if proc.returncode else [],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--model", default="yolox-n")
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it")
    args = ap.parse_args()
    imp = import_figures()
    print(
        f"import agent.daemon.spine: RSS {int(imp['rss_kib']) / 1024:.1f} MiB; "  # type: ignore[call-overload]
        f"loaded: {', '.join(imp['loaded']) or '-'}"  # type: ignore[arg-type]
    )
    with tempfile.TemporaryDirectory(prefix="agent-footprint-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        run = run_figures(work, epochs=args.epochs, model=args.model)
    mib = lambda kib: f"{int(kib) / 1024:.1f} MiB"  # noqa: E731
    print(
        f"agent run ({args.model}, {args.epochs} epochs, rc {run['rc']}, {run['seconds']} s, "
        f"{run['checkpoints']} checkpoints of up to {int(run['checkpoint_bytes']) / 1e6:.1f} MB):"  # type: ignore[call-overload]
        f" VmHWM {mib(run['vmhwm_kib'])}, RSS max sampled {mib(run['rss_max_sampled_kib'])},"
        f" median {mib(run['rss_median_kib'])} ({run['samples']} samples)"
    )
    for line in run["tail"]:  # type: ignore[attr-defined]
        print("  |", line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
