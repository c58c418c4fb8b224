"""Preflight: prove the box can really train before anything is paid for in vain.

Every check is a :class:`Check` named like ``gpu0.matmul`` or ``disk.runs``, with a status
(``pass``, ``warn``, ``fail``), the measured value and, when it did not pass, a one-line fix.
``run_preflight`` returns them all in a :class:`PreflightReport`; ``ok`` means nothing failed.

Everything that needs torch runs in a child Python (``agent/probe.py``) in its own session, under
``job.preflight.timeout_s``: this process never imports torch, and a hung GPU makes the child's
whole process group get killed and reported as a failure instead of hanging the agent. While the
child runs, this process reads the NVIDIA driver (NVML, else ``nvidia-smi``) and asks the Hub
for the dataset's size and whether ``HF_TOKEN`` is valid, each under its own timeout; the local
checks (disk, ``/dev/shm``, RAM, CPUs, ``HF_HOME``'s volume) take milliseconds.

Estimates, and where their numbers come from:

* **Disk** (``disk.<role>``): every location must have ``(what it will hold) x 1.3`` free (the
  30 % headroom rule); locations on one file system add up. The dataset archive lands in
  ``HF_HOME``'s cache (its size is read from the Hub's file metadata) and is unpacked into
  ``dataset.dest`` (estimated as the archive size: x1.0 for ``.tar``, x1.2 for compressed
  archives, whose images are already compressed). Checkpoints land in ``job.runs_dir``:
  ``last.pt``, ``best.pt``, one ``epoch_N.pt`` every ``save_period`` epochs (LibreYOLO keeps them
  all; defaults 300 epochs, every 10) and two snapshots in flight for the uploader. One checkpoint
  is ``parameters x 16 bytes`` (fp32 weights twice, training copy and EMA, plus the optimizer
  state; measured 12.6 B/parameter for yolox-n with SGD on LibreYOLO 1.6.0, AdamW adds 4);
  parameters are guessed from the model's size letter (:data:`MODEL_PARAMS_M`).
* **/dev/shm** (``shm``): DataLoader workers pass batches through it; below 1 GiB it fails when
  workers or several GPUs use it (Docker's default is 64 MB). It warns below the batches in
  flight: ``GPUs x workers x 2 (prefetch) x per-GPU batch x 3 x imgsz^2 x 4 bytes``.
* **RAM** and **CPUs**: about 2 GiB per GPU process plus 0.5 GiB per DataLoader worker, and one
  CPU per process and per worker; container (cgroup) limits count.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import psutil

from agent.config import DatasetSection, Env, Job, JobSection, PreflightSection, TrainValue

log = logging.getLogger(__name__)

PASS = "pass"
WARN = "warn"
FAIL = "fail"

GiB = 1024**3
MiB = 1024**2

#: The 30 % headroom rule: a location needs what it will hold times this.
DISK_HEADROOM = 1.3
#: Side of the square matmul each GPU must get right.
MATMUL_N = 2000
#: Largest ``max |gpu - cpu| / max |cpu|`` accepted; TF32 lands near 1e-3, garbage near 1.
MATMUL_TOLERANCE = 5e-3
#: A GPU with less than this share of its memory free is already used by someone else.
GPU_FREE_MEMORY_MIN_FRACTION = 0.8
#: Seconds the Hub (dataset metadata, token check) and the driver query may take.
HUB_TIMEOUT_S = 30.0
DRIVER_TIMEOUT_S = 15.0
#: Seconds to wait for a killed probe to go away before giving up on it.
KILL_GRACE_S = 5.0

#: Millions of parameters guessed from a model's size letter (LibreYOLO families, rounded up).
MODEL_PARAMS_M = {"n": 3, "t": 3, "s": 10, "m": 26, "c": 26, "l": 55, "e": 60, "x": 100}
#: ... and for a model whose size cannot be read from its name.
UNKNOWN_MODEL_PARAMS_M = 60
#: Bytes one checkpoint takes per parameter (see the module docstring).
CHECKPOINT_BYTES_PER_PARAM = 16
#: LibreYOLO 1.6.0 training defaults the estimates fall back on.
DEFAULT_EPOCHS = 300
DEFAULT_SAVE_PERIOD = 10
DEFAULT_BATCH = 16
DEFAULT_IMGSZ = 640
#: LibreYOLO's DataLoader worker default is 4 or 8 depending on the family: assume the larger.
DEFAULT_WORKERS = 8
#: ``batch=-1`` lets LibreYOLO pick; assume this many images per GPU for the /dev/shm estimate.
AUTO_BATCH_PER_GPU = 64
SHM_MIN_BYTES = 1 * GiB
RAM_PER_RANK_BYTES = 2 * GiB
RAM_PER_WORKER_BYTES = GiB // 2

PROBE_PATH = Path(__file__).with_name("probe.py")
_STAGE_PREFIX = "libreyolo-agent-probe: stage "
_PROBE_SCHEMA = 1
_STDERR_TAIL = 4000
_PYTORCH_INSTALL = "https://pytorch.org/get-started/locally/"
_NO_KERNEL = "no kernel image is available"


# --------------------------------------------------------------------------------------------
# Report


@dataclass(frozen=True)
class Check:
    """One named check: its status, what was measured, and a one-line fix when not ``pass``."""

    #: e.g. ``gpu0.matmul``, ``disk.runs``, ``shm``, ``torch.version``.
    name: str
    #: ``pass``, ``warn`` or ``fail``.
    status: str
    #: The measured value, human readable, one line.
    value: str
    #: What to do about it when the status is not ``pass``.
    fix: str | None = None
    #: Machine-readable measurements (JSON types only).
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The check as JSON-able data."""
        return {
            "name": self.name,
            "status": self.status,
            "value": self.value,
            "fix": self.fix,
            "details": self.details,
        }


@dataclass(frozen=True)
class PreflightReport:
    """All checks of one preflight run, in a stable order, and how long the run took."""

    checks: tuple[Check, ...]
    wall_s: float

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings do not stop a job)."""
        return not self.failures()

    def failures(self) -> list[Check]:
        """The failed checks, in report order."""
        return [c for c in self.checks if c.status == FAIL]

    def warnings(self) -> list[Check]:
        """The checks that passed with a warning."""
        return [c for c in self.checks if c.status == WARN]

    def get(self, name: str) -> Check | None:
        """The check called ``name``, or None when it was not run."""
        return next((c for c in self.checks if c.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """``{"ok": ..., "wall_s": ..., "checks": [...]}``, ready for ``json.dumps``."""
        return {
            "ok": self.ok,
            "wall_s": round(self.wall_s, 3),
            "checks": [c.to_dict() for c in self.checks],
        }


def format_table(report: PreflightReport) -> str:
    """The report as a table for humans: one row per check, fixes under the rows that need one."""
    labels = {PASS: "pass", WARN: "WARN", FAIL: "FAIL"}
    width = max((len(c.name) for c in report.checks), default=0)
    lines = []
    for c in report.checks:
        lines.append(f"{labels.get(c.status, c.status):4}  {c.name:<{width}}  {c.value}")
        if c.fix and c.status != PASS:
            lines.append(f"{'':4}  {'':<{width}}  fix: {c.fix}")
    failed = report.failures()
    n_warn = len(report.warnings())
    warn_text = f"{n_warn} warning{'s' if n_warn != 1 else ''}"
    if failed:
        names = ", ".join(c.name for c in failed)
        lines.append(
            f"preflight FAILED: {len(failed)} of {len(report.checks)} checks failed ({names}), "
            f"{warn_text}, {report.wall_s:.1f} s"
        )
    else:
        lines.append(
            f"preflight passed: {len(report.checks)} checks, {warn_text}, {report.wall_s:.1f} s"
        )
    return "\n".join(lines)


def _check(name: str, status: str, value: str, fix: str | None = None, /, **details: Any) -> Check:
    return Check(name, status, value, fix if status != PASS else None, details)


# --------------------------------------------------------------------------------------------
# Small formatting helpers


def format_bytes(n: float) -> str:
    """``1536 -> "1.5 KiB"``; binary units, one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return text.strip()


def _strip_exc_type(text: str) -> str:
    """``"AcceleratorError: CUDA error: ..."`` -> ``"CUDA error: ..."``."""
    head, sep, rest = text.partition(": ")
    return rest if sep and re.fullmatch(r"[A-Za-z_][\w.]*", head) else text


# --------------------------------------------------------------------------------------------
# What the job asks for


@dataclass(frozen=True)
class DeviceSpec:
    """``train.device`` as LibreYOLO reads it (``parse_device_arg`` in LibreYOLO 1.6.0).

    ``kind`` is ``auto`` (unset, ``auto``, ``cuda``: one GPU, cuda:0, when there is one),
    ``all`` (no job: every visible GPU), ``cpu``, ``mps``, ``gpus`` (explicit indices) or
    ``invalid``.
    """

    kind: str
    ids: tuple[int, ...] = ()
    text: str | None = None


