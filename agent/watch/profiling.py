"""The ``[profile]`` pre-run: LibreYOLO's own profiler, a few steps on the rented card.

Before the long run, ``libreyolo profile run DATA --weights W --size S --steps N --warmup M
--batch B --imgsz I --workers K --device D --project DIR --json`` trains a few steps with the
job's model, batch, imgsz and workers, then ``libreyolo profile summary PROFILE --json`` reads
the result. Both run in children, in their own session, under one deadline
(``[profile] timeout``); a child still running at the deadline is killed with its group.

The profiler needs a weights file of the job's model family with a matching ``--size`` (a
mismatched size fails on tensor shapes), so ``train.model`` decides:

- a checkpoint that exists: its family and size are read from the checkpoint's own metadata
  (``model_family``, ``size``) without torch (:func:`checkpoint_meta`);
- a model name (``yolox-n``) or a packaged weights name (``LibreYOLO9s.pt``): only when the box
  may download (:func:`online_allowed`); a child Python asks LibreYOLO which file and size the
  name means, and the profiler downloads it;
- anything else: no profile, and :attr:`ProfileResult.message` says why.

Where the profiler cannot run (no weights, offline, a crash, a timeout, no JSON), the result
says so in one line (``cannot profile: ...``) and carries no verdict: the live samples of
agent/watch/sizing.py judge the box instead. A verdict is only ever LibreYOLO's own.

``profile run --json`` prints ``{"profile", "trace", "img_per_s", "bound", "gpu_util", ...}``
(``gpu_util`` a fraction, ``bound`` one of ``compute``, ``dataloader``, ``host / launch``,
``memory-pressure``, ``mixed``). ``summary`` is run on the self-contained ``profile.json``
rather than the raw trace: the same verdict, without analysing the trace again.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import pickle
import re
import signal
import sys
import time
import zipfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent.config.model import Job
from agent.install.libreyolo import find_libreyolo
from agent.util.procs import finish_readers, stop_group
from agent.util.text import one_line
from agent.watch.sizing import Verdict, profiler_verdict

log = logging.getLogger(__name__)

#: ``train.model`` when the job sets none: LibreYOLO's ``train`` default.
DEFAULT_MODEL = "yolox-s"
#: Largest ``data.pkl`` of a checkpoint read for its metadata (the tensors are elsewhere).
MAX_META_BYTES = 64 << 20
#: Provider keys never go to the profiler's children (the Hub token may: weights downloads).
_SECRET_ENV = ("CONTAINER_API_KEY", "VAST_API_KEY", "RUNPOD_API_KEY", "LAMBDA_API_KEY")
#: An exception line of a Python traceback, at the start of a line (not inside rich's boxes).
_EXC_LINE = re.compile(rb"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (.*)$")
#: What the name resolver prints: ``{"weights", "family", "size"}`` or null, for ``argv[1]``.
_RESOLVE = """
import json, sys
from pathlib import Path
from libreyolo.cli.config import resolve_model_name
from libreyolo.models.base.model import BaseModel
weights = resolve_model_name(sys.argv[1])
found = None
for cls in BaseModel._registry:
    size = cls.detect_size_from_filename(Path(weights).name)
    if size:
        found = {"weights": weights, "family": cls.FAMILY, "size": size}
        break
print(json.dumps(found))
"""


class CannotProfile(Exception):
    """The profiler cannot run for this job on this box; the message says why."""


@dataclass(frozen=True)
class ProfilePlan:
    """What the profiler will be run with."""

    argv: tuple[str, ...]
    weights: str
    size: str
    family: str | None
    #: How each setting was chosen where the job did not set it.
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProfileResult:
    """The pre-run's outcome: LibreYOLO's verdict, or why there is none."""

    #: The profiler ran and printed its JSON (``verdict`` is then set).
    ran: bool
    #: One line for the log and the page: the verdict's figures, or ``cannot profile: <why>``.
    message: str
    verdict: Verdict | None = None
    img_per_s: float | None = None
    #: GPU utilisation over the profiled steps, percent.
    gpu_util_pct: float | None = None
    #: LibreYOLO's own word (``compute``, ``dataloader``, ``host / launch``...).
    bound: str | None = None
    seconds: float = 0.0
    argv: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    #: The ``profile summary --json`` document (None when it could not be read).
    summary: dict[str, Any] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """For ``/status`` (``sizing.profile``) and the post-mortem."""
        d = asdict(self)
        d["verdict"] = None if self.verdict is None else self.verdict.to_dict()
        d["argv"] = list(self.argv)
        d["notes"] = list(self.notes)
        summary = self.summary or {}
        d["summary"] = {
            k: summary[k]
            for k in ("bound_why", "step_ms", "dataload_frac", "peak_vram_mb", "config")
            if k in summary
        } or None
        return d


def online_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the profiler may download weights: not when ``HF_HUB_OFFLINE`` is set true."""
    e = os.environ if environ is None else environ
    return (e.get("HF_HUB_OFFLINE") or "").strip().lower() not in ("1", "true", "yes", "on")


