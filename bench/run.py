"""The benchmark harness (issue 15): every figure measured side by side with its anchor in one
run, repeated; medians and min-max written to bench/RESULTS.md, as measured.

    .venv/bin/python bench/run.py [--quick] [--repeat N] [--only P1,P3] [--device 0] [--out PATH]

- P1: the agent (``python -m agent.cli run JOB``, a real process) supervising a real tiny
  training (yolox-n, imgsz 64, on ``--device``, default ``cpu``): its own peak RSS
  (/proc/PID/status VmHWM) and CPU seconds per epoch; anchor, on the same training at the same
  time: a loop that every 20 s reads status.json and hashes last.pt (``bench/common.py poll``).
- P2: the epoch's checkpoints written (its last ``torch.save`` returned; status.json comes
  next) -> the sink's ``upload`` of that epoch's last.pt entered, for several checkpoint
  sizes; the real Daemon in-process; the checkpoints written by the real ``torch.save``, as
  LibreYOLO's are (a dict with the epoch and float32 tensors of the size, in place, a write
  call per tensor, a zip with data descriptors: ``bench/common.py trainer torch_save=1``);
  anchor on the same trainer at the same time: a loop that every 10 s copies changed
  checkpoints (``bench/common.py sync``).
- P3: the scripted trainer exits -> the agent's phase DONE (teardown provider none); anchor on
  the same trainer: a 60 s idle check (``bench/common.py idle``), started at a random phase.
- P4: a spot notice on the fake metadata servers -> the sink's last.pt upload starts
  (bench/preemption_upload.py's trial, AWS and GCP).
- P5: ``HubSink.upload`` vs ``HfApi.upload_file`` of the same file to the same fake Hub
  (tests/fakes/hub.py), alternated; ratio = upload_file time / sink time.
- P6: preflight vs the bare recipe (bench/preflight_ratio.py), only where a GPU exists.
- P7: from the P1 runs: seconds from starting the agent to the trainer process starting, and
  to the trainer's first status.json, against a bare ``libreyolo train`` of the same job
  (the same command line the agent builds), run right after each P1 run.

Figures only: nothing about timing is asserted. The machine is shared and noisy; ratios come
from the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (
    CKPT_TENSORS,
    REPO,
    THIS,
    checkpoint_epoch,
    cpu_seconds,
    fmt_spread,
    machine,
    proc_status,
    read_jsonl,
    spread,
)

PY = sys.executable
FIGURES = ("P1", "P2", "P3", "P4", "P5", "P6", "P7")
MIB = 1024 * 1024

os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
os.environ.setdefault("no_proxy", "127.0.0.1,localhost")
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_XET"] = "1"


@dataclass
class Config:
    quick: bool
    repeat: int
    # P1/P7: the real trainer.
    p1_train_images: int
    p1_epochs: int
    # P2: the scripted trainer.
    p2_sizes_kb: list[int]
    p2_epochs: int
    p2_epoch_s: float
    # P5: the file uploaded.
    p5_mb: int
    p5_rounds: int
    # P1/P7: the trainer's device (``train.device``): "cpu", or a GPU such as "0".
    device: str = "cpu"


def config(quick: bool, repeat: int | None, device: str = "cpu") -> Config:
    if quick:
        return Config(True, repeat or 1, 16, 2, [1_000, 20_000], 6, 1.5, 8, 3, device)
    return Config(False, repeat or 3, 32, 3, [1_000, 20_000, 200_000], 8, 2.0, 50, 5, device)


@dataclass
class Row:
    """One line of the results table."""

    figure: str
    measure: str
    agent: str
    anchor: str = "-"
    ratio: str = "-"
    goal: str = "-"
    met: str = "-"


@dataclass
class Section:
    figure: str
    title: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None


def say(msg: str) -> None:
    print(f"[{datetime.now():%H:%M:%S}] {msg}", flush=True)


def yes(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "**no**")


def med(values: list[float]) -> float | None:
    s = spread(values)
    return None if s is None else s[0]


def ratio(a: list[float], b: list[float], digits: int = 2) -> str:
    ma, mb = med(a), med(b)
    if ma is None or mb is None or mb == 0:
        return "-"
    return f"{ma / mb:.{digits}g}" if ma / mb < 0.01 else f"{ma / mb:.{digits}f}"


def kill_pid(pid: int, sig: int = signal.SIGTERM) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def stop_proc(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """Ask a process this bench started to stop (SIGTERM), then SIGKILL it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


# ==================================================================================== P1 + P7


def real_job_text(tmp: Path, data: Path, epochs: int, runs: Path, device: str = "cpu") -> str:
    """A tiny real job as a user would write it: the agent's defaults (preflight, dataset
    doctor) kept, checkpoints synced to a folder, teardown provider none. On ``device = "cpu"``
    preflight allows the CPU; on a GPU it keeps its default (a missing GPU fails the job)."""
    allow_cpu = "true" if device == "cpu" else "false"
    return f"""
[job]
name = "run1"
runs_dir = "{runs}"
[train]
model = "yolox-n"
pretrained = false
data = "{data}"
epochs = {epochs}
imgsz = 64
batch = 4
workers = 0
device = "{device}"
[preflight]
allow_cpu = {allow_cpu}
[server]
listen = "127.0.0.1:0"
[sync]
target = "file://{tmp / "synced"}"
[teardown]
provider = "none"
"""


def log_times(agent_log: Path) -> dict[str, float]:
    """Wall times of the agent.log lines that bound its start-up phases."""
    marks = {
        "first line": "",
        "preflight start": "phase BOOTING -> PREFLIGHT",
        "staging start": "-> STAGING",
        "training phase": "-> TRAINING",
        "trainer started": "trainer started pid=",
        "warm trainer": "warm start: trainer pid=",
    }
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in agent_log.read_text(errors="replace").splitlines():
            try:
                t = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                continue
            for name, needle in marks.items():
                if name not in out and needle in line:
                    out[name] = t
    return out


@dataclass
class P1Run:
    agent_peak: float | None = None
    agent_rss_training: list[float] = field(default_factory=list)
    agent_cpu_per_epoch: float | None = None
    agent_cpu_pct: float | None = None
    anchor_peak: float | None = None
    anchor_cpu_per_epoch: float | None = None
    anchor_cpu_pct: float | None = None
    epoch_s: float | None = None
    epochs: int = 0
    guard_peak: float | None = None
    #: The NVML host the agent starts on a GPU box (agent/gpu/nvmlhost.py), its peak RSS.
    nvml_host_peak: float | None = None
    to_trainer_start: float | None = None
    #: Agent started -> the launch (``trainer started pid=``: a cold spawn, or the warm go).
    to_launch: float | None = None
    to_status: float | None = None
    trainer_startup: float | None = None
    warm: bool = False
    phases: dict[str, float] = field(default_factory=dict)
    problem: str | None = None


