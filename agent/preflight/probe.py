"""The torch probe: the only part of preflight that imports torch, run in a child Python.

``agent.preflight`` starts it as ``python <this file> '<json config>'`` (``python -m
agent.preflight.probe``
works too) in its own session, with a timeout. It measures and reports facts; the verdicts
(pass/warn/fail, fixes) are the parent's. It prints exactly one JSON document on stdout, and
progress lines (``libreyolo-agent-probe: stage NAME``) on stderr, so that a parent that has to
kill a hung probe can still say which step hung.

It imports only the standard library at module level: it must run under any Python that has
torch, including one without the agent installed, and ``multiprocessing`` re-imports it in the
NCCL workers.

Config keys (all optional):

``matmul_n``
    Side of the square float32 matmul run on every GPU (default 2000).
``matmul_tolerance``
    Largest ``max |gpu - cpu| / max |cpu|`` of a good matmul (default 5e-3); the NCCL step
    leaves out GPUs whose matmul failed.
``nccl_devices``
    GPU indices to all-reduce across through NCCL (``torch.distributed``), or ``"all"``;
    nothing runs with fewer than two.
``deadline_s``
    Seconds the parent will wait; the NCCL step gives up on its own a little before that.
``libreyolo``
    Import ``libreyolo`` (default true), then ``cv2``, which its training imports.
``libreyolo_deep``
    Also import its model classes, which imports torchvision (default false; about 5 s on an
    H200 box, overlapped with the GPU checks).
``context_devices``
    The GPU indices on which the probe may create a CUDA context (free memory, matmul); the
    others get their properties read only and ``"skipped"`` set. Default: every visible GPU.
    The warm start (``agent/trainer/warm_entry.py``) runs the probe in the trainer's own process,
    which keeps its contexts for the whole training: there it lists only the job's GPU.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any, cast

#: Version of the JSON document; the parent refuses documents it does not know.
SCHEMA = 1
STAGE_PREFIX = "libreyolo-agent-probe: stage "
#: Seconds kept back from the parent's deadline so a timed-out NCCL step is still reported.
_DEADLINE_MARGIN_S = 2.0
_MAX_TEXT = 2000
_TORCH_DIR = f"{os.sep}torch{os.sep}"


#: Where stage lines go: stderr, or the warm start's report pipe (``agent/trainer/warm_entry.py``).
stage_out: Any = None


def _stage(name: str) -> None:
    out = stage_out or sys.stderr
    out.write(f"{STAGE_PREFIX}{name}\n")
    out.flush()


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."


def _torch() -> Any:
    # Typed as Any on purpose: the probe must also run against a stand-in ``torch``.
    return importlib.import_module("torch")


def probe(config: dict[str, Any]) -> dict[str, Any]:
    """Measure everything preflight needs from torch; never raises."""
    start = time.monotonic()
    deadline = start + float(config.get("deadline_s", 120.0))
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "timings_s": {},
        "warnings": [],
    }
    try:
        _probe_into(doc, config, deadline)
    except BaseException as exc:  # the parent must always get a document
        doc["error"] = _error_text(exc)
        doc["traceback"] = traceback.format_exc()[-_MAX_TEXT:]
    doc["timings_s"]["total"] = round(time.monotonic() - start, 3)
    return doc


def _probe_into(doc: dict[str, Any], config: dict[str, Any], deadline: float) -> None:
    timings: dict[str, float] = doc["timings_s"]
    _stage("import torch")
    t0 = time.monotonic()
    try:
        torch = _torch()
    except BaseException as exc:
        doc["torch"] = {"error": _error_text(exc)}
        doc["libreyolo"] = _libreyolo(deep=False)
        return
    timings["import_torch"] = round(time.monotonic() - t0, 3)
    version = getattr(torch, "version", None)
    doc["torch"] = {
        "version": str(torch.__version__),
        "cuda": getattr(version, "cuda", None),
        "hip": getattr(version, "hip", None),
    }

    # The deep libreyolo import (torchvision and the model classes) takes about as long as the
    # CUDA start-up below, which mostly waits on the driver: overlap the two.
    libreyolo: dict[str, Any] = {}
    lib_thread: threading.Thread | None = None
    if config.get("libreyolo", True) and not config.get("libreyolo_deep", False):
        # Importable + version: cheap (libreyolo imports its heavy parts lazily).
        doc["libreyolo"] = _libreyolo(deep=False)
    elif config.get("libreyolo", True):
        lib_thread = threading.Thread(
            target=lambda: libreyolo.update(_libreyolo(deep=True)),
            name="probe-libreyolo",
            daemon=True,
        )
        lib_thread.start()

    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _cuda(doc, torch, config, deadline)
    timings["gpu"] = round(time.monotonic() - t0, 3)
    # The recording is process-wide: keep torch's own warnings ("driver too old", "GPU not
    # compatible"), not what the libreyolo import thread triggers meanwhile (torchvision...).
    doc["warnings"] = _unique(
        str(w.message).strip() for w in caught if _TORCH_DIR in os.path.normpath(w.filename)
    )

    if lib_thread is not None:
        _stage("libreyolo")
        t0 = time.monotonic()
        lib_thread.join(max(0.0, deadline - _DEADLINE_MARGIN_S - time.monotonic()))
        # What the libreyolo import adds to the probe's time beyond the GPU checks it overlaps.
        timings["libreyolo_wait"] = round(time.monotonic() - t0, 3)
        doc["libreyolo"] = (
            dict(libreyolo) if libreyolo else {"error": "import of libreyolo did not finish"}
        )


def _cuda(doc: dict[str, Any], torch: Any, config: dict[str, Any], deadline: float) -> None:
    cuda: dict[str, Any] = {"available": False, "device_count": 0, "arch_list": []}
    doc["cuda"] = cuda
    doc["devices"] = []
    _stage("cuda.is_available")
    t0 = time.monotonic()
    try:
        cuda["available"] = bool(torch.cuda.is_available())
    except Exception as exc:
        cuda["error"] = _error_text(exc)
        return
    if not cuda["available"]:
        return
    try:
        cuda["device_count"] = int(torch.cuda.device_count())
        cuda["arch_list"] = [str(a) for a in torch.cuda.get_arch_list()]
    except Exception as exc:
        cuda["error"] = _error_text(exc)
        return
    doc["timings_s"]["cuda_init"] = round(time.monotonic() - t0, 3)

    n = int(config.get("matmul_n", 2000))
    inputs: tuple[Any, Any, Any] | None = None
    only = config.get("context_devices")
    for i in range(cuda["device_count"]):
        _stage(f"gpu{i}.properties")
        dev: dict[str, Any] = {"index": i}
        doc["devices"].append(dev)
        try:
            props = torch.cuda.get_device_properties(i)
            dev["name"] = str(props.name)
            dev["total_memory"] = int(props.total_memory)
            dev["capability"] = [int(props.major), int(props.minor)]
        except Exception as exc:
            dev["error"] = _error_text(exc)
            continue
        if only is not None and i not in only:
            dev["skipped"] = "not used by this job"
            continue
        _stage(f"gpu{i}.mem_get_info")
        try:
            free, _total = torch.cuda.mem_get_info(i)
            dev["free_memory"] = int(free)
        except Exception as exc:
            dev["mem_error"] = _error_text(exc)
        _stage(f"gpu{i}.matmul")
        if inputs is None:
            inputs = _matmul_inputs(torch, n)
        dev["matmul"] = _matmul(torch, i, *inputs)
        dev["matmul"]["ok"] = _matmul_ok(dev["matmul"], float(config.get("matmul_tolerance", 5e-3)))

    spec = config.get("nccl_devices") or []
    nccl_devices = list(range(cuda["device_count"])) if spec == "all" else [int(d) for d in spec]
    if len(nccl_devices) >= 2:
        doc["nccl"] = _nccl_step(doc, torch, nccl_devices, deadline)


def _matmul_inputs(torch: Any, n: int) -> tuple[Any, Any, Any]:
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(n, n, generator=gen) * 2 - 1
    b = torch.rand(n, n, generator=gen) * 2 - 1
    return a, b, a @ b


def _matmul(torch: Any, index: int, a: Any, b: Any, ref: Any) -> dict[str, Any]:
    """A real matmul on GPU ``index``, compared with the CPU reference ``ref``."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"n": int(a.shape[0])}
    try:
        device = f"cuda:{index}"
        c = a.to(device) @ b.to(device)
        # isfinite runs one of torch's own kernels on the device (the matmul itself is cuBLAS,
        # which may carry kernels for an architecture that torch's build does not).
        out["finite"] = bool(torch.isfinite(c).all().item())
        host = c.cpu()
        out["max_abs_err"] = float((host - ref).abs().max().item())
        out["ref_max_abs"] = float(ref.abs().max().item())
    except Exception as exc:
        out["error"] = _error_text(exc)
    out["seconds"] = round(time.monotonic() - t0, 4)
    return out


