"""The CUDA side: the verdicts on what the torch probe measured in its child Python.

torch's build and CUDA, the driver against it, whether CUDA is available, the GPUs against
``train.device``, each GPU's properties, architecture (does torch carry kernels for it?) and a
2000x2000 matmul checked against the CPU, the all-reduce across the job's GPUs, and LibreYOLO.
The probe itself runs through :mod:`agent.preflight.runner`; the driver is read by
:mod:`agent.preflight.driver`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent.preflight.driver import (
    DriverInfo,
    evaluate_cuda_compat,
    evaluate_driver,
    wheel_index,
)
from agent.preflight.plan import DeviceSpec, Plan
from agent.preflight.report import (
    FAIL,
    PASS,
    WARN,
    Check,
    CheckStatus,
    first_line,
    make_check,
    strip_exc_type,
)
from agent.preflight.runner import ProbeResult
from agent.util.text import format_bytes

#: Side of the square matmul each GPU must get right.
MATMUL_N = 2000
#: Largest ``max |gpu - cpu| / max |cpu|`` accepted; TF32 lands near 1e-3, garbage near 1.
MATMUL_TOLERANCE = 5e-3
#: A GPU with less than this share of its memory free is already used by someone else.
GPU_FREE_MEMORY_MIN_FRACTION = 0.8
_PYTORCH_INSTALL = "https://pytorch.org/get-started/locally/"
_NO_KERNEL = "no kernel image is available"


def probe_config(plan: Plan) -> dict[str, Any]:
    """What ``agent/preflight/probe.py`` is asked to measure, and its own deadline."""
    return {
        "matmul_n": MATMUL_N,
        "matmul_tolerance": MATMUL_TOLERANCE,
        "nccl_devices": plan.nccl_devices,
        "deadline_s": plan.timeout_s,
        "libreyolo": True,
        "libreyolo_deep": plan.deep_import,
    }


def warm_probe_config(plan: Plan) -> dict[str, Any] | None:
    """The probe's config when it runs in the trainer's own process
    (``agent/trainer/warm_entry.py``),
    or None when this job cannot start warm: only one training process on at most one GPU
    (a DDP coordinator must hold no CUDA context). The probe touches only the job's GPU, and
    imports LibreYOLO's training stack, which the trainer needs next anyway."""
    if plan.generic or plan.nccl_devices is not None:
        return None
    kind = plan.device.kind
    if kind == "gpus" and len(plan.device.ids) == 1:
        devices = list(plan.device.ids)
    elif kind == "auto":
        devices = [0]  # LibreYOLO's "auto" is cuda:0
    elif kind == "cpu":
        devices = []
    else:
        return None
    return {**probe_config(plan), "libreyolo_deep": True, "context_devices": devices}


