"""Preflight: prove the box can really train before anything is paid for in vain.

Every check is a :class:`Check` named like ``gpu0.matmul`` or ``disk.runs``, with a status
(``pass``, ``warn``, ``fail``), the measured value and, when it did not pass, a one-line fix.
``run_preflight`` returns them all in a :class:`PreflightReport`; ``ok`` means nothing failed.

Everything that needs torch runs in a child Python (``agent/preflight/probe.py``) in its own
session, under
``job.preflight.timeout_s``: this process never imports torch, and a hung GPU makes the child's
whole process group get killed and reported as a failure instead of hanging the agent. While the
child runs, this process reads the NVIDIA driver (NVML, else ``nvidia-smi``) and asks the Hub
for the dataset's size and whether ``HF_TOKEN`` is valid, each under its own timeout; the local
checks (disk, ``/dev/shm``, RAM, CPUs, ``HF_HOME``'s volume) take milliseconds.

The parts, lowest first (each imports only those above it, and of the rest of the agent only the
base modules: ``config``, ``hub``, and the helpers ``threads``, ``text`` and ``disk``):

* :mod:`~agent.preflight.report`: ``Check``, ``CheckStatus``, the report and its table.
* :mod:`~agent.preflight.plan`: what the job asks for (``train.device``, LibreYOLO's defaults).
* :mod:`~agent.preflight.runner`, :mod:`~agent.preflight.driver`, :mod:`~agent.preflight.cuda`:
  the CUDA side (the probe's child process, the NVIDIA driver, the verdicts on GPUs).
* :mod:`~agent.preflight.host`: the host side (disk, volumes, shm, RAM, CPUs, cgroups); its
  docstring says where the estimates come from.
* :mod:`~agent.preflight.hub_access`: the Hub side (dataset size and access, ``HF_TOKEN``).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from agent.config.model import Env, Job
from agent.preflight.cloud import provider_check
from agent.preflight.cuda import (
    GPU_FREE_MEMORY_MIN_FRACTION,
    MATMUL_N,
    MATMUL_TOLERANCE,
    arch_support,
    evaluate_gpu_count,
    evaluate_matmul,
    evaluate_nccl,
    probe_checks,
    probe_config,
    warm_probe_config,
)
from agent.preflight.driver import (
    DRIVER_TIMEOUT_S,
    DriverInfo,
    evaluate_cuda_compat,
    evaluate_driver,
    read_driver,
    wheel_index,
)
from agent.preflight.host import (
    CHECKPOINT_BYTES_PER_PARAM,
    DISK_HEADROOM,
    MODEL_PARAMS_M,
    RAM_PER_RANK_BYTES,
    RAM_PER_WORKER_BYTES,
    SHM_MIN_BYTES,
    UNKNOWN_MODEL_PARAMS_M,
    CgroupLimits,
    DiskNeed,
    FsUsage,
    MountInfo,
    cgroup_limits,
    checkpoint_estimate,
    default_hf_home,
    disk_checks,
    disk_needs,
    evaluate_cpu,
    evaluate_disk,
    evaluate_hf_home,
    evaluate_ram,
    evaluate_shm,
    find_volumes,
    fs_usage,
    machine_checks,
    mount_of,
    read_mounts,
    unpack_factor,
)
from agent.preflight.hub_access import HUB_TIMEOUT_S, hub_checks, hub_facts
from agent.preflight.plan import (
    AUTO_BATCH_PER_GPU,
    DEFAULT_BATCH,
    DEFAULT_EPOCHS,
    DEFAULT_IMGSZ,
    DEFAULT_SAVE_PERIOD,
    DEFAULT_WORKERS,
    DeviceKind,
    DeviceSpec,
    parse_device,
    plan_for,
)
from agent.preflight.report import (
    FAIL,
    PASS,
    WARN,
    Check,
    CheckStatus,
    GiB,
    MiB,
    PreflightReport,
    format_table,
)
from agent.preflight.runner import KILL_GRACE_S, PROBE_PATH, ProbeResult, run_probe
from agent.util.text import format_bytes

__all__ = [
    "AUTO_BATCH_PER_GPU",
    "CHECKPOINT_BYTES_PER_PARAM",
    "DEFAULT_BATCH",
    "DEFAULT_EPOCHS",
    "DEFAULT_IMGSZ",
    "DEFAULT_SAVE_PERIOD",
    "DEFAULT_WORKERS",
    "DISK_HEADROOM",
    "DRIVER_TIMEOUT_S",
    "FAIL",
    "GPU_FREE_MEMORY_MIN_FRACTION",
    "HUB_TIMEOUT_S",
    "KILL_GRACE_S",
    "MATMUL_N",
    "MATMUL_TOLERANCE",
    "MODEL_PARAMS_M",
    "PASS",
    "PROBE_PATH",
    "RAM_PER_RANK_BYTES",
    "RAM_PER_WORKER_BYTES",
    "SHM_MIN_BYTES",
    "UNKNOWN_MODEL_PARAMS_M",
    "WARN",
    "CgroupLimits",
    "Check",
    "CheckStatus",
    "DeviceKind",
    "DeviceSpec",
    "DiskNeed",
    "DriverInfo",
    "FsUsage",
    "GiB",
    "MiB",
    "MountInfo",
    "PreflightReport",
    "arch_support",
    "cgroup_limits",
    "checkpoint_estimate",
    "default_hf_home",
    "disk_needs",
    "evaluate_cpu",
    "evaluate_cuda_compat",
    "evaluate_disk",
    "evaluate_driver",
    "evaluate_gpu_count",
    "evaluate_hf_home",
    "evaluate_matmul",
    "evaluate_nccl",
    "evaluate_ram",
    "evaluate_shm",
    "find_volumes",
    "format_bytes",
    "format_table",
    "fs_usage",
    "mount_of",
    "parse_device",
    "read_mounts",
    "run_and_log",
    "run_preflight",
    "unpack_factor",
    "warm_probe_config",
    "wheel_index",
]

#: Runs the torch probe under a deadline (seconds) instead of preflight's own child Python.
ProbeRunner = Callable[[float], Coroutine[Any, Any, ProbeResult]]

log = logging.getLogger(__name__)
#: Phase messages go to the daemon's log name, as they always did (agent.log is grepped).
phase_log = logging.getLogger(__name__)


async def run_preflight(
    job: Job | None,
    env: Env,
    *,
    python: str = sys.executable,
    extra_pythonpath: list[str] | None = None,
    on_storage_checked: Callable[[bool], object] | None = None,
    probe_runner: ProbeRunner | None = None,
) -> PreflightReport:
    """Run every check and return the report; never raises for a problem of the machine.

    ``job=None`` checks the machine generically: every visible GPU must work (and there must be
    one), no dataset, no sync. ``python`` is the interpreter the torch probe runs under (the one
    that will train); ``extra_pythonpath`` goes first on the probe's import path (tests put a
    stand-in ``torch`` there). The probe gets ``job.preflight.timeout_s``; the Hub and the driver
    query run meanwhile, so the whole run takes about as long as the probe.

    ``on_storage_checked(ok)`` is called as soon as the disk and Hub checks are known (the probe
    still running): ``ok`` says none of them failed, so the dataset may be staged meanwhile.

    ``probe_runner(timeout_s)`` runs the torch probe instead of a child Python: the warm start
    (:class:`agent.trainer.warmstart.WarmStart`) runs it in the trainer's own process.
    """
    t0 = time.monotonic()
    plan = plan_for(job)
    async with asyncio.TaskGroup() as tg:
        probe_task = tg.create_task(
            probe_runner(plan.timeout_s)
            if probe_runner is not None
            else run_probe(python, probe_config(plan), plan.timeout_s, list(extra_pythonpath or []))
        )
        driver_task = tg.create_task(read_driver(min(DRIVER_TIMEOUT_S, plan.timeout_s)))
        cloud_task = tg.create_task(provider_check(job, env, plan.timeout_s))
        # The Hub's answer and the disk come long before the probe's (torch import, CUDA
        # context, matmul): the dataset may start downloading now, while the probe runs.
        hub = await hub_facts(plan, env, min(HUB_TIMEOUT_S, plan.timeout_s))
        disk = await asyncio.to_thread(disk_checks, plan, env, hub.dataset_size)
        remote = hub_checks(plan, env, hub)
        if on_storage_checked is not None:
            on_storage_checked(all(c.status != FAIL for c in (*disk, *remote)))
    probe = probe_task.result()

    checks = probe_checks(probe, plan, driver_task.result())
    doc = probe.doc or {}
    visible = int(doc.get("cuda", {}).get("device_count") or 0)
    ranks = plan.ranks(visible)
    checks += disk + machine_checks(plan, ranks)
    checks += remote
    cloud = cloud_task.result()
    if cloud is not None:
        checks.append(cloud)
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


async def run_and_log(
    job: Job,
    env: Env,
    *,
    on_storage_checked: Callable[[bool], object] | None = None,
    probe_runner: ProbeRunner | None = None,
) -> tuple[PreflightReport, str | None]:
    """The PREFLIGHT phase: run the checks, log every warning with its fix and the verdict.
    Returns the report and, when it failed, the one-line cause for the run's record."""
    report = await run_preflight(
        job, env, on_storage_checked=on_storage_checked, probe_runner=probe_runner
    )
    for check in report.warnings():
        fix = f" (fix: {check.fix})" if check.fix else ""
        phase_log.warning("preflight warning: %s: %s%s", check.name, check.value, fix)
    if report.ok:
        phase_log.info("preflight passed in %.1fs", report.wall_s)
        return report, None
    failed = ", ".join(f"{c.name} ({c.value})" for c in report.failures())
    phase_log.error("preflight failed: %s", failed)
    return report, f"preflight failed: {failed}"