def nvml_hosts(parent: int) -> set[int]:
    """The NVML hosts (the C host ``.../nvmlhost-<digest>``, or ``python -I -S
    .../agent/gpu/nvml.py``) among ``parent``'s children."""
    from agent.gpu.nvmlhost import C_PROGRAM_PREFIX

    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{parent}/task").iterdir():
            with contextlib.suppress(OSError):
                for pid in (task / "children").read_text().split():
                    with contextlib.suppress(OSError):
                        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                        if argv[0].rsplit(b"/", 1)[-1].startswith(C_PROGRAM_PREFIX.encode()) or any(
                            a.endswith(b"agent/gpu/nvml.py") for a in argv
                        ):
                            found.add(int(pid))
    return found


def p1_run(tmp: Path, data: Path, cfg: Config) -> P1Run:
    """One supervised real training, the agent and the 20 s anchor watched side by side."""

    from agent.guard import plan as guardplan

    out = P1Run()
    runs = tmp / "runs"
    job = tmp / "job.toml"
    job.write_text(real_job_text(tmp, data, cfg.p1_epochs, runs, cfg.device))
    state_dir = tmp / "state"
    env = {k: v for k, v in os.environ.items() if k != "LIBREYOLO_AGENT_CRASHPOINT"}
    env["LIBREYOLO_AGENT_STATE_DIR"] = str(state_dir)
    anchor_log = tmp / "anchor-poll.jsonl"
    t_spawn = time.time()
    agent = subprocess.Popen(
        [PY, "-m", "agent.cli", "run", str(job)],
        cwd=REPO,
        env=env,
        stdout=(tmp / "agent.out").open("wb"),
        stderr=subprocess.STDOUT,
    )
    anchor = subprocess.Popen([PY, str(THIS), "poll", str(runs), "20", str(anchor_log)], cwd=REPO)
    trainer_pid: int | None = None
    t_status: float | None = None
    run_dir: Path | None = None
    marks: list[tuple[int, float, float | None, float | None]] = []  # (epochs, t, cpu a, cpu b)
    last_epochs = -1
    peak = {"agent": 0, "anchor": 0, "guard": 0, "nvml": 0}
    guard_pid: int | None = None
    nvml_pids: set[int] = set()
    deadline = time.time() + 900
    try:
        while agent.poll() is None and time.time() < deadline:
            for name, pid in (("agent", agent.pid), ("anchor", anchor.pid)):
                st = proc_status(pid)
                peak[name] = max(peak[name], st.get("VmHWM", 0))
            if trainer_pid is None:
                with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                    state = json.loads((state_dir / "state.json").read_text())
                    trainer_pid = int(state["trainer"]["pid"])
            if guard_pid is None and trainer_pid is not None:
                with contextlib.suppress(OSError):
                    guard_pid = guardplan.guard_pid(state_dir) or None
            if guard_pid is not None:
                peak["guard"] = max(peak["guard"], proc_status(guard_pid).get("VmHWM", 0))
            nvml_pids |= nvml_hosts(agent.pid)
            for pid in nvml_pids:
                peak["nvml"] = max(peak["nvml"], proc_status(pid).get("VmHWM", 0))
            if run_dir is None:
                found = sorted(runs.glob("*/status.json"))
                if found:
                    t_status = time.time()
                    run_dir = found[0].parent
            if run_dir is not None:
                with contextlib.suppress(OSError, ValueError):
                    status = json.loads((run_dir / "status.json").read_text())
                    n = int(status.get("completed_epochs") or 0)
                    if n != last_epochs and status.get("state") == "running":
                        last_epochs = n
                        marks.append(
                            (n, time.time(), cpu_seconds(agent.pid), cpu_seconds(anchor.pid))
                        )
                rss = proc_status(agent.pid).get("VmRSS")
                if rss:
                    out.agent_rss_training.append(rss / MIB)
            # Fine-grained until the trainer's first status.json (P7), then gentle.
            time.sleep(0.05 if run_dir is None else 0.5)
        if agent.poll() is None:
            out.problem = "the agent did not finish within 900 s"
    finally:
        stop_proc(agent, 30)
        stop_proc(anchor)
        with contextlib.suppress(OSError):
            gpid = guardplan.guard_pid(state_dir)  # only while it holds its lock
            if gpid:
                kill_pid(gpid)  # the guard this run's agent started (it leaves by itself too)
    out.guard_peak = peak["guard"] / MIB or None
    out.nvml_host_peak = peak["nvml"] / MIB or None
    out.agent_peak = peak["agent"] / MIB
    out.anchor_peak = peak["anchor"] / MIB
    lt = log_times(state_dir / "agent.log")
    if "trainer started" in lt:
        out.to_launch = lt["trainer started"] - t_spawn
    # The trainer's process: spawned at the launch, or (warm) when preflight began. From the
    # agent's log (ms), not psutil's create time (its boot time is whole seconds).
    started = lt.get("warm trainer", lt.get("trainer started"))
    if started is not None:
        out.to_trainer_start = started - t_spawn
    with contextlib.suppress(OSError):
        out.warm = "(warm: its Python ran the probe)" in (state_dir / "agent.log").read_text()
    if t_status is not None:
        out.to_status = t_status - t_spawn
        if out.to_launch is not None:
            out.trainer_startup = out.to_status - out.to_launch
    marks = [m for m in marks if m[2] is not None]
    if len(marks) >= 2:
        (n0, t0, a0, b0), (n1, t1, a1, b1) = marks[0], marks[-1]
        epochs = n1 - n0
        if epochs > 0 and a0 is not None and a1 is not None:
            out.epochs = epochs
            out.epoch_s = (t1 - t0) / epochs
            out.agent_cpu_per_epoch = (a1 - a0) / epochs
            out.agent_cpu_pct = 100 * (a1 - a0) / (t1 - t0)
            if b0 is not None and b1 is not None:
                out.anchor_cpu_per_epoch = (b1 - b0) / epochs
                out.anchor_cpu_pct = 100 * (b1 - b0) / (t1 - t0)
    if "first line" in lt:
        out.phases["start -> first log line (imports)"] = lt["first line"] - t_spawn
    if "preflight start" in lt and "staging start" in lt:
        out.phases["preflight"] = lt["staging start"] - lt["preflight start"]
    if "staging start" in lt and "training phase" in lt:
        out.phases["staging (dataset doctor)"] = lt["training phase"] - lt["staging start"]
    if "training phase" in lt and "trainer started" in lt:
        out.phases["launch"] = lt["trainer started"] - lt["training phase"]
    if out.problem is None and agent.returncode not in (0, None):
        out.problem = f"the agent exited {agent.returncode}"
    return out