def probe_checks(probe: ProbeResult, plan: Plan, driver: DriverInfo) -> list[Check]:
    """Every check the probe's report (or its failure) gives, in report order."""
    checks = [_probe_check(probe, plan)]
    doc = probe.doc
    if doc is None:
        return checks
    py = doc.get("python", {})
    checks.append(make_check("python", PASS, f"{py.get('version')} ({py.get('executable')})", **py))

    torch_info: dict[str, Any] = doc.get("torch", {})
    if "error" in torch_info:
        err = str(torch_info["error"])
        checks.append(
            make_check(
                "torch.version",
                FAIL,
                f"cannot import torch: {first_line(err)}",
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
    checks.append(make_check("torch.version", PASS, version, version=version))

    cuda: dict[str, Any] = doc.get("cuda", {})
    available = bool(cuda.get("available"))
    if torch_cuda:
        checks.append(make_check("torch.cuda_build", PASS, f"CUDA {torch_cuda}", cuda=torch_cuda))
    elif hip:
        checks.append(make_check("torch.cuda_build", PASS, f"ROCm {hip}", hip=hip))
    else:
        checks.append(
            make_check(
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


def _probe_check(probe: ProbeResult, plan: Plan) -> Check:
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
            return make_check(
                "probe",
                FAIL,
                f"the probe failed at {stage}: {first_line(err)}",
                "run `python agent/preflight/probe.py` by hand to see the whole error",
                error=err,
                traceback=probe.doc.get("traceback"),
                **details,
            )
        return make_check(
            "probe", PASS, f"torch checks ran in {probe.seconds:.1f} s{extra}", **details
        )
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
        return make_check(
            "probe",
            FAIL,
            f"no answer within {plan.timeout_s:.0f} s (hung at {stage}); killed",
            fix,
            stderr_tail=probe.stderr_tail,
            **details,
        )
    last = first_line(probe.stderr_tail.strip().splitlines()[-1]) if probe.stderr_tail else ""
    code = probe.returncode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    reason = probe.error or how
    return make_check(
        "probe",
        FAIL,
        f"the torch probe died at {stage} ({reason})" + (f": {last}" if last else ""),
        "run `python agent/preflight/probe.py` by hand with the same interpreter to see the error",
        stderr_tail=probe.stderr_tail,
        **details,
    )


def _cuda_available_check(
    cuda: Mapping[str, Any],
    plan: Plan,
    torch_cuda: str | None,
    driver: DriverInfo,
    warnings_seen: list[str],
) -> Check:
    """Whether torch sees CUDA; without it, whether the job may do without, else why not."""
    count = int(cuda.get("device_count") or 0)
    details = {"device_count": count, "warnings": warnings_seen}
    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible_env is not None:
        details["CUDA_VISIBLE_DEVICES"] = visible_env
    if cuda.get("available"):
        return make_check(
            "cuda.available", PASS, f"yes, {count} GPU{'s' * (count != 1)}", **details
        )
    why = ""
    relevant = [w for w in warnings_seen if re.search(r"CUDA|driver|GPU", w)]
    if cuda.get("error"):
        why = first_line(str(cuda["error"]))
    elif relevant:
        why = first_line(relevant[0])
    value = "no" + (f": {why}" if why else "")
    if plan.device.kind == "cpu":
        return make_check("cuda.available", PASS, f"{value} (train.device='cpu')", **details)
    if plan.cpu_ok:
        # Said plainly, as what the job asked for: no GPU is not a problem to fix here.
        return make_check(
            "cuda.available",
            WARN,
            f"no GPU{f': {why}' if why else ''}; training will run on the CPU, as the job "
            "allows (preflight.allow_cpu)",
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
    return make_check("cuda.available", FAIL, value, fix, **details)


def evaluate_gpu_count(spec: DeviceSpec, visible: int) -> Check:
    """Visible GPUs against the ones ``train.device`` asks for (CUDA is available)."""
    details: dict[str, Any] = {"visible": visible, "device": spec.text, "wanted": list(spec.ids)}
    plural = "s" * (visible != 1)
    if spec.kind == "invalid":
        return make_check(
            "gpu.count",
            FAIL,
            f"train.device={spec.text!r} is not a device LibreYOLO understands",
            "set train.device to 'auto', 'cpu', '0' or a list like '0,1,2,3'",
            **details,
        )
    if spec.kind == "mps":
        return make_check(
            "gpu.count",
            FAIL,
            "train.device='mps' is Apple's GPU, not on this box",
            f"set train.device to '0' (or '0,...,{max(visible - 1, 0)}' for all {visible})",
            **details,
        )
    if visible == 0:
        return make_check(
            "gpu.count", FAIL, "0 GPUs visible", "check `nvidia-smi` and CUDA_VISIBLE_DEVICES"
        )
    all_ids = ",".join(str(i) for i in range(visible))
    if spec.kind == "all":
        return make_check(
            "gpu.count", PASS, f"{visible} GPU{plural} visible, all checked", **details
        )
    if spec.kind == "cpu":
        return make_check(
            "gpu.count",
            WARN,
            f"train.device='cpu' on a box with {visible} GPU{plural}",
            f"set train.device='{all_ids}' to train on the GPUs you pay for",
            **details,
        )
    used = spec.ids if spec.kind == "gpus" else (0,)
    missing = [i for i in used if i >= visible]
    if missing:
        return make_check(
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
        return make_check(
            "gpu.count",
            WARN,
            f"{visible} GPUs visible; {how}; {idle} idle but billed",
            f"set train.device='{all_ids}' to use them all, or rent a smaller box",
            **details,
        )
    return make_check(
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
            make_check(
                name,
                FAIL,
                f"cannot read its properties: {first_line(strip_exc_type(err))}",
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
            make_check(
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
        if "skipped" in dev:
            extra = f", {dev['skipped']}"
        checks.append(make_check(name, PASS, value + extra, **details))

    status, how = arch_support((major, minor), arch_list)
    build_fix = _torch_build_fix((major, minor), driver_cuda)
    checks.append(
        make_check(
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
    if "skipped" not in dev:
        # A GPU the job does not use (warm start: the probe runs in the trainer's own process,
        # which must not keep a CUDA context on it) has no matmul to judge.
        checks.append(evaluate_matmul(i, dev.get("matmul") or {}, (major, minor), driver_cuda))
    return checks


def arch_support(capability: tuple[int, int], arch_list: Sequence[str]) -> tuple[CheckStatus, str]:
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
        line = first_line(strip_exc_type(text))
        if _NO_KERNEL in text:
            return make_check(
                name, FAIL, line, _torch_build_fix(capability, driver_cuda), **details
            )
        if "out of memory" in text.lower():
            return make_check(
                name,
                FAIL,
                line,
                f"GPU {index} memory is taken by another process: find it with `nvidia-smi`",
                **details,
            )
        if "busy or unavailable" in text:
            return make_check(
                name,
                FAIL,
                line,
                f"GPU {index} is in use in exclusive mode, or broken: check `nvidia-smi`",
                **details,
            )
        return make_check(name, FAIL, line, hw_fix, **details)
    if not result:
        return make_check(name, FAIL, "not run", hw_fix, **details)
    if not result.get("finite", False):
        return make_check(name, FAIL, f"{n}x{n} matmul result holds NaN/Inf", hw_fix, **details)
    scale = float(result.get("ref_max_abs") or 0.0) or 1.0
    rel = float(result.get("max_abs_err", math.inf)) / scale
    details["rel_err"] = rel
    ms = float(result.get("seconds") or 0.0) * 1000
    if not rel <= MATMUL_TOLERANCE:
        return make_check(
            name,
            FAIL,
            f"{n}x{n} matmul disagrees with the CPU: relative error {rel:.2g} "
            f"(tolerance {MATMUL_TOLERANCE:g})",
            hw_fix,
            **details,
        )
    return make_check(
        name, PASS, f"{n}x{n} matmul matches the CPU (rel. err {rel:.1g}, {ms:.0f} ms)", **details
    )


def evaluate_nccl(result: Mapping[str, Any]) -> Check:
    """Judge the all-reduce across the job's GPUs."""
    world = result.get("world_size", "?")
    details = dict(result)
    if result.get("ok"):
        return make_check(
            "nccl",
            PASS,
            f"all-reduce across {world} GPUs in {float(result.get('seconds', 0)):.1f} s",
            **details,
        )
    err = str(result.get("error") or "")
    if result.get("timed_out"):
        return make_check(
            "nccl",
            FAIL,
            f"all-reduce across {world} GPUs hung ({err}); killed",
            "retry with NCCL_P2P_DISABLE=1 (consumer GPUs often lack working P2P), check "
            "with NCCL_DEBUG=INFO",
            **details,
        )
    line = first_line(strip_exc_type(err)) if err else "wrong result"
    if "shared memory" in err or "/dev/shm" in err:
        fix = "NCCL needs a bigger /dev/shm: restart the container with --shm-size=16g"
    elif not err:
        line = f"all-reduce gave {result.get('values')}, expected {result.get('expected')}"
        fix = "the interconnect corrupts data: retry with NCCL_P2P_DISABLE=1, or rent another box"
    else:
        fix = "run with NCCL_DEBUG=INFO; NCCL_P2P_DISABLE=1 or NCCL_IB_DISABLE=1 often help"
    return make_check("nccl", FAIL, line, fix, **details)


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
        return make_check(
            "libreyolo",
            FAIL,
            ("not installed" if missing else f"not importable: {first_line(err)}"),
            fix,
            error=err,
        )
    if info.get("opencv_error"):
        return _opencv_check(str(info["opencv_error"]), info)
    return make_check("libreyolo", PASS, str(info.get("version")), **dict(info))


#: OpenCV's system libraries, as Debian and Ubuntu name their packages.
OPENCV_APT = "apt-get install -y libgl1 libglib2.0-0"


def _opencv_check(err: str, info: Mapping[str, Any]) -> Check:
    """LibreYOLO imports, but the OpenCV its training imports does not: the trainer would fail
    at its first batch, after staging, on a box that bills."""
    if "No module named 'cv2'" in err:
        fix = "pip install opencv-python-headless (LibreYOLO's training imports cv2)"
    else:
        fix = (
            f"install OpenCV's system libraries ({OPENCV_APT}), or use the build that needs "
            "none: pip uninstall -y opencv-python && pip install opencv-python-headless"
        )
    return make_check(
        "libreyolo",
        FAIL,
        f"OpenCV (cv2, imported by LibreYOLO's training) cannot load: {first_line(err)}",
        fix,
        **dict(info),
    )