def parse_device(value: TrainValue | None) -> DeviceSpec:
    """Read ``train.device``: ``0``, ``"0"``, ``"0,1"``, ``"cuda:1"``, ``"cpu"``, ``"auto"``."""
    text = None if value is None else str(value)
    if value is None:
        return DeviceSpec("auto")
    if isinstance(value, bool | float):
        return DeviceSpec("invalid", text=text)
    if isinstance(value, int):
        return (
            DeviceSpec("gpus", (value,), text) if value >= 0 else DeviceSpec("invalid", text=text)
        )
    s = value.strip().lower().strip("[]()")
    if s in ("", "auto", "cuda"):
        return DeviceSpec("auto", text=text)
    if s in ("cpu", "mps"):
        return DeviceSpec(s, text=text)
    parts = [p.strip().removeprefix("cuda:") for p in s.split(",") if p.strip()]
    if parts and all(p.isdigit() for p in parts):
        ids = tuple(int(p) for p in parts)
        if len(set(ids)) == len(ids):
            return DeviceSpec("gpus", ids, text)
    return DeviceSpec("invalid", text=text)


@dataclass(frozen=True)
class _Plan:
    """What the checks expect, read once from the job (or the defaults when there is none)."""

    generic: bool
    device: DeviceSpec
    allow_cpu: bool
    timeout_s: float
    workers: int | None
    batch: int | None
    imgsz: int
    model: str | None
    epochs: int | None
    save_period: int | None
    runs_dir: Path
    dataset: DatasetSection | None
    sync_hf_repo: str | None

    @property
    def cpu_ok(self) -> bool:
        """Whether training may run without CUDA."""
        return self.device.kind == "cpu" or (self.allow_cpu and self.device.kind == "auto")

    def ranks(self, visible: int) -> int:
        """Training processes (one per GPU used)."""
        if self.device.kind == "gpus":
            return len(self.device.ids)
        if self.device.kind == "all":
            return max(1, visible)
        return 1

    @property
    def workers_assumed(self) -> int:
        return DEFAULT_WORKERS if self.workers is None else self.workers


def _plan(job: Job | None) -> _Plan:
    if job is None:
        return _Plan(
            generic=True,
            device=DeviceSpec("all"),
            allow_cpu=False,
            timeout_s=PreflightSection().timeout_s,
            workers=None,
            batch=None,
            imgsz=DEFAULT_IMGSZ,
            model=None,
            epochs=None,
            save_period=None,
            runs_dir=Path.cwd() / JobSection().runs_dir,
            dataset=None,
            sync_hf_repo=None,
        )
    train = job.train

    def int_arg(key: str) -> int | None:
        v = train.get(key)
        if isinstance(v, bool):
            return None
        if isinstance(v, int):
            return v
        if isinstance(v, str) and re.fullmatch(r"-?\d+", v.strip()):
            return int(v)
        return None

    imgsz = int_arg("imgsz")
    if imgsz is None:  # "640,480" and friends: the larger side
        sides = re.findall(r"\d+", str(train.get("imgsz") or ""))
        imgsz = max((int(s) for s in sides), default=DEFAULT_IMGSZ)
    model = train.get("model")
    sync = job.sync
    return _Plan(
        generic=False,
        device=parse_device(train.get("device")),
        allow_cpu=job.preflight.allow_cpu,
        timeout_s=job.preflight.timeout_s,
        workers=int_arg("workers"),
        batch=int_arg("batch"),
        imgsz=imgsz,
        model=None if model is None else str(model),
        epochs=train.epochs,
        save_period=int_arg("save_period"),
        runs_dir=job.job.runs_dir,
        dataset=job.dataset,
        sync_hf_repo=sync.location if sync is not None and sync.scheme == "hf" else None,
    )


# --------------------------------------------------------------------------------------------
# Entry point


async def run_preflight(
    job: Job | None,
    env: Env,
    *,
    python: str = sys.executable,
    extra_pythonpath: list[str] | None = None,
) -> PreflightReport:
    """Run every check and return the report; never raises for a problem of the machine.

    ``job=None`` checks the machine generically: every visible GPU must work (and there must be
    one), no dataset, no sync. ``python`` is the interpreter the torch probe runs under (the one
    that will train); ``extra_pythonpath`` goes first on the probe's import path (tests put a
    stand-in ``torch`` there). The probe gets ``job.preflight.timeout_s``; the Hub and the driver
    query run meanwhile, so the whole run takes about as long as the probe.
    """
    t0 = time.monotonic()
    plan = _plan(job)
    if plan.device.kind == "gpus" and len(plan.device.ids) >= 2:
        nccl: list[int] | str | None = list(plan.device.ids)
    elif plan.device.kind == "all":
        nccl = "all"
    else:
        nccl = None
    probe_config = {
        "matmul_n": MATMUL_N,
        "matmul_tolerance": MATMUL_TOLERANCE,
        "nccl_devices": nccl,
        "deadline_s": plan.timeout_s,
        "libreyolo": True,
        "libreyolo_deep": bool(job and job.preflight.deep_import),
    }
    async with asyncio.TaskGroup() as tg:
        probe_task = tg.create_task(
            _run_probe(python, probe_config, plan.timeout_s, list(extra_pythonpath or []))
        )
        driver_task = tg.create_task(_driver_info(min(DRIVER_TIMEOUT_S, plan.timeout_s)))
        hub_task = tg.create_task(_hub_facts(plan, env, min(HUB_TIMEOUT_S, plan.timeout_s)))
    probe = probe_task.result()
    driver = driver_task.result()
    hub = hub_task.result()

    checks = _probe_checks(probe, plan, driver)
    doc = probe.doc or {}
    visible = int(doc.get("cuda", {}).get("device_count") or 0)
    ranks = plan.ranks(visible)
    checks += _local_checks(plan, env, hub, ranks)
    checks += _hub_checks(plan, env, hub)
    report = PreflightReport(tuple(checks), time.monotonic() - t0)
    failed = ", ".join(c.name for c in report.failures()) or "-"
    log.debug(
        "preflight: %s in %.1f s (failed: %s; %d warnings)",
        "ok" if report.ok else "FAILED",
        report.wall_s,
        failed,
        len(report.warnings()),
    )
    return report


# --------------------------------------------------------------------------------------------
# Running blocking calls (NVML, the Hub client) without ever blocking the agent

_T = TypeVar("_T")


