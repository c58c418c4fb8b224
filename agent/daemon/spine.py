"""The orchestrator: runs the phases, owns the long-lived tasks, handles signals and shutdown.

BOOTING -> PREFLIGHT -> STAGING -> TRAINING -> FINISHING -> TEARDOWN -> DONE

Signals only set events. SIGINT/SIGTERM to the agent stop the *agent*: the trainer is left
running (unless ``job.stop_trainer_on_exit``) and a restarted agent re-attaches to it. Stopping
the *job* is a different request (``libreyolo-agent stop`` / POST /stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent import hub
from agent.config.model import Env, Job, LimitsSection, TeardownAction, TeardownSection
from agent.daemon import signals
from agent.daemon.control import AgentError as AgentError  # re-exported: the CLI catches it
from agent.daemon.control import ControlMixin
from agent.daemon.signals import Flags
from agent.daemon.training import TrainingMixin
from agent.data import staging
from agent.events import Event, EventBus
from agent.gpu.health import GpuMonitor
from agent.guard import plan as guardplan
from agent.policy import restart, teardown
from agent.policy.limits import BudgetWarner, effective_limits, read_price
from agent.policy.resume import boot_id
from agent.providers import Provider
from agent.sinks import Sink, make_sink
from agent.state import Phase, Reason, RunState, StateDirLocked, StateStore, transition
from agent.status.notify import Notifier
from agent.status.server import StatusServer
from agent.sync.engine import AGENT_FILES, SyncEngine
from agent.trainer.process import Launcher, Outcome, ProcessLauncher, TrainerProcess
from agent.trainer.rundir import RunStatus, read_status
from agent.util import logutil
from agent.util.crashpoints import crashpoint
from agent.util.sdnotify import SdNotify
from agent.util.text import os_error
from agent.util.threads import in_thread
from agent.watch.preemption import Notice, PreemptionWatcher
from agent.watch.profiling import ProfileResult
from agent.watch.progress import ProgressTracker
from agent.watch.sizing import ProcessSampler, Projection, SizingWatch, job_gpu_indices, job_workers

log = logging.getLogger(__name__)


class Daemon(TrainingMixin, ControlMixin):
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
        state is read (the demo wipes its own folder there, never one another agent uses)."""
        self.job = job
        self.env = env
        self.launcher: Launcher = launcher or ProcessLauncher()
        self._sink = sink
        self.provider_factory = provider_factory
        self.store = StateStore(env.state_dir)
        self.stage_hook = stage_hook
        self.clock = clock
        self.poll_interval_s = poll_interval_s
        self.on_ready = on_ready
        self.fresh_start = fresh_start
        #: Start agent/guard/run.py, the process that stops the box if this agent dies for good.
        self.start_guard = start_guard
        now = clock()
        self.state_boot_id = boot_id()
        self.state = RunState(
            job_name=job.job.name,
            job_source=job.source,
            started_at=now,
            updated_at=now,
            boot_id=self.state_boot_id,
        )
        self.trainer: TrainerProcess | None = None
        self.run_dir: Path | None = None
        self.status: RunStatus | None = None
        self.sync: SyncEngine | None = None
        self.server: StatusServer | None = None
        self.preflight_report: dict[str, Any] | None = None
        self.staging_report: dict[str, Any] | None = None
        self.breach_message: str | None = None
        self._last_progress_at = clock()
        self._tasks: set[asyncio.Task[None]] = set()
        self.flags: Flags | None = None
        #: The last failure to write state.json (full disk...): shown in /status, logged once.
        self.state_write_error: str | None = None
        #: Turns of the training loop (each a wake-up: an event, a file change or the poll).
        self.loop_turns = 0
        self.rebooted = False
        self.progress: ProgressTracker | None = (
            ProgressTracker(job.limits, clock=clock, gpu=gpu)
            if job.limits.stall_timeout_s is not None
            else None
        )
        #: NVML health while training (None: no GPU or no driver on this box).
        self.gpu: GpuMonitor | None = gpu
        self.notice: Notice | None = None
        self.watcher: PreemptionWatcher | None = None
        self.box_fault: str | None = None
        self._outcome: Outcome | None = None
        self._budget = BudgetWarner()
        self.reason_hint: Reason | None = None
        self.disk_stop: str | None = None
        self.hung_at_exit = False
        self._exit_code: int | None = None
        #: Set by ``release``: a HELD box goes on to its teardown.
        self._released = asyncio.Event()
        #: What happened, for ``GET /events``, the page and the webhooks (agent/events.py).
        self.events = EventBus(clock=clock)
        self._history_published = 0
        #: Warnings of this run, for the post-mortem report.
        self.warnings: list[str] = []
        self.events.listen(self._note_warning)
        #: "Is this the right box?" (agent/daemon/sizingrun.py).
        self.sizing = SizingWatch(gpu_indices=job_gpu_indices(job), workers=job_workers(job))
        self.sizer: ProcessSampler | None = None
        self.projection: Projection | None = None
        self.profile_result: ProfileResult | None = None
        self._sizing_said: str | None = None
        #: systemd's notify socket (READY, WATCHDOG, STATUS, STOPPING), a no-op without one.
        self.systemd = SdNotify.from_env()
        self.events.listen(self._tell_systemd)
        #: Webhook notices ([notify]), or None (agent/status/notify.py).
        self.notifier: Notifier | None = (
            Notifier(
                job.notify, self.events, secrets=[v for _, v in env.secrets()], job=job.job.name
            )
            if job.notify is not None
            else None
        )

    # ------------------------------------------------------------------ entry

    async def run(self, shutdown_trigger: asyncio.Event | None = None) -> int:
        """Run the job to its end (or until the agent is asked to exit). Returns the exit code."""
        self.flags = Flags(shutdown=shutdown_trigger or asyncio.Event())
        on_preempt = self._sigterm_notice if self.job.preemption.sigterm else None
        signals.install(self.flags, on_preempt=on_preempt)
        try:
            self.store.ensure()
        except OSError as exc:
            raise AgentError(
                f"cannot create the state directory {self.env.state_dir}: {exc.strerror or exc}; "
                "set LIBREYOLO_AGENT_STATE_DIR to a writable folder"
            ) from exc
        try:
            lock = self.store.lock()
        except StateDirLocked as exc:
            raise AgentError(
                f"another agent (pid {exc.holder}) is running on the state directory "
                f"{self.env.state_dir}; stop it first, or use another LIBREYOLO_AGENT_STATE_DIR"
            ) from None
        try:
            if self.fresh_start is not None:
                self.fresh_start()
            file_handler = self.store.log_handler()
        except BaseException:
            os.close(lock)
            signals.remove()
            raise
        # agent.log travels with the checkpoints: no secret may ever be written to it.
        logutil.redact_secrets(self.env.secrets())
        # 1,024 descriptors (a common default) ran out under a flood of idle connections.
        logutil.raise_fd_limit()
        try:
            with logutil.to_file(file_handler):
                try:
                    return await self._run()
                except AgentError:
                    raise
                except Exception as exc:
                    log.exception("agent crashed in phase %s", self.state.phase.value)
                    self._record_crash(exc)
                    raise
        finally:
            self.systemd.stopping(f"phase {self.state.phase.value}")
            self.systemd.close()
            os.close(lock)
            signals.remove()

    def _record_crash(self, exc: BaseException) -> None:
        """Count the crash in state.json, so the next agent can tell a crash loop."""
        self.state.crashes.append(restart.crash_record(self.state, exc, self.clock()))
        self._save()

    async def _run(self) -> int:
        # The Hub client's timeouts, once, for staging, sync and everything else.
        hub.configure(self.env)
        try:
            previous = self.store.load()
        except (ValueError, KeyError, TypeError) as exc:
            raise AgentError(
                f"{self.store.state_path} is unreadable ({type(exc).__name__}: {exc}); the "
                "previous run's state is unknown, so the agent will not guess (it could start "
                "a second trainer): inspect it, then remove it to start the job over"
            ) from exc
        resume_at = self._adopt(previous)
        if resume_at is None:
            return 0
        if self.notifier is not None:
            self._spawn(self.notifier.run(), "notify")
        self.events.publish(
            "job_started",
            job=self.job.job.name,
            phase=resume_at.value,
            restarted=previous is not None,
        )
        if self.start_guard:  # the safety net if this agent dies for good (agent/guard/run.py)
            plan = guardplan.write_plan(
                self.env.state_dir,
                self.job,
                self.state.started_at,
                extended_s=self.state.extended_s,
            )
            self._spawn(
                guardplan.heartbeat_task(self.env.state_dir, plan.heartbeat_every_s), "heartbeat"
            )
            guardplan.ensure_running(self.env.state_dir)
        if self.job.sync is not None:
            sink = self._sink or make_sink(self.job.sync, self.env)
            self.sync = SyncEngine(sink, self.job.sync, state_dir=self.env.state_dir)
            self.sync.uploads.on_outcome = lambda **d: self.events.publish("upload", **d)
            # What a killed agent promised and had not delivered is queued again; its leftover
            # snapshots are reused or removed.
            await self.sync.recover(self.run_dir)
            self._spawn(self.sync.run(), "sync")
        await self._start_server()
        self._save()
        self.systemd.ready(f"phase {self.state.phase.value}")
        if self.systemd.watchdog_interval_s() is not None:
            self._spawn(self.systemd.watchdog_task(lambda: True), "watchdog")
        if self.on_ready:
            self.on_ready(self)
        try:
            return await self._phases(resume_at)
        finally:
            self._stop_doctor()
            await self._shutdown()

    def _adopt(self, previous: RunState | None) -> Phase | None:
        """Decide where to start from what a previous agent left (agent/policy/restart.py); None:
        nothing to do."""
        if previous is None:
            return Phase.PREFLIGHT
        if previous.job_name != self.job.job.name:
            raise AgentError(
                f"the state directory {self.env.state_dir} belongs to job "
                f"{previous.job_name!r}, not {self.job.job.name!r}; use another "
                "LIBREYOLO_AGENT_STATE_DIR or remove its state.json"
            )
        restart.reopen_unconfirmed(previous, self.clock())  # DONE, never confirmed: TEARDOWN
        if previous.phase.terminal:
            log.info(
                "job %s already ended: phase=%s reason=%s; nothing to do "
                "(remove %s to run it again)",
                previous.job_name,
                previous.phase.value,
                previous.reason.value if previous.reason else None,
                self.store.state_path,
            )
            self.state = previous
            return None
        # Carry over what must survive restarts: the job's clock, its history, its trainer.
        was = previous.phase
        self.state = previous
        self._history_published = len(previous.history)  # old phases are not news
        self.state.agent_pid = os.getpid()
        self.state.history.append(
            {"at": self.clock(), "event": "agent restarted", "was": was.value}
        )
        if was != Phase.BOOTING:
            transition(self.state, Phase.BOOTING, note="agent restarted")  # any -> BOOTING
        if previous.boot_id is not None and previous.boot_id != self.state_boot_id:
            # Every pid recorded before a reboot is meaningless (and may be reused).
            self.rebooted = True
            log.warning("the box rebooted since the last agent ran (boot id changed)")
            self.state.history.append({"at": self.clock(), "event": "box rebooted"})
        self.state.boot_id = self.state_boot_id
        if previous.trainer and previous.trainer.run_dir:
            self.run_dir = Path(previous.trainer.run_dir)
        return restart.resume_phase(was, previous)

    # ------------------------------------------------------------------ phases

    async def _phases(self, start: Phase) -> int:
        assert self.flags is not None
        if start == Phase.FAILED:
            self.state.cause = restart.crash_loop_cause(self.state)
            log.error("crash loop: %s", self.state.cause)
            return await self._teardown_phase(Reason.AGENT_FAILED)
        if start == Phase.TEARDOWN:
            assert self.state.reason is not None
            return await self._teardown_phase(self.state.reason, resumed=True)
        if start == Phase.PREFLIGHT:
            staged: asyncio.Task[bool] | None = None
            from agent.daemon import essentials

            # Provider, key and sync target: proven always, preflight on or off.
            if not await essentials.gate(self):
                return await self._teardown_phase(Reason.PREFLIGHT_FAILED)
            if self.job.preflight.enabled:
                transition(self.state, Phase.PREFLIGHT)  # BOOTING -> PREFLIGHT
                self._save()
                # Billed seconds: the dataset (download, data YAML, doctor) is staged while the
                # GPU probe runs, once the disk and the Hub checks have passed.
                may_stage = asyncio.Event()
                staged = asyncio.create_task(self._staging(after=may_stage))
                try:
                    passed = await self._preflight(may_stage)
                finally:
                    if not may_stage.is_set():
                        staged.cancel()
                if not passed:
                    await _abandon(staged)
                    self._stop_doctor()
                    await self._sync_reports()
                    return await self._teardown_phase(Reason.PREFLIGHT_FAILED)
                may_stage.set()
            if self.flags.shutdown.is_set():
                await self._drop_warm()
                if staged is not None:
                    await _abandon(staged)
                return 0
            transition(self.state, Phase.STAGING)  # PREFLIGHT -> STAGING
            self._save()
            crashpoint("staging")
            if not await (staged if staged is not None else self._staging()):
                await self._sync_reports()
                return await self._teardown_phase(Reason.PREFLIGHT_FAILED)
            wrong_box = await self._profile_gate()
            if wrong_box is not None:
                self.state.cause = wrong_box
                log.error("%s", wrong_box)
                await self._sync_reports()
                return await self._teardown_phase(Reason.PREFLIGHT_FAILED)
            if self.flags.shutdown.is_set():
                await self._drop_warm()
                return 0
            if self.flags.stop_job.is_set():
                # Stopped before anything was trained: no trainer to start, nothing to sync.
                self.state.cause = "stop requested before training started"
                return await self._teardown_phase(Reason.STOPPED_BY_USER)
            start = Phase.TRAINING
        if start == Phase.TRAINING:
            transition(self.state, Phase.TRAINING)  # STAGING|BOOTING -> TRAINING
            restart.note_progress(self.state, Phase.TRAINING)
            await self._read_price()
            self._save()
            await self._watch_gpus()
            reason = await self._training()
            await self._drop_warm()  # not launched (already done, or the agent is exiting)
            self._stop_doctor()  # still running after the trainer: its verdict is moot
            if reason is None:
                return 0  # the agent was asked to exit; the trainer goes on
            self.state.reason = reason
            start = Phase.FINISHING
        if start == Phase.FINISHING:
            transition(self.state, Phase.FINISHING)  # TRAINING|BOOTING -> FINISHING
            restart.note_progress(self.state, Phase.FINISHING)
            self._save()
            if not await self._finishing():
                return 0  # state.json still says FINISHING: the next agent carries on
        assert self.state.reason is not None
        return await self._teardown_phase(self.state.reason)

    async def _preflight(self, may_stage: asyncio.Event) -> bool:
        from agent import preflight

        def storage_checked(ok: bool) -> None:
            if ok:
                log.info(
                    "disk and Hub checks passed: the dataset is staged and checked while "
                    "the GPU probe runs"
                )
                may_stage.set()

        warm = None
        if self.job.preflight.warm_start and isinstance(self.launcher, ProcessLauncher):
            from agent.trainer.warmstart import for_job

            warm = for_job(
                self.job,
                self.launcher,
                log_path=self.store.path("trainer.log"),
                result_path=self.store.path("trainer-result.json"),
            )
        cause: str | None = "preflight did not finish"
        try:
            report, cause = await preflight.run_and_log(
                self.job,
                self.env,
                on_storage_checked=storage_checked,
                probe_runner=warm.probe if warm is not None else None,
            )
        finally:
            if warm is not None and cause is None:
                # Passed: the trainer's Python waits for its command line (the launch).
                assert isinstance(self.launcher, ProcessLauncher)
                self.launcher.warm = warm
            elif warm is not None:
                await asyncio.shield(warm.abort())
        self.preflight_report = report.to_dict()
        self.store.write_report("preflight.json", self.preflight_report)
        if cause is not None:
            self.state.cause = cause
        return cause is None

    async def _drop_warm(self) -> None:
        """Call off a warm trainer that will not be launched (the job ends before training)."""
        launcher = self.launcher
        if isinstance(launcher, ProcessLauncher) and launcher.warm is not None:
            warm, launcher.warm = launcher.warm, None
            await warm.abort()

    async def _staging(self, *, after: asyncio.Event | None = None) -> bool:
        assert self.flags is not None
        if after is not None:
            await after.wait()
        stop = (self.flags.shutdown, self.flags.stop_job)
        beside = self._doctor_beside()
        outcome = await staging.stage(
            self.job,
            self.env,
            hook=self.stage_hook,
            stop=stop,
            doctor=False if beside else None,
        )
        if outcome.cause is not None:
            self.state.cause = outcome.cause
        if outcome.report is not None:
            self.staging_report = outcome.report
            self.store.write_report("staging.json", outcome.report)
        if outcome.ok and beside and not any(e.is_set() for e in stop):
            self._queue_doctor(outcome.report)  # agent/daemon/doctor.py: the trainer need not wait
        return outcome.ok

    def _agent_files(self) -> list[Path]:
        return [p for p in (self.store.path(n) for n in AGENT_FILES) if p.exists()]

    async def _finishing(self) -> bool:
        """Final sync of everything, then verification of everything the ledger expects.
        False when the agent was asked to exit meanwhile (a restarted agent finishes it)."""
        assert self.flags is not None
        if self.sync is None or self.job.sync is None:
            log.info("no [sync] target: nothing to upload")
            return True
        if self.run_dir is not None:
            self.status = read_status(self.run_dir) or self.status
        self._save()
        clean = bool(self.state.outcome and self.state.outcome.get("kind") == "completed")
        finished = await self.sync.finish(
            self.run_dir,
            self.status,
            self._agent_files(),
            clean_exit=clean,
            timeout_s=self.job.sync.finish_timeout_s,
            exiting=self.flags.shutdown,
        )
        if not finished:
            return False  # state.json still says FINISHING: the next agent carries on
        self._save()
        return True

    async def _sync_reports(self) -> None:
        """A box that failed before training is usually destroyed at once: get the reason off
        it first (preflight/staging report, agent.log, state.json), within a short wait."""
        if self.sync is None or self.job.sync is None:
            return
        self._save()
        await self.sync.send_reports(self._agent_files())

    async def _teardown_phase(self, reason: Reason, *, resumed: bool = False) -> int:
        await self._drop_warm()
        if not resumed:
            transition(self.state, Phase.TEARDOWN, reason=reason)  # ... -> TEARDOWN
        else:
            transition(self.state, Phase.TEARDOWN, note="resumed")  # BOOTING -> TEARDOWN
        self._save()
        if not await self._held():
            return 0  # the agent exits while HELD; the next agent holds on
        record = self.state.teardown
        resumed = resumed and record is not None and bool(record.get("action"))
        cfg = self.job.teardown
        if resumed and record is not None and record.get("instance_id") and not cfg.instance_id:
            # The instance the first agent identified (Lambda finds itself by IP, and a
            # terminated instance can leave the list).
            cfg = dataclasses.replace(cfg, instance_id=str(record["instance_id"]))
        provider = self.provider_factory(cfg, self.env)
        if not resumed or record is None:
            action, why = self._teardown_action(reason, can_stop=provider.can_stop)
            (log.error if "KEPT" in why else log.info)("teardown decision: %s (%s)", action, why)
            self.events.publish(
                "teardown",
                action=action,
                why=why,
                provider=provider.name,
                downgraded="downgraded" in why or "KEPT" in why,
            )
            self.state.teardown = record = {
                "provider": provider.name,
                "action": action,
                "why": why,
                "started_at": self.clock(),
                "instance_id": await teardown.instance_id(provider),
            }
            self._save(required=True)  # irreversible steps are recorded as started first
        # The story of the run leaves the box before a destroy may end this agent with it.
        await self._send_report(self._write_report())
        if self.notifier is not None:
            await self.notifier.flush(10.0)  # the last word leaves before the box may be gone
        # Done only when the provider confirms: until then the teardown stays open, tried
        # again with backoff for as long as it takes (agent/policy/teardown.py).
        result = await teardown.carry_until_confirmed(
            provider,
            record,
            reason,
            resumed=resumed,
            save=self._save,
            wait=self._teardown_wait,
            on_open=lambda r: self.events.publish(
                "teardown_confirmed", **r.to_dict(), open=True, attempts=record.get("attempts")
            ),
            clock=self.clock,
        )
        if self.box_fault:  # resuming on this box would fail again: a new box is needed
            record["box_fault"] = self.box_fault
        if not result.confirmed:  # the agent was asked to exit: state.json says TEARDOWN
            self._save()
            log.error(
                "exiting with the teardown open (%s): exit %d",
                result.detail,
                teardown.EXIT_TEARDOWN_OPEN,
            )
            return teardown.EXIT_TEARDOWN_OPEN
        self.events.publish("teardown_confirmed", **result.to_dict())
        record["finished_at"] = self.clock()
        transition(self.state, Phase.DONE)  # TEARDOWN -> DONE
        self._save()
        for beat in [t for t in self._tasks if t.get_name() == "heartbeat"]:
            beat.cancel()  # the job ended: its guard exits, and no beat may start another
        paths = self._write_report()  # before anyone can read DONE and look for it
        if record.get("action") != "destroy":
            await self._send_report(paths)  # the box is still there: the final version too
        if self.sync is not None:
            await self.sync.cleanup()
        log.info(
            "job %s done: reason=%s cause=%s", self.job.job.name, reason.value, self.state.cause
        )
        if reason != Reason.COMPLETED:
            self.events.publish("failure", reason=reason.value, cause=self.state.cause)
        self.events.publish("done", reason=reason.value, cause=self.state.cause)
        return 0

    async def _teardown_wait(self, seconds: float) -> bool:
        """The pause between attempts of an open teardown; False when the agent must exit."""
        assert self.flags is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flags.shutdown.wait(), seconds)
        return not self.flags.shutdown.is_set()

    async def _watch_gpus(self) -> None:
        """NVML health and load for the run, where a driver answers (a CPU job: none)."""
        if self.gpu is None and self.job.train.get("device") != "cpu":
            monitor = GpuMonitor()
            if await asyncio.to_thread(lambda: monitor.available):
                self.gpu = monitor
                log.info("watching GPU health through NVML")
            else:
                await asyncio.to_thread(monitor.close)
        if self.progress is not None and self.gpu is not None:
            self.progress = ProgressTracker(self.job.limits, clock=self.clock, gpu=self.gpu)
        self._start_sizing()

    def limits(self) -> LimitsSection:
        """The job's limits, with the provider's real price where the job says ``auto``."""
        return effective_limits(self.job.limits, self.state.price_usd_per_hour)

    async def _read_price(self) -> None:
        if self.job.limits.price_auto and self.state.price_usd_per_hour is None:
            self.state.price_usd_per_hour = await read_price(
                self.preflight_report, lambda: self.provider_factory(self.job.teardown, self.env)
            )

    def _teardown_action(
        self, reason: Reason, *, can_stop: bool = True
    ) -> tuple[TeardownAction, str]:
        verified = bool(
            self.sync and self.sync.verify_result and self.sync.verify_result.sync_verified
        )
        decision = teardown.decide(
            reason,
            self.job.teardown,
            sync_verified=verified,
            anything_to_save=teardown.anything_to_save(self.state, self.run_dir, self.job.job),
            can_stop=can_stop,
        )
        return decision.action, decision.why

    # ------------------------------------------------------------------ plumbing

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s crashed: %r", task.get_name(), task.exception())

    async def _shutdown(self) -> None:
        # 1. Persist where we are, so a restarted agent carries on from here.
        self._save()
        # 2. Give in-flight uploads a short grace, then stop the sync queue.
        if self.sync is not None:
            if self.state.phase not in (Phase.DONE,) and not (
                self.flags and self.flags.force.is_set()
            ):
                await self.sync.drain(5.0)
            await self.sync.close()
        # The last notices (done, failure) go out before the notifier's task is cancelled.
        if self.notifier is not None:
            if not (self.flags and self.flags.force.is_set()):
                await self.notifier.flush(5.0)
            await self.notifier.close()
        # 3. Cancel the remaining long-lived tasks and say how many there were.
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            # A crashed task was already logged by _task_done; it must not fail a finished job.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if tasks:
            log.info("cancelled %d task(s)", len(tasks))
        # The NVML host ends with its pipe; a call stuck in the driver is not waited for.
        if self.gpu is not None:
            with contextlib.suppress(TimeoutError):
                await in_thread(self.gpu.close, 5.0, "nvml-close")
        # 4. The HTTP server goes last, so /status stays answerable as long as possible.
        if self.server is not None:
            await self.server.stop()

    def _tell_systemd(self, event: Event) -> None:
        if event.kind == "phase":
            why = f" ({event.data['reason']})" if event.data.get("reason") else ""
            self.systemd.status(f"phase {event.data['to']}{why}")

    def _publish_phases(self) -> None:
        """Every phase change recorded in the history since the last save, as an event."""
        history = self.state.history
        for entry in history[self._history_published :]:
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
        self._history_published = len(history)

    def _save(self, *, required: bool = False) -> None:
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


async def _abandon(task: asyncio.Task[bool]) -> None:
    """Stop waiting for a staging that is no longer wanted (a failed preflight, an agent
    exiting). A download already running in its thread cannot be interrupted: it ends on its
    own and its result is dropped; staging is idempotent, so a later run reuses or redoes it."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