def _matmul_ok(result: dict[str, Any], tolerance: float) -> bool:
    if "error" in result or not result.get("finite"):
        return False
    return bool(result["max_abs_err"] <= tolerance * max(result["ref_max_abs"], 1e-30))


def _nccl_step(
    doc: dict[str, Any], torch: Any, devices: list[int], deadline: float
) -> dict[str, Any]:
    count = doc["cuda"]["device_count"]
    missing = [d for d in devices if d >= count]
    if missing:
        return {"skipped": f"GPU(s) {missing} not visible ({count} visible)"}
    broken = [d["index"] for d in doc["devices"] if not d.get("matmul", {}).get("ok")]
    if any(d in broken for d in devices):
        return {"skipped": f"GPU(s) {sorted(set(devices) & set(broken))} failed their matmul"}
    try:
        dist = importlib.import_module("torch.distributed")
        if not (dist.is_available() and dist.is_nccl_available()):
            return {"ok": False, "error": "this torch build has no NCCL (torch.distributed)"}
    except Exception as exc:
        return {"ok": False, "error": _error_text(exc)}
    _stage("nccl")
    timeout_s = max(1.0, deadline - _DEADLINE_MARGIN_S - time.monotonic())
    return all_reduce(devices, timeout_s)


def all_reduce(devices: list[int], timeout_s: float) -> dict[str, Any]:
    """All-reduce a small tensor across ``devices``, one spawned process per GPU.

    Workers that have not answered within ``timeout_s`` are killed and the step is reported as
    timed out (a hung NCCL init or collective is the usual multi-GPU failure).
    """
    import multiprocessing
    from multiprocessing.connection import Connection, wait

    ctx = multiprocessing.get_context("spawn")
    world = len(devices)
    store_dir = tempfile.mkdtemp(prefix="libreyolo-agent-nccl-")
    init_method = "file://" + os.path.join(store_dir, "store")
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    procs = []
    pending: dict[Connection, int] = {}
    results: dict[int, dict[str, Any]] = {}
    try:
        for rank, device in enumerate(devices):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_nccl_worker,
                args=(rank, world, device, init_method, timeout_s, send),
                name=f"probe-nccl-{rank}",
                daemon=True,
            )
            proc.start()
            send.close()
            procs.append(proc)
            pending[recv] = rank
        while pending and time.monotonic() < deadline:
            for ready in wait(list(pending), timeout=max(0.0, deadline - time.monotonic())):
                conn = cast(Connection, ready)
                rank = pending.pop(conn)
                try:
                    results[rank] = conn.recv()
                except EOFError:
                    code = procs[rank].exitcode
                    results[rank] = {"ok": False, "error": f"worker died (exit code {code})"}
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(5)
        shutil.rmtree(store_dir, ignore_errors=True)
    seconds = round(time.monotonic() - t0, 3)
    out: dict[str, Any] = {"world_size": world, "devices": devices, "seconds": seconds}
    if pending:
        out.update(
            ok=False, timed_out=True, error=f"no answer from ranks {sorted(pending.values())}"
        )
    else:
        errors = [r["error"] for r in results.values() if r.get("error")]
        out["ok"] = not errors and all(r.get("ok") for r in results.values())
        out["values"] = [results[r].get("value") for r in sorted(results)]
        out["expected"] = world * (world + 1) / 2
        if errors:
            out["error"] = errors[0]
    return out