async def _in_thread(fn: Callable[[], _T], timeout_s: float, name: str) -> _T:
    """Run ``fn`` in a daemon thread; TimeoutError after ``timeout_s``.

    Not ``asyncio.to_thread``: a call that never returns (the Hub client has no read timeout, a
    broken driver can block NVML) would keep the default executor, and with it
    ``asyncio.run``'s shutdown, waiting forever. A daemon thread is simply abandoned.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[_T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def target() -> None:
        try:
            result: Any = fn()
            ok = True
        except BaseException as exc:
            result, ok = exc, False
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting
            loop.call_soon_threadsafe(settle, ok, result)

    threading.Thread(target=target, name=name, daemon=True).start()
    return await asyncio.wait_for(fut, timeout_s)


# --------------------------------------------------------------------------------------------
# The torch probe (child process)


@dataclass(frozen=True)
class _ProbeResult:
    doc: dict[str, Any] | None
    seconds: float
    returncode: int | None
    timed_out: bool = False
    last_stage: str | None = None
    error: str | None = None
    stderr_tail: str = ""


async def _run_probe(
    python: str, config: dict[str, Any], timeout_s: float, extra_pythonpath: list[str]
) -> _ProbeResult:
    env = dict(os.environ)
    paths = [*extra_pythonpath, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    # Run by path, so that the probe needs no installed agent; PYTHONSAFEPATH keeps agent/
    # itself (the script's directory) off sys.path.
    env["PYTHONSAFEPATH"] = "1"
    t0 = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            python,
            str(PROBE_PATH),
            json.dumps(config),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        return _ProbeResult(None, 0.0, None, error=f"cannot start {python}: {exc}")
    assert proc.stdout is not None and proc.stderr is not None
    stages: list[str] = []
    tail = bytearray()

    def on_line(raw: bytes) -> None:
        line = raw.decode("utf-8", "replace")
        if line.startswith(_STAGE_PREFIX):
            stages.append(line[len(_STAGE_PREFIX) :].strip())
        else:
            tail.extend(raw + b"\n")
            del tail[:-_STDERR_TAIL]

    async def read_stderr(stream: asyncio.StreamReader) -> None:
        # By chunks, not readline(): a progress bar redrawn with \r makes one endless "line".
        pending = b""
        while chunk := await stream.read(65536):
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                on_line(raw)
            if len(pending) > _STDERR_TAIL:
                on_line(pending)
                pending = b""
        if pending:
            on_line(pending)

    out_task = asyncio.create_task(proc.stdout.read())
    err_task = asyncio.create_task(read_stderr(proc.stderr))
    timed_out = False
    try:
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            timed_out = True
            log.warning(
                "preflight: probe hung at %s, killing it after %.0f s",
                stages[-1] if stages else "start",
                timeout_s,
            )
    finally:
        # Always, also after a normal exit: NCCL workers left behind share the group.
        _kill_group(proc.pid)
        if timed_out or proc.returncode is None:
            with contextlib.suppress(TimeoutError):
                # A process stuck in the driver (state D) may never go; do not wait for it.
                await asyncio.wait_for(proc.wait(), KILL_GRACE_S)
        _, pending = await asyncio.wait({out_task, err_task}, timeout=1.0)
        for task in pending:
            task.cancel()
        # Also collects the readers' own errors, so none is left "never retrieved".
        await asyncio.gather(out_task, err_task, return_exceptions=True)
    seconds = time.monotonic() - t0
    ok_read = out_task.done() and not out_task.cancelled() and out_task.exception() is None
    stdout = out_task.result() if ok_read else b""
    result = _ProbeResult(
        None,
        seconds,
        proc.returncode,
        timed_out=timed_out,
        last_stage=stages[-1] if stages else None,
        stderr_tail=tail.decode("utf-8", "replace"),
    )
    if timed_out:
        return result
    text = stdout.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(text.splitlines()[-1]) if text else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("schema") != _PROBE_SCHEMA:
        what = "no report" if not text else "an unreadable report"
        return replace(result, error=f"{what} (exit code {proc.returncode})")
    return replace(result, doc=doc)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _probe_checks(probe: _ProbeResult, plan: _Plan, driver: DriverInfo) -> list[Check]:
    checks = [_probe_check(probe, plan)]
    doc = probe.doc
    if doc is None:
        return checks
    py = doc.get("python", {})
    checks.append(_check("python", PASS, f"{py.get('version')} ({py.get('executable')})", **py))

    torch_info: dict[str, Any] = doc.get("torch", {})
    if "error" in torch_info:
        err = str(torch_info["error"])
        checks.append(
            _check(
                "torch.version",
                FAIL,
                f"cannot import torch: {_first_line(err)}",
                "install the torch build for this machine's CUDA first, then libreyolo: "
                f"{_PYTORCH_INSTALL}",
                error=err,
            )
        )
        checks.append(_libreyolo_check(doc.get("libreyolo", {})))
        return checks
    version = str(torch_info.get("version"))
    torch_cuda = torch_info.get("cuda")
    hip = torch_info.get("hip")
    checks.append(_check("torch.version", PASS, version, version=version))

    cuda: dict[str, Any] = doc.get("cuda", {})
    available = bool(cuda.get("available"))
    if torch_cuda:
        checks.append(_check("torch.cuda_build", PASS, f"CUDA {torch_cuda}", cuda=torch_cuda))
    elif hip:
        checks.append(_check("torch.cuda_build", PASS, f"ROCm {hip}", hip=hip))
    else:
        checks.append(
            _check(
                "torch.cuda_build",
                WARN if plan.cpu_ok else FAIL,
                f"CPU-only build (torch {version})",
                "install a CUDA build of torch: pip install --force-reinstall torch torchvision "
                f"--index-url {wheel_index(None, driver.cuda) or _PYTORCH_INSTALL}",
            )
        )

    checks.append(evaluate_driver(driver, cuda_available=available, cpu_ok=plan.cpu_ok, hip=hip))
    compat = evaluate_cuda_compat(driver.cuda, torch_cuda)
    if compat is not None:
        checks.append(compat)

    warnings_seen = [str(w) for w in doc.get("warnings", [])]
    checks.append(_cuda_available_check(cuda, plan, torch_cuda, driver, warnings_seen))
    if available:
        count = int(cuda.get("device_count") or 0)
        checks.append(evaluate_gpu_count(plan.device, count))
        arch_list = [str(a) for a in cuda.get("arch_list", [])]
        for dev in doc.get("devices", []):
            checks += _gpu_checks(dev, arch_list, driver.cuda)
        nccl = doc.get("nccl")
        if isinstance(nccl, dict) and "skipped" not in nccl:
            checks.append(evaluate_nccl(nccl))
    checks.append(_libreyolo_check(doc.get("libreyolo", {})))
    return checks


def _probe_check(probe: _ProbeResult, plan: _Plan) -> Check:
    stage = probe.last_stage or "start-up"
    details: dict[str, Any] = {
        "seconds": round(probe.seconds, 3),
        "returncode": probe.returncode,
        "last_stage": probe.last_stage,
    }
    if probe.doc is not None:
        timings = probe.doc.get("timings_s", {})
        details["timings_s"] = timings
        extra = (
            f", import torch {timings['import_torch']:.1f} s" if "import_torch" in timings else ""
        )
        if "error" in probe.doc:
            err = str(probe.doc["error"])
            return _check(
                "probe",
                FAIL,
                f"the probe failed at {stage}: {_first_line(err)}",
                "run `python agent/probe.py` by hand to see the whole error",
                error=err,
                traceback=probe.doc.get("traceback"),
                **details,
            )
        return _check("probe", PASS, f"torch checks ran in {probe.seconds:.1f} s{extra}", **details)
    if probe.timed_out:
        if stage.startswith(("gpu", "cuda", "nccl")):
            fix = (
                "the GPU or its driver is hung: check `nvidia-smi` and `dmesg` for Xid errors, "
                "reset the GPU or rent another box"
            )
        else:
            fix = (
                f"{stage} hung: check the Python environment and its disk "
                "(a network file system?), or raise [preflight] timeout"
            )
        return _check(
            "probe",
            FAIL,
            f"no answer within {plan.timeout_s:.0f} s (hung at {stage}); killed",
            fix,
            stderr_tail=probe.stderr_tail,
            **details,
        )
    last = _first_line(probe.stderr_tail.strip().splitlines()[-1]) if probe.stderr_tail else ""
    code = probe.returncode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    reason = probe.error or how
    return _check(
        "probe",
        FAIL,
        f"the torch probe died at {stage} ({reason})" + (f": {last}" if last else ""),
        "run `python agent/probe.py` by hand with the same interpreter to see the error",
        stderr_tail=probe.stderr_tail,
        **details,
    )


def _cuda_available_check(
    cuda: Mapping[str, Any],
    plan: _Plan,
    torch_cuda: str | None,
    driver: DriverInfo,
    warnings_seen: list[str],
) -> Check:
    count = int(cuda.get("device_count") or 0)
    details = {"device_count": count, "warnings": warnings_seen}
    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible_env is not None:
        details["CUDA_VISIBLE_DEVICES"] = visible_env
    if cuda.get("available"):
        return _check("cuda.available", PASS, f"yes, {count} GPU{'s' * (count != 1)}", **details)
    why = ""
    relevant = [w for w in warnings_seen if re.search(r"CUDA|driver|GPU", w)]
    if cuda.get("error"):
        why = _first_line(str(cuda["error"]))
    elif relevant:
        why = _first_line(relevant[0])
    value = "no" + (f": {why}" if why else "")
    if plan.device.kind == "cpu":
        return _check("cuda.available", PASS, f"{value} (train.device='cpu')", **details)
    if plan.cpu_ok:
        return _check(
            "cuda.available",
            WARN,
            f"{value}; training will run on the CPU (preflight.allow_cpu)",
            "fine for a demo; for real training rent a GPU box",
            **details,
        )
    if not torch_cuda:
        fix = "install a CUDA build of torch (see torch.cuda_build)"
    elif "too old" in why.lower():
        fix = (
            f"the NVIDIA driver is too old for torch's CUDA {torch_cuda}: update the driver or "
            f"install a torch build for an older CUDA ({_PYTORCH_INSTALL})"
        )
    elif visible_env is not None and not visible_env.strip():
        fix = "CUDA_VISIBLE_DEVICES is set but empty: unset it"
    elif driver.version is None:
        fix = (
            "no NVIDIA driver: use a GPU instance, and start containers with `--gpus all` "
            "(NVIDIA Container Toolkit)"
        )
    else:
        fix = "check `nvidia-smi` and CUDA_VISIBLE_DEVICES; see the torch warning in details"
    if plan.device.kind == "gpus" and plan.allow_cpu:
        fix += f" (preflight.allow_cpu does not apply: train.device={plan.device.text!r})"
    return _check("cuda.available", FAIL, value, fix, **details)


def evaluate_gpu_count(spec: DeviceSpec, visible: int) -> Check:
    """Visible GPUs against the ones ``train.device`` asks for (CUDA is available)."""
    details: dict[str, Any] = {"visible": visible, "device": spec.text, "wanted": list(spec.ids)}
    plural = "s" * (visible != 1)
    if spec.kind == "invalid":
        return _check(
            "gpu.count",
            FAIL,
            f"train.device={spec.text!r} is not a device LibreYOLO understands",
            "set train.device to 'auto', 'cpu', '0' or a list like '0,1,2,3'",
            **details,
        )
    if spec.kind == "mps":
        return _check(
            "gpu.count",
            FAIL,
            "train.device='mps' is Apple's GPU, not on this box",
            f"set train.device to '0' (or '0,...,{max(visible - 1, 0)}' for all {visible})",
            **details,
        )
    if visible == 0:
        return _check(
            "gpu.count", FAIL, "0 GPUs visible", "check `nvidia-smi` and CUDA_VISIBLE_DEVICES"
        )
    all_ids = ",".join(str(i) for i in range(visible))
    if spec.kind == "all":
        return _check("gpu.count", PASS, f"{visible} GPU{plural} visible, all checked", **details)
    if spec.kind == "cpu":
        return _check(
            "gpu.count",
            WARN,
            f"train.device='cpu' on a box with {visible} GPU{plural}",
            f"set train.device='{all_ids}' to train on the GPUs you pay for",
            **details,
        )
    used = spec.ids if spec.kind == "gpus" else (0,)
    missing = [i for i in used if i >= visible]
    if missing:
        return _check(
            "gpu.count",
            FAIL,
            f"train.device={spec.text!r} wants GPU{'s' * (len(used) != 1)} "
            f"{','.join(map(str, used))} but {visible} {'is' if visible == 1 else 'are'} visible",
            f"set train.device='{all_ids}', rent a box with more GPUs, or check "
            "CUDA_VISIBLE_DEVICES",
            **details,
        )
    idle = visible - len(used)
    if idle > 0:
        how = (
            "train.device is unset/auto: LibreYOLO trains on cuda:0 only"
            if spec.kind == "auto"
            else f"train.device={spec.text!r} uses {len(used)}"
        )
        return _check(
            "gpu.count",
            WARN,
            f"{visible} GPUs visible; {how}; {idle} idle but billed",
            f"set train.device='{all_ids}' to use them all, or rent a smaller box",
            **details,
        )
    return _check(
        "gpu.count", PASS, f"{visible} GPU{plural} visible, the job uses {len(used)}", **details
    )


def _gpu_checks(
    dev: Mapping[str, Any], arch_list: Sequence[str], driver_cuda: str | None
) -> list[Check]:
    i = int(dev.get("index", 0))
    name = f"gpu{i}"
    if "error" in dev:
        err = str(dev["error"])
        return [
            _check(
                name,
                FAIL,
                f"cannot read its properties: {_first_line(_strip_exc_type(err))}",
                "check `nvidia-smi` and `dmesg` for Xid errors; rent another box if it persists",
                error=err,
            )
        ]
    cap = tuple(int(x) for x in dev.get("capability", (0, 0)))
    major, minor = cap[0], cap[1]
    total = int(dev.get("total_memory") or 0)
    free = dev.get("free_memory")
    sm = f"sm_{major}{minor}"
    details = {
        "name": dev.get("name"),
        "total_memory": total,
        "free_memory": free,
        "capability": [major, minor],
    }
    if dev.get("mem_error"):
        details["mem_error"] = dev["mem_error"]
    value = f"{dev.get('name')}, {format_bytes(total)}, {sm}"
    checks = []
    if free is not None and total and free < GPU_FREE_MEMORY_MIN_FRACTION * total:
        checks.append(
            _check(
                name,
                WARN,
                f"{value}, only {format_bytes(free)} free: another process holds "
                f"{format_bytes(total - free)}",
                "find it with `nvidia-smi` and stop it; a rented GPU should be idle",
                **details,
            )
        )
    else:
        extra = f", {format_bytes(free)} free" if free is not None else ""
        checks.append(_check(name, PASS, value + extra, **details))

    status, how = arch_support((major, minor), arch_list)
    build_fix = _torch_build_fix((major, minor), driver_cuda)
    checks.append(
        _check(
            f"{name}.arch",
            status,
            how,
            build_fix
            if status == FAIL
            else f"fine, but a torch build with native kernels for {sm} starts faster: {build_fix}",
            capability=[major, minor],
            arch_list=list(arch_list),
        )
    )
    checks.append(evaluate_matmul(i, dev.get("matmul") or {}, (major, minor), driver_cuda))
    return checks


def arch_support(capability: tuple[int, int], arch_list: Sequence[str]) -> tuple[str, str]:
    """Whether torch's build carries code for a GPU of ``capability`` -> (status, explanation).

    CUDA's rules: a cubin for ``sm_XY`` runs on compute capability ``X.Z`` with ``Z >= Y`` (same
    major), ``sm_XYa`` only on ``X.Y``; PTX (``compute_XY``) is compiled on the spot for any
    capability ``>= X.Y`` (slow at start, hence a warning).
    """
    major, minor = capability
    cc = major * 10 + minor
    sm = f"sm_{cc}"
    listed = " ".join(arch_list)
    native: list[tuple[int, str]] = []
    ptx: list[tuple[int, str]] = []
    for arch in arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+)([af]?)", arch.strip())
        if not m:
            continue
        code = int(m.group(2))
        if m.group(1) == "sm":
            same_major = code // 10 == major and code % 10 <= minor
            if (m.group(3) == "a" and code == cc) or (m.group(3) != "a" and same_major):
                native.append((code, arch))
        elif code <= cc:
            ptx.append((code, arch))
    # The closest code wins: sm_86 over sm_80 on an sm_89 card.
    native = [max(native)] if native else []
    if native and native[0][1] == sm:
        return PASS, f"{sm} is in torch's arch list ({listed})"
    if native:
        return PASS, f"{sm} runs torch's {native[0][1]} kernels (same major; arch list: {listed})"
    if ptx:
        return WARN, f"no {sm} kernels; runs through PTX JIT from {max(ptx)[1]} (slow first start)"
    if not arch_list:
        return WARN, "torch reports no arch list; the matmul decides"
    return FAIL, f"torch has no kernels for {sm} (it has {listed})"


#: CUDA versions PyTorch publishes wheels for (download.pytorch.org/whl/cuXYZ), newest first.
_WHEEL_CUDA = ((13, 0), (12, 8), (12, 6), (12, 4), (12, 1), (11, 8))


def wheel_index(capability: tuple[int, int] | None, driver_cuda: str | None) -> str | None:
    """The newest PyTorch wheel index that runs on this driver and has kernels for this GPU.

    CUDA 12.8 builds are the first with Blackwell (10.x, 12.x) kernels and the first without
    Maxwell, Pascal and Volta (< 7.5) ones.
    """
    driver = _version_tuple(driver_cuda) if driver_cuda else None
    for cuda in _WHEEL_CUDA:
        if driver is not None and cuda > driver:
            continue
        if capability is not None and capability < (7, 5) and cuda >= (12, 8):
            continue
        if capability is not None and capability >= (10, 0) and cuda < (12, 8):
            continue
        return f"https://download.pytorch.org/whl/cu{cuda[0]}{cuda[1]}"
    return None


def _torch_build_fix(capability: tuple[int, int], driver_cuda: str | None) -> str:
    sm = f"sm_{capability[0]}{capability[1]}"
    index = wheel_index(capability, driver_cuda)
    if index is None:
        return f"no PyTorch CUDA build runs {sm} on this driver: update the driver"
    return (
        f"install the torch build for {sm}: pip install --force-reinstall torch torchvision "
        f"--index-url {index} (see {_PYTORCH_INSTALL})"
    )


def evaluate_matmul(
    index: int,
    result: Mapping[str, Any],
    capability: tuple[int, int],
    driver_cuda: str | None = None,
) -> Check:
    """Judge one GPU's 2000x2000 matmul as the probe measured it."""
    name = f"gpu{index}.matmul"
    n = result.get("n", MATMUL_N)
    details = dict(result)
    err = result.get("error")
    hw_fix = (
        "faulty GPU or driver: check `nvidia-smi -q -d ECC` and `dmesg` for Xid errors, "
        "rent another box"
    )
    if err:
        text = str(err)
        line = _first_line(_strip_exc_type(text))
        if _NO_KERNEL in text:
            return _check(name, FAIL, line, _torch_build_fix(capability, driver_cuda), **details)
        if "out of memory" in text.lower():
            return _check(
                name,
                FAIL,
                line,
                f"GPU {index} memory is taken by another process: find it with `nvidia-smi`",
                **details,
            )
        if "busy or unavailable" in text:
            return _check(
                name,
                FAIL,
                line,
                f"GPU {index} is in use in exclusive mode, or broken: check `nvidia-smi`",
                **details,
            )
        return _check(name, FAIL, line, hw_fix, **details)
    if not result:
        return _check(name, FAIL, "not run", hw_fix, **details)
    if not result.get("finite", False):
        return _check(name, FAIL, f"{n}x{n} matmul result holds NaN/Inf", hw_fix, **details)
    scale = float(result.get("ref_max_abs") or 0.0) or 1.0
    rel = float(result.get("max_abs_err", math.inf)) / scale
    details["rel_err"] = rel
    ms = float(result.get("seconds") or 0.0) * 1000
    if not rel <= MATMUL_TOLERANCE:
        return _check(
            name,
            FAIL,
            f"{n}x{n} matmul disagrees with the CPU: relative error {rel:.2g} "
            f"(tolerance {MATMUL_TOLERANCE:g})",
            hw_fix,
            **details,
        )
    return _check(
        name, PASS, f"{n}x{n} matmul matches the CPU (rel. err {rel:.1g}, {ms:.0f} ms)", **details
    )