def bare_run(tmp: Path, data: Path, cfg: Config) -> float | None:
    """A bare ``libreyolo train`` of the same job: seconds to its first status.json."""
    from agent.config.jobfile import parse_job
    from agent.trainer.process import build_argv

    runs = tmp / "bare-runs"
    text = real_job_text(tmp, data, cfg.p1_epochs, runs, cfg.device)
    job = parse_job(text, source="bench", base_dir=tmp)
    argv = build_argv(job)
    t0 = time.time()
    proc = subprocess.Popen(
        argv,
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=(tmp / "bare.log").open("wb"),
        start_new_session=True,
    )
    seen: float | None = None
    try:
        while proc.poll() is None and time.time() - t0 < 300:
            if any(runs.glob("*/status.json")):
                seen = time.time() - t0
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # its own session: this bench started it
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    return seen


#: P1's long-epoch figure: the real Daemon in-process (this process's CPU is the agent's) with
#: the scripted trainer writing last.pt and best.pt of this size every this many seconds (a GPU
#: epoch of a real dataset lasts minutes; 30 s keeps the bench short and is on the safe side).
LONG_EPOCH_S = 30.0
LONG_CKPT_KB = 8_000
#: Epochs per run; CPU is counted from the first epoch's last.pt to the second-to-last one's.
LONG_EPOCHS = 4


def long_epoch_cpu(cfg: Config, root: Path) -> tuple[list[float], list[float], list[float]]:
    """Agent CPU over epochs of a realistic length: % of one core from the first epoch's
    last.pt to the second-to-last one's, and CPU seconds per epoch, per repeat. The tiny real
    training of P1 has epochs of about a second, where the per-epoch sync work is most of the
    figure; a GPU epoch lasts minutes. Third: % of one core between checkpoints (the loop's own
    polling)."""
    pct: list[float] = []
    per_epoch: list[float] = []
    quiet: list[float] = []
    for i in range(cfg.repeat):
        tmp = root / f"p1-long-{i + 1}"
        tmp.mkdir()
        samples: list[tuple[float, float]] = []
        stop = threading.Event()

        def sample(samples: list[tuple[float, float]] = samples, stop: threading.Event = stop):
            while not stop.is_set():
                samples.append((time.time(), time.process_time()))
                stop.wait(0.25)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            r = daemon_run(
                tmp, LONG_EPOCHS, lambda pid: None, epoch_s=LONG_EPOCH_S, ckpt_kb=LONG_CKPT_KB
            )
        finally:
            stop.set()
            sampler.join()
        # The window ends at the second-to-last epoch's last.pt: the agent returns moments
        # after the last one, before the sampler may have looked again.
        epochs = sorted(r.written)[:-1]
        if r.error or len(epochs) < 2:
            say(f"  run {i + 1} not counted: {r.error or f'{len(epochs) + 1} epoch(s) written'}")
            continue
        t0, t1 = r.written[epochs[0]], r.written[epochs[-1]]
        c0 = next((c for t, c in reversed(samples) if t <= t0), None)
        c1 = next((c for t, c in samples if t >= t1), None)
        if c0 is None or c1 is None:
            say(f"  run {i + 1} not counted: no CPU sample around its epochs")
            continue
        pct.append(100 * (c1 - c0) / (t1 - t0))
        per_epoch.append((c1 - c0) / (len(epochs) - 1))
        # Between checkpoints: from 3 s after one epoch's last.pt to 0.5 s before the next.
        quiet_cpu = quiet_s = 0.0
        for a, b in itertools.pairwise(epochs):
            qa, qb = r.written[a] + 3.0, r.written[b] - 0.5
            ca = next((c for t, c in samples if t >= qa), None)
            cb = next((c for t, c in reversed(samples) if t <= qb), None)
            if ca is not None and cb is not None and qb > qa:
                quiet_cpu += cb - ca
                quiet_s += qb - qa
        if quiet_s:
            quiet.append(100 * quiet_cpu / quiet_s)
        say(
            f"  {pct[-1]:.3f} % of a core, {per_epoch[-1]:.3f} s per epoch, between "
            f"checkpoints {quiet[-1] if quiet else float('nan'):.3f} %"
        )
        shutil.rmtree(tmp, ignore_errors=True)
    return pct, per_epoch, quiet


