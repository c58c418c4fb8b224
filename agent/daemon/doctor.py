"""The dataset doctor beside the trainer (``dataset.doctor_first = false``, the default).

``libreyolo doctor`` imports torch, torchvision and ``torch._dynamo`` before it looks at a single
label: measured on an H200 it took 6.8-14 s, longer than the GPU probe, and a trainer that waited
for it started that much later on a box billed by the second. So by default the daemon runs the
doctor beside the trainer (the data YAML itself is checked before, as always) and launches the
trainer without waiting. The doctor starts once the trainer has started: at its first
status.json, or :data:`DOCTOR_START_CAP_S` after its launch, whichever comes first. Started with
the trainer, its own torch import slowed the trainer's start-up (1.14-1.23x a bare start on an
H200).

The doctor's verdict is read at the supervision loop's next turn (it wakes the loop): errors stop
the trainer like any other stop, with reason ``preflight_failed`` and the doctor's findings as the
cause (staging.json holds the report); warnings are logged. A trainer that fails on its own
before or while the doctor runs waits for the verdict (at most :data:`DOCTOR_AFTER_EXIT_S`), so a
broken dataset is blamed, not retried as a crash. A job that must not spend a GPU second on a
dataset the doctor has not passed sets ``doctor_first = true``.

A restarted agent that re-attaches to the trainer does not run the doctor again.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
from typing import Any

from agent.config.model import Job
from agent.daemon.context import RunContext
from agent.data import staging
from agent.util.procs import kill_group

log = logging.getLogger(__name__)

#: How long a trainer that exited with an error waits for a doctor still running, seconds.
DOCTOR_AFTER_EXIT_S = 120.0
#: The doctor starts at the trainer's first status.json, or this long after its launch at the
#: latest (a trainer that reads a large dataset before its first status), seconds.
DOCTOR_START_CAP_S = 30.0


def runs_beside(job: Job) -> bool:
    """Whether this job's doctor runs beside the trainer (not before it)."""
    check = job.data_check
    return check.doctor and not check.doctor_first and job.train.get("data") is not None


class DoctorBeside:
    """The doctor of one run: queued by staging, started and read by the training loop, killed
    when the run ends. Its verdict completes the context's staging report."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        #: Staging passed and the doctor is to run beside the trainer, not started yet; the
        #: staging report it completes.
        self.due = False
        self.report: dict[str, Any] | None = None
        self.task: asyncio.Task[staging.StagingOutcome] | None = None
        #: The doctor's processes (their groups are killed by :meth:`stop`).
        self.procs: list[subprocess.Popen[str]] = []

    def queue(self, report: dict[str, Any] | None) -> None:
        """Run the doctor once the trainer has started (:meth:`when_started`)."""
        self.due, self.report = True, report
        log.info(
            "libreyolo doctor runs once the trainer has started (its first status.json, or "
            "%.0fs after its launch); its errors stop the trainer (dataset.doctor_first = true "
            "makes the trainer wait for it)",
            DOCTOR_START_CAP_S,
        )

    def when_started(self, *, status_seen: bool, since_launch_s: float) -> None:
        """Start a queued doctor once the trainer wrote its first status.json (its imports are
        done) or has had :data:`DOCTOR_START_CAP_S` to."""
        if self.due and (status_seen or since_launch_s >= DOCTOR_START_CAP_S):
            self.start(self.report)

    def start(self, report: dict[str, Any] | None) -> None:
        self.due, self.report = False, None
        procs: list[subprocess.Popen[str]] = []
        self.procs = procs
        self.task = asyncio.create_task(
            staging.check_data(self.ctx.job, report, doctor=True, started=procs.append),
            name="doctor",
        )
        log.info("libreyolo doctor started beside the trainer")

    def waiter(self) -> asyncio.Future[Any] | None:
        """A future done when the doctor is (cancelling it leaves the doctor running)."""
        task = self.task
        if task is None or task.done():
            return None
        return asyncio.ensure_future(asyncio.wait({task}))

    def verdict(self) -> str | None:
        """Once the doctor is done: the cause to stop the job for (its errors), or None (it
        passed, could not run, or is still running). Reads the verdict once."""
        task = self.task
        if task is None or not task.done():
            return None
        self.task = None
        if task.cancelled():
            return None
        ctx = self.ctx
        exc = task.exception()
        if exc is not None:
            message = f"the dataset doctor could not run: {type(exc).__name__}: {exc}"
            log.error("%s; training goes on unchecked", message)
            ctx.events.publish("warning", message=message)
            return None
        outcome = task.result()
        if outcome.report is not None:
            ctx.staging_report = outcome.report
            ctx.store.write_report("staging.json", outcome.report)
        if outcome.ok:
            return None
        ctx.events.publish("warning", message=outcome.cause or "dataset check failed")
        return outcome.cause or "dataset check failed"

    async def after_exit(self) -> str | None:
        """The trainer exited with an error while the doctor ran (or before it started): its
        verdict explains it."""
        if self.due:
            self.start(self.report)
        task = self.task
        if task is None:
            return None
        if not task.done():
            log.info(
                "the trainer failed while libreyolo doctor runs: waiting up to %.0fs for its "
                "verdict",
                DOCTOR_AFTER_EXIT_S,
            )
            await asyncio.wait({task}, timeout=DOCTOR_AFTER_EXIT_S)
        if not task.done():
            self.stop()
            return None
        return self.verdict()

    def stop(self) -> None:
        """Kill a doctor still running (its process group); its verdict no longer matters."""
        self.due, self.report = False, None
        for proc in self.procs:
            if proc.poll() is None:
                kill_group(proc.pid)
        self.task = None
