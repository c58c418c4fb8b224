"""Relaunching a trainer: resume from ``last.pt`` (fetched from the sync target when the box
lost it), a new box picking up where the old one stopped, the backoff between resumes.

The rules (whether to resume at all) are :mod:`agent.policy.resume`'s; this is the daemon's side of
them, a mixin of :class:`agent.daemon.training.TrainingMixin` (itself a part of the daemon).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from agent.config.model import Job, LimitsSection
from agent.daemon.signals import Flags
from agent.events import EventBus
from agent.policy import resume
from agent.policy.resume import AlreadyDone as AlreadyDone  # supervise.py catches it
from agent.sinks import SinkError
from agent.state import Reason, RunState
from agent.sync.engine import SyncEngine
from agent.trainer.process import Launcher, Outcome, build_argv
from agent.trainer.rundir import RunStatus, read_status

log = logging.getLogger(__name__)


class RelaunchMixin:
    # Provided by the daemon.
    job: Job
    launcher: Launcher
    clock: Callable[[], float]
    state: RunState
    run_dir: Path | None
    status: RunStatus | None
    sync: SyncEngine | None
    flags: Flags | None
    events: EventBus
    rebooted: bool
    box_fault: str | None
    breach_message: str | None
    reason_hint: Reason | None
    _outcome: Outcome | None

    def _save(self, *, required: bool = False) -> None:
        raise NotImplementedError

    def limits(self) -> LimitsSection:
        raise NotImplementedError

    async def _launch_or_adopt(self, argv: list[str] | None = None) -> Reason | None:
        raise NotImplementedError

    async def _resume_from_target(self) -> list[str] | None:
        """A first launch on a box whose sync target already holds this job's ``last.pt`` (the
        old box is gone): download it and resume instead of training from scratch, which would
        overwrite the target's checkpoints. None: nothing there, train from scratch."""
        if self.sync is None:
            return None
        run_dir = self.job.job.runs_dir / self.job.job.name
        local_status = run_dir / "status.json"
        try:
            remote = await asyncio.to_thread(self.sync.sink.stat, "weights/last.pt")
            if remote is None:
                return None
            got = await asyncio.to_thread(self.sync.sink.download, "status.json", local_status)
        except SinkError as exc:
            # Not knowing must not block training (the target may be down for hours); a repo that
            # does not exist yet simply holds no earlier run.
            if "was not found" not in str(exc):
                log.warning(
                    "cannot read the sync target to check for an earlier run of this job (%s); "
                    "training from scratch: checkpoints an earlier box uploaded there would be "
                    "overwritten",
                    exc,
                )
            return None
        status = read_status(run_dir) if got is not None else None
        total = resume.new_box_epochs(status, self.job.train.epochs)  # AlreadyDone: nothing left
        if not await self._fetch_last_pt(run_dir):
            return None
        await self._fetch_history(run_dir)
        started_for = status.total_epochs if status else None
        changed = total is not None and started_for is not None and started_for != total
        note = (
            f"; that run was started for {started_for} epochs, this job asks for {total}: it "
            f"ends at epoch {total}"
            if changed
            else ""
        )
        (log.warning if changed else log.info)(
            "the sync target holds this job's last.pt (epoch %s): resuming from it in %s%s",
            status.completed_epochs if status else "?",
            run_dir,
            note,
        )
        self.run_dir = run_dir
        self.state.resumes.append(
            {
                "at": self.clock(),
                "epoch": status.completed_epochs if status else None,
                "kind": "new_box",
                "message": f"resumed from the sync target's last.pt{note}",
            }
        )
        return self._resume_argv(run_dir, total)

    async def _fetch_last_pt(self, run_dir: Path) -> bool:
        """``run_dir/weights/last.pt`` is valid, or was fetched from the target and is now."""
        last = run_dir / "weights" / "last.pt"
        if await asyncio.to_thread(resume.valid_checkpoint, last):
            return True
        if self.sync is None:
            return False
        what = "is not a valid checkpoint" if last.exists() else "is missing"
        log.warning("%s %s; fetching the verified copy from the sync target", last, what)
        try:
            got = await asyncio.to_thread(self.sync.sink.download, "weights/last.pt", last)
        except SinkError as exc:
            log.error("cannot fetch last.pt from %s: %s", self.sync.sink.description, exc)
            return False
        if got is None or not await asyncio.to_thread(resume.valid_checkpoint, last):
            log.error("the sync target has no usable last.pt either")
            return False
        log.info("fetched last.pt (%d bytes, sha256 %s) from the target", got.size, got.sha256[:12])
        return True

    async def _fetch_history(self, run_dir: Path) -> None:
        """The earlier box's ``metrics.jsonl`` and ``results.csv``: LibreYOLO appends a resumed
        run's rows to them, so the copies this box uploads keep every epoch's row instead of
        replacing the target's history with the epochs trained here."""
        assert self.sync is not None
        for name in ("metrics.jsonl", "results.csv"):
            try:
                await asyncio.to_thread(self.sync.sink.download, name, run_dir / name)
            except SinkError as exc:
                log.warning(
                    "cannot fetch %s from %s (%s): the target's copy will hold only the epochs "
                    "trained from here on",
                    name,
                    self.sync.sink.description,
                    exc,
                )

    def _resume_argv(self, run_dir: Path, total_epochs: int | None) -> list[str]:
        argv = getattr(self.launcher, "resume_argv", None)
        if callable(argv):
            result: list[str] = argv(self.job, run_dir, total_epochs)
            return result
        return build_argv(self.job, resume_dir=run_dir, total_epochs=total_epochs)

    # ------------------------------------------------------------------ resuming

    async def _backoff(self, seconds: float) -> None:
        """Wait before a resume; a stop request or the agent exiting cuts it short."""
        assert self.flags is not None
        events = (self.flags.shutdown, self.flags.stop_job)
        if seconds <= 0 or any(e.is_set() for e in events):
            return
        waiters = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    async def _resume_or_not(self, stop_reason: Reason | None) -> bool | None:
        """The trainer ended without a clean end: resume it (True, after the backoff and with
        the new trainer launched) or not (False: the run ends; the cause says why). None: the
        agent is exiting before the resume (the next agent decides again)."""
        assert self.flags is not None
        outcome = self._outcome
        if outcome is None:
            return False  # the launch itself failed: nothing to resume
        cause: str | None = None
        if self.state.preempted:
            cause = "preempted"
        elif stop_reason == Reason.STALLED:
            cause = "stalled"
        elif self.rebooted:
            cause = "reboot"
        decision = resume.decide(
            outcome,
            self.status,
            cfg=self.limits(),
            resumes=self.state.resumes,
            stop_reason=None
            if stop_reason in (Reason.STALLED, Reason.PREEMPTED) or self.box_fault
            else stop_reason,
            box_fault=self.box_fault,
            cause=cause,
        )
        if decision.completed:
            log.info("%s", decision.why)
            self.reason_hint = Reason.COMPLETED
            self.state.cause = decision.why
            return False
        if not decision.resume:
            log.error("not resuming: %s", decision.why)
            self.state.cause = f"{self.state.cause}; not resumed: {decision.why}"
            return False
        run_dir = self.run_dir
        epoch = self.status.completed_epochs if self.status else 0
        argv: list[str] | None = None
        if run_dir is not None and epoch > 0:
            if not await self._fetch_last_pt(run_dir):
                self.state.cause = (
                    f"{self.state.cause}; not resumed: last.pt is missing or invalid and the "
                    "sync target has no usable copy"
                )
                log.error("%s", self.state.cause)
                return False
            total = self.status.total_epochs if self.status else None
            argv = self._resume_argv(run_dir, total)
        log.warning("%s: relaunching in %.0fs", decision.why, decision.wait_s)
        self.events.publish(
            "resume",
            cause=cause or outcome.kind.value,
            epoch=self.status.completed_epochs if self.status else 0,
            why=decision.why,
        )
        # The backoff comes before anything is recorded: an agent that exits meanwhile leaves
        # the dead trainer in state.json, and the next agent takes the same decision afresh
        # (recording the resume first would count it twice: "the same failure twice").
        await self._backoff(decision.wait_s)
        if self.flags.shutdown.is_set():
            log.info("agent exiting before the resume; the next agent resumes the trainer")
            return None
        if self.flags.stop_job.is_set():
            self.reason_hint = Reason.STOPPED_BY_USER
            self.state.cause = f"{self.state.cause}; stop requested before the resume"
            log.warning("stop requested: not resuming the trainer")
            return False
        self.state.resumes.append(
            resume.death_record(outcome, self.status, now=self.clock(), cause=cause)
        )
        self.state.trainer = None
        self.state.launch = None
        self.state.preempted = None
        self.state.outcome = None
        self.state.cause = None
        self.box_fault = None
        self.rebooted = False
        self.breach_message = None
        self._save()
        if argv is None:
            # Died before its first epoch: start it over, in the same run dir when known.
            argv = (
                list(self.launcher.argv(self.job))
                if run_dir is None
                else self._fresh_argv_in(run_dir)
            )
        failed = await self._launch_or_adopt(argv)
        if failed is not None:
            self.reason_hint = failed
            return False
        return True

    def _fresh_argv_in(self, run_dir: Path) -> list[str]:
        argv = list(self.launcher.argv(self.job))
        return [a for a in argv if not a.startswith("name=")] + [
            f"name={run_dir.name}",
            "exist_ok=true",
        ]