def bench_p1_p7(cfg: Config, root: Path, want: set[str]) -> list[Section]:
    from agent.demo import make_dataset

    data = make_dataset(root / "data", train=cfg.p1_train_images, val=4)
    runs: list[P1Run] = []
    bare: list[float] = []
    extra: list[float] = []  # agent start -> status.json, minus the bare run's, per repeat
    for i in range(cfg.repeat):
        tmp = root / f"p1-{i + 1}"
        tmp.mkdir()
        say(f"P1/P7 run {i + 1}/{cfg.repeat}: the agent supervising a real training")
        r = p1_run(tmp, data, cfg)
        runs.append(r)
        say(
            f"  agent peak {r.agent_peak:.1f} MiB, cpu/epoch {r.agent_cpu_per_epoch}, "
            f"epoch {r.epoch_s} s, anchor peak {r.anchor_peak:.1f} MiB; to trainer start "
            f"{r.to_trainer_start} s, to status.json {r.to_status} s {r.problem or ''}"
        )
        if "P7" in want:
            b = bare_run(tmp, data, cfg)
            say(f"  bare libreyolo train: status.json after {b} s")
            if b is not None:
                bare.append(b)
                if r.problem is None and r.to_status is not None:
                    extra.append(r.to_status - b)
        shutil.rmtree(tmp, ignore_errors=True)
    ok = [r for r in runs if r.problem is None]
    sections: list[Section] = []

    def vals(name: str, rows: list[P1Run] = ok) -> list[float]:
        return [v for v in (getattr(r, name) for r in rows) if v is not None]

    if "P1" in want:
        s = Section("P1", "Agent memory and CPU while a real trainer trains")
        peak, apeak = vals("agent_peak"), vals("anchor_peak")
        s.rows.append(
            Row(
                "P1",
                "agent peak RSS (agent pid only, VmHWM)",
                fmt_spread(peak, "MiB", 1),
                fmt_spread(apeak, "MiB", 1),
                ratio(peak, apeak),
                "< 80 MiB",
                yes(bool(peak) and max(peak) < 80),
            )
        )
        pct, apct = vals("agent_cpu_pct"), vals("anchor_cpu_pct")
        epoch_s = med(vals("epoch_s"))
        s.rows.append(
            Row(
                "P1",
                "agent CPU while the tiny real training runs (epochs of "
                f"{epoch_s:.1f} s), % of one core"
                if epoch_s is not None
                else "agent CPU while the tiny real training runs, % of one core",
                fmt_spread(pct, "%", 3),
                fmt_spread(apct, "%", 3),
                ratio(pct, apct),
            )
        )
        say(f"P1: agent CPU over {LONG_EPOCH_S:g} s epochs (scripted trainer)")
        long_pct, long_per_epoch, long_quiet = long_epoch_cpu(cfg, root)
        s.rows.append(
            Row(
                "P1",
                f"agent CPU over {LONG_EPOCH_S:g} s epochs ({LONG_CKPT_KB // 1000} MB last.pt and "
                "best.pt each epoch), % of one core",
                fmt_spread(long_pct, "%", 3),
                "-",
                "-",
                "< 0.5 %",
                yes(bool(long_pct) and max(long_pct) < 0.5),
            )
        )
        s.rows.append(
            Row(
                "P1",
                f"agent CPU per {LONG_EPOCH_S:g} s epoch, all of it (snapshots, upload, "
                "verify, ledger and state writes, polling), CPU seconds",
                fmt_spread(long_per_epoch, "s", 3),
                "-",
                "-",
            )
        )
        s.rows.append(
            Row(
                "P1",
                "agent CPU between checkpoints (the supervision loop's polling), % of one core",
                fmt_spread(long_quiet, "%", 3),
                "-",
                "-",
            )
        )
        cpe, acpe = vals("agent_cpu_per_epoch"), vals("anchor_cpu_per_epoch")
        s.rows.append(
            Row(
                "P1",
                "agent CPU seconds per epoch",
                fmt_spread(cpe, "s", 3),
                fmt_spread(acpe, "s", 3),
                ratio(cpe, acpe),
            )
        )
        epoch = vals("epoch_s")
        rss_t = [med(r.agent_rss_training) or 0.0 for r in ok if r.agent_rss_training]
        guard = vals("guard_peak")
        nvml_host = vals("nvml_host_peak")
        s.notes += [
            f"Real trainer: yolox-n, imgsz 64, {cfg.p1_train_images} train images, "
            f"{cfg.p1_epochs} epochs, device {cfg.device}; an epoch took "
            f"{fmt_spread(epoch, 's', 1)}. CPU is "
            "counted from the trainer's first status.json to its last epoch's, over "
            f"{ok[0].epochs if ok else '?'} epoch(s) per run (the agent's start-up, preflight "
            "and final sync are outside it; its peak RSS covers the whole run).",
            f"Agent RSS during training (median of its samples): {fmt_spread(rss_t, 'MiB', 1)}.",
            "Anchor: `bench/common.py poll`, a bare Python loop that every 20 s reads "
            "status.json and hashes last.pt, on the same training at the same time.",
            "Not in the agent's figure: the guard process the agent starts "
            f"(`python -m agent.guard`, its own session), peak {fmt_spread(guard, 'MiB', 1)}; "
            "on a GPU box the NVML host "
            "(`python -I -S agent/gpu/nvml.py`: the driver's libraries, kept out of the agent), "
            f"peak {fmt_spread(nvml_host, 'MiB', 1) if nvml_host else 'none started'}.",
        ]
        bad = [r.problem for r in runs if r.problem]
        if bad:
            s.notes.append(f"Runs left out: {'; '.join(str(b) for b in bad)}.")
        sections.append(s)
    if "P7" in want:
        s = Section("P7", "Billed seconds the agent adds before training")
        to_start = vals("to_trainer_start")
        to_launch = vals("to_launch")
        to_status = vals("to_status")
        startup = vals("trainer_startup")
        s.rows += [
            Row(
                "P7",
                "agent started -> trainer process started",
                fmt_spread(to_start),
            ),
            Row(
                "P7",
                "agent started -> the launch (the trainer handed its command line)",
                fmt_spread(to_launch),
            ),
            Row(
                "P7",
                "trainer start-up (the launch -> first status.json): under the agent vs bare",
                fmt_spread(startup),
                fmt_spread(bare),
                ratio(startup, bare),
            ),
            Row(
                "P7",
                "agent started -> first status.json, minus bare `libreyolo train`'s",
                fmt_spread(extra),
                fmt_spread(bare),
                ratio(to_status, bare),
                "< 5 s",
                yes(bool(extra) and max(extra) < 5),
            ),
        ]
        for name in (
            "start -> first log line (imports)",
            "preflight",
            "staging (dataset doctor)",
            "launch",
        ):
            v = [r.phases[name] for r in ok if name in r.phases]
            s.notes.append(f"of which {name}: {fmt_spread(v)}")
        warm = sum(1 for r in ok if r.warm)
        s.notes.append(
            f"Started warm in {warm} of {len(ok)} runs: preflight's torch probe ran in the "
            "trainer's own Python, which then trained without importing torch again "
            "(agent/trainer/warm_entry.py). A warm trainer's process starts with preflight, so its "
            "start-up is counted from the launch, where a cold one's process starts."
        )
        s.notes.append(
            "The job keeps the agent's defaults: preflight "
            f"({'allow_cpu' if cfg.device == 'cpu' else 'GPU required'}) and the dataset doctor "
            f"run before the trainer starts (device {cfg.device}). The bare run is the command "
            "line the agent builds (`agent.trainer.process.build_argv`), started right after each "
            "agent run and stopped at its first status.json."
        )
        sections.append(s)
    return sections


# ==================================================================================== P2 + P3


def scripted_job(tmp: Path, epochs: int) -> Any:
    """The tests' tiny job (tests/support.py), synced to a folder every epoch."""
    from tests.support import tiny_job

    data = tmp / "data.yaml"
    (tmp / "images").mkdir(parents=True, exist_ok=True)
    data.write_text("train: images\nval: images\nnames:\n  0: box\n")
    sections = f'[sync]\ntarget = "file://{tmp / "target"}"\nevery_epochs = 1\n'
    return tiny_job(tmp, data, epochs=epochs, sections=sections)


