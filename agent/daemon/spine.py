"""The orchestrator: runs the phases, owns the long-lived tasks, handles signals and shutdown.

BOOTING -> PREFLIGHT -> STAGING -> TRAINING -> FINISHING -> TEARDOWN -> DONE

Signals only set events. SIGINT/SIGTERM to the agent stop the *agent*: the trainer is left
running (unless ``job.stop_trainer_on_exit``) and a restarted agent re-attaches to it. Stopping
the *job* is a different request (``libreyolo-agent stop`` / POST /stop).

The phases are objects over one :class:`~agent.daemon.context.RunContext`, each in its module
and each returning its result: :class:`~agent.daemon.prepare.Preparation` (PREFLIGHT, STAGING),
:class:`~agent.daemon.training.Training` (TRAINING, resumes included, with
:mod:`agent.daemon.relaunch` and :mod:`agent.daemon.preempted`),
:class:`~agent.daemon.finish.Ending` (FINISHING, TEARDOWN, HELD);
:class:`~agent.daemon.control.Control` answers people. :meth:`Daemon._phases` reads top to
bottom as the run goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

from agent import hub
from agent.config.model import Env, Job, TeardownSection
from agent.daemon import signals
from agent.daemon.context import RunContext
from agent.daemon.control import AgentError as AgentError  # re-exported: the CLI catches it
from agent.daemon.control import Control
from agent.daemon.doctor import DoctorBeside
from agent.daemon.finish import Ending
from agent.daemon.prepare import Preparation, abandon, drop_warm
from agent.daemon.signals import Flags
from agent.daemon.sizingrun import SizingRun
from agent.daemon.training import Training
from agent.data import staging
from agent.events import Event, EventBus
from agent.gpu.health import GpuMonitor
from agent.guard import plan as guardplan
from agent.policy import restart, teardown
from agent.policy.resume import boot_id
from agent.providers import Provider
from agent.sinks import Sink
from agent.sinks.target import make_sink
from agent.state import Phase, Reason, RunState, StateDirLocked, StateStore, transition
from agent.status.notify import Notifier
from agent.sync.engine import SyncEngine
from agent.trainer.process import Launcher, ProcessLauncher, TrainerProcess
from agent.trainer.rundir import RunStatus
from agent.util import logutil
from agent.util.crashpoints import crashpoint
from agent.util.sdnotify import SdNotify
from agent.util.threads import in_thread
from agent.watch.progress import ProgressTracker

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Shared(Generic[T]):
    """A daemon attribute that is the run context's (``daemon.state`` is ``daemon.ctx.state``):
    the CLI, the demo and the tests read and set them on the daemon they built."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, daemon: None, owner: type) -> _Shared[T]: ...
    @overload
    def __get__(self, daemon: Daemon, owner: type | None = None) -> T: ...
    def __get__(self, daemon: Daemon | None, owner: type | None = None) -> T | _Shared[T]:
        if daemon is None:
            return self  # on the class (introspection, patching)
        value: T = getattr(daemon.ctx, self.name)
        return value

    def __set__(self, daemon: Daemon, value: T) -> None:
        setattr(daemon.ctx, self.name, value)