def evaluate_nccl(result: Mapping[str, Any]) -> Check:
    """Judge the all-reduce across the job's GPUs."""
    world = result.get("world_size", "?")
    details = dict(result)
    if result.get("ok"):
        return _check(
            "nccl",
            PASS,
            f"all-reduce across {world} GPUs in {float(result.get('seconds', 0)):.1f} s",
            **details,
        )
    err = str(result.get("error") or "")
    if result.get("timed_out"):
        return _check(
            "nccl",
            FAIL,
            f"all-reduce across {world} GPUs hung ({err}); killed",
            "retry with NCCL_P2P_DISABLE=1 (consumer GPUs often lack working P2P), check "
            "with NCCL_DEBUG=INFO",
            **details,
        )
    line = _first_line(_strip_exc_type(err)) if err else "wrong result"
    if "shared memory" in err or "/dev/shm" in err:
        fix = "NCCL needs a bigger /dev/shm: restart the container with --shm-size=16g"
    elif not err:
        line = f"all-reduce gave {result.get('values')}, expected {result.get('expected')}"
        fix = "the interconnect corrupts data: retry with NCCL_P2P_DISABLE=1, or rent another box"
    else:
        fix = "run with NCCL_DEBUG=INFO; NCCL_P2P_DISABLE=1 or NCCL_IB_DISABLE=1 often help"
    return _check("nccl", FAIL, line, fix, **details)


