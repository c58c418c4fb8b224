"""The daemon's parts that answer people: the HTTP endpoint and what it serves (status, logs,
history, events), the steering actions (stop, extend, hold, release) and the HELD phase, the
SIGTERM-as-preemption hook, and the post-mortem report that outlives the box.

A mixin of :class:`agent.daemon.spine.Daemon` (like :mod:`agent.daemon.training`): it uses the
daemon's state, store, sync engine, event bus and flags, and never imports the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.config.model import Env, Job, LimitsSection
from agent.daemon.signals import Flags
from agent.events import Event, EventBus
from agent.guard import plan as guardplan
from agent.policy import steering
from agent.state import Phase, Reason, RunState, StateStore, transition
from agent.status import report
from agent.status.document import StatusInputs, status_document
from agent.status.notify import Notifier
from agent.status.server import StatusServer
from agent.status.views import tail_lines
from agent.sync.engine import SyncEngine
from agent.trainer.process import TrainerProcess
from agent.trainer.rundir import RunStatus, read_metrics
from agent.util.text import os_error
from agent.watch.preemption import Notice, PreemptionWatcher
from agent.watch.progress import ProgressTracker

log = logging.getLogger("agent.daemon")

#: Warnings kept for the post-mortem report.
MAX_WARNINGS = 200


class AgentError(Exception):
    """The agent cannot go on (state directory unusable, job/state mismatch...)."""


class ControlMixin:
    # Provided by the daemon.
    job: Job
    env: Env
    store: StateStore
    clock: Callable[[], float]
    state: RunState
    trainer: TrainerProcess | None
    run_dir: Path | None
    status: RunStatus | None
    sync: SyncEngine | None
    flags: Flags | None
    server: StatusServer | None
    events: EventBus
    notifier: Notifier | None
    watcher: PreemptionWatcher | None
    progress: ProgressTracker | None
    notice: Notice | None
    box_fault: str | None
    rebooted: bool
    disk_stop: str | None
    start_guard: bool
    preflight_report: dict[str, Any] | None
    staging_report: dict[str, Any] | None
    state_write_error: str | None
    breach_message: str | None
    _released: asyncio.Event
    warnings: list[str]

    def _save(self, *, required: bool = False) -> None:
        raise NotImplementedError

    def limits(self) -> LimitsSection:
        raise NotImplementedError

    def _reserve_s(self) -> float:
        raise NotImplementedError

    def _sizing_status(self) -> dict[str, Any]:
        raise NotImplementedError

    def _teardown_action(self, reason: Reason, *, can_stop: bool = True) -> tuple[str, str]:
        raise NotImplementedError

    async def _held(self) -> bool:
        """``hold``: keep the box up (phase HELD, nothing torn down) until ``release`` or the
        hold's own timeout. False when the agent exits meanwhile (state.json says HELD)."""
        assert self.flags is not None
        if not steering.hold_active(self.state, self.clock()):
            return True
        transition(self.state, Phase.HELD, note="held by a person")  # TEARDOWN -> HELD
        self._save()
        while steering.hold_active(self.state, self.clock()):
            left = steering.hold_remaining_s(self.state, self.clock()) or 0.0
            log.info("HELD: the box stays up until release or %.0fs from now", left)
            self._released.clear()
            waiters = [
                asyncio.ensure_future(self._released.wait()),
                asyncio.ensure_future(self.flags.shutdown.wait()),
            ]
            try:
                await asyncio.wait(
                    waiters, timeout=min(max(left, 0.0), 600.0), return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for w in waiters:
                    w.cancel()
            if self.flags.shutdown.is_set():
                return False
        why = "released" if (self.state.hold or {}).get("released_at") else "hold timed out"
        log.info("HELD -> TEARDOWN (%s)", why)
        transition(self.state, Phase.TEARDOWN, note=why)  # HELD -> TEARDOWN
        self._save()
        return True

    async def _request_extend(self, body: str) -> dict[str, Any]:
        seconds = steering.parse_request_duration(body)
        answer = steering.extend(
            self.state,
            seconds,
            now=self.clock(),
            max_runtime_s=self.job.limits.max_runtime_s,
            stopping=self._stopping(),
        )
        self._save()
        self.events.publish("steering", action="extend", seconds=seconds)
        if self.start_guard:  # the guard's hard deadline moves with it
            with contextlib.suppress(OSError):
                guardplan.write_plan(
                    self.env.state_dir,
                    self.job,
                    self.state.started_at,
                    extended_s=self.state.extended_s,
                )
        return answer

    async def _request_hold(self, body: str) -> dict[str, Any]:
        timeout = steering.parse_request_duration(body, default=self.job.teardown.hold_timeout_s)
        answer = steering.hold(self.state, now=self.clock(), timeout_s=timeout)
        self._save()
        self.events.publish("steering", action="hold", seconds=timeout)
        return answer

    async def _request_release(self, body: str) -> dict[str, Any]:
        answer = steering.release(self.state, now=self.clock())
        self._save()
        self.events.publish("steering", action="release")
        self._released.set()
        return answer

    def _sigterm_notice(self) -> None:
        """``[preemption] sigterm = true``: a SIGTERM is the provider reclaiming the box."""
        assert self.flags is not None
        if self.state.phase != Phase.TRAINING or self.trainer is None:
            self.flags.shutdown.set()  # nothing to save yet (or already saving): just exit
            return
        self.notice = Notice(
            "sigterm", "SIGTERM to the agent (declared a preemption)", self.clock()
        )
        self.flags.preempt.set()

    async def _start_server(self) -> None:
        cfg = self.job.server
        self.server = StatusServer(
            cfg.host,
            cfg.port,
            token=self.store.token(),
            status=self.status_dict,
            actions={
                "stop": lambda _body: self._request_stop(),
                "extend": self._request_extend,
                "hold": self._request_hold,
                "release": self._request_release,
            },
            events=self.events,
            logs=self._log_tails,
            history=self._history_rows,
        )
        try:
            port = await self.server.start()
        except OSError as exc:
            raise AgentError(
                f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}; "
                "set [server] listen to a free port"
            ) from exc
        self.state.server = {"host": cfg.host, "port": port}

    def _stopping(self) -> str | None:
        """Why the run is already on its way to a stop (a stop request, a limit, a notice);
        None while it is not."""
        flags = self.flags
        if flags is not None and flags.stop_job.is_set():
            return "a stop was requested"
        if flags is not None and flags.preempt.is_set():
            return "a preemption notice"
        if self.breach_message:
            return self.breach_message
        return None

    async def _request_stop(self) -> dict[str, Any]:
        """``POST /stop``: before or during training, the run stops (the trainer gets SIGINT,
        the final sync runs, then the teardown); in HELD, the hold is released and the teardown
        goes ahead now. Refused (409, with the reason) where it cannot act: a stop already under
        way, the run already ending (FINISHING, TEARDOWN) or ended."""
        assert self.flags is not None
        state, now = self.state, self.clock()
        phase = state.phase
        if phase is Phase.HELD:
            answer = steering.stop_held(state, now=now, teardown=self._teardown_preview())
            self._save()
            self.events.publish("steering", action="stop")
            self._released.set()
            return answer
        held = ""
        if steering.hold_active(state, now) and state.hold is not None:
            held = (
                f"; the box is then HELD until {steering.utc_iso(float(state.hold['until']))} "
                "as asked (`release` lets the teardown go ahead)"
            )
        if phase.terminal:
            raise steering.SteeringError(
                f"nothing to stop: the run has ended ({phase.value})", status=steering.CONFLICT
            )
        if phase is Phase.TEARDOWN:
            raise steering.SteeringError(
                "nothing to stop: the run has ended and its teardown is under way",
                status=steering.CONFLICT,
            )
        if phase is Phase.FINISHING:
            raise steering.SteeringError(
                "nothing to stop: training is over and the final sync runs, then the teardown"
                + (held or " follows on its own"),
                status=steering.CONFLICT,
            )
        if self.flags.shutdown.is_set():
            raise steering.SteeringError(
                "the agent is exiting (state.json keeps the run; the trainer goes on unless "
                "job.stop_trainer_on_exit): send stop again to the next agent",
                status=steering.CONFLICT,
            )
        already = self._stopping()
        if already is not None:
            raise steering.SteeringError(
                f"a stop is already under way ({already}): the final sync, then the teardown"
                + held,
                status=steering.CONFLICT,
            )
        self.flags.stop_job.set()
        state.steering.append({"at": now, "action": "stop", "phase": phase.value})
        self._save()
        self.events.publish("steering", action="stop")
        if phase is Phase.TRAINING:
            message = "stop requested: the trainer gets SIGINT, then the final sync runs"
        else:
            message = (
                f"stop requested in {phase.value}: the run ends before training starts "
                "(nothing is trained), then the teardown"
            )
        return {"ok": True, "action": "stop", "phase": phase.value, "message": message + held}

    def _teardown_preview(self) -> str:
        """What the teardown will do for the run's reason, in a few words (``destroy:
        teardown.on_success = destroy``), for the answer of a stop in HELD."""
        reason = self.state.reason
        if reason is None:
            return "as the job's [teardown] says"
        action, why = self._teardown_action(reason, can_stop=self.job.teardown.can_stop)
        return f"{action}: {why}"

    # ------------------------------------------------------------------ status

    def status_dict(self) -> dict[str, Any]:
        return status_document(
            StatusInputs(
                job=self.job,
                state=self.state,
                status=self.status,
                run_dir=self.run_dir,
                sync=self.sync.status() if self.sync else None,
                last_synced_epoch=self.sync.last_synced_epoch if self.sync else None,
                preflight=self.preflight_report,
                staging=self.staging_report,
                state_write_error=self.state_write_error,
                now=self.clock(),
                limits=self.limits(),
                reserve_s=self._reserve_s(),
                supervision=self._supervision(),
                notify=self.notifier.status() if self.notifier else None,
                sizing=self._sizing_status(),
            )
        )

    def _supervision(self) -> dict[str, Any]:
        return {
            "resumes": self.state.resumes,
            "max_restarts": self.job.limits.max_restarts,
            "rebooted": self.rebooted,
            "preempted": self.state.preempted,
            "preemption": self.watcher.status() if self.watcher else None,
            "box_fault": self.box_fault,
            "stall": self.progress.snapshot() if self.progress else None,
            "disk_stop": self.disk_stop,
        }

    # ------------------------------------------------------------------ what the page reads

    def _log_tails(self, n: int) -> dict[str, list[str]]:
        """GET /logs (runs in a thread): the last n lines of agent.log and trainer.log."""
        return {
            "agent": tail_lines(self.store.path("agent.log"), n),
            "trainer": tail_lines(self.store.path("trainer.log"), n),
        }

    def _history_rows(self) -> list[dict[str, Any]]:
        """GET /history (runs in a thread): the run's metrics.jsonl rows."""
        run_dir = self.run_dir
        return read_metrics(run_dir) if run_dir is not None else []

    def _note_warning(self, event: Event) -> None:
        if event.kind in ("warning", "stall", "failure") and len(self.warnings) < MAX_WARNINGS:
            self.warnings.append(str(event.data.get("message") or event.data.get("cause") or ""))

    # ------------------------------------------------------------------ post-mortem

    def _write_report(self) -> list[Path]:
        """report.json + report.md in the state directory (agent/status/report.py): the story of the
        run, written before the teardown call (a destroy may end this agent) and again at DONE."""
        try:
            doc = report.build(
                self.state,
                self.status_dict(),
                list(self.sync.ledger.entries.values()) if self.sync else [],
                read_metrics(self.run_dir) if self.run_dir else [],
                self.warnings,
            )
            return list(report.write(self.env.state_dir, doc))
        except OSError as exc:
            log.error("post-mortem report not written: %s", os_error(exc, filename=True))
        except Exception:  # the report must never cost the teardown
            log.exception("post-mortem report failed")
        return []

    async def _send_report(self, paths: list[Path]) -> None:
        if self.sync is not None and paths:
            await self.sync.send_reports(paths)