def _nccl_worker(
    rank: int, world: int, device: int, init_method: str, timeout_s: float, conn: Any
) -> None:
    from datetime import timedelta

    try:
        torch = _torch()
        dist = importlib.import_module("torch.distributed")
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl",
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            t = torch.full((1024,), float(rank + 1), device=f"cuda:{device}")
            dist.all_reduce(t)
            torch.cuda.synchronize(device)
            lo, hi = float(t.min().item()), float(t.max().item())
        finally:
            dist.destroy_process_group()
        expected = world * (world + 1) / 2
        conn.send({"ok": lo == hi == expected, "value": hi if lo == hi else [lo, hi]})
    except BaseException as exc:
        conn.send({"ok": False, "error": _error_text(exc)})
    finally:
        conn.close()


def _libreyolo(*, deep: bool) -> dict[str, Any]:
    """Import libreyolo; ``deep`` also touches a model class, which imports torchvision and
    the model registry (a torchvision built for another torch fails only there)."""
    out: dict[str, Any] = {}
    try:
        mod = importlib.import_module("libreyolo")
        version = getattr(mod, "__version__", None)
        if version is None:
            version = importlib.metadata.version("libreyolo")
        out["version"] = str(version)
        if deep:
            t0 = time.monotonic()
            getattr(mod, "LibreYOLO")  # noqa: B009 - a lazy attribute: reading it imports
            out["import_s"] = round(time.monotonic() - t0, 3)
    except BaseException as exc:
        out["error"] = _error_text(exc)
        return out
    out.update(_opencv())
    return out