@dataclass
class Upload:
    remote: str
    t: float
    epoch: int | None


class WallSink:
    """A LocalSink that notes (wall clock) when each upload is entered, and of which epoch."""

    def __init__(self, root: Path) -> None:
        from agent.sinks.local import LocalSink

        self.inner = LocalSink(root)
        self.description = self.inner.description
        self.uploads: list[Upload] = []
        self._lock = threading.Lock()

    def prepare(self) -> None:
        self.inner.prepare()

    def upload(self, local: Path, remote_path: str) -> None:
        t = time.time()
        epoch = checkpoint_epoch(local) if remote_path.endswith(".pt") else None
        with self._lock:
            self.uploads.append(Upload(remote_path, t, epoch))
        self.inner.upload(local, remote_path)

    def stat(self, remote_path: str) -> Any:
        return self.inner.stat(remote_path)

    def download(self, remote_path: str, local: Path) -> Any:
        return self.inner.download(remote_path, local)


def make_launcher(log: Path, on_launch: Callable[[int], None], **options: object) -> Any:
    from tests.fakes.scripted_launcher import ScriptedLauncher

    class TimedLauncher(ScriptedLauncher):
        def _base(self) -> list[str]:
            return [
                PY,
                str(THIS),
                "trainer",
                f"bench_log={log}",
                *(f"{k}={v}" for k, v in self.options.items()),
            ]

        async def launch(self, argv: list[str], **kw: Any) -> Any:
            trainer = await super().launch(argv, **kw)
            on_launch(trainer.pid)
            return trainer

    return TimedLauncher(**options)


@dataclass
class DaemonRun:
    written: dict[int, float]  # epoch -> last.pt written
    #: epoch -> its last checkpoint written (best.pt comes after last.pt; status.json next)
    exit_at: float | None
    done_at: float | None
    returned_at: float
    uploads: list[Upload]
    launched_pid: int | None
    code: int | None
    error: str | None
    epoch_written: dict[int, float] = field(default_factory=dict)
    write_s: list[float] = field(default_factory=list)  # each checkpoint write's seconds
    #: When the trainer process was gone (its pidfd became readable). Later than ``exit_at``
    #: (``main`` returned) by the interpreter's own shutdown: with torch loaded (``torch_save``)
    #: 0.3-0.4 s on the 2-core VM, time in which the agent cannot see an exit yet.
    gone_at: float | None = None

    @property
    def ended(self) -> float | None:
        """The trainer's exit as the agent can see it: the process gone, else ``main`` returned."""
        return self.gone_at if self.gone_at is not None else self.exit_at


def daemon_run(
    tmp: Path,
    epochs: int,
    on_launch: Callable[[int], None],
    **options: object,
) -> DaemonRun:
    """The real Daemon in-process, with the timed scripted trainer and a wall-clock sink."""
    from agent.config.model import Env
    from agent.daemon.spine import Daemon

    log = tmp / "trainer-times.jsonl"
    pid: list[int] = []
    gone: list[float] = []

    def watch(p: int) -> None:
        try:
            fd = os.pidfd_open(p)
        except OSError:
            return
        try:
            select.select([fd], [], [])
            gone.append(time.time())
        finally:
            os.close(fd)

    def launched(p: int) -> None:
        pid.append(p)
        if len(pid) == 1:
            threading.Thread(target=watch, args=(p,), daemon=True).start()
        on_launch(p)

    launcher = make_launcher(log, launched, **options)
    sink = WallSink(tmp / "target")
    job = scripted_job(tmp, epochs)
    daemon = Daemon(job, Env(state_dir=tmp / "state"), launcher=launcher, sink=sink)
    done: list[float] = []

    def listen(event: Any) -> None:
        if event.kind == "phase" and event.data.get("to") == "DONE" and not done:
            done.append(time.time())

    daemon.events.listen(listen)
    code: int | None = None
    error: str | None = None
    try:
        code = asyncio.run(asyncio.wait_for(daemon.run(), 600))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    returned = time.time()
    rows = read_jsonl(log)
    written = {int(r["epoch"]): float(r["t"]) for r in rows if r.get("name") == "last.pt"}
    epoch_written: dict[int, float] = {}
    for r in rows:
        if str(r.get("name", "")).endswith(".pt"):
            e = int(r["epoch"])
            epoch_written[e] = max(epoch_written.get(e, 0.0), float(r["t"]))
    exit_at = next((float(r["exit"]) for r in rows if "exit" in r), None)
    return DaemonRun(
        written,
        exit_at,
        done[0] if done else None,
        returned,
        list(sink.uploads),
        pid[0] if pid else None,
        code,
        error,
        epoch_written,
        [float(r["write_s"]) for r in rows if "write_s" in r],
        gone[0] if gone else None,
    )


def latencies(written: dict[int, float], caught: list[tuple[int | None, float]]) -> list[float]:
    """Per epoch: its last.pt written -> the first upload (or copy) of that epoch's content."""
    first: dict[int, float] = {}
    for epoch, t in caught:
        if epoch is not None and epoch not in first:
            first[epoch] = t
    return [first[e] - written[e] for e in sorted(first) if e in written]


def epoch_s(cfg: Config, kb: int) -> float:
    """Epochs long enough for the checkpoint writes themselves (2 x size per epoch): the
    trainer's wait between epochs, at 50 MB/s (200 MB: 4 s). torch.save writes 200 MB in about
    0.2-0.7 s on a 2-core machine, so best.pt and last.pt take well under 1.5 s an epoch, on
    top of this wait."""
    return max(cfg.p2_epoch_s, kb / 50_000)


