"""Helpers of ``scripts/gpu-validation.sh issue15``: the whole job on a real GPU.

    python3 scripts/gpu_issue15.py serve DIR        # fake Hub + fake vast.ai until SIGTERM
    python3 scripts/gpu_issue15.py sample PID FILE  # the agent's peak RSS and CPU until it exits
    python3 scripts/gpu_issue15.py report JOB_DIR NAME SERVE_DIR [T0]  # a finished job, read back
    python3 scripts/gpu_issue15.py gone PID T0      # seconds from T0 until PID's tree is gone
    python3 scripts/gpu_issue15.py kill-tree AGENT_PID TRAINER_PID STATE_DIR   # a "reboot"
    python3 scripts/gpu_issue15.py cleanup STATE_DIR...   # guards and trainers left behind

``serve`` seeds the fake Hub (tests/fakes/hub.py) with a private dataset repo holding a
``agent.demo.make_dataset`` archive and the fake vast.ai (tests/fakes/providers.py) with
instances 1501..1520, writes ``DIR/serve.env`` (shell assignments: HF_ENDPOINT, HF_TOKEN,
VAST_URL, VAST_API_KEY, DATA_REPO, DATA_FILE) and keeps ``DIR/vast.json`` (every request the fake
vast got, and each instance's state) up to date until SIGTERM. Both listen on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import signal
import sys
import tarfile
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

HF_TOKEN = "hf_gpu_issue15_write"
VAST_KEY = "vast-gpu-issue15-key"
DATA_REPO = "gpu-i15/boxes"
DATA_FILE = "boxes.tar.gz"
INSTANCES = [str(i) for i in range(1501, 1521)]
PHASES = ("BOOTING", "PREFLIGHT", "STAGING", "TRAINING", "FINISHING", "TEARDOWN", "DONE")


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _dataset_archive(train: int, val: int, size: int) -> bytes:
    """``make_dataset`` as a .tar.gz whose data.yaml has no absolute ``path:`` (the YAML's
    folder is the root, so the staged copy stays inside ``dataset.dest``)."""
    from agent.demo import make_dataset

    with tempfile.TemporaryDirectory(prefix="i15-ds-") as tmp:
        root = Path(tmp) / "boxes"
        yaml = make_dataset(root, train=train, val=val, size=size)
        yaml.write_text("train: images/train\nval: images/val\nnames:\n  0: box\n")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tf:
            tf.add(root, arcname="boxes")
        return buf.getvalue()


def serve(out: Path) -> int:
    from tests.fakes.hub import run_fake_hub
    from tests.fakes.providers import run_fake_vast

    out.mkdir(parents=True, exist_ok=True)
    size = int(os.environ.get("I15_IMG", "64"))
    archive = _dataset_archive(
        int(os.environ.get("I15_TRAIN", "64")), int(os.environ.get("I15_VAL", "16")), size
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with run_fake_hub(tokens={HF_TOKEN}) as hub, run_fake_vast(keys={VAST_KEY}) as vast:
        hub.add_file("dataset", DATA_REPO, DATA_FILE, archive, private=True)
        for iid in INSTANCES:
            vast.add_instance(iid)
        env = {
            "HF_ENDPOINT": hub.url,
            "HF_TOKEN": HF_TOKEN,
            "VAST_URL": vast.url,
            "VAST_API_KEY": VAST_KEY,
            "DATA_REPO": DATA_REPO,
            "DATA_FILE": DATA_FILE,
        }
        _write(out / "serve.env", "".join(f"{k}={v}\n" for k, v in env.items()))
        print(
            f"fake hub {hub.url} (dataset {DATA_REPO}/{DATA_FILE}, {len(archive)} B), "
            f"fake vast {vast.url}",
            flush=True,
        )

        def dump() -> None:
            with vast.lock:
                calls = [
                    {
                        "method": c.method,
                        "path": c.path,
                        "route": c.route,
                        "status": c.status,
                        "body": c.body,
                        "at": c.at,
                    }
                    for c in vast.requests
                ]
            routes: dict[str, int] = {}
            for r in hub.requests:
                key = f"{r.method} {r.route}"
                routes[key] = routes.get(key, 0) + 1
            doc = {
                "written_at": time.time(),
                "hub_routes": routes,
                "requests": calls,
                "instances": {i: vast.instance(i) for i in INSTANCES},
            }
            _write(out / "vast.json", json.dumps(doc, default=str))

        while not stop.wait(0.5):
            dump()
        dump()
    return 0


def sample(pid: int, out: Path) -> int:
    """Peak RSS (VmHWM) and CPU seconds of ``pid``, every 0.2 s until it is gone (the last
    sample is at most 0.2 s before its exit)."""
    import psutil

    doc: dict[str, Any] = {"pid": pid, "samples": 0}
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return 1
    while True:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                break
            t = proc.cpu_times()
            hwm = rss = 0
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
                elif line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        except (psutil.Error, OSError, ValueError):
            break
        if not hwm or not rss:  # it exited between the two reads: /proc shows no memory then
            break
        # The NVML host the agent starts on a GPU box (agent/gpu/nvmlhost.py): its own peak.
        with contextlib.suppress(psutil.Error, OSError, ValueError):
            for child in proc.children():
                if any(a.endswith("agent/gpu/nvml.py") for a in child.cmdline()):
                    ct = child.cpu_times()
                    doc["nvml_host_cpu_s"] = round(ct.user + ct.system, 3)
                    for line in Path(f"/proc/{child.pid}/status").read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            host = round(int(line.split()[1]) / 1024, 1)
                            doc["nvml_host_peak_mib"] = max(doc.get("nvml_host_peak_mib", 0), host)
        doc.update(
            cpu_s=round(t.user + t.system, 3),
            user_s=round(t.user, 3),
            system_s=round(t.system, 3),
            peak_rss_mib=max(doc.get("peak_rss_mib", 0), round(hwm / 2**20, 1)),
            rss_mib=round(rss / 2**20, 1),
            rss_samples=[*doc.get("rss_samples", []), round(rss / 2**20, 1)],
            samples=doc["samples"] + 1,
            last_sample=time.time(),
        )
        _write(out, json.dumps(doc))
        time.sleep(0.2)
    return 0


def _sha(path: Path) -> str | None:
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _log_time(line: str) -> float | None:
    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def timeline(state: dict[str, Any]) -> str:
    """``BOOTING 1.2s -> PREFLIGHT 3.4s -> ... -> DONE`` from state.json (seconds in each)."""
    marks: list[tuple[str, float]] = [("BOOTING", float(state.get("started_at") or 0))]
    marks += [(str(h["to"]), float(h["at"])) for h in state.get("history", []) if "to" in h]
    parts = []
    for i, (phase, at) in enumerate(marks):
        if i + 1 < len(marks):
            parts.append(f"{phase} {marks[i + 1][1] - at:.1f}s")
        else:
            parts.append(phase)
    return " -> ".join(parts)


def run_dir_of(runs: Path) -> Path | None:
    found = sorted(runs.glob("*/status.json"))
    return found[0].parent if found else None


def epochs_line(run_dir: Path | None) -> str:
    if run_dir is None:
        return "no run dir"
    rows: list[int] = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                rows.append(int(json.loads(line)["epoch"]))
            except (ValueError, KeyError, TypeError):
                continue
    try:
        st = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        st = {}
    total = st.get("total_epochs")
    whole = isinstance(total, int) and rows == list(range(1, total + 1))
    return (
        f"epochs trained: {len(rows)}; metrics.jsonl epochs {rows} (1..{total} each once: "
        f"{whole}); status.json completed_epochs {st.get('completed_epochs')} of {total} "
        f"(this launch), state {st.get('state')}, start_epoch {st.get('start_epoch')}"
    )


def hub_readback(endpoint: str, repo: str, run_dir: Path | None) -> list[str]:
    """sha256 of weights/last.pt and best.pt as the fake Hub describes them (paths-info through
    the real huggingface_hub client) and as a download hashes, against the local files."""
    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi(endpoint=endpoint, token=HF_TOKEN)
    out = []
    names = ["weights/last.pt", "weights/best.pt"]
    try:
        infos = {i.path: i for i in api.get_paths_info(repo, names, repo_type="model")}
    except Exception as exc:  # a read-back that failed is a result to print
        return [f"hub read-back of hf://{repo} failed: {type(exc).__name__}: {exc}"]
    with tempfile.TemporaryDirectory(prefix="i15-dl-") as tmp:
        for name in names:
            local = _sha(run_dir / name) if run_dir is not None else None
            info = infos.get(name)
            lfs = getattr(info, "lfs", None)
            listed = getattr(lfs, "sha256", None) if lfs is not None else None
            try:
                got = hf_hub_download(repo, name, endpoint=endpoint, token=HF_TOKEN, cache_dir=tmp)
                downloaded = _sha(Path(got))
            except Exception as exc:
                downloaded = f"download failed: {type(exc).__name__}"
            if local is None and listed is None:
                out.append(f"hub {name}: not on the Hub and not here (none was written)")
                continue
            same = local is not None and local == listed == downloaded
            out.append(
                f"hub {name}: paths-info sha256 {str(listed)[:16]} download {str(downloaded)[:16]}"
                f" local {str(local)[:16]} -> {'MATCH' if same else 'MISMATCH'}"
            )
    return out


def vast_lines(serve_dir: Path, instance: str) -> list[str]:
    # serve rewrites vast.json every 0.5 s: wait for a copy written after this call began.
    since, doc = time.time(), None
    while time.time() - since < 5:
        try:
            doc = json.loads((serve_dir / "vast.json").read_text())
        except (OSError, ValueError):
            doc = None
        if doc is not None and doc.get("written_at", 0) > since:
            break
        time.sleep(0.1)
    if doc is None:
        return ["fake vast: no record (vast.json unreadable)"]
    path = f"/api/v0/instances/{instance}/"
    mine = [r for r in doc["requests"] if r["path"] == path]
    muts = [f"{r['method']} {r['body']} -> {r['status']}" for r in mine if r["method"] != "GET"]
    reads = sum(r["method"] == "GET" for r in mine)
    inst = doc["instances"].get(instance)
    now = "gone (destroyed)" if inst is None else f"actual_status={inst.get('actual_status')}"
    return [
        f"fake vast instance {instance}: mutations {muts or 'none'}, {reads} read(s); "
        f"instance now {now}"
    ]


def teardown_line(state: dict[str, Any], report: dict[str, Any] | None) -> str:
    td = state.get("teardown") or {}
    keys = ("provider", "action", "performed", "confirmed", "instance_id", "detail")
    shown = {k: td.get(k) for k in keys if k in td}
    rtd = (report or {}).get("teardown") or {}
    same = "report.json teardown == state.json teardown" if rtd == td else "report.json differs"
    return f"teardown record: {json.dumps(shown, default=str)[:400]} ({same})"


def report(d: Path, name: str, serve_dir: Path, t0: float | None) -> int:
    """The read-back of one job run in ``d`` (job.toml, state/, runs/, agent*.log, usage.json):
    phases, start-up (from ``t0``, the agent's start in epoch seconds, when given), usage,
    epochs, the fake vast's record of the instance (``CONTAINER_ID``), the teardown record and
    the Hub's sha256 of the weights against the local files."""
    env = dict(
        line.split("=", 1)
        for line in (serve_dir / "serve.env").read_text().splitlines()
        if "=" in line
    )
    try:
        state = json.loads((d / "state" / "state.json").read_text())
    except (OSError, ValueError) as exc:
        print(f"  no state.json: {exc}")
        return 1
    rep: dict[str, Any] | None
    try:
        rep = json.loads((d / "state" / "report.json").read_text())
    except (OSError, ValueError):
        rep = None
    run_dir = run_dir_of(d / "runs")
    print(f"  phase {state.get('phase')}, reason {state.get('reason')}, cause {state.get('cause')}")
    print(f"  timeline (seconds in each phase): {timeline(state)}")
    if state.get("resumes"):
        resumes = [(r.get("kind"), r.get("epoch")) for r in state["resumes"]]
        print(f"  resumes (kind, epoch): {resumes}")
    if t0 is not None:
        started = None
        log = d / "state" / "agent.log"
        if log.is_file():
            for line in log.read_text(errors="replace").splitlines():
                if "trainer started" in line:
                    started = _log_time(line)
                    break
        if started is not None:
            print(f"  agent start -> 'trainer started' in the agent log: {started - t0:.2f} s")
        else:
            print("  no 'trainer started' line in the agent log")
    usage = d / "usage.json"
    if usage.is_file():
        try:
            use = json.loads(usage.read_text())
            rss = sorted(use.get("rss_samples") or [0.0])
            print(
                f"  agent pid {use['pid']}: peak RSS (VmHWM) {use.get('peak_rss_mib')} MiB "
                f"(VmRSS sampled: median {rss[len(rss) // 2]}, last {use.get('rss_mib')} MiB), "
                f"CPU {use.get('cpu_s')} s (user {use.get('user_s')}, system "
                f"{use.get('system_s')}; {use['samples']} samples every 0.2 s, the last <= 0.2 s "
                "before its exit)"
            )
            host_peak = use.get("nvml_host_peak_mib")
            print(
                "  NVML host (python -I -S agent/gpu/nvml.py, the agent's child): "
                + (
                    f"peak RSS (VmHWM) {host_peak} MiB, CPU {use.get('nvml_host_cpu_s')} s"
                    if host_peak
                    else "none seen"
                )
            )
            last = run_dir / "weights" / "last.pt" if run_dir is not None else None
            if last is not None and last.is_file():
                print(
                    f"  (last.pt is {last.stat().st_size / 2**20:.1f} MiB; like the real Hub, "
                    "the fake takes checkpoints through the Git LFS batch API, each streamed "
                    "from its snapshot in PUTs)"
                )
        except (OSError, ValueError, KeyError) as exc:
            print(f"  usage samples unreadable: {exc}")
    print(f"  {epochs_line(run_dir)}")
    for line in vast_lines(serve_dir, os.environ.get("CONTAINER_ID", "")):
        print(f"  {line}")
    print(f"  {teardown_line(state, rep)}")
    if rep is not None:
        print(f"  report headline: {rep.get('headline')}")
    for line in hub_readback(env["HF_ENDPOINT"], f"gpu-i15/{name}", run_dir):
        print(f"  {line}")
    return 0


def _tree(pid: int) -> list[Any]:
    import psutil

    try:
        proc = psutil.Process(pid)
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []


def _alive(procs: list[Any]) -> list[Any]:
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def gone(pid: int, t0: float, timeout: float = 180.0) -> int:
    """Print the seconds from ``t0`` until ``pid`` and every descendant seen are gone."""
    procs = _tree(pid) if pid > 0 else []
    if not procs:
        print("trainer already gone")
        return 0
    seen = {p.pid: p for p in procs}
    while time.time() - t0 < timeout:
        for p in _tree(pid):
            seen.setdefault(p.pid, p)
        if not _alive(list(seen.values())):
            print(f"{time.time() - t0:.2f} s ({len(seen)} processes)")
            return 0
        time.sleep(0.05)
    print(f"still running after {timeout:.0f} s")
    return 1


def _guard_pid(state_dir: Path) -> int | None:
    from agent.guard import plan as guardplan

    try:
        return guardplan.guard_pid(state_dir) or None
    except OSError:
        return None


def kill_tree(agent_pid: int, trainer_pid: int, state_dir: Path) -> int:
    """SIGKILL the agent, the whole trainer tree and the agent's guard, as a reboot would."""
    import psutil

    procs = _tree(agent_pid) + (_tree(trainer_pid) if trainer_pid > 0 else [])
    guard = _guard_pid(state_dir)
    if guard:
        procs += _tree(guard)
    procs = list({p.pid: p for p in procs}.values())
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(procs, timeout=30)
    left = len(alive)
    print(f"{len(procs)} processes SIGKILLed (agent, trainer tree, guard {guard}), {left} left")
    return 0


def cleanup(state_dirs: list[Path]) -> int:
    """End what the runs left behind, by pid: each state dir's guard (SIGTERM) and a trainer
    whose tree still runs (SIGKILL); both were started by this script's agents."""
    import psutil

    for sd in state_dirs:
        guard = _guard_pid(sd)
        if guard:
            with contextlib.suppress(OSError):
                os.kill(guard, signal.SIGTERM)
                print(f"{sd}: guard {guard} ended")
        try:
            tp = int(json.loads((sd / "state.json").read_text())["trainer"]["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        procs = _alive(_tree(tp))
        if procs and "libreyolo" in " ".join(procs[0].cmdline()) + procs[0].name():
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            print(f"{sd}: trainer tree {tp} killed ({len(procs)} processes)")
    return 0


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        return serve(Path(rest[0]))
    if cmd == "sample":
        return sample(int(rest[0]), Path(rest[1]))
    if cmd == "report":
        t0 = float(rest[3]) if len(rest) > 3 else None
        return report(Path(rest[0]), rest[1], Path(rest[2]), t0)
    if cmd == "gone":
        return gone(int(rest[0]), float(rest[1]))
    if cmd == "kill-tree":
        return kill_tree(int(rest[0]), int(rest[1]), Path(rest[2]))
    if cmd == "cleanup":
        return cleanup([Path(p) for p in rest])
    if cmd == "epochs":
        print(epochs_line(run_dir_of(Path(rest[0]))))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