def _opencv() -> dict[str, Any]:
    """Import ``cv2``, which LibreYOLO's training path imports (its augmentations) but its
    package import does not: a box without OpenCV's system libraries (``libGL.so.1``,
    ``libgthread``) passed preflight and failed at the first epoch. About 0.05 s after torch
    (0.15-0.2 s alone, measured on the CPU machine)."""
    t0 = time.monotonic()
    try:
        cv2 = importlib.import_module("cv2")
    except BaseException as exc:
        return {"opencv_error": _error_text(exc)}
    return {
        "opencv": str(getattr(cv2, "__version__", "?")),
        "opencv_import_s": round(time.monotonic() - t0, 3),
    }


def _unique(items: Any) -> list[str]:
    seen: dict[str, None] = {}
    for item in items:
        seen.setdefault(str(item)[:_MAX_TEXT], None)
    return list(seen)[:20]


def main(argv: list[str] | None = None) -> int:
    """Run the probe with the JSON config in ``argv[1]`` and print one JSON document."""
    args = sys.argv if argv is None else argv
    config = json.loads(args[1]) if len(args) > 1 else {}
    # Keep stdout for the document alone: whatever torch, NCCL or libreyolo print (also from C,
    # and from spawned workers, which inherit fd 1) goes to stderr instead.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    doc = probe(config)
    with os.fdopen(out_fd, "w", encoding="utf-8") as out:
        out.write(json.dumps(doc) + "\n")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    # Skip interpreter teardown: CUDA contexts and a libreyolo import thread still running past
    # its deadline only slow it down, and the document is already written.
    os._exit(code)
