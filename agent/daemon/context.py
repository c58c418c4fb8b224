"""The run context: what every phase of the daemon works on, in one typed object.

The phases (:mod:`agent.daemon.prepare`, :mod:`agent.daemon.training`,
:mod:`agent.daemon.relaunch`, :mod:`agent.daemon.finish`) and the parts that answer people
(:mod:`agent.daemon.control`) each take this context and return their result; what only one of
them needs (the followed trainer's exit, the doctor's process, the sizing samples) lives in that
phase's own object, not here. Here are the collaborators the daemon was given (job, state store,
clock, launcher, provider factory), the run's shared facts (state, trainer, run directory, sync
engine, flags) and the few rules every phase needs the same way (save the state, start a
long-lived task, the effective limits).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.config.model import Env, Job, LimitsSection, TeardownSection
from agent.daemon.signals import Flags
from agent.data.staging import StageHook
from agent.events import EventBus
from agent.gpu.health import GpuMonitor
from agent.policy.limits import effective_limits, read_price
from agent.providers import Provider
from agent.state import RunState, StateStore
from agent.status.notify import Notifier
from agent.sync.engine import AGENT_FILES, SyncEngine
from agent.trainer.process import Launcher, TrainerProcess
from agent.trainer.rundir import RunStatus, read_status
from agent.util.text import os_error
from agent.watch.preemption import Notice, PreemptionWatcher
from agent.watch.progress import ProgressTracker

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RunContext:
    """One run of one job on this box, as every phase sees it."""

    job: Job
    env: Env
    store: StateStore
    #: The one clock every deadline is compared with (tests move it by hand).
    clock: Callable[[], float]
    #: Starts and finds trainers (real processes, or a test's fake).
    launcher: Launcher
    #: Builds the teardown provider for a ``[teardown]`` section.
    provider_factory: Callable[[TeardownSection, Env], Provider]
    #: What happened, for ``GET /events``, the page and the webhooks (agent/events.py).
    events: EventBus
    state: RunState
    #: The longest a turn of the training loop sleeps without an event, seconds.
    poll_interval_s: float
    #: Called by staging (the demo makes its dataset there).
    stage_hook: StageHook | None = None
    #: Start agent/guard/run.py, the process that stops the box if this agent dies for good.
    start_guard: bool = False
    #: What the agent is asked to do (set by signals and steering; replaced at ``run``).
    flags: Flags = field(default_factory=Flags)
    #: The box rebooted since the state was written (another boot id): no recorded pid counts.
    rebooted: bool = False
    trainer: TrainerProcess | None = None
    run_dir: Path | None = None
    #: The trainer's last status.json.
    status: RunStatus | None = None
    sync: SyncEngine | None = None
    #: NVML health while training (None: no GPU or no driver on this box).
    gpu: GpuMonitor | None = None
    progress: ProgressTracker | None = None
    notifier: Notifier | None = None
    #: The preemption notice being handled, and the watcher that delivers them.
    notice: Notice | None = None
    watcher: PreemptionWatcher | None = None
    #: A GPU fault seen while training (Xid, ECC, lost, thermal): the box is bad.
    box_fault: str | None = None
    #: Why the agent stopped (or is stopping) the trainer, in words (the outcome's cause).
    breach_message: str | None = None
    #: Why the disk cannot take the next checkpoint (set after an epoch, acted on next turn).
    disk_stop: str | None = None
    preflight_report: dict[str, Any] | None = None
    staging_report: dict[str, Any] | None = None
    #: The last failure to write state.json (full disk...): shown in /status, logged once.
    state_write_error: str | None = None
    #: History entries already published as ``phase`` events (old phases are not news).
    history_published: int = 0
    #: Every long-lived task (sync, notify, heartbeat, watchdog, preemption), kept to cancel.
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    # ------------------------------------------------------------------ the state file

    def save(self, *, required: bool = False) -> None:
        """Persist the state. Out of disk the agent keeps supervising with the state in memory
        (and says so in /status); ``required`` saves (a launch intent, a teardown decision)
        raise instead, because acting without the record could not be undone safely."""
        self._publish_phases()
        try:
            self.store.save(self.state)
        except OSError as exc:
            message = f"cannot write {self.store.state_path}: {os_error(exc, filename=True)}"
            if message != self.state_write_error:
                log.error("%s; the agent carries on with its state in memory", message)
            self.state_write_error = message
            if required:
                raise
        else:
            if self.state_write_error is not None:
                log.info("state.json written again")
            self.state_write_error = None

    def _publish_phases(self) -> None:
        """Every phase change recorded in the history since the last save, as an event."""
        history = self.state.history
        for entry in history[self.history_published :]:
            if "to" in entry:
                self.events.publish(
                    "phase",
                    **{
                        "from": entry.get("from"),
                        "to": entry["to"],
                        "reason": entry.get("reason"),
                        "note": entry.get("note"),
                    },
                )
        self.history_published = len(history)

    # ------------------------------------------------------------------ shared rules

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Start a long-lived task; it is kept (to cancel at shutdown) and its crash logged."""
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s crashed: %r", task.get_name(), task.exception())

    def limits(self) -> LimitsSection:
        """The job's limits, with the provider's real price where the job says ``auto``."""
        return effective_limits(self.job.limits, self.state.price_usd_per_hour)

    async def read_price(self) -> None:
        """``price_usd_per_hour = "auto"``: ask the provider once, keep it in the state."""
        if self.job.limits.price_auto and self.state.price_usd_per_hour is None:
            self.state.price_usd_per_hour = await read_price(
                self.preflight_report, lambda: self.provider_factory(self.job.teardown, self.env)
            )

    def agent_files(self) -> list[Path]:
        """The agent's own files that travel with the checkpoints (state.json, agent.log...)."""
        return [p for p in (self.store.path(n) for n in AGENT_FILES) if p.exists()]

    async def save_now(self) -> None:
        """Queue ``last.pt`` (and ``best.pt``) at once, whatever the sync policy's schedule:
        a stop, a stall or a notice is coming."""
        if self.sync is not None and self.run_dir is not None:
            # The label is the epoch the files hold as far as can be known: status.json read
            # now, not the last poll's (a trainer that wrote epoch N and its status since then
            # would be saved as N-1). LibreYOLO writes the checkpoint before the status, so
            # the label may still say one less than the bytes, never more.
            fresh = await asyncio.to_thread(read_status, self.run_dir)
            epochs = [s.completed_epochs for s in (self.status, fresh) if s is not None]
            await self.sync.save_now(self.run_dir, max(epochs, default=None))

    async def sync_reports(self) -> None:
        """A box that failed before training is usually destroyed at once: get the reason off
        it first (preflight/staging report, agent.log, state.json), within a short wait."""
        if self.sync is None or self.job.sync is None:
            return
        self.save()
        if not self.reports_can_leave():
            return
        await self.sync.send_reports(self.agent_files())

    def reports_can_leave(self) -> bool:
        """False (and said) where the sync target can take no upload at all: an hf:// target
        with no ``HF_TOKEN`` (the Hub takes no write without one; the preflight failed on it).
        Waiting for the reports to leave would only bill: they stay in the state directory."""
        if self.job.sync is None or self.job.sync.scheme != "hf" or self.env.hf_token is not None:
            return True
        log.warning(
            "the reports stay on the box, in %s: %s takes no upload without HF_TOKEN",
            self.env.state_dir,
            self.job.sync.target,
        )
        return False