class Daemon:
    """One job on this box, from BOOTING to DONE (or until the agent is asked to exit)."""

    job = _Shared[Job]()
    env = _Shared[Env]()
    state = _Shared[RunState]()
    flags = _Shared[Flags]()
    events = _Shared[EventBus]()
    trainer = _Shared[TrainerProcess | None]()
    run_dir = _Shared[Path | None]()
    status = _Shared[RunStatus | None]()
    sync = _Shared[SyncEngine | None]()
    gpu = _Shared[GpuMonitor | None]()
    progress = _Shared[ProgressTracker | None]()
    box_fault = _Shared[str | None]()
    breach_message = _Shared[str | None]()
    disk_stop = _Shared[str | None]()
    preflight_report = _Shared[dict[str, Any] | None]()
    staging_report = _Shared[dict[str, Any] | None]()
    poll_interval_s = _Shared[float]()
    stage_hook = _Shared[staging.StageHook | None]()
    provider_factory = _Shared[Callable[[TeardownSection, Env], Provider]]()
    start_guard = _Shared[bool]()

    def __init__(
        self,
        job: Job,
        env: Env,
        *,
        stage_hook: staging.StageHook | None = None,
        clock: Callable[[], float] = time.time,
        poll_interval_s: float = 5.0,
        on_ready: Callable[[Daemon], None] | None = None,
        fresh_start: Callable[[], None] | None = None,
        start_guard: bool = False,
        launcher: Launcher | None = None,
        sink: Sink | None = None,
        provider_factory: Callable[[TeardownSection, Env], Provider] = (
            teardown.make_teardown_provider
        ),
        gpu: GpuMonitor | None = None,
    ) -> None:
        """The collaborators come from outside, so the orchestrator is tested with fakes:
        ``launcher`` starts and finds trainers (default: real processes), ``sink`` is the sync
        target (default: built from ``[sync]``), ``provider_factory`` builds the teardown
        provider, ``clock`` is the one clock every deadline is compared with, ``gpu`` watches
        the GPUs' health while training (default: NVML, where a driver answers).

        ``fresh_start`` runs once this agent holds the state directory's lock, before the
        state is read (the demo wipes its own folder there, never one another agent uses).
        ``start_guard`` starts agent/guard/run.py, the process that stops the box if this
        agent dies for good."""
        now = clock()
        self.boot_id = boot_id()
        events = EventBus(clock=clock)
        self.ctx = ctx = RunContext(
            job=job,
            env=env,
            store=StateStore(env.state_dir),
            clock=clock,
            launcher=launcher or ProcessLauncher(),
            provider_factory=provider_factory,
            events=events,
            state=RunState(
                job_name=job.job.name,
                job_source=job.source,
                started_at=now,
                updated_at=now,
                boot_id=self.boot_id,
            ),
            poll_interval_s=poll_interval_s,
            stage_hook=stage_hook,
            start_guard=start_guard,
            gpu=gpu,
            # Always: its observations are also the per-epoch GPU figures of /history and the
            # page; without limits.stall_timeout it never calls a stall.
            progress=ProgressTracker(job.limits, clock=clock, gpu=gpu),
            # Webhook notices ([notify]), or None (agent/status/notify.py).
            notifier=(
                Notifier(
                    job.notify,
                    events,
                    secrets=[v for _, v in env.secrets()],
                    job=env.run_name(job.job.name),
                )
                if job.notify is not None
                else None
            ),
        )
        self._sink = sink
        self.on_ready = on_ready
        self.fresh_start = fresh_start
        # The phases, each over the run context; what only one needs lives in it.
        self.doctor = DoctorBeside(ctx)
        self.sizing = SizingRun(ctx)
        self.prepare = Preparation(ctx, self.doctor)
        self.training = Training(ctx, self.doctor, self.sizing)
        self.control = Control(ctx, self.sizing)
        self.ending = Ending(ctx, self.control.status_dict)
        #: systemd's notify socket (READY, WATCHDOG, STATUS, STOPPING), a no-op without one.
        self.systemd = SdNotify.from_env()
        events.listen(self._tell_systemd)

    def status_dict(self) -> dict[str, Any]:
        """The ``/status`` document, as served."""
        return self.control.status_dict()

    # ------------------------------------------------------------------ entry

    async def run(self, shutdown_trigger: asyncio.Event | None = None) -> int:
        """Run the job to its end (or until the agent is asked to exit). Returns the exit code."""
        ctx = self.ctx
        ctx.flags = Flags(shutdown=shutdown_trigger or asyncio.Event())
        on_preempt = self.control.sigterm_notice if ctx.job.preemption.sigterm else None
        signals.install(ctx.flags, on_preempt=on_preempt)
        try:
            ctx.store.ensure()
        except OSError as exc:
            raise AgentError(
                f"cannot create the state directory {ctx.env.state_dir}: {exc.strerror or exc}; "
                "set LIBREYOLO_AGENT_STATE_DIR to a writable folder"
            ) from exc
        try:
            lock = ctx.store.lock()
        except StateDirLocked as exc:
            raise AgentError(
                f"another agent (pid {exc.holder}) is running on the state directory "
                f"{ctx.env.state_dir}; stop it first, or use another LIBREYOLO_AGENT_STATE_DIR"
            ) from None
        try:
            if self.fresh_start is not None:
                self.fresh_start()
            file_handler = ctx.store.log_handler()
        except BaseException:
            os.close(lock)
            signals.remove()
            raise
        # agent.log travels with the checkpoints: no secret may ever be written to it.
        logutil.redact_secrets(ctx.env.secrets())
        # 1,024 descriptors (a common default) ran out under a flood of idle connections.
        logutil.raise_fd_limit()
        try:
            with logutil.to_file(file_handler):
                try:
                    return await self._run()
                except AgentError:
                    raise
                except Exception as exc:
                    log.exception("agent crashed in phase %s", ctx.state.phase.value)
                    self._record_crash(exc)
                    raise
        finally:
            self.systemd.stopping(f"phase {ctx.state.phase.value}")
            self.systemd.close()
            os.close(lock)
            signals.remove()

    def _record_crash(self, exc: BaseException) -> None:
        """Count the crash in state.json, so the next agent can tell a crash loop."""
        ctx = self.ctx
        ctx.state.crashes.append(restart.crash_record(ctx.state, exc, ctx.clock()))
        ctx.save()

    async def _run(self) -> int:
        ctx = self.ctx
        # The Hub client's timeouts, once, for staging, sync and everything else.
        hub.configure(ctx.env)
        if ctx.env.run_id:  # a launch engine's run: the same id on every box it relaunches
            log.info("run id %s (from %s)", ctx.env.run_id, ctx.env.run_id_from)
        try:
            previous = ctx.store.load()
        except (ValueError, KeyError, TypeError) as exc:
            raise AgentError(
                f"{ctx.store.state_path} is unreadable ({type(exc).__name__}: {exc}); the "
                "previous run's state is unknown, so the agent will not guess (it could start "
                "a second trainer): inspect it, then remove it to start the job over"
            ) from exc
        resume_at = self._adopt(previous)
        if resume_at is None:
            return 0
        if resume_at == Phase.PREFLIGHT and ctx.job.preflight.enabled:
            # The longest step before the first epoch starts first (agent/daemon/prepare.py).
            self.prepare.start_warm()
        try:
            return await self._start(resume_at, previous)
        finally:
            await self.prepare.drop_early_warm()  # started, and the job ended before preflight

    async def _start(self, resume_at: Phase, previous: RunState | None) -> int:
        ctx = self.ctx
        if ctx.notifier is not None:
            ctx.spawn(ctx.notifier.run(), "notify")
        ctx.events.publish(
            "job_started",
            job=ctx.job.job.name,
            phase=resume_at.value,
            restarted=previous is not None,
        )
        if ctx.start_guard:  # the safety net if this agent dies for good (agent/guard/run.py)
            plan = guardplan.write_plan(
                ctx.env.state_dir,
                ctx.job,
                ctx.state.started_at,
                extended_s=ctx.state.extended_s,
            )
            ctx.spawn(
                guardplan.heartbeat_task(ctx.env.state_dir, plan.heartbeat_every_s), "heartbeat"
            )
            guardplan.ensure_running(ctx.env.state_dir)
        if ctx.job.sync is not None:
            sink = self._sink or make_sink(ctx.job.sync, ctx.env)
            ctx.sync = SyncEngine(sink, ctx.job.sync, state_dir=ctx.env.state_dir)
            ctx.sync.uploads.on_outcome = lambda **d: ctx.events.publish("upload", **d)
            # What a killed agent promised and had not delivered is queued again; its leftover
            # snapshots are reused or removed.
            await ctx.sync.recover(ctx.run_dir)
            ctx.spawn(ctx.sync.run(), "sync")
        await self.control.start_server()
        ctx.save()
        self.systemd.ready(f"phase {ctx.state.phase.value}")
        if self.systemd.watchdog_interval_s() is not None:
            ctx.spawn(self.systemd.watchdog_task(lambda: True), "watchdog")
        if self.on_ready:
            self.on_ready(self)
        try:
            return await self._phases(resume_at)
        finally:
            self.doctor.stop()
            await self._shutdown()

    def _adopt(self, previous: RunState | None) -> Phase | None:
        """Decide where to start from what a previous agent left (agent/policy/restart.py); None:
        nothing to do."""
        ctx = self.ctx
        if previous is None:
            return Phase.PREFLIGHT
        if previous.job_name != ctx.job.job.name:
            raise AgentError(
                f"the state directory {ctx.env.state_dir} belongs to job "
                f"{previous.job_name!r}, not {ctx.job.job.name!r}; use another "
                "LIBREYOLO_AGENT_STATE_DIR or remove its state.json"
            )
        restart.reopen_unconfirmed(previous, ctx.clock())  # DONE, never confirmed: TEARDOWN
        if previous.phase.terminal:
            log.info(
                "job %s already ended: phase=%s reason=%s; nothing to do "
                "(remove %s to run it again)",
                previous.job_name,
                previous.phase.value,
                previous.reason.value if previous.reason else None,
                ctx.store.state_path,
            )
            ctx.state = previous
            return None
        # Carry over what must survive restarts: the job's clock, its history, its trainer.
        was = previous.phase
        ctx.state = previous
        ctx.history_published = len(previous.history)  # old phases are not news
        ctx.state.agent_pid = os.getpid()
        ctx.state.history.append({"at": ctx.clock(), "event": "agent restarted", "was": was.value})
        if was != Phase.BOOTING:
            transition(ctx.state, Phase.BOOTING, note="agent restarted")  # any -> BOOTING
        if previous.boot_id is not None and previous.boot_id != self.boot_id:
            # Every pid recorded before a reboot is meaningless (and may be reused).
            ctx.rebooted = True
            log.warning("the box rebooted since the last agent ran (boot id changed)")
            ctx.state.history.append({"at": ctx.clock(), "event": "box rebooted"})
        ctx.state.boot_id = self.boot_id
        if previous.trainer and previous.trainer.run_dir:
            ctx.run_dir = Path(previous.trainer.run_dir)
        return restart.resume_phase(was, previous)

    # ------------------------------------------------------------------ phases

    async def _phases(self, start: Phase) -> int:
        ctx = self.ctx
        if start == Phase.FAILED:
            ctx.state.cause = restart.crash_loop_cause(ctx.state)
            log.error("crash loop: %s", ctx.state.cause)
            return await self.ending.teardown(Reason.AGENT_FAILED)
        if start == Phase.TEARDOWN:
            assert ctx.state.reason is not None
            return await self.ending.teardown(ctx.state.reason, resumed=True)
        if start == Phase.PREFLIGHT:
            staged: asyncio.Task[bool] | None = None
            from agent.daemon import essentials

            # Provider, key and sync target: proven always, preflight on or off.
            if not await essentials.gate(ctx):
                await self.prepare.drop_early_warm()
                return await self.ending.teardown(Reason.PREFLIGHT_FAILED)
            if ctx.job.preflight.enabled:
                transition(ctx.state, Phase.PREFLIGHT)  # BOOTING -> PREFLIGHT
                ctx.save()
                # Billed seconds: the dataset (download, data YAML, doctor) is staged while the
                # GPU probe runs, once the disk and the Hub checks have passed.
                may_stage = asyncio.Event()
                staged = asyncio.create_task(self.prepare.staging(after=may_stage))
                try:
                    passed = await self.prepare.preflight(may_stage)
                finally:
                    if not may_stage.is_set():
                        staged.cancel()
                if not passed:
                    await abandon(staged)
                    self.doctor.stop()
                    await ctx.sync_reports()
                    return await self.ending.teardown(Reason.PREFLIGHT_FAILED)
                may_stage.set()
            if ctx.flags.shutdown.is_set():
                await drop_warm(ctx)
                if staged is not None:
                    await abandon(staged)
                return 0
            transition(ctx.state, Phase.STAGING)  # PREFLIGHT -> STAGING
            ctx.save()
            crashpoint("staging")
            if not await (staged if staged is not None else self.prepare.staging()):
                await ctx.sync_reports()
                return await self.ending.teardown(Reason.PREFLIGHT_FAILED)
            wrong_box = await self.sizing.profile_gate()
            if wrong_box is not None:
                ctx.state.cause = wrong_box
                log.error("%s", wrong_box)
                await ctx.sync_reports()
                return await self.ending.teardown(Reason.PREFLIGHT_FAILED)
            if ctx.flags.shutdown.is_set():
                await drop_warm(ctx)
                return 0
            if ctx.flags.stop_job.is_set():
                # Stopped before anything was trained: no trainer to start, nothing to sync.
                ctx.state.cause = "stop requested before training started"
                return await self.ending.teardown(Reason.STOPPED_BY_USER)
            start = Phase.TRAINING
        if start == Phase.TRAINING:
            transition(ctx.state, Phase.TRAINING)  # STAGING|BOOTING -> TRAINING
            restart.note_progress(ctx.state, Phase.TRAINING)
            await ctx.read_price()
            ctx.save()
            await self._watch_gpus()
            reason = await self.training.run()
            await drop_warm(ctx)  # not launched (already done, or the agent is exiting)
            self.doctor.stop()  # still running after the trainer: its verdict is moot
            if reason is None:
                return 0  # the agent was asked to exit; the trainer goes on
            ctx.state.reason = reason
            start = Phase.FINISHING
        if start == Phase.FINISHING:
            transition(ctx.state, Phase.FINISHING)  # TRAINING|BOOTING -> FINISHING
            restart.note_progress(ctx.state, Phase.FINISHING)
            ctx.save()
            if not await self.ending.finishing():
                return 0  # state.json still says FINISHING: the next agent carries on
        assert ctx.state.reason is not None
        return await self.ending.teardown(ctx.state.reason)

    async def _watch_gpus(self) -> None:
        """NVML health and load for the run, where a driver answers (a CPU job: none)."""
        ctx = self.ctx
        if ctx.gpu is None and ctx.job.train.get("device") != "cpu":
            monitor = GpuMonitor()
            if await asyncio.to_thread(lambda: monitor.available):
                ctx.gpu = monitor
                log.info("watching GPU health through NVML")
            else:
                await asyncio.to_thread(monitor.close)
        if ctx.progress is not None and ctx.gpu is not None:
            ctx.progress = ProgressTracker(ctx.job.limits, clock=ctx.clock, gpu=ctx.gpu)
        self.sizing.start()

    async def _shutdown(self) -> None:
        ctx = self.ctx
        # 1. Persist where we are, so a restarted agent carries on from here.
        ctx.save()
        # 2. Give in-flight uploads a short grace, then stop the sync queue.
        if ctx.sync is not None:
            if ctx.state.phase not in (Phase.DONE,) and not ctx.flags.force.is_set():
                await ctx.sync.drain(5.0)
            await ctx.sync.close()
        # The last notices (done, failure) go out before the notifier's task is cancelled.
        if ctx.notifier is not None:
            if not ctx.flags.force.is_set():
                await ctx.notifier.flush(5.0)
            await ctx.notifier.close()
        # 3. Cancel the remaining long-lived tasks and say how many there were.
        tasks = list(ctx.tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            # A crashed task was already logged (RunContext.spawn); it must not fail a finished job.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if tasks:
            log.info("cancelled %d task(s)", len(tasks))
        # The NVML host ends with its pipe; a call stuck in the driver is not waited for.
        if ctx.gpu is not None:
            with contextlib.suppress(TimeoutError):
                await in_thread(ctx.gpu.close, 5.0, "nvml-close")
        # 4. The HTTP server goes last, so /status stays answerable as long as possible.
        if self.control.server is not None:
            await self.control.server.stop()

    def _tell_systemd(self, event: Event) -> None:
        if event.kind == "phase":
            why = f" ({event.data['reason']})" if event.data.get("reason") else ""
            self.systemd.status(f"phase {event.data['to']}{why}")