def _libreyolo_check(info: Mapping[str, Any]) -> Check:
    if info.get("error"):
        err = str(info["error"])
        missing = "No module named 'libreyolo'" in err
        fix = (
            "pip install libreyolo (after torch, so pip keeps the torch you installed)"
            if missing
            else "reinstall torchvision to match torch, then libreyolo: pip install "
            "--force-reinstall torchvision libreyolo (see the error in details)"
        )
        return _check(
            "libreyolo",
            FAIL,
            ("not installed" if missing else f"not importable: {_first_line(err)}"),
            fix,
            error=err,
        )
    return _check("libreyolo", PASS, str(info.get("version")), **dict(info))


# --------------------------------------------------------------------------------------------
# NVIDIA driver (parent side: NVML needs no torch)


@dataclass(frozen=True)
class DriverInfo:
    """The NVIDIA driver: its version and the newest CUDA it supports (``"12.4"``)."""

    version: str | None = None
    cuda: str | None = None
    source: str | None = None
    error: str | None = None


def _nvml_driver() -> DriverInfo:
    try:
        import pynvml
    except ImportError:
        return DriverInfo(error="NVML: nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return DriverInfo(error=f"NVML: {exc}")
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        if isinstance(version, bytes):
            version = version.decode()
        cuda_int = int(pynvml.nvmlSystemGetCudaDriverVersion())
        cuda = f"{cuda_int // 1000}.{cuda_int % 1000 // 10}"
        return DriverInfo(version=str(version), cuda=cuda, source="nvml")
    except pynvml.NVMLError as exc:
        return DriverInfo(error=f"NVML: {exc}")
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


async def _driver_info(timeout_s: float) -> DriverInfo:
    try:
        info = await _in_thread(_nvml_driver, timeout_s, "preflight-nvml")
    except TimeoutError:
        info = DriverInfo(error=f"NVML: no answer within {timeout_s:.0f} s")
    if info.version is not None:
        return info
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return DriverInfo(error=f"{info.error}; nvidia-smi: not found")
    try:
        proc = await asyncio.create_subprocess_exec(
            smi,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        return DriverInfo(error=f"{info.error}; nvidia-smi: {exc}")
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        _kill_group(proc.pid)
        return DriverInfo(error=f"{info.error}; nvidia-smi: no answer within {timeout_s:.0f} s")
    text = out.decode("utf-8", "replace")
    version = re.search(r"Driver Version:\s*([\d.]+)", text)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", text)
    if version is None:
        return DriverInfo(error=f"{info.error}; nvidia-smi: {_first_line(text) or 'no output'}")
    return DriverInfo(
        version=version.group(1), cuda=cuda.group(1) if cuda else None, source="nvidia-smi"
    )


def evaluate_driver(
    driver: DriverInfo, *, cuda_available: bool, cpu_ok: bool, hip: str | None = None
) -> Check:
    """The driver check: found (pass), or missing (a failure only when a GPU is needed)."""
    details = {"version": driver.version, "cuda": driver.cuda, "source": driver.source}
    if driver.version is not None:
        supports = f" (supports CUDA {driver.cuda})" if driver.cuda else ""
        return _check("driver", PASS, f"{driver.version}{supports}", **details)
    details["error"] = driver.error
    value = f"no NVIDIA driver found ({driver.error})"
    if hip:
        return _check("driver", WARN, value, "ROCm box: the NVIDIA driver check does not apply")
    if cuda_available:
        return _check(
            "driver",
            WARN,
            value + ", yet torch sees CUDA",
            "torch works, so only the driver checks are skipped; for them, make NVML "
            "(libnvidia-ml.so, nvidia-ml-py) or nvidia-smi available",
            **details,
        )
    return _check(
        "driver",
        WARN if cpu_ok else FAIL,
        value,
        "use a GPU instance; in a container, start it with `--gpus all` (NVIDIA Container Toolkit)",
        **details,
    )


def _version_tuple(text: str) -> tuple[int, int]:
    major, minor = [*(int(p) for p in re.findall(r"\d+", text)[:2]), 0, 0][:2]
    return major, minor


#: Oldest Linux driver per CUDA major version (CUDA's minor-version compatibility floor).
_MIN_DRIVER = {11: "450.80", 12: "525.60", 13: "580"}


def evaluate_cuda_compat(driver_cuda: str | None, torch_cuda: str | None) -> Check | None:
    """Whether the driver runs torch's CUDA build; None when either side is unknown.

    Same major version, older minor: CUDA's minor-version compatibility runs it (warn: PTX JIT
    and a few features need the newer driver). Older major version: it cannot run (fail).
    """
    if not driver_cuda or not torch_cuda:
        return None
    drv, built = _version_tuple(driver_cuda), _version_tuple(torch_cuda)
    details = {"driver_cuda": driver_cuda, "torch_cuda": torch_cuda}
    if drv >= built:
        return _check(
            "driver.cuda_compat",
            PASS,
            f"driver supports CUDA {driver_cuda} >= torch's CUDA {torch_cuda}",
            **details,
        )
    minimum = _MIN_DRIVER.get(built[0], "the latest")
    fix = f"update the NVIDIA driver (>= {minimum} for CUDA {built[0]})"
    index = wheel_index(None, driver_cuda)
    if index is not None:
        fix += (
            f", or install torch built for CUDA <= {driver_cuda}: pip install --force-reinstall "
            f"torch torchvision --index-url {index}"
        )
    if drv[0] == built[0]:
        return _check(
            "driver.cuda_compat",
            WARN,
            f"driver supports CUDA {driver_cuda}, torch was built for {torch_cuda}: runs by "
            "minor-version compatibility only",
            fix,
            **details,
        )
    return _check(
        "driver.cuda_compat",
        FAIL,
        f"driver supports CUDA {driver_cuda} but torch was built for CUDA {torch_cuda}",
        fix,
        **details,
    )


# --------------------------------------------------------------------------------------------
# Hugging Face Hub: dataset size and access, HF_TOKEN


@dataclass(frozen=True)
class _HubFacts:
    #: ``skipped``, ``ok``, ``missing_file``, ``missing_revision``, ``no_access``, ``gated``,
    #: ``unreachable``, ``error``.
    dataset: str = "skipped"
    dataset_size: int | None = None
    dataset_error: str | None = None
    #: ``skipped``, ``ok``, ``invalid``, ``unreachable``, ``error``.
    token: str = "skipped"
    whoami: Mapping[str, Any] | None = None
    token_error: str | None = None


def _redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


def _classify_hub_error(exc: BaseException, timeout_s: float, token: str | None) -> tuple[str, str]:
    from huggingface_hub import errors

    if isinstance(exc, TimeoutError):
        return "unreachable", f"no answer within {timeout_s:.0f} s"
    # The client's messages run over several lines ("401 Client Error." then the reason).
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    text = _redact(text if len(text) <= 200 else text[:197] + "...", token) or type(exc).__name__
    if isinstance(exc, errors.GatedRepoError):
        return "gated", text
    if isinstance(exc, errors.RevisionNotFoundError):
        return "missing_revision", text
    if isinstance(exc, errors.RepositoryNotFoundError):
        return "no_access", text
    if isinstance(exc, errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            return "no_access", text
        if status is None or status == 429 or status >= 500:
            return "unreachable", text
        return "error", text
    # Connection refused, DNS, TLS, HF_HUB_OFFLINE: the Hub cannot be asked.
    return "unreachable", f"{type(exc).__name__}: {text}"


async def _hub_facts(plan: _Plan, env: Env, timeout_s: float) -> _HubFacts:
    token = env.hf_token
    ds = plan.dataset
    needs_token_check = token is not None and (ds is not None or plan.sync_hf_repo is not None)

    def dataset_size() -> int | None:
        from huggingface_hub import HfApi

        assert ds is not None
        infos = HfApi(endpoint=env.hf_endpoint).get_paths_info(
            ds.repo, [ds.file], repo_type="dataset", revision=ds.revision, token=token or False
        )
        for info in infos:
            if info.path == ds.file and hasattr(info, "size"):
                return int(info.size)
        return None

    def whoami() -> dict[str, Any]:
        from huggingface_hub import HfApi

        return HfApi(endpoint=env.hf_endpoint).whoami(token=token)

    async def get_dataset() -> tuple[str, int | None, str | None]:
        if ds is None:
            return "skipped", None, None
        try:
            size = await _in_thread(dataset_size, timeout_s, "preflight-hub-dataset")
        except Exception as exc:
            status, text = _classify_hub_error(exc, timeout_s, token)
            return status, None, text
        if size is None:
            return "missing_file", None, f"no file {ds.file!r} in {ds.repo}@{ds.revision}"
        return "ok", size, None

    async def get_whoami() -> tuple[str, Mapping[str, Any] | None, str | None]:
        if not needs_token_check:
            return "skipped", None, None
        try:
            who = await _in_thread(whoami, timeout_s, "preflight-hub-whoami")
        except Exception as exc:
            status, text = _classify_hub_error(exc, timeout_s, token)
            return ("invalid" if status == "no_access" else status), None, text
        return "ok", who, None

    (d_status, size, d_err), (t_status, who, t_err) = await asyncio.gather(
        get_dataset(), get_whoami()
    )
    return _HubFacts(d_status, size, d_err, t_status, who, t_err)


def _hub_checks(plan: _Plan, env: Env, hub: _HubFacts) -> list[Check]:
    checks = []
    ds = plan.dataset
    endpoint = env.hf_endpoint
    if ds is not None:
        where = f"{ds.repo}@{ds.revision}"
        details: dict[str, Any] = {
            "repo": ds.repo,
            "file": ds.file,
            "revision": ds.revision,
            "endpoint": endpoint,
        }
        if hub.dataset == "ok" and hub.dataset_size is not None:
            checks.append(
                _check(
                    "dataset.remote",
                    PASS,
                    f"{where}: {ds.file}, {format_bytes(hub.dataset_size)}",
                    size=hub.dataset_size,
                    **details,
                )
            )
        elif hub.dataset == "unreachable":
            checks.append(
                _check(
                    "dataset.remote",
                    WARN,
                    f"Hub unreachable at {endpoint} ({hub.dataset_error}); size unknown",
                    "check the network (and HF_ENDPOINT); staging will fail if it stays down",
                    error=hub.dataset_error,
                    **details,
                )
            )
        else:
            fixes = {
                "missing_file": f"check dataset.file (the files are listed at "
                f"{endpoint}/datasets/{ds.repo}/tree/{ds.revision})",
                "missing_revision": "check dataset.revision (a branch, tag or commit)",
                "gated": f"accept the dataset's terms at {endpoint}/datasets/{ds.repo} with "
                "the HF_TOKEN account",
                "no_access": (
                    "check dataset.repo; if it is private, export HF_TOKEN (read access)"
                    if env.hf_token is None
                    else "check dataset.repo, and that HF_TOKEN's account can read it"
                ),
            }
            value = {
                "missing_file": f"no file {ds.file!r} in {where}",
                "missing_revision": f"no revision {ds.revision!r} in {ds.repo}",
                "gated": f"{ds.repo} is gated",
                "no_access": f"{ds.repo} not found"
                + (
                    " or private (HF_TOKEN is not set)" if env.hf_token is None else " or no access"
                ),
            }.get(hub.dataset, f"{where}: {hub.dataset_error}")
            checks.append(
                _check(
                    "dataset.remote",
                    FAIL,
                    value,
                    fixes.get(hub.dataset, "see the error in details"),
                    error=hub.dataset_error,
                    **details,
                )
            )
    checks.append(_token_check(plan, env, hub))
    return checks


def _token_check(plan: _Plan, env: Env, hub: _HubFacts) -> Check:
    sync = plan.sync_hf_repo
    ds = plan.dataset
    private_ds = ds is not None and hub.dataset in ("no_access", "gated")
    if env.hf_token is None:
        if sync is not None:
            return _check(
                "hf_token",
                FAIL,
                f"HF_TOKEN is not set; sync to hf://{sync} needs a write token",
                f"export HF_TOKEN (a token with write access to {sync}: "
                f"{env.hf_endpoint}/settings/tokens)",
            )
        if private_ds:
            assert ds is not None
            return _check(
                "hf_token",
                FAIL,
                f"HF_TOKEN is not set; dataset {ds.repo} is private (or missing)",
                f"export HF_TOKEN (a token that can read {ds.repo})",
            )
        why = "dataset is public" if ds is not None else "no Hub dataset or hf:// sync"
        return _check("hf_token", PASS, f"not set, not needed ({why})")
    if hub.token == "skipped":
        return _check("hf_token", PASS, "set, not needed (no Hub dataset or hf:// sync)")
    if hub.token == "ok" and hub.whoami is not None:
        who = str(hub.whoami.get("name", "?"))
        access = hub.whoami.get("auth", {}).get("accessToken", {})
        role = access.get("role") if isinstance(access, dict) else None
        details = {"user": who, "role": role}
        if sync is not None and role == "read":
            return _check(
                "hf_token",
                FAIL,
                f"valid but read-only (user {who}); sync to hf://{sync} needs write access",
                f"create a write token at {env.hf_endpoint}/settings/tokens and export HF_TOKEN",
                **details,
            )
        return _check("hf_token", PASS, f"valid (user {who}, role {role or 'unknown'})", **details)
    if hub.token == "invalid":
        return _check(
            "hf_token",
            FAIL,
            f"rejected by {env.hf_endpoint} ({hub.token_error})",
            f"create a new token at {env.hf_endpoint}/settings/tokens and export HF_TOKEN",
        )
    return _check(
        "hf_token",
        WARN,
        f"set, but could not be checked: {hub.token_error}",
        f"check the network and HF_ENDPOINT ({env.hf_endpoint})",
    )


# --------------------------------------------------------------------------------------------
# Local checks: disk, HF_HOME's volume, /dev/shm, RAM, CPUs


def _local_checks(plan: _Plan, env: Env, hub: _HubFacts, ranks: int) -> list[Check]:
    hf_home = default_hf_home(env)
    ckpt_bytes, ckpt_note = checkpoint_estimate(plan.model, plan.epochs, plan.save_period)
    unknown = None
    if plan.dataset is not None and hub.dataset_size is None:
        unknown = "dataset size unknown"
    needs = disk_needs(
        runs_dir=plan.runs_dir,
        checkpoints=(ckpt_bytes, ckpt_note),
        hf_home=hf_home if plan.dataset is not None else None,
        dataset_dest=plan.dataset.dest if plan.dataset is not None else None,
        archive_name=plan.dataset.file if plan.dataset is not None else "",
        archive_bytes=hub.dataset_size,
        unknown=unknown,
    )
    mounts = read_mounts()
    usage: dict[Path, FsUsage] = {}
    unmeasured = []
    for need in needs:
        try:
            usage[need.path] = fs_usage(need.path, mounts)
        except OSError as exc:
            unmeasured.append(
                _check(
                    f"disk.{need.role}",
                    WARN,
                    f"cannot measure {need.path}: {exc}",
                    "check that the agent can read the path (permissions, mount)",
                )
            )
    checks = evaluate_disk([n for n in needs if n.path in usage], usage, strict=not plan.generic)
    checks += unmeasured
    checks.append(evaluate_hf_home(hf_home, mounts, resolved=_existing(hf_home)))

    try:
        shm: int | None = shutil.disk_usage("/dev/shm").total
    except OSError:
        shm = None
    checks.append(
        evaluate_shm(
            shm,
            workers=plan.workers_assumed,
            ranks=ranks,
            batch=plan.batch,
            imgsz=plan.imgsz,
        )
    )
    limits = cgroup_limits()
    vm = psutil.virtual_memory()
    checks.append(
        evaluate_ram(
            vm.available,
            vm.total,
            workers=plan.workers_assumed,
            ranks=ranks,
            limit=limits.memory_bytes,
        )
    )
    cpus = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    if limits.cpus is not None:
        cpus = min(cpus, limits.cpus)
    checks.append(evaluate_cpu(cpus, workers=plan.workers, ranks=ranks))
    return checks


def default_hf_home(env: Env) -> Path:
    """``HF_HOME`` as huggingface_hub resolves it: the env value, else ``~/.cache/huggingface``."""
    if env.hf_home is not None:
        return env.hf_home.expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "huggingface"


def checkpoint_estimate(
    model: str | None, epochs: int | None, save_period: int | None
) -> tuple[int, str]:
    """Bytes the run's checkpoints will take, and how that was worked out (module docstring)."""
    params_m = UNKNOWN_MODEL_PARAMS_M
    basis = "size unknown"
    if model:
        stem = re.sub(r"\.(pt|pth|yaml|yml)$", "", Path(model).name.lower())
        m = re.search(r"(?:^|[\d_-])([ntsmclex])$", stem)
        if m:
            params_m = MODEL_PARAMS_M[m.group(1)]
            basis = f"size '{m.group(1)}'"
    per = params_m * 1_000_000 * CHECKPOINT_BYTES_PER_PARAM
    epochs = epochs or DEFAULT_EPOCHS
    period = DEFAULT_SAVE_PERIOD if save_period is None else save_period
    snapshots = epochs // period if period > 0 else 0
    count = 2 + snapshots + 2
    note = (
        f"{count} checkpoints (last, best, {snapshots} epoch_N, 2 upload snapshots) x "
        f"~{format_bytes(per)} ({basis}, ~{params_m}M params x {CHECKPOINT_BYTES_PER_PARAM} B)"
    )
    return count * per, note


def unpack_factor(archive_name: str) -> float:
    """Unpacked size / archive size, estimated from the archive's kind (module docstring)."""
    name = archive_name.lower()
    return 1.0 if name.endswith(".tar") else 1.2


@dataclass(frozen=True)
class DiskNeed:
    """What one location will hold; the check is ``disk.<role>``."""

    role: str
    path: Path
    #: (what, bytes) pairs, e.g. ``("dataset archive", 4_000_000_000)``.
    parts: tuple[tuple[str, int], ...]
    #: Why part of the need could not be sized (then at most a warning, never a pass).
    unknown: str | None = None
    #: How an estimate was worked out (goes into the check's details).
    note: str | None = None


def disk_needs(
    *,
    runs_dir: Path,
    checkpoints: tuple[int, str],
    hf_home: Path | None,
    dataset_dest: Path | None,
    archive_name: str,
    archive_bytes: int | None,
    unknown: str | None,
) -> list[DiskNeed]:
    """The locations a job writes to, and what each will hold."""
    needs = []
    if hf_home is not None:
        parts = (("dataset archive", archive_bytes),) if archive_bytes is not None else ()
        needs.append(DiskNeed("hf_home", hf_home, parts, unknown))
    if dataset_dest is not None:
        if archive_bytes is not None:
            factor = unpack_factor(archive_name)
            what = f"unpacked (estimate: archive x{factor:g})"
            parts = ((what, int(archive_bytes * factor)),)
        else:
            parts = ()
        needs.append(DiskNeed("dataset", dataset_dest, parts, unknown))
    ckpt_bytes, note = checkpoints
    needs.append(DiskNeed("runs", runs_dir, (("checkpoints (estimate)", ckpt_bytes),), note=note))
    return needs


@dataclass(frozen=True)
class FsUsage:
    """The file system a path lives on: locations with the same ``device`` share ``free``."""

    device: int
    mount: str
    free: int


@dataclass(frozen=True)
class MountInfo:
    """One line of the mount table."""

    mountpoint: str
    fstype: str
    device: str = ""


def read_mounts() -> list[MountInfo]:
    """The mount table (``psutil.disk_partitions(all=True)``)."""
    try:
        parts = psutil.disk_partitions(all=True)
    except OSError:
        return []
    return [MountInfo(p.mountpoint, p.fstype, p.device) for p in parts]


def mount_of(path: Path, mounts: Sequence[MountInfo]) -> MountInfo | None:
    """The mount ``path`` lives on (the longest mount point above it)."""
    best: MountInfo | None = None
    text = str(path)
    for m in mounts:
        mp = m.mountpoint.rstrip("/") or "/"
        if (text == mp or text.startswith(mp.rstrip("/") + "/")) and (
            best is None or len(mp) >= len(best.mountpoint.rstrip("/") or "/")
        ):
            best = m
    return best


def _existing(path: Path) -> Path:
    p = path.expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p.resolve()


def fs_usage(path: Path, mounts: Sequence[MountInfo] = ()) -> FsUsage:
    """Free space where ``path`` is (or will be created: its nearest existing parent)."""
    p = _existing(path)
    st = os.stat(p)
    m = mount_of(p, mounts)
    return FsUsage(st.st_dev, m.mountpoint if m else str(p), shutil.disk_usage(p).free)


def evaluate_disk(
    needs: Sequence[DiskNeed], usage: Mapping[Path, FsUsage], *, strict: bool = True
) -> list[Check]:
    """One check per location: free >= (everything on its file system) x 1.3.

    ``strict=False`` (no job, so the needs are a guess) turns failures into warnings.
    """
    checks = []
    for need in needs:
        fs = usage[need.path]
        sharing = [n for n in needs if usage[n.path].device == fs.device]
        total = sum(b for n in sharing for _, b in n.parts)
        required = int(total * DISK_HEADROOM)
        others = [f"disk.{n.role}" for n in sharing if n is not need]
        unknown = next((n.unknown for n in sharing if n.unknown), None)
        parts = " + ".join(f"{what} {format_bytes(b)}" for n in sharing for what, b in n.parts)
        value = (
            f"{format_bytes(fs.free)} free on {fs.mount}; needs {format_bytes(required)} = "
            f"({parts or 'nothing known'}) x {DISK_HEADROOM:g}"
        )
        if others:
            value += f" (shared with {', '.join(others)})"
        if unknown:
            value += f"; {unknown}"
        details = {
            "path": str(need.path),
            "mount": fs.mount,
            "free_bytes": fs.free,
            "required_bytes": required,
            "parts": {what: b for n in sharing for what, b in n.parts},
            "shared_with": others,
            "estimates": [n.note for n in sharing if n.note],
        }
        if fs.free < required:
            status = FAIL if strict else WARN
            fix = (
                f"free {format_bytes(required - fs.free)} on {fs.mount}, put the {need.role} "
                "directory on a bigger volume, or rent a bigger disk (data + checkpoints + 30 %); "
                "a larger train.save_period keeps fewer epoch_N.pt"
            )
        elif unknown:
            status, fix = WARN, "the estimate misses the dataset: see dataset.remote"
        else:
            status, fix = PASS, None
        checks.append(_check(f"disk.{need.role}", status, value, fix, **details))
    return checks


#: File systems that are never a persistent data volume.
_NOT_VOLUMES = frozenset(
    {
        "autofs", "aufs", "binfmt_misc", "bpf", "cgroup", "cgroup2", "configfs", "debugfs",
        "devpts", "devtmpfs", "efivarfs", "fuse-overlayfs", "fuse.lxcfs", "fusectl", "hugetlbfs",
        "mqueue", "nfsd", "nsfs", "overlay", "proc", "pstore", "ramfs", "rpc_pipefs",
        "securityfs", "selinuxfs", "squashfs", "sysfs", "tmpfs", "tracefs",
    }
)  # fmt: skip
_SYSTEM_PREFIXES = (
    "/proc", "/sys", "/dev", "/run", "/var/run", "/etc", "/boot", "/usr", "/lib", "/lib64",
    "/bin", "/sbin", "/snap", "/var/lib/docker", "/var/lib/containerd",
)  # fmt: skip
_OVERLAYS = frozenset({"overlay", "aufs", "fuse-overlayfs"})


def find_volumes(
    mounts: Sequence[MountInfo], is_dir: Callable[[str], bool] = os.path.isdir
) -> list[MountInfo]:
    """Mounts that look like persistent data volumes (``/workspace``, ``/mnt/data``...).

    Not the root, not pseudo or overlay file systems, not system directories, and not the single
    files Docker bind-mounts (``/etc/hosts``, the NVIDIA libraries).
    """
    out = []
    seen = set()
    for m in mounts:
        mp = m.mountpoint
        if mp == "/" or mp in seen or m.fstype in _NOT_VOLUMES:
            continue
        if any(mp == p or mp.startswith(p + "/") for p in _SYSTEM_PREFIXES):
            continue
        if not is_dir(mp):
            continue
        seen.add(mp)
        out.append(m)
    return out


def evaluate_hf_home(
    hf_home: Path,
    mounts: Sequence[MountInfo],
    *,
    resolved: Path | None = None,
    is_dir: Callable[[str], bool] = os.path.isdir,
) -> Check:
    """Warn when ``HF_HOME`` sits on the container's ephemeral overlay while a volume exists.

    ``resolved`` is where ``hf_home`` really is (symlinks resolved, or its nearest existing
    parent); this function touches the file system only through ``is_dir`` on mount points.
    """
    mount = mount_of(resolved or hf_home, mounts)
    volumes = find_volumes(mounts, is_dir)
    fstype = mount.fstype if mount else "unknown"
    where = f"{hf_home} is on {mount.mountpoint if mount else '?'} ({fstype})"
    details = {
        "hf_home": str(hf_home),
        "mount": mount.mountpoint if mount else None,
        "fstype": fstype,
        "volumes": [v.mountpoint for v in volumes],
    }
    if mount is not None and mount.fstype in _OVERLAYS and volumes:
        vol = volumes[0].mountpoint
        return _check(
            "hf_home.volume",
            WARN,
            f"{where}: the container's ephemeral layer, while {vol} is a volume",
            f"export HF_HOME={vol.rstrip('/')}/huggingface so downloads survive a restart",
            **details,
        )
    if mount is not None and mount in volumes:
        return _check("hf_home.volume", PASS, f"{where}, a persistent volume", **details)
    note = "; no separate volume mounted" if not volumes else ""
    return _check("hf_home.volume", PASS, where + note, **details)


def evaluate_shm(
    total_bytes: int | None,
    *,
    workers: int,
    ranks: int,
    batch: int | None,
    imgsz: int,
) -> Check:
    """``/dev/shm`` against what DataLoader workers (and NCCL, with several GPUs) put there."""
    if batch is None:
        per_rank = math.ceil(DEFAULT_BATCH / ranks)
    elif batch <= 0:  # batch=-1: LibreYOLO picks the largest that fits
        per_rank = AUTO_BATCH_PER_GPU
    else:
        per_rank = math.ceil(batch / ranks)
    batch_bytes = per_rank * 3 * imgsz * imgsz * 4
    in_flight = ranks * workers * 2 * batch_bytes
    needed = max(SHM_MIN_BYTES, in_flight)
    uses_shm = workers > 0 or ranks > 1
    details = {
        "total_bytes": total_bytes,
        "estimated_need_bytes": needed,
        "workers": workers,
        "ranks": ranks,
        "batch_per_gpu": per_rank,
        "imgsz": imgsz,
    }
    fix = "restart the container with --shm-size=16g (or --ipc=host)"
    if total_bytes is None:
        return _check("shm", FAIL if uses_shm else WARN, "/dev/shm is missing", fix, **details)
    value = f"{format_bytes(total_bytes)} at /dev/shm"
    if total_bytes < SHM_MIN_BYTES:
        if uses_shm:
            who = f"{workers} DataLoader workers" if workers else "NCCL"
            return _check(
                "shm",
                FAIL,
                f"{value}: too small for {who} (Docker's default is 64 MB)",
                fix + ", or train.workers=0 (slow)",
                **details,
            )
        return _check("shm", WARN, f"{value}: small (fine with workers=0)", fix, **details)
    if total_bytes < needed:
        return _check(
            "shm",
            WARN,
            f"{value}: may be short for {ranks} x {workers} workers x 2 batches of "
            f"{per_rank} x {imgsz}px (~{format_bytes(needed)})",
            fix,
            **details,
        )
    return _check("shm", PASS, value, **details)


def evaluate_ram(
    available: int, total: int, *, workers: int, ranks: int, limit: int | None = None
) -> Check:
    """Available RAM (and the container's limit) against the training processes' needs."""
    effective = min(available, limit) if limit is not None else available
    floor = ranks * RAM_PER_RANK_BYTES
    needed = ranks * (RAM_PER_RANK_BYTES + workers * RAM_PER_WORKER_BYTES)
    details = {
        "available_bytes": available,
        "total_bytes": total,
        "cgroup_limit_bytes": limit,
        "estimated_need_bytes": needed,
    }
    value = f"{format_bytes(effective)} available of {format_bytes(total)}"
    if limit is not None and limit < total:
        value += f" (container limit {format_bytes(limit)})"
    if effective < floor:
        return _check(
            "ram",
            FAIL,
            f"{value}: not enough for {ranks} training process{'es' * (ranks != 1)}",
            "stop what uses the memory, or rent a box with more RAM",
            **details,
        )
    if effective < needed:
        return _check(
            "ram",
            WARN,
            f"{value}: tight for {ranks} x ({workers} workers) (~{format_bytes(needed)})",
            "lower train.workers, or set train.cache=false/disk",
            **details,
        )
    return _check("ram", PASS, value, **details)


def evaluate_cpu(cpus: float, *, workers: int | None, ranks: int) -> Check:
    """CPUs against one per training process plus one per DataLoader worker."""
    w = DEFAULT_WORKERS if workers is None else workers
    needed = ranks * (w + 1)
    shown = f"{cpus:g} CPU{'s' * (cpus != 1)}"
    wtext = f"{w} workers" + (", LibreYOLO's default" if workers is None else "")
    details = {"cpus": cpus, "workers": w, "ranks": ranks, "needed": needed}
    if cpus < needed:
        fit = max(0, int(cpus // ranks) - 1)
        return _check(
            "cpu",
            WARN,
            f"{shown}; training wants {needed}: {ranks} process{'es' * (ranks != 1)} x "
            f"(1 + {wtext})",
            f"set train.workers={fit} to avoid oversubscribing the CPUs",
            **details,
        )
    return _check(
        "cpu", PASS, f"{shown}; training wants {needed}: {ranks} x (1 + {wtext})", **details
    )


@dataclass(frozen=True)
class CgroupLimits:
    """The container's limits (None: unlimited or unknown)."""

    cpus: float | None = None
    memory_bytes: int | None = None


def cgroup_limits(
    root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")
) -> CgroupLimits:
    """CPU quota and memory limit of this process's cgroup and its ancestors (v2 and v1)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    v2 = "/"
    v1: dict[str, str] = {}
    for line in lines:
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if hid == "0" and not ctrls:
            v2 = path or "/"
        for c in ctrls.split(","):
            if c:
                v1[c] = path
    cpus: list[float] = []
    mems: list[int] = []

    def read(p: Path) -> str | None:
        try:
            return p.read_text().strip()
        except OSError:
            return None

    for d in _cgroup_dirs(root, v2):
        cpu_max = read(d / "cpu.max")
        if cpu_max:
            quota, _, period = cpu_max.partition(" ")
            if quota.isdigit() and period.isdigit() and int(period) > 0:
                cpus.append(int(quota) / int(period))
        mem = read(d / "memory.max")
        if mem and mem.isdigit():
            mems.append(int(mem))
    for name in ("cpu", "cpu,cpuacct"):
        for d in _cgroup_dirs(root / name, v1.get("cpu", "/")):
            quota_s, period_s = read(d / "cpu.cfs_quota_us"), read(d / "cpu.cfs_period_us")
            # cfs_quota_us is -1 when there is no quota: isdigit() refuses it.
            if quota_s and period_s and quota_s.isdigit() and period_s.isdigit():
                cpus.append(int(quota_s) / max(1, int(period_s)))
    for d in _cgroup_dirs(root / "memory", v1.get("memory", "/")):
        mem = read(d / "memory.limit_in_bytes")
        if mem and mem.isdigit() and int(mem) < 2**60:  # v1 says "unlimited" with a huge number
            mems.append(int(mem))
    return CgroupLimits(min(cpus) if cpus else None, min(mems) if mems else None)


def _cgroup_dirs(base: Path, path: str) -> Iterable[Path]:
    """``base/path`` and its parents up to ``base``, those that exist."""
    seen = set()
    d = base / path.strip("/")
    while True:
        if d not in seen and d.is_dir():
            seen.add(d)
            yield d
        if d == base or base not in d.parents:
            break
        d = d.parent