def bench_p2(cfg: Config, root: Path) -> Section:
    s = Section("P2", "Checkpoint written -> upload request")
    info: list[str] = []
    rng = random.Random()
    for kb in cfg.p2_sizes_kb:
        agent_lat: list[float] = []
        from_last: list[float] = []  # from last.pt itself written (best.pt's save included)
        best_lat: list[float] = []  # best.pt's upload, from the epoch's checkpoints written
        anchor_lat: list[float] = []
        epochs_total = agent_caught = anchor_caught = torn = 0
        exit_done: list[float] = []
        write_s: list[float] = []
        for i in range(cfg.repeat):
            tmp = root / f"p2-{kb}-{i + 1}"
            tmp.mkdir()
            say(f"P2 {kb // 1000} MB checkpoints, run {i + 1}/{cfg.repeat}")
            anchor_log = tmp / "anchor-sync.jsonl"
            procs: list[subprocess.Popen[bytes]] = []

            first = rng.uniform(0, 10)

            def start_anchor(
                pid: int,
                first: float = first,
                tmp: Path = tmp,
                anchor_log: Path = anchor_log,
                procs: list[subprocess.Popen[bytes]] = procs,
            ) -> None:
                procs.append(
                    subprocess.Popen(
                        [
                            PY,
                            str(THIS),
                            "sync",
                            str(tmp / "runs"),
                            str(tmp / "anchor-target"),
                            "10",
                            f"{first:.3f}",
                            str(anchor_log),
                        ],
                        cwd=REPO,
                    )
                )

            try:
                r = daemon_run(
                    tmp,
                    cfg.p2_epochs,
                    start_anchor,
                    epoch_s=epoch_s(cfg, kb),
                    ckpt_kb=kb,
                    torch_save=1,
                )
            finally:
                for p in procs:
                    stop_proc(p)
            if r.error:
                s.notes.append(f"{kb // 1000} MB run {i + 1}: the daemon failed: {r.error}")
            ups = [(u.epoch, u.t) for u in r.uploads if u.remote == "weights/last.pt"]
            a = latencies(r.epoch_written, ups)
            from_last += latencies(r.written, ups)
            best_ups = [(u.epoch, u.t) for u in r.uploads if u.remote == "weights/best.pt"]
            best_lat += latencies(r.epoch_written, best_ups)
            copies = [row for row in read_jsonl(anchor_log) if row.get("name") == "last.pt"]
            # The anchor does not wait for status.json: its copy of last.pt may start as soon
            # as last.pt is written, so its figure counts from there.
            b = latencies(r.written, [(c.get("epoch"), c["t"]) for c in copies])
            torn += sum(c.get("epoch") is None for c in copies)
            agent_lat += a
            anchor_lat += b
            epochs_total += len(r.written)
            agent_caught += len(a)
            anchor_caught += len(b)
            write_s += r.write_s
            if r.ended is not None and r.done_at is not None:
                exit_done.append(r.done_at - r.ended)
            say(f"  agent {fmt_spread(a, 's', 3)}; anchor {fmt_spread(b, 's', 3)}")
            shutil.rmtree(tmp, ignore_errors=True)
        size = f"{kb / 1000:g} MB"
        s.rows.append(
            Row(
                "P2",
                f"{size}: p50 over all epochs (agent: {agent_caught}/{epochs_total} epochs "
                f"uploaded; anchor: {anchor_caught}/{epochs_total} copied)",
                fmt_spread(agent_lat, "s", 3),
                fmt_spread(anchor_lat, "s", 3),
                ratio(agent_lat, anchor_lat, 3),
                "p50 < 0.2 s",
                yes(bool(agent_lat) and (med(agent_lat) or 0) < 0.2),
            )
        )
        s.rows.append(
            Row(
                "P2",
                f"{size}: max",
                f"{max(agent_lat):.3f} s" if agent_lat else "-",
                f"{max(anchor_lat):.3f} s" if anchor_lat else "-",
                "-",
                "max < 0.5 s",
                yes(bool(agent_lat) and max(agent_lat) < 0.5),
            )
        )
        if torn:
            info.append(f"{size}: the anchor made {torn} torn copy(ies) of last.pt (mid-write).")
        info.append(
            f"{size}: from last.pt itself written (the trainer's save of best.pt after it "
            f"included): {fmt_spread(from_last, 's', 3)}."
        )
        info.append(
            f"{size}: best.pt's upload request (written last, so its copy finishes after the "
            f"write), from the epoch's checkpoints written: {fmt_spread(best_lat, 's', 3)}."
        )
        info.append(f"{size}: each torch.save of a checkpoint took {fmt_spread(write_s, 's', 3)}.")
        info.append(
            f"{size}: trainer exit (the process gone) -> DONE in these runs (the rest of the "
            f"last epoch's upload of {size} checkpoints, and the final verification, included):"
            f" {fmt_spread(exit_done, 's', 3)}."
        )
    s.notes += [
        "Written: the epoch's last checkpoint write returned (LibreYOLO, and the scripted "
        "trainer, save last.pt, then best.pt, then write status.json: the agent may not send "
        "last.pt before status.json says its epoch is complete, so the time the trainer spends "
        "saving best.pt after last.pt is the trainer's, reported apart below). The "
        "checkpoints are written by the real "
        "`torch.save`, as LibreYOLO's are: a dict with the epoch and float32 tensors of the "
        f"size ({CKPT_TENSORS} of them, seeded by the epoch), written in place, a write call "
        "per tensor, "
        "as a zip with data descriptors (`bench/common.py trainer torch_save=1`). Upload "
        "request: the sink's `upload` entered with "
        "that epoch's snapshot (the real Daemon in-process, LocalSink, `[sync] every_epochs = "
        f"1`, {cfg.p2_epochs} epochs per run of "
        f"{', '.join(f'{epoch_s(cfg, kb):g} s ({kb / 1000:g} MB)' for kb in cfg.p2_sizes_kb)};"
        " last.pt and best.pt are both written every epoch). The median and min-max "
        "are over every epoch of every run.",
        "Anchor: `bench/common.py sync`, a process that every 10 s (first look at a random "
        "0-10 s) copies the checkpoints whose size or mtime changed, on the same trainer at the "
        "same time, counted from last.pt written (it does not wait for status.json); its "
        "figure is over the "
        "epochs it caught (the others were overwritten before it looked).",
        *info,
    ]
    return s


