"""Benchmark (issue 26 item 1): from the first command on a fresh box to the first epoch, the
guide's bare recipe against the project's on-start line (scripts/bootstrap.sh), alternating on
one box, with the same tiny job. Run it ON the box, in this checkout, with the image's Python:

    python3 bench/firstbox.py [--rounds 3] [--device 0|cpu] [--wheels .whl] [--repo URL]

Both recipes get the same things: a dataset (one .tar.gz, private) on a fake Hub on 127.0.0.1
(``scripts/gpu_issue15.py serve``), wheels from a local folder and no index (``PIP_NO_INDEX=1``,
``PIP_FIND_LINKS``; ``--index`` lets pip use its usual index instead), a fresh Hub cache and a
fresh venv every round. Both are timed from their first command to the moment the run's
``status.json`` (LibreYOLO's, in the run folder) says ``completed_epochs >= 1``.

The bare recipe, as a person following LibreYOLO's guide on a GPU image would type it:

    python3 -m venv V                                   # the image's python3
    echo <the image's site-packages> > V/lib/pythonX.Y/site-packages/image.pth
    V/bin/pip install libreyolo==1.6.0
    V/bin/python -c 'hf_hub_download(repo, file, repo_type="dataset"); tar xf'
    nohup V/bin/libreyolo train model=yolox-n data=... epochs=... imgsz=320 ... &

The .pth line is the one step the guide does not say: these images' python3 is itself a venv
holding CUDA torch, whose packages ``--system-site-packages`` would not show (it shows the base
interpreter's, which holds no torch); without it pip downloads a 3 GB torch. install.sh does
the same for the agent's venv, so both recipes use the image's torch.

The agent's recipe is the README's start line, with its folders under a temporary one
(``LIBREYOLO_AGENT_REPO`` = ``--repo``, default .gpu/repo.bundle when there is one, else this
checkout): clone, install.sh (torch decision, venv, pip, check), job check, the supervisor, the
agent (preflight, staging, trainer). After the first epoch the same line runs again (a second
boot: it must change nothing) and is timed; then every process of the round is killed.

The step columns: ``clone`` (start line to bootstrap's first line), install.sh's own timing line
(``torch`` decision, ``venv``, ``pip``, ``check``), ``data`` (bare: download + unpack; the agent
stages it itself, overlapped with the preflight), ``start`` (seconds from the first command to
the trainer's start for bare, to the supervisor's start for the agent), ``preflight`` (the
agent's PREFLIGHT phase, from state.json), ``agent`` (first command to the agent's first phase
change: the agent up), ``train`` (first command to the trainer's start for bare, to the agent's
TRAINING phase for the agent: its warm trainer told to train, its imports and the GPU probe
done), ``epoch1`` (the figure compared), ``again`` (the
second boot). ``--no-doctor`` gives the agent's job ``dataset.doctor = false`` (what the dataset
doctor beside the first epoch costs). ``--device cpu`` (a sanity run on a machine without a
GPU) uses a smaller dataset and image size and puts a stand-in ``nvidia-smi`` (an H200 on driver
580) on install.sh's PATH so the image's torch is kept as on a GPU box; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MARK = "LIBREYOLO_FIRSTBOX_BENCH"
LIBREYOLO = "libreyolo==1.6.0"


def opencv_standin(wheels: Path) -> str:
    """libreyolo requires opencv-python; GPU images often hold opencv-python-headless only (the
    same cv2). With no index, a metadata-only opencv-python of the headless version stands for
    it (cv2 stays the image's)."""
    try:
        md.version("opencv-python")
        return "opencv-python is in the image"
    except md.PackageNotFoundError:
        pass
    try:
        ver = md.version("opencv-python-headless")
    except md.PackageNotFoundError:
        return "no OpenCV in the image: pip installs opencv-python from the wheels"
    name = f"opencv_python-{ver}.dist-info"
    files = {
        f"{name}/METADATA": f"Metadata-Version: 2.1\nName: opencv-python\nVersion: {ver}\n",
        f"{name}/WHEEL": "Wheel-Version: 1.0\nGenerator: firstbox\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }

    def rec(data: str) -> str:
        d = hashlib.sha256(data.encode()).digest()
        return f"sha256={base64.urlsafe_b64encode(d).rstrip(b'=').decode()},{len(data.encode())}"

    record = "".join(f"{p},{rec(t)}\n" for p, t in files.items()) + f"{name}/RECORD,,\n"
    with zipfile.ZipFile(wheels / f"opencv_python-{ver}-py3-none-any.whl", "w") as z:
        for p, t in files.items():
            z.writestr(p, t)
        z.writestr(f"{name}/RECORD", record)
    return f"stand-in opencv-python {ver} (cv2 from opencv-python-headless)"


def marked_pids(mark: str) -> list[int]:
    found = []
    needle = f"{MARK}={mark}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
    return found


def kill_marked(mark: str) -> None:
    """SIGKILL every process of a round (they all carry its mark) until none is left."""
    for _ in range(100):
        pids = marked_pids(mark)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def agent_done(state: Path) -> bool:
    with contextlib.suppress(OSError, ValueError):
        return bool(json.loads((state / "state.json").read_text()).get("phase") == "DONE")
    return False


def epoch_done(runs: Path) -> bool:
    for status in runs.glob("*/status.json"):
        with contextlib.suppress(OSError, ValueError):
            if int(json.loads(status.read_text()).get("completed_epochs") or 0) >= 1:
                return True
    return False


def first_epoch(runs: Path, deadline: float, ended: Callable[[], bool]) -> float | None:
    """The monotonic time at which a run under ``runs`` reports epoch 1 done (None: not before
    the deadline, or ``ended()`` said the trainer or agent ended first)."""
    while time.monotonic() < deadline:
        if epoch_done(runs):
            return time.monotonic()
        if ended():
            return None
        time.sleep(0.1)
    return None


class Lines:
    """A command's output lines, each with the monotonic time it arrived."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, cwd: str = "/") -> None:
        self.t0 = time.monotonic()
        self.w0 = time.time()  # the same moment on the wall clock (state.json's times)
        self.lines: list[tuple[float, str]] = []
        with open(log, "w", encoding="utf-8") as out:
            proc = subprocess.Popen(
                argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            assert proc.stdout is not None
            for line in proc.stdout:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                out.write(line)
            self.rc = proc.wait()
        self.t1 = time.monotonic()

    def at(self, pattern: str) -> tuple[float, str] | None:
        for t, line in self.lines:
            if re.search(pattern, line):
                return t, line
        return None


def bare_round(
    w: Path, env: dict[str, str], a: argparse.Namespace, data: tuple[str, str]
) -> dict[str, Any]:
    repo, file = data
    image_site = sysconfig.get_paths()["purelib"]
    train = (
        f"model=yolox-n pretrained=false epochs={a.epochs} imgsz={a.imgsz} batch={a.batch} "
        f"workers={a.workers} device={a.device} data={w}/data/boxes/data.yaml "
        f"project={w}/runs name=bare"
    )
    script = f"""set -e
step() {{ echo "@step $1"; }}
step venv
{sys.executable} -m venv {w}/venv
site="$({w}/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo {image_site} > "$site/image.pth"
step pip
{w}/venv/bin/pip install --disable-pip-version-check {LIBREYOLO}
step data
{w}/venv/bin/python -c '
import tarfile
from huggingface_hub import hf_hub_download
p = hf_hub_download("{repo}", "{file}", repo_type="dataset")
tarfile.open(p).extractall("{w}/data")
'
step train
export PATH="{w}/venv/bin:{Path(sys.executable).parent}:$PATH"  # the venv activated
nohup libreyolo train {train} > {w}/train.log 2>&1 &
echo "@pid $!"
step end
"""
    benv = dict(env, HF_HOME=str(w / "hf"))
    run = Lines(["bash", "-c", script], benv, w / "bare.log")
    steps = {line.split()[1]: t for t, line in run.lines if line.startswith("@step ")}
    row: dict[str, Any] = {"recipe": "bare", "rc": run.rc}
    if run.rc != 0 or "end" not in steps:
        return row
    row["venv"] = steps["pip"] - steps["venv"]
    row["pip"] = steps["data"] - steps["pip"]
    row["data"] = steps["train"] - steps["data"]
    row["start"] = steps["train"] - run.t0
    row["train"] = row["start"]  # the trainer's own start: its imports come after
    pid = next(int(line.split()[1]) for _, line in run.lines if line.startswith("@pid "))
    done = first_epoch(
        w / "runs", time.monotonic() + a.timeout, lambda: not os.path.exists(f"/proc/{pid}")
    )
    row["epoch1"] = None if done is None else done - run.t0
    return row


def ours_round(
    w: Path, env: dict[str, str], a: argparse.Namespace, data: tuple[str, str], line: str
) -> dict[str, Any]:
    repo, file = data
    opt, state = w / "opt" / "libreyolo-agent", w / "state"
    (w / "volume").mkdir(parents=True)
    job = f"""[job]
name = "firstbox"
runs_dir = "{w}/runs"
[train]
model = "yolox-n"
pretrained = false
epochs = {a.epochs}
imgsz = {a.imgsz}
batch = {a.batch}
workers = {a.workers}
device = "{a.device}"
[dataset]
repo = "{repo}"
file = "{file}"
dest = "{w}/data"
data_yaml = "boxes/data.yaml"{"" if a.doctor else chr(10) + "doctor = false"}
[teardown]
provider = "none"
"""
    oenv = dict(
        env,
        LIBREYOLO_AGENT_REPO=a.repo,
        LIBREYOLO_AGENT_JOB_TOML=job,
        LIBREYOLO_AGENT_CONFIG_DIR=str(w / "etc"),
        LIBREYOLO_AGENT_STATE_DIR=str(state),
        LIBREYOLO_AGENT_VOLUME=str(w / "volume"),
        LIBREYOLO_AGENT_INIT="container",
    )
    stmt = line.replace("/opt/libreyolo-agent", str(opt))
    run = Lines(["bash", "-c", stmt], oenv, w / "boot1.log")
    row: dict[str, Any] = {"recipe": "agent", "rc": run.rc}
    first = next((t for t, text in run.lines if text.startswith("bootstrap:")), None)
    if first is not None:
        row["clone"] = first - run.t0
    timing = run.at(r"^install\.sh: timing: ")
    if timing:
        for key, name in (
            ("torch", "torch decision"),
            ("venv", "venv"),
            ("pip", "pip"),
            ("check", "check"),
        ):
            m = re.search(rf"{name} ([0-9.]+) s", timing[1])
            if m:
                row[key] = float(m.group(1))
    started = run.at(r"started the supervisor")
    if started:
        row["start"] = started[0] - run.t0
    if run.rc not in (0,):
        return row
    done = first_epoch(w / "runs", time.monotonic() + a.timeout, lambda: agent_done(state))
    row["epoch1"] = None if done is None else done - run.t0
    with contextlib.suppress(OSError, ValueError):
        st = json.loads((state / "state.json").read_text())
        marks = [(str(h.get("to")), float(h["at"])) for h in st.get("history", []) if "at" in h]
        for i, (phase, at) in enumerate(marks):
            if phase == "PREFLIGHT":
                row["agent"] = at - run.w0  # the agent up: its first phase change
                if i + 1 < len(marks):
                    row["preflight"] = marks[i + 1][1] - at
            if phase == "TRAINING" and "train" not in row:
                row["train"] = at - run.w0  # the trainer told to train (warm: its imports done)
    again = Lines(["bash", "-c", stmt], oenv, w / "boot2.log")
    row["again"] = again.t1 - again.t0
    row["again_ok"] = again.rc == 0 and again.at("runs already") is not None
    return row


COLS = (
    "clone",
    "torch",
    "venv",
    "pip",
    "check",
    "data",
    "start",
    "agent",
    "preflight",
    "train",
    "epoch1",
    "again",
)


def fmt(v: object) -> str:
    return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)


def start_line_repo(given: str) -> str:
    """What the start line clones (LIBREYOLO_AGENT_REPO): ``--repo`` as given, a local path made
    absolute (the line clones from another folder, where a relative path names nothing and git
    exits 128 on every round), or by default .gpu/repo.bundle where there is one, else this
    checkout."""
    if not given:
        bundle = REPO / ".gpu" / "repo.bundle"
        return str(bundle) if bundle.is_file() else str(REPO)
    if "://" not in given and Path(given).exists():
        return str(Path(given).resolve())
    return given


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="0", help="the job's device: 0 (a GPU) or cpu")
    p.add_argument("--wheels", type=Path, default=REPO / ".whl", help="the local wheel folder")
    p.add_argument("--index", action="store_true", help="let pip use its index (no PIP_NO_INDEX)")
    p.add_argument("--repo", default="", help="git URL or bundle the start line clones")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for epoch 1")
    p.add_argument(
        "--no-doctor",
        dest="doctor",
        action="store_false",
        help="the agent's job without the dataset doctor (dataset.doctor = false): what it costs",
    )
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "firstbox-out"))
    a = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the rounds' and serve's cleanup run
    cpu = a.device == "cpu"
    a.imgsz, a.batch, a.workers = (64, 4, 0) if cpu else (320, 16, 2)
    a.repo = start_line_repo(a.repo)
    a.out.mkdir(parents=True, exist_ok=True)
    line = next(
        (
            x.strip()
            for x in (REPO / "README.md").read_text().splitlines()
            if re.match(r"^(R=|\[ -d).*scripts/bootstrap\.sh", x.strip())
        ),
        None,
    )
    if line is None:
        sys.exit("firstbox: no start line (R=... scripts/bootstrap.sh) in README.md")
    top = Path(tempfile.mkdtemp(prefix="firstbox-"))
    wheels = top / "wheels"
    wheels.mkdir()
    for whl in a.wheels.glob("*.whl"):
        shutil.copy2(whl, wheels)
    notes = [opencv_standin(wheels), f"start line: {line}", f"repo: {a.repo}"]
    bin_dir = top / "bin"
    bin_dir.mkdir()
    # Last on PATH, the image's Python's own folder: a `libreyolo` the image holds (pip then
    # finds it satisfied and writes none into the venv) is found there, as an activated image
    # venv would find it.
    path = f"{os.environ['PATH']}:{Path(sys.executable).parent}"
    if cpu:  # the image's torch kept as on a GPU box (install.sh's decision reads nvidia-smi)
        smi = bin_dir / "nvidia-smi"
        smi.write_text('#!/bin/sh\necho "580.82.07, NVIDIA H200, 9.0"\n')
        smi.chmod(0o755)
        path = f"{bin_dir}:{path}"
    serve_env = dict(os.environ, PYTHONPATH=str(REPO))
    if cpu:
        serve_env.update(I15_TRAIN="16", I15_VAL="4", I15_IMG="64")
    with open(top / "serve.log", "w") as serve_log:
        serve = subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "gpu_issue15.py"), "serve", str(top / "serve")],
            env=serve_env,
            stdout=serve_log,
            stderr=subprocess.STDOUT,
        )
    rows: list[dict[str, Any]] = []
    try:
        senv_file = top / "serve" / "serve.env"
        for _ in range(300):
            if senv_file.exists() and senv_file.stat().st_size:
                break
            time.sleep(0.2)
        served = dict(x.split("=", 1) for x in senv_file.read_text().splitlines() if "=" in x)
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PIP_", "LIBREYOLO_AGENT_", "HF_", "VIRTUAL_ENV", "PYTHONPATH"))
        }
        env.update(
            PATH=path,
            PYTHON=sys.executable,  # install.sh's interpreter: the image's, as the bare recipe's
            PIP_FIND_LINKS=str(wheels),
            PIP_DISABLE_PIP_VERSION_CHECK="1",
            HF_ENDPOINT=served["HF_ENDPOINT"],
            HF_TOKEN=served["HF_TOKEN"],
            HF_HUB_DISABLE_TELEMETRY="1",
            NO_PROXY="127.0.0.1,localhost",
            no_proxy="127.0.0.1,localhost",
        )
        if not a.index:
            env["PIP_NO_INDEX"] = "1"
        data = (served["DATA_REPO"], served["DATA_FILE"])
        for i in range(1, a.rounds + 1):
            order = ("bare", "agent") if i % 2 else ("agent", "bare")
            for recipe in order:
                mark = uuid.uuid4().hex
                w = top / f"{recipe}{i}"
                w.mkdir()
                renv = dict(env, **{MARK: mark})
                try:
                    if recipe == "bare":
                        row = bare_round(w, renv, a, data)
                    else:
                        row = ours_round(w, renv, a, data, line)
                finally:
                    kill_marked(mark)
                row["round"] = i
                rows.append(row)
                print(
                    f"round {i} {recipe}: "
                    + ", ".join(f"{k} {fmt(row.get(k))}" for k in ("rc", *COLS) if k in row),
                    flush=True,
                )
                for log in [
                    *w.glob("*.log"),
                    *w.glob("state/*.log"),
                    *w.glob("state/*.out"),
                    *w.glob("state/*.json"),
                ]:
                    shutil.copy2(log, a.out / f"{recipe}{i}-{log.name}")
    finally:
        serve.terminate()
        serve.wait(timeout=30)
        shutil.rmtree(top, ignore_errors=True)  # the rounds' venvs (their logs are in --out)
    print()
    print("\n".join(f"# {n}" for n in notes))
    head = f"{'recipe':<7}{'round':>6}" + "".join(f"{c:>10}" for c in COLS)
    print(head)
    for r in rows:
        print(f"{r['recipe']:<7}{r['round']:>6}" + "".join(f"{fmt(r.get(c)):>10}" for c in COLS))
    med: dict[str, float | None] = {}
    for recipe in ("bare", "agent"):
        vals = [r["epoch1"] for r in rows if r["recipe"] == recipe and r.get("epoch1")]
        med[recipe] = statistics.median(vals) if vals else None
        steps = {
            c: statistics.median([r[c] for r in rows if r["recipe"] == recipe and r.get(c)])
            for c in COLS
            if any(r["recipe"] == recipe and r.get(c) for r in rows)
        }
        print(f"{'median':<7}{recipe:>6}" + "".join(f"{fmt(steps.get(c)):>10}" for c in COLS))
    if med["bare"] and med["agent"]:
        print(
            f"first command -> epoch 1: bare {med['bare']:.2f} s, agent {med['agent']:.2f} s, "
            f"ratio {med['agent'] / med['bare']:.2f} (goal <= 1.1)"
        )
    else:
        print("no ratio: a recipe reached no first epoch (logs in " + str(a.out) + ")")
    bad = [r for r in rows if r.get("rc") != 0 or not r.get("epoch1") or r.get("again_ok") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
