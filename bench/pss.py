"""Memory of every process of ours during a whole job (issue 26 item 2; goal: all of them together
under 80 MiB PSS, the agent under 64 MiB, with hf:// sync).

    python3 -m bench.pss [--epochs 3] [--model yolox-n] [--device DEV] [--imgsz 64]
        [--nvml auto|off] [--every 0.2] [--keep DIR] [--json FILE]

One whole job as on a rented box: ``libreyolo-agent supervise JOB`` (as the bootstrap starts it)
runs the agent, the agent starts the guard, the NVML host (where the job is not ``device =
"cpu"`` and a driver answers) and the real ``libreyolo train`` (the tiny job: a synthetic dataset
from :func:`agent.demo.make_dataset`, ``pretrained = false``, every epoch's checkpoints synced to
``hf://`` on the fake Hub of tests/fakes/hub.py, which takes ``.pt`` files over Git LFS as the
Hub does, through the real ``huggingface_hub`` client; ``[teardown] provider = "vast"`` against
the fake Vast API of tests/fakes/providers.py; preflight on with its defaults). Both fakes run
in this process on 127.0.0.1.

Every ``--every`` seconds (0.2) it reads ``/proc/PID/smaps_rollup`` of each process of ours:
the supervisor, its forked job check (it reads the job file and exits, before the agent starts),
the agent (``agent.cli run``), the guard (``python -m agent.guard``), the NVML host
(``agent/gpu/nvml.py``), and the restore drill's child before the destroy
(``agent.trainer.loadcheck_entry``: it imports torch, after the trainer exited; a second sum
is printed without it), and in a tree before this round's torch-free weights check its child
per epoch (``agent.trainer.finite_entry``, for a before/after); the trainer, the torch probe
and this bench are not ours to count. PSS counts a page shared by N processes as 1/N in each,
so the sum of PSS is what they cost the box together. Printed: per process its peak PSS and RSS
(and Pss_Anon, the part no other process shares), and the peak of the sum over the samples
taken at the same moment.

The NVML host: on a box with a driver it is the real one. Without one (``--nvml auto`` on a CPU
box) the bench compiles the stand-in ``libnvidia-ml.so.1`` of tests/fakes/nvml/ (needs ``cc``)
and leaves ``device`` unset, so the agent watches two stand-in GPUs while LibreYOLO trains on
the CPU; preflight then gets ``allow_cpu = true``. The host's Python is measured that way, the
driver's own memory is not (the stand-in is a few KiB). With no compiler: "absent".

Figures only; nothing is asserted. On a GPU box from the source tree, with the image's python3
and the wheels on ``PYTHONPATH`` (as scripts/gpu-validation.sh sets them up)::

    PYTHONPATH="$PWD:/tmp/site" PATH="/tmp/site/bin:$PATH" python3 -m bench.pss --device 0 \\
        --imgsz 320 --epochs 6
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent.gpu.nvmlhost import C_PROGRAM_PREFIX  # noqa: E402 (after the path)

HF_TOKEN = "hf_bench_pss_token"
HF_REPO = "bench-user/pss-run"
VAST_KEY = "vast-instance-key-bench-pss-0123456789"
INSTANCE = "2626"
GOAL_SUM_MIB = 80.0
GOAL_AGENT_MIB = 64.0
ROLES = (
    "supervisor",
    "job check",
    "agent",
    "guard",
    "nvml host",
    "weights check",
    "restore drill",
)
#: A role whose process lives only after the trainer exited, for a destroy (README, "The restore
#: drill"): it imports torch and LibreYOLO. Counted in the sum; a second sum without it says what
#: the box pays while it trains.
AFTER_TRAINING = "restore drill"


def role_of(cmdline: list[str]) -> str | None:
    """Which process of ours this command line is, None for any other (the trainer, a probe)."""
    if cmdline and Path(cmdline[0]).name.startswith(C_PROGRAM_PREFIX):
        return "nvml host"  # the C host (agent/gpu/nvmlhost.c), built into the cache folder
    if not cmdline or "python" not in Path(cmdline[0]).name:
        return None
    args = cmdline[1:]
    if any(a.endswith("nvml.py") for a in args):
        return "nvml host"
    if "agent.trainer.loadcheck_entry" in args:
        return "restore drill"
    if "agent.trainer.finite_entry" in args:  # a tree before the torch-free check: per epoch
        return "weights check"
    if "agent.guard" in args:
        return "guard"
    if "agent.cli" in args or any(a.endswith("libreyolo-agent") for a in args):
        if "supervise" in args:
            return "supervisor"
        if "run" in args:
            return "agent"
    return None


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[1])


def rollup(pid: int) -> dict[str, int] | None:
    """``/proc/PID/smaps_rollup`` in KiB (Pss, Rss, Pss_Anon, ...); None once it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            out[parts[0].rstrip(":")] = int(parts[1])
    return out or None