# ------------------------------------------------------------------------- the checkpoint


class _Stub:
    """Stands for every class a checkpoint's pickle names: nothing is imported or run."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Stub:
        return _Stub()

    def __setitem__(self, key: object, value: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        pass

    def append(self, value: object) -> None:
        pass

    def extend(self, values: object) -> None:
        pass


class _MetaUnpickler(pickle.Unpickler):
    # No class is ever looked up and no tensor storage loaded: safe on any file, and no torch.
    def find_class(self, module: str, name: str) -> Any:
        return _Stub()

    def persistent_load(self, pid: Any) -> Any:
        return None


def checkpoint_meta(path: Path) -> dict[str, str]:
    """``{"family", "size"}`` of a LibreYOLO checkpoint, read from its own metadata without
    torch (a ``.pt`` is a zip whose ``data.pkl`` holds the top-level dict). Raises
    :class:`CannotProfile` when the file is not such a checkpoint or says no size."""
    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith("data.pkl")]
            if not names:
                raise CannotProfile(f"{path} is not a PyTorch checkpoint (no data.pkl inside)")
            info = z.getinfo(min(names, key=len))
            if info.file_size > MAX_META_BYTES:
                raise CannotProfile(f"{path}: its data.pkl is too large to read for metadata")
            raw = z.read(info)
    except (OSError, zipfile.BadZipFile, KeyError) as exc:
        raise CannotProfile(f"cannot read {path} as a checkpoint ({exc})") from None
    try:
        doc = _MetaUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # a damaged pickle can raise anything
        raise CannotProfile(f"cannot read the metadata of {path} ({exc})") from None
    if not isinstance(doc, dict):
        raise CannotProfile(f"{path} holds no LibreYOLO metadata (model_family, size)")
    family, size = doc.get("model_family"), doc.get("size")
    if not isinstance(size, str) or not size:
        raise CannotProfile(
            f"{path} does not say its model size (no LibreYOLO metadata): the profiler needs "
            "--size to match it"
        )
    return {"family": family if isinstance(family, str) else "", "size": size}


# ----------------------------------------------------------------------------- the plan


def _device(job: Job) -> tuple[str, int, str | None]:
    """The device to profile on (one GPU: the profiler is single-process), the number of GPUs
    the job uses, and a note when it differs from the job's."""
    device = job.train.get("device")
    if device is None:
        return "0", 1, "train.device not set: profiled on GPU 0"
    text = str(device).strip()
    gpus = [d for d in re.split(r"[,\s]+", text.removeprefix("cuda:")) if d]
    if len(gpus) > 1:
        return gpus[0], len(gpus), f"multi-GPU job ({text}): profiled on GPU {gpus[0]} alone"
    return text, 1, None


