"""STAGING: the dataset made ready for training, and every job's data YAML checked.

Downloads and unpacks a Hub dataset (retrying what a network hiccup broke), runs the job's stage
hook (the demo makes its synthetic dataset there), then checks the data YAML the trainer will
use - staged or local - with the doctor on by default. A broken dataset is found here, before a
GPU is paid for, not at epoch 0. The doctor (``libreyolo doctor``, which imports torch: seconds
on a GPU box) runs beside the trainer's start-up unless ``dataset.doctor_first``: the daemon
starts it with :func:`check_data` when staging is done and stops the trainer on its errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from agent.config.model import Env, Job
from agent.util import backoff

log = logging.getLogger(__name__)

#: How often a retryable staging error (network, Hub 5xx) is tried before the job fails.
STAGING_ATTEMPTS = 5
#: A hook run in STAGING (the demo job makes its synthetic dataset there).
StageHook = Callable[[], None]


@dataclass(frozen=True)
class StagingOutcome:
    #: False: the job cannot train on this data (the reason is ``cause``).
    ok: bool
    #: What goes to staging.json; None when there was nothing to report.
    report: dict[str, Any] | None
    cause: str | None = None


async def stage(
    job: Job,
    env: Env,
    *,
    hook: StageHook | None,
    stop: tuple[asyncio.Event, ...],
    doctor: bool | None = None,
) -> StagingOutcome:
    """Stage ``job``'s dataset and check its data YAML (with the doctor when ``doctor``, by
    default ``job.data_check.doctor``). Returns early (ok) once any of the ``stop`` events is
    set: the agent is exiting or the job was stopped, no trainer will start."""
    report: dict[str, Any] | None = None
    if job.dataset is not None:
        from agent.data.dataset import StagingError, stage_dataset

        data = job.train.get("data")
        attempt = 0
        while True:
            attempt += 1
            try:
                # The data YAML check (and doctor) below covers staged and local datasets
                # alike: not twice here.
                result = await asyncio.to_thread(
                    stage_dataset,
                    job.dataset,
                    env,
                    data_yaml=str(data) if data is not None else None,
                    check=False,
                )
                break
            except StagingError as exc:
                # Staging is idempotent: a network hiccup is worth a few patient retries.
                if exc.retryable and attempt < STAGING_ATTEMPTS:
                    delay = backoff.delay_s(attempt, first_s=5.0, cap_s=60.0)
                    log.warning(
                        "staging attempt %d failed: %s; retry in %.1fs", attempt, exc, delay
                    )
                    if await _stopped_within(stop, delay):
                        return StagingOutcome(True, None)
                    continue
                log.error("staging failed: %s", exc)
                return StagingOutcome(
                    False,
                    {"ok": False, "error": str(exc), "findings": exc.findings},
                    f"staging failed: {exc}",
                )
        report = {"ok": True, **_jsonable(result)}
        for warning in result.warnings:
            log.warning("dataset: %s", warning)
    if hook is not None:
        await asyncio.to_thread(hook)
        report = report or {"ok": True}
    if any(e.is_set() for e in stop):
        return StagingOutcome(True, report)  # no trainer will start: nothing to check
    return await check_data(job, report, doctor=doctor)


async def check_data(
    job: Job,
    report: dict[str, Any] | None,
    *,
    doctor: bool | None = None,
    started: Callable[[subprocess.Popen[str]], object] | None = None,
) -> StagingOutcome:
    """The data YAML must read, stay inside a staged dataset, and (``doctor``, by default
    ``dataset.doctor``, on by default) pass ``libreyolo doctor``, whose process is handed to
    ``started`` as it starts (the daemon kills a doctor that runs beside the trainer when it
    no longer matters)."""
    from agent.data.dataset import StagingError, check_data_yaml

    data = job.train.get("data")
    report = report or {"ok": True}
    if data is None:
        return StagingOutcome(True, report)
    try:
        check = await asyncio.to_thread(
            check_data_yaml,
            Path(str(data)),
            doctor=job.data_check.doctor if doctor is None else doctor,
            allow_outside_paths=job.data_check.allow_outside_paths,
            staged_root=job.dataset.dest if job.dataset is not None else None,
            started=started,
        )
    except StagingError as exc:
        log.error("dataset check failed: %s", exc)
        failed = {**report, "ok": False, "error": str(exc), "findings": exc.findings}
        return StagingOutcome(False, failed, f"dataset check failed: {exc}")
    # Each of check.warnings was logged where it was found (agent/data/datacheck.py).
    log.info("dataset %s checked (doctor %s)", check.data_yaml, check.doctor_status)
    data_check = {
        "data_yaml": str(check.data_yaml),
        "root": str(check.root),
        "doctor_status": check.doctor_status,
        "doctor": check.doctor,
        "warnings": check.warnings,
    }
    return StagingOutcome(True, {**report, "data_check": data_check})


async def _stopped_within(stop: tuple[asyncio.Event, ...], seconds: float) -> bool:
    waiters = [asyncio.ensure_future(e.wait()) for e in stop]
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED), seconds
            )
    finally:
        for w in waiters:
            w.cancel()
    return any(e.is_set() for e in stop)


def _jsonable(obj: Any) -> dict[str, Any]:
    data: dict[str, Any] = asdict(obj) if is_dataclass(obj) and not isinstance(obj, type) else {}
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in data.items()}