def ours(root: int, state_dir: str) -> dict[int, str]:
    """Every process of ours now: the supervisor ``root``, its descendants that are ours, and
    the guard of ``state_dir`` (its own session, reparented once the agent is gone)."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            ppid = _ppid(int(name))
            if ppid is not None:
                parents[int(name)] = ppid
    found: dict[int, str] = {}
    for pid in parents:
        cmd = _cmdline(pid)
        role = role_of(cmd)
        if role is None:
            continue
        if role == "guard" and state_dir in cmd:
            found[pid] = role
            continue
        up, hops = pid, 0
        while up not in (0, 1, root) and hops < 64:
            up, hops = parents.get(up, 0), hops + 1
        if up == root:
            # The supervisor's forked child that checks the job file, then exits.
            found[pid] = "job check" if role == "supervisor" and pid != root else role
    return found


def threads(pid: int) -> int:
    """The process's thread count (``/proc/PID/status``), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class Sampler:
    def __init__(self) -> None:
        self.peak: dict[str, dict[str, int]] = {r: {} for r in ROLES}
        self.pids: dict[str, set[int]] = {r: set() for r in ROLES}
        self.sum_peak_kib = 0
        self.sum_peak_parts: dict[str, int] = {}
        self.training_peak_kib = 0
        self.samples = 0

    def take(self, procs: dict[int, str]) -> None:
        total = 0
        parts: dict[str, int] = {}
        for pid, role in procs.items():
            got = rollup(pid)
            if got is None:
                continue
            self.pids[role].add(pid)
            got["Threads"] = threads(pid)
            for key in ("Pss", "Rss", "Pss_Anon", "Pss_File", "Threads"):
                if got.get(key, 0) > self.peak[role].get(key, 0):
                    self.peak[role][key] = got.get(key, 0)
            total += got.get("Pss", 0)
            parts[role] = parts.get(role, 0) + got.get("Pss", 0)
        self.samples += 1
        self.training_peak_kib = max(self.training_peak_kib, total - parts.get(AFTER_TRAINING, 0))
        if total > self.sum_peak_kib:
            self.sum_peak_kib = total
            self.sum_peak_parts = parts


def standin_nvml(work: Path) -> Path | None:
    """The stand-in ``libnvidia-ml.so.1`` compiled into ``work`` (two GPUs), or None."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = work / "nvml"
    out.mkdir(parents=True, exist_ok=True)
    source = REPO / "tests" / "fakes" / "nvml" / "fake_nvml.c"
    lib = out / "libnvidia-ml.so.1"
    subprocess.run([cc, "-Wall", "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    (out / "box.txt").write_text("gpus=2\nutil=97\npower=650000\nlimit=700000\necc=0\n")
    return out


def smaps_by_mapping(pid: int) -> list[tuple[str, int, int]]:
    """``/proc/PID/smaps`` summed per mapped file (``[anon]`` for anonymous memory, ``[heap]``):
    ``(name, Pss KiB, Rss KiB)``, largest PSS first."""
    sums: dict[str, list[int]] = {}
    name = "?"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header line
                name = parts[5] if len(parts) > 5 else "[anon]"
                name = Path(name).name if name.startswith("/") else name
            elif parts[0] in ("Pss:", "Rss:"):
                entry = sums.setdefault(name, [0, 0])
                entry[0 if parts[0] == "Pss:" else 1] += int(parts[1])
    return sorted(((n, v[0], v[1]) for n, v in sums.items()), key=lambda t: -t[1])


def nvml_host_only(seconds: float) -> int:
    """The NVML host alone, as the agent uses it (agent.gpu.health.GpuMonitor: load, power,
    ECC, Xid events), sampled for ``seconds``: its PSS and RSS, and what they are made of."""
    from agent.gpu.health import GpuMonitor

    monitor = GpuMonitor()
    try:
        if not monitor.available:
            print(f"NVML host: absent ({monitor.unavailable_reason})")
            return 1
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            monitor.samples()
            monitor.faults()
            time.sleep(1.0)
        pid = monitor._nvml._proc.pid
        got = rollup(pid) or {}
        print(
            f"NVML host pid {pid}: PSS {mib(got.get('Pss'))} MiB, RSS {mib(got.get('Rss'))} MiB, "
            f"Pss_Anon {mib(got.get('Pss_Anon'))}, Pss_File {mib(got.get('Pss_File'))}"
        )
        print("| mapping | PSS MiB | RSS MiB |\n|---|---|---|")
        for name, pss, rss in smaps_by_mapping(pid)[:15]:
            print(f"| {name} | {pss / 1024:.2f} | {rss / 1024:.2f} |")
    finally:
        monitor.close()
    return 0


def has_driver() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def job_text(work: Path, args: argparse.Namespace, data: Path, vast_url: str, cpu: bool) -> str:
    device = f'device = "{args.device}"' if args.device else ""
    return f"""