def bench_p3(cfg: Config, root: Path) -> Section:
    s = Section("P3", "Trainer exit -> DONE (teardown provider none)")
    agent: list[float] = []
    anchor: list[float] = []
    returned: list[float] = []
    rng = random.Random()
    for i in range(cfg.repeat):
        tmp = root / f"p3-{i + 1}"
        tmp.mkdir()
        anchor_log = tmp / "anchor-idle.jsonl"
        procs: list[subprocess.Popen[bytes]] = []
        first = rng.uniform(0, 60)

        def start_anchor(
            pid: int,
            anchor_log: Path = anchor_log,
            first: float = first,
            procs: list[subprocess.Popen[bytes]] = procs,
        ) -> None:
            procs.append(
                subprocess.Popen(
                    [PY, str(THIS), "idle", str(pid), "60", f"{first:.3f}", str(anchor_log)],
                    cwd=REPO,
                )
            )

        say(f"P3 run {i + 1}/{cfg.repeat} (the 60 s idle check's first look at {first:.0f} s)")
        try:
            r = daemon_run(tmp, 3, start_anchor, epoch_s=0.3, ckpt_kb=1000)
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(130)
        finally:
            for p in procs:
                stop_proc(p)
        gone = next((row["gone"] for row in read_jsonl(anchor_log) if "gone" in row), None)
        if r.error:
            s.notes.append(f"run {i + 1}: the daemon failed: {r.error}")
        if r.ended is not None and r.done_at is not None:
            agent.append(r.done_at - r.ended)
            returned.append(r.returned_at - r.ended)
        if r.ended is not None and gone is not None:
            anchor.append(gone - r.ended)
        say(f"  agent {agent[-1:]} s, anchor {anchor[-1:]} s")
        shutil.rmtree(tmp, ignore_errors=True)
    s.rows.append(
        Row(
            "P3",
            "trainer exit -> phase DONE",
            fmt_spread(agent, "s", 3),
            fmt_spread(anchor, "s", 1),
            ratio(agent, anchor, 3),
            "< 0.5 s always",
            yes(bool(agent) and max(agent) < 0.5),
        )
    )
    s.notes += [
        "The real Daemon in-process; the scripted trainer (3 epochs of 0.3 s, 1 MB "
        "checkpoints) synced to a folder (so DONE includes the final sync, its verification, "
        "the report and the teardown decision). Exit: the trainer process gone (its pidfd "
        "became readable, watched by the bench); DONE: the agent's phase event.",
        f"trainer exit -> `Daemon.run` returned (shutdown included): {fmt_spread(returned)}.",
        "Anchor: `bench/common.py idle`, a process that checks every 60 s whether the trainer "
        "is still there, started at the trainer's launch with its first look at a random "
        "0-60 s (a cron-like check's phase is random).",
    ]
    return s


# ========================================================================================= P4


def bench_p4(cfg: Config, root: Path) -> Section:
    import preemption_upload as pu

    from tests.fakes.metadata import run_fake_gce, run_fake_imds

    s = Section("P4", "Preemption notice -> last.pt upload request")
    res: dict[str, list[Any]] = {"aws": [], "gcp": []}

    async def go() -> None:
        rng = random.Random()
        with run_fake_imds() as imds, run_fake_gce() as gce:
            for i in range(cfg.repeat):
                for source, fake in (("aws", imds), ("gcp", gce)):
                    tmp = root / f"p4-{source}-{i + 1}"
                    tmp.mkdir()
                    say(f"P4 {source} trial {i + 1}/{cfg.repeat}")
                    try:
                        r = await pu.trial(source, fake, tmp, rng, 5.0)
                    finally:
                        shutil.rmtree(tmp, ignore_errors=True)
                    say(f"  upload starts {r.upload_start_s} s {r.problem or ''}")
                    res[source].append(r)

    asyncio.run(go())
    for source, rows in res.items():
        start = [r.upload_start_s for r in rows if r.upload_start_s is not None]
        notice = [r.notice_s for r in rows if r.notice_s is not None]
        s.rows.append(
            Row(
                "P4",
                f"{source.upper()}: notice on the fake metadata server -> last.pt upload starts",
                fmt_spread(start, "s", 3),
                "-",
                "-",
                "< 2 s",
                yes(bool(start) and max(start) < 2),
            )
        )
        s.notes.append(
            f"{source.upper()}: of which the watcher saw the notice after "
            f"{fmt_spread(notice, 's', 3)}."
        )
        bad = [r.problem for r in rows if r.problem]
        if bad:
            s.notes.append(f"{source.upper()} problems: {'; '.join(str(b) for b in bad)}")
    s.notes.append(
        "bench/preemption_upload.py's trial: the real Daemon, the scripted trainer (0.5 s "
        "epochs, 20 MB checkpoints), AWS IMDS polled every 1 s, GCP long poll, the agent's poll "
        "5 s; see the Preemption section of docs/benchmarks.md. No anchor: without the agent "
        "nothing uploads on a notice."
    )
    return s


# ========================================================================================= P5


def bench_p5(cfg: Config, root: Path) -> Section:
    from huggingface_hub import HfApi

    from agent import hub
    from agent.config.model import Env
    from agent.sinks.hf import HubSink
    from tests.fakes.hub import run_fake_hub

    s = Section("P5", "Upload through the sink vs `HfApi.upload_file`")
    sink_t: list[float] = []
    raw_t: list[float] = []
    ratios: list[float] = []
    read_back: list[float] = []
    path = root / "upload.pt"
    with run_fake_hub(tokens={"hf_bench"}) as fake:
        env = Env(state_dir=root / "p5-state", hf_endpoint=fake.url, hf_token="hf_bench")
        hub.configure(env)
        sink = HubSink("bench/run", env=env, private=True)
        sink.prepare()
        api = HfApi(endpoint=fake.url, token="hf_bench")
        rounds = cfg.p5_rounds * cfg.repeat
        for i in range(rounds + 1):  # round 0 warms both up and is not counted
            order = ["sink", "raw"] if i % 2 else ["raw", "sink"]
            took: dict[str, float] = {}
            for who in order:
                # New bytes for each: the Hub (and the fake) skips an LFS object it already
                # holds, so the second of two uploads of one content would move nothing.
                path.write_bytes(os.urandom(cfg.p5_mb * MIB))
                t0 = time.perf_counter()
                if who == "sink":
                    sink.upload(path, "weights/sink.pt")
                else:
                    api.upload_file(
                        path_or_fileobj=str(path),
                        path_in_repo="weights/raw.pt",
                        repo_id="bench/run",
                        repo_type="model",
                        revision="main",
                        commit_message="bench: upload_file",
                    )
                took[who] = time.perf_counter() - t0
            t0 = time.perf_counter()
            sink.stat("weights/sink.pt")
            rb = time.perf_counter() - t0
            if i == 0:
                continue
            sink_t.append(took["sink"])
            raw_t.append(took["raw"])
            ratios.append(took["raw"] / took["sink"])
            read_back.append(rb)
            say(
                f"P5 round {i}/{rounds}: sink {took['sink']:.3f} s, upload_file {took['raw']:.3f} s"
            )
    r = spread(ratios)
    met = "-"
    if r is not None:
        met = "yes" if r[0] >= 1.0 else ("within noise" if r[2] >= 1.0 else "**no**")
    s.rows.append(
        Row(
            "P5",
            f"upload of a {cfg.p5_mb} MB .pt (anchor: `HfApi.upload_file`; ratio: anchor / sink, "
            "per round)",
            fmt_spread(sink_t, "s", 3),
            fmt_spread(raw_t, "s", 3),
            fmt_spread(ratios, "", 3),
            ">= 1.0",
            met,
        )
    )
    s.notes += [
        "The fake Hub of tests/fakes/hub.py on 127.0.0.1 (it takes every file in the commit "
        "body, base64, as the real Hub does for regular files); each round writes new random "
        "content and runs both, alternating which goes first; one warm-up round not counted.",
        "The sink's read-back after its upload (`stat`, paths-info): "
        f"{fmt_spread(read_back, 's', 3)} (the agent's queue does this after every upload; "
        "not in the ratio).",
        "`HubSink.upload` is one `HfApi.upload_file` call plus a path check, so the ratio is "
        "1.0 within the machine's noise; 'within noise' means a median below 1.0 with a max at "
        "or above it.",
    ]
    return s