async def plan_profile(
    job: Job,
    *,
    work_dir: Path,
    online: bool,
    exe: str | None = None,
    python: str | None = None,
    timeout_s: float | None = None,
) -> ProfilePlan:
    """The ``libreyolo profile run`` argv for ``job``; raises :class:`CannotProfile` with the
    reason when there is no weights file to give it (see the module docstring). May run the
    name resolver child (a few seconds, within ``timeout_s``)."""
    exe = exe or find_libreyolo()
    if exe is None:
        raise CannotProfile("the libreyolo command was not found next to this Python or on PATH")
    data = job.train.get("data")
    if not isinstance(data, str):
        raise CannotProfile("the job has no train.data to profile with")
    model = job.train.get("model", DEFAULT_MODEL)
    ref = str(model)
    notes: list[str] = []
    path = Path(ref).expanduser()
    if path.is_file():
        meta = checkpoint_meta(path)
        weights, size, family = str(path), meta["size"], meta["family"] or None
    elif os.sep in ref or "/" in ref or ref.startswith((".", "~")):
        raise CannotProfile(f"train.model {ref!r} does not exist (the profiler needs the file)")
    elif not online:
        raise CannotProfile(
            f"train.model {ref!r} is a model name and this box may not download (HF_HUB_OFFLINE): "
            "the profiler needs a weights file; set train.model to a checkpoint of the same "
            "family and size"
        )
    else:
        found = await _resolve(ref, python or _python_of(exe), timeout_s or 120.0, work_dir)
        weights, size, family = found["weights"], found["size"], found.get("family")
        notes.append(f"weights {weights} (downloaded for the profile: {ref!r})")
        if job.train.get("pretrained") is False:
            notes.append("the job trains from scratch: the profile uses the pretrained weights")
    device, ngpu, note = _device(job)
    if note:
        notes.append(note)
    argv = [exe, "profile", "run", data, "--weights", weights, "--size", size]
    argv += ["--steps", str(job.profile.steps), "--warmup", str(job.profile.warmup)]
    batch = job.train.get("batch")
    if isinstance(batch, int) and not isinstance(batch, bool):
        # The profiler is one process: a multi-GPU job's global batch is split over its ranks.
        per_gpu = batch if batch < 0 or ngpu == 1 else max(1, batch // ngpu)
        argv += ["--batch", str(per_gpu)]
    else:
        notes.append("train.batch not set: the profiler's default batch (16)")
    for key, default in (("imgsz", "640"), ("workers", "8")):
        value = job.train.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            argv += [f"--{key}", str(value)]
        else:
            notes.append(f"train.{key} not set: the profiler's default ({default})")
    amp = job.train.get("amp")
    if isinstance(amp, bool):
        argv.append("--amp" if amp else "--no-amp")
    argv += ["--device", device, "--project", str(work_dir), "--json"]
    return ProfilePlan(tuple(argv), weights, size, family, tuple(notes))


def _python_of(exe: str) -> str:
    """The Python beside the ``libreyolo`` command (its venv), else this one."""
    beside = Path(exe).parent / "python"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else sys.executable


async def _resolve(ref: str, python: str, timeout_s: float, cwd: Path) -> dict[str, str]:
    child = await _run_child([python, "-c", _RESOLVE, ref], timeout_s, cwd)
    if child.timed_out:
        raise CannotProfile(f"asking LibreYOLO what {ref!r} means took over {timeout_s:.0f} s")
    try:
        found = json.loads(child.stdout.strip().splitlines()[-1]) if child.stdout.strip() else None
    except ValueError:
        found = None
    if child.returncode != 0:
        raise CannotProfile(f"cannot ask LibreYOLO what {ref!r} means: {child.error}")
    if not isinstance(found, dict) or not all(
        isinstance(found.get(k), str) and found[k] for k in ("weights", "size")
    ):
        raise CannotProfile(
            f"train.model {ref!r} is neither a checkpoint nor a LibreYOLO model name "
            "(`libreyolo models` lists them)"
        )
    return {k: str(v) for k, v in found.items() if isinstance(v, str)}


# ------------------------------------------------------------------------------ running


@dataclass
class _ErrorScan:
    """Keeps a child's last exception line (and the line after it: LibreYOLO wraps the cause
    there) and whether a size mismatch was reported, from its stderr, line by line."""

    error: bytes = b""
    size_mismatch: bool = False
    _next: bool = False

    def line(self, line: bytes) -> None:
        if self._next:
            self.error += b" " + line.strip()
            self._next = False
        if _EXC_LINE.match(line):
            self.error, self._next = line.strip(), True
        if b"size mismatch" in line:
            self.size_mismatch = True


@dataclass
class _Child:
    returncode: int | None
    stdout: str
    timed_out: bool
    #: The child's last exception line (``RuntimeError: ...``) and the one after it.
    error: str
    size_mismatch: bool
    seconds: float


async def _run_child(argv: list[str], timeout_s: float, cwd: Path) -> _Child:
    """Run ``argv`` in its own session; kill its group after ``timeout_s``. Never raises for
    a problem of the child."""
    env = {k: v for k, v in os.environ.items() if k not in _SECRET_ENV}
    t0 = time.monotonic()
    cwd.mkdir(parents=True, exist_ok=True)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        return _Child(None, "", False, f"cannot start {argv[0]}: {exc}", False, 0.0)
    assert proc.stdout is not None and proc.stderr is not None
    scan = _ErrorScan()

    async def read_stderr(stream: asyncio.StreamReader) -> None:
        # By chunks: a progress bar redrawn with \r makes one endless "line".
        pending = b""
        while chunk := await stream.read(65536):
            *lines, pending = (pending + chunk).replace(b"\r", b"\n").split(b"\n")
            for line in lines:
                scan.line(line)
            pending = pending[-4096:]
        scan.line(pending)

    out_task = asyncio.create_task(proc.stdout.read())
    err_task = asyncio.create_task(read_stderr(proc.stderr))
    timed_out = False
    try:
        try:
            await asyncio.wait_for(proc.wait(), max(0.1, timeout_s))
        except TimeoutError:
            timed_out = True
    finally:
        # Always: dataloader workers left behind share the group.
        await stop_group(proc, sig=signal.SIGKILL)
        await finish_readers(out_task, err_task)
    ok = out_task.done() and not out_task.cancelled() and out_task.exception() is None
    stdout = out_task.result().decode("utf-8", "replace") if ok else ""
    error = scan.error.decode("utf-8", "replace")
    if not error:
        error = f"exit code {proc.returncode}, no error message"
    return _Child(
        proc.returncode,
        stdout,
        timed_out,
        one_line(error, 300),
        scan.size_mismatch,
        time.monotonic() - t0,
    )


def _json_object(text: str) -> dict[str, Any] | None:
    """The JSON object a LibreYOLO command printed (indented: the whole stdout, else the text
    from the first ``{``)."""
    text = text.strip()
    for candidate in (text, text[text.find("{") :] if "{" in text else ""):
        try:
            doc = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(doc, dict):
            return doc
    return None


async def run_profile(
    job: Job,
    *,
    work_dir: Path,
    online: bool | None = None,
    exe: str | None = None,
    python: str | None = None,
    cpu_count: int | None = None,
) -> ProfileResult:
    """The ``[profile]`` pre-run (see the module docstring): never raises for a problem of the
    profiler; a result without ``verdict`` says why in ``message``. ``work_dir``: where the
    profiler writes its short run (``--project``) and downloads weights."""
    cfg = job.profile
    t0 = time.monotonic()
    deadline = t0 + cfg.timeout_s

    def left() -> float:
        return deadline - time.monotonic()

    def cannot(why: str, argv: tuple[str, ...] = (), notes: tuple[str, ...] = ()) -> ProfileResult:
        message = f"cannot profile: {why}; the first epochs' samples judge the box instead"
        log.warning("%s", message)
        return ProfileResult(False, message, seconds=time.monotonic() - t0, argv=argv, notes=notes)

    try:
        plan = await plan_profile(
            job,
            work_dir=work_dir,
            online=online_allowed() if online is None else online,
            exe=exe,
            python=python,
            timeout_s=left(),
        )
    except CannotProfile as exc:
        return cannot(str(exc))
    log.info("profile: %s", " ".join(plan.argv))
    child = await _run_child(list(plan.argv), left(), work_dir)
    if child.timed_out:
        return cannot(
            f"the profiler did not finish within [profile] timeout ({cfg.timeout_s:.0f} s); killed",
            plan.argv,
            plan.notes,
        )
    doc = _json_object(child.stdout)
    if child.returncode != 0 or doc is None:
        why = f"the profiler failed (exit {child.returncode}): {child.error}"
        if child.size_mismatch:
            why = (
                f"the weights {plan.weights} do not match --size {plan.size} (size mismatch "
                "on tensor shapes): train.model must be a checkpoint of the job's family and size"
            )
        return cannot(why, plan.argv, plan.notes)
    summary = await _summary(doc, exe or plan.argv[0], left(), work_dir)
    source = summary or doc
    verdict = profiler_verdict(source, cpu_count)
    ips = source.get("img_per_s")
    util = source.get("gpu_util")
    bound = source.get("bound")
    notes = plan.notes
    if str(job.train.get("device", "")).strip().lower() == "cpu":
        notes = (*notes, "profiled on the CPU (train.device = cpu): GPU figures are zero")
    result = ProfileResult(
        True,
        verdict.detail,
        verdict=verdict,
        img_per_s=float(ips) if isinstance(ips, int | float) else None,
        gpu_util_pct=float(util) * 100.0 if isinstance(util, int | float) else None,
        bound=str(bound) if bound is not None else None,
        seconds=time.monotonic() - t0,
        argv=plan.argv,
        notes=notes,
        summary=summary,
    )
    log.info("profile: %s (%.0f s)", result.message, result.seconds)
    return result


async def _summary(
    run_doc: Mapping[str, Any], exe: str, timeout_s: float, cwd: Path
) -> dict[str, Any] | None:
    """``libreyolo profile summary PROFILE --json`` on the run's profile; None (the run's own
    JSON is used) when it cannot be read in time."""
    target = run_doc.get("profile") or run_doc.get("trace")
    if not isinstance(target, str) or timeout_s <= 1:
        return None
    child = await _run_child([exe, "profile", "summary", target, "--json"], timeout_s, cwd)
    doc = _json_object(child.stdout) if child.returncode == 0 else None
    if doc is None:
        log.info("profile summary gave no JSON (%s): using profile run's", child.error)
    return doc