[job]
name = "pss"
runs_dir = "{work / "runs"}"
[train]
model = "{args.model}"
pretrained = false
data = "{data}"
epochs = {args.epochs}
imgsz = {args.imgsz}
batch = {args.batch}
workers = 0
{device}
save_period = 1
[preflight]
allow_cpu = {"true" if cpu else "false"}
[server]
listen = "127.0.0.1:0"
[sync]
target = "hf://{HF_REPO}"
every_epochs = 1
[teardown]
provider = "vast"
api_url = "{vast_url}"
"""


def run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from agent.demo import make_dataset
    from tests.fakes.hub import run_fake_hub
    from tests.fakes.providers import run_fake_vast

    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBREYOLO_AGENT_")}
    env |= {
        "LIBREYOLO_AGENT_STATE_DIR": str(work / "state"),
        "HF_TOKEN": HF_TOKEN,
        "HF_HOME": str(work / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "CONTAINER_ID": INSTANCE,
        "CONTAINER_API_KEY": VAST_KEY,
        "PYTHONUNBUFFERED": "1",
    }
    old_path = env.get("PYTHONPATH")  # this tree's agent, whatever else is installed
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + old_path if old_path else "")
    env.pop("HF_HUB_DISABLE_XET", None)  # the agent's default: the fake speaks Git LFS
    driver = has_driver()
    nvml = "driver" if driver else "absent"
    cpu = args.device == "cpu" or not driver
    if not driver and args.nvml != "off" and args.device != "cpu":
        lib = standin_nvml(work)
        if lib is not None:
            nvml = "stand-in"
            old = env.get("LD_LIBRARY_PATH")
            env["LD_LIBRARY_PATH"] = str(lib) + (os.pathsep + old if old else "")
            env["FAKE_NVML_CONTROL"] = str(lib / "box.txt")
    data = make_dataset(work / "data", train=args.images, val=max(args.images // 4, 2))
    sampler = Sampler()
    with (
        run_fake_hub(tokens={HF_TOKEN}) as hub,
        run_fake_vast(keys=set(), instance_keys={VAST_KEY: INSTANCE}) as vast,
    ):
        vast.add_instance(INSTANCE)
        env["HF_ENDPOINT"] = hub.url
        job = work / "job.toml"
        job.write_text(job_text(work, args, data, vast.url, cpu))
        started = time.monotonic()
        sup = subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-m",
                "agent.cli",
                "supervise",
                str(job),
                "--log",
                str(work / "supervisor.log"),
            ],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        state_dir = str(work / "state")
        seen: dict[int, str] = {}
        ended = time.monotonic()
        try:
            while True:
                procs = ours(sup.pid, state_dir) if sup.poll() is None else {}
                if sup.poll() is not None:  # the guard may outlive it, until the job's end
                    procs = {p: r for p, r in ours(0, state_dir).items() if r == "guard"}
                    if not procs:
                        break
                    if time.monotonic() - ended > args.guard_wait:
                        break
                else:
                    ended = time.monotonic()
                seen.update(procs)
                sampler.take(procs)
                if time.monotonic() - started > args.timeout:
                    break
                time.sleep(args.every)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(sup.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                sup.wait(30)
            for pid, role in seen.items():  # the guard, and anything left of ours
                with contextlib.suppress(ProcessLookupError):
                    if role == "guard" and _cmdline(pid):
                        os.kill(pid, signal.SIGTERM)
        seconds = time.monotonic() - started
        remote = [p for p in hub.files("model", HF_REPO) if p.endswith(".pt")]
        lfs = list(hub.lfs_transfers)
    record = _read_json(work / "state" / "supervisor.json")
    return {
        "rc": sup.returncode,
        "seconds": round(seconds, 1),
        "samples": sampler.samples,
        "nvml": nvml,
        "peak": sampler.peak,
        "pids": {r: sorted(p) for r, p in sampler.pids.items()},
        "sum_peak_kib": sampler.sum_peak_kib,
        "sum_peak_parts": sampler.sum_peak_parts,
        "training_peak_kib": sampler.training_peak_kib,
        "hub_pt_files": sorted(remote),
        "lfs_transfers": len(lfs),
        "supervisor_state": (record or {}).get("state"),
        "restarts": (record or {}).get("restarts"),
    }


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def mib(kib: int | None) -> str:
    return "-" if not kib else f"{kib / 1024:.1f}"


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"whole job under supervise: {args.model}, {args.epochs} epochs, imgsz {args.imgsz}, "
        f"device {args.device or 'unset'}, hf:// sync to the fake Hub "
        f"({len(result['hub_pt_files'])} .pt files there, {result['lfs_transfers']} LFS "
        "transfers), teardown vast (fake); "
        f"supervisor {result['supervisor_state']} rc {result['rc']}, {result['seconds']} s, "
        f"{result['samples']} samples every {args.every} s",
        "",
        "| process | peak PSS MiB | peak RSS MiB | peak Pss_Anon MiB | pids | peak threads |",
        "|---|---|---|---|---|---|",
    ]
    for role in ROLES:
        peak = result["peak"].get(role, {})
        pids = result["pids"][role]
        note = ""
        if role == "nvml host":
            note = f" ({result['nvml']})"
        if not pids and role == "guard":
            where = "a thread of the supervisor (agent/guard/hosted.py)"
            lines.append(f"| guard | {where} | - | - | - | - |")
            continue
        if not pids and role == "weights check":
            lines.append(f"| {role} | a thread of the agent (no torch) | - | - | - | - |")
            continue
        if not pids and role == AFTER_TRAINING:
            lines.append(f"| {role} | not run (no destroy, or the drill is off) | - | - | - | - |")
            continue
        if not pids:
            lines.append(f"| {role}{note} | absent | - | - | - | - |")
            continue
        if role == "job check" and peak.get("Pss", 0) == 0:
            lines.append(f"| {role} | exited before a sample | - | - | - | - |")
            continue
        lines.append(
            f"| {role}{note} | {mib(peak.get('Pss'))} | {mib(peak.get('Rss'))} | "
            f"{mib(peak.get('Pss_Anon'))} | {len(pids)} | {peak.get('Threads', '-')} |"
        )
    parts = ", ".join(f"{r} {mib(k)}" for r, k in result["sum_peak_parts"].items())
    lines += [
        f"| **sum, at its peak** | **{mib(result['sum_peak_kib'])}** | | | ({parts}) |",
        f"| sum without the {AFTER_TRAINING}, at its peak | {mib(result['training_peak_kib'])} "
        "| | | |",
        "",
        f"goals: sum < {GOAL_SUM_MIB:g} MiB: "
        f"{'yes' if result['sum_peak_kib'] / 1024 < GOAL_SUM_MIB else 'NO'} (while training: "
        f"{'yes' if result['training_peak_kib'] / 1024 < GOAL_SUM_MIB else 'NO'}); agent < "
        f"{GOAL_AGENT_MIB:g} MiB: "
        f"{'yes' if result['peak']['agent'].get('Pss', 0) / 1024 < GOAL_AGENT_MIB else 'NO'}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--model", default="yolox-n")
    ap.add_argument("--imgsz", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--images", type=int, default=16, help="training images of the dataset")
    ap.add_argument("--device", default=None, help="[train] device (default: unset)")
    ap.add_argument(
        "--nvml",
        choices=("auto", "off"),
        default="auto",
        help="auto: the driver, else the stand-in library where cc exists",
    )
    ap.add_argument("--every", type=float, default=0.2, help="seconds between samples")
    ap.add_argument("--timeout", type=float, default=900.0, help="give up after this, seconds")
    ap.add_argument(
        "--guard-wait",
        type=float,
        default=60.0,
        help="seconds to keep sampling the guard after the supervisor exits",
    )
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it")
    ap.add_argument("--json", type=Path, help="also write the figures here as JSON")
    ap.add_argument(
        "--nvml-host",
        type=float,
        metavar="SECONDS",
        help="instead: the NVML host alone, used as the agent does for SECONDS, its memory "
        "per mapping (the driver's library against the Python around it)",
    )
    args = ap.parse_args(argv)
    if args.nvml_host is not None:
        return nvml_host_only(args.nvml_host)
    with tempfile.TemporaryDirectory(prefix="bench-pss-") as tmp:
        work = (args.keep or Path(tmp)).absolute()
        work.mkdir(parents=True, exist_ok=True)
        result = run(work, args)
        print(report(result, args))
        if result["rc"] != 0:
            log = (work / "supervisor.log").read_text(errors="replace").splitlines()
            print("supervisor.log, last lines:", *log[-15:], sep="\n  ")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["rc"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