# ========================================================================================= P6


def has_gpu() -> bool:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def bench_p6(cfg: Config) -> Section:
    s = Section("P6", "Preflight vs the bare recipe")
    if not has_gpu():
        s.skipped = "not measured: no GPU"
        return s
    out = subprocess.run(
        [PY, str(REPO / "bench" / "preflight_ratio.py"), "--rounds", str(max(3, cfg.repeat))],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=1800,
    )
    bare: list[float] = []
    full: list[float] = []
    for line in out.stdout.splitlines():
        if line.startswith("round"):
            parts = line.split()
            bare.append(float(parts[3].rstrip("s")))
            full.append(float(parts[5].rstrip("s")))
    rs = [f / b for f, b in zip(full, bare, strict=False) if b]
    s.rows.append(
        Row(
            "P6",
            "`libreyolo-agent preflight` vs import torch + one matmul on the GPU",
            fmt_spread(full),
            fmt_spread(bare),
            fmt_spread(rs, "", 2),
            "<= 1.5",
            yes(bool(rs) and (med(rs) or 9) <= 1.5),
        )
    )
    s.notes.append("bench/preflight_ratio.py, alternated rounds.")
    return s


# ===================================================================================== report


def write_results(
    path: Path,
    sections: list[Section],
    mach: dict[str, str],
    cfg: Config,
    started: float,
    argv: list[str],
) -> None:
    lines = [
        "# Benchmark results",
        "",
        "Written by `bench/run.py` (as measured; not edited by hand). Command: "
        f"`{' '.join(['bench/run.py', *argv])}`; {datetime.now():%Y-%m-%d %H:%M}, "
        f"{(time.time() - started) / 60:.1f} min; {cfg.repeat} repeat(s)"
        f"{' (--quick)' if cfg.quick else ''}.",
        "",
        "## Machine",
        "",
        *[f"- {k}: {v}" for k, v in mach.items()],
        "",
        "## Figures",
        "",
        "Median (min-max, n) of the agent's figure and of its anchor, measured side by side in "
        "this run; ratio: agent / anchor unless the row says otherwise.",
        "",
        "| figure | measure | agent | anchor | ratio | goal | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in sections:
        if s.skipped:
            lines.append(f"| {s.figure} | {s.title} | {s.skipped} | - | - | - | - |")
        for r in s.rows:
            lines.append(
                f"| {r.figure} | {r.measure} | {r.agent} | {r.anchor} | {r.ratio} | {r.goal} "
                f"| {r.met} |"
            )
    lines.append("")
    for s in sections:
        if s.skipped or not s.notes:
            continue
        lines += [f"### {s.figure}: {s.title}", ""]
        lines += [f"- {n}" for n in s.notes]
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def _shown(argv: list[str]) -> list[str]:
    """The command line as RESULTS.md shows it: an absolute ``--out`` is shown by its file name
    (a results file says nothing about the folders of the machine it was written on)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg.startswith("--out=") and Path(arg[6:]).is_absolute():
            arg = "--out=" + Path(arg[6:]).name
        elif i and argv[i - 1] == "--out" and Path(arg).is_absolute():
            arg = Path(arg).name
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller jobs, 1 repeat by default")
    ap.add_argument("--repeat", type=int, default=None, help="repeats (default 3; --quick: 1)")
    ap.add_argument("--only", default=",".join(FIGURES), help="figures to run, e.g. P3,P5")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "RESULTS.md")
    ap.add_argument(
        "--device",
        default="cpu",
        help='P1/P7 trainer device (train.device): "cpu" (default) or a GPU, e.g. "0"; on a GPU '
        "preflight must find it (allow_cpu false)",
    )
    args = ap.parse_args(argv)
    argv = _shown(list(sys.argv[1:] if argv is None else argv))
    want = {f.strip().upper() for f in args.only.split(",") if f.strip()}
    unknown = want - set(FIGURES)
    if unknown:
        ap.error(f"unknown figure(s): {', '.join(sorted(unknown))}")
    cfg = config(args.quick, args.repeat, args.device)
    logging.getLogger("agent").setLevel(logging.INFO)
    logging.getLogger("agent").propagate = False  # agent.log has it; keep the console for us
    started = time.time()
    mach = machine()
    say(
        f"bench: {', '.join(sorted(want))}; {cfg.repeat} repeat(s){' (quick)' if cfg.quick else ''}"
    )
    sections: dict[str, Section] = {}
    failed = False
    with tempfile.TemporaryDirectory(prefix="libreyolo-bench-") as tmp:
        root = Path(tmp)
        steps: list[tuple[set[str], Callable[[], list[Section]]]] = [
            ({"P1", "P7"}, lambda: bench_p1_p7(cfg, root, want)),
            ({"P2"}, lambda: [bench_p2(cfg, root)]),
            ({"P3"}, lambda: [bench_p3(cfg, root)]),
            ({"P4"}, lambda: [bench_p4(cfg, root)]),
            ({"P5"}, lambda: [bench_p5(cfg, root)]),
            ({"P6"}, lambda: [bench_p6(cfg)]),
        ]
        for figs, step in steps:
            if not figs & want:
                continue
            try:
                for s in step():
                    sections[s.figure] = s
            except Exception as exc:
                failed = True
                traceback.print_exc()
                for f in sorted(figs & want):
                    sections[f] = Section(
                        f, "failed", skipped=f"failed: {type(exc).__name__}: {exc}"
                    )
    mach["load average at the end"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    ordered = [
        sections.get(f) or Section(f, "not run", skipped="not run (--only)") for f in FIGURES
    ]
    write_results(args.out, ordered, mach, cfg, started, argv)
    say(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
