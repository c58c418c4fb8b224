"""The daemon's parts that answer people: the HTTP endpoint and what it serves (status, logs,
history, events), the steering actions (stop, extend, hold, release) and the
SIGTERM-as-preemption hook. The HELD phase these actions steer is :mod:`agent.daemon.finish`'s.

One :class:`Control` per run, over the run context: an action changes the state (and saves
it) or sets a flag the phases wait on; it never reaches into a phase.
"""

from __future__ import annotations

import contextlib
from typing import Any

from agent.config.jobvalues import MAX_STEERING_S
from agent.daemon.context import RunContext
from agent.daemon.finish import teardown_action
from agent.daemon.sizingrun import SizingRun
from agent.daemon.training import reserve_s
from agent.events import Event
from agent.guard import plan as guardplan
from agent.policy import steering
from agent.state import Phase, RunState
from agent.status.document import StatusInputs, status_document
from agent.status.server import StatusServer
from agent.status.views import tail_lines
from agent.trainer.rundir import read_metrics
from agent.watch.preemption import Notice


class AgentError(Exception):
    """The agent cannot go on (state directory unusable, job/state mismatch...)."""


class Control:
    """What people can ask of one run, and what it shows them."""

    def __init__(self, ctx: RunContext, sizing: SizingRun) -> None:
        self.ctx = ctx
        self.sizing = sizing
        self.server: StatusServer | None = None
        #: Per epoch, the GPUs as NVML last saw them when the epoch ended (``/history``).
        self.gpu_by_epoch: dict[int, dict[str, float]] = {}
        ctx.events.listen(self._note_gpu)

    async def request_extend(self, body: str) -> dict[str, Any]:
        """``POST /extend``: more time before the deadline (the guard's moves with it)."""
        ctx = self.ctx
        seconds = steering.parse_request_duration(body)
        answer = steering.extend(
            ctx.state,
            seconds,
            now=ctx.clock(),
            max_runtime_s=ctx.job.limits.max_runtime_s,
            stopping=self._stopping(),
        )
        ctx.save()
        ctx.events.publish("steering", action="extend", seconds=seconds)
        if ctx.start_guard:  # the guard's hard deadline moves with it
            with contextlib.suppress(OSError):
                guardplan.write_plan(
                    ctx.env.state_dir,
                    ctx.job,
                    ctx.state.started_at,
                    extended_s=ctx.state.extended_s,
                )
        return answer

    async def request_hold(self, body: str) -> dict[str, Any]:
        """``POST /hold``: keep the box up after the run (phase HELD) until release or timeout."""
        ctx = self.ctx
        timeout = steering.parse_request_duration(body, default=ctx.job.teardown.hold_timeout_s)
        answer = steering.hold(ctx.state, now=ctx.clock(), timeout_s=timeout)
        ctx.save()
        ctx.events.publish("steering", action="hold", seconds=timeout)
        return answer

    async def request_release(self, body: str) -> dict[str, Any]:
        """``POST /release``: a held box goes on to its teardown."""
        ctx = self.ctx
        answer = steering.release(ctx.state, now=ctx.clock())
        ctx.save()
        ctx.events.publish("steering", action="release")
        ctx.flags.release.set()
        return answer

    def sigterm_notice(self) -> None:
        """``[preemption] sigterm = true``: a SIGTERM is the provider reclaiming the box."""
        ctx = self.ctx
        if ctx.state.phase != Phase.TRAINING or ctx.trainer is None:
            ctx.flags.shutdown.set()  # nothing to save yet (or already saving): just exit
            return
        ctx.notice = Notice("sigterm", "SIGTERM to the agent (declared a preemption)", ctx.clock())
        ctx.flags.preempt.set()

    async def start_server(self) -> None:
        """The HTTP endpoint (``[server]``); its port goes into the state for the CLI."""
        ctx = self.ctx
        cfg = ctx.job.server
        self.server = StatusServer(
            cfg.host,
            cfg.port,
            token=ctx.store.token(),
            status=self.status_dict,
            actions={
                "stop": lambda _body: self.request_stop(),
                "extend": self.request_extend,
                "hold": self.request_hold,
                "release": self.request_release,
            },
            events=ctx.events,
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
        ctx.state.server = {"host": cfg.host, "port": port}

    def _stopping(self) -> str | None:
        """Why the run is already on its way to a stop (a stop request, a limit, a notice);
        None while it is not."""
        ctx = self.ctx
        flags = ctx.flags
        if flags.stop_job.is_set():
            return "a stop was requested"
        if flags.preempt.is_set():
            return "a preemption notice"
        if ctx.breach_message:
            return ctx.breach_message
        return None

    async def request_stop(self) -> dict[str, Any]:
        """``POST /stop``: before or during training, the run stops (the trainer gets SIGINT,
        the final sync runs, then the teardown); in HELD, the hold is released and the teardown
        goes ahead now. Refused (409, with the reason) where it cannot act: a stop already under
        way, the run already ending (FINISHING, TEARDOWN) or ended."""
        ctx = self.ctx
        state, now = ctx.state, ctx.clock()
        phase = state.phase
        if phase is Phase.HELD:
            answer = steering.stop_held(state, now=now, teardown=self._teardown_preview())
            ctx.save()
            ctx.events.publish("steering", action="stop")
            ctx.flags.release.set()
            return answer
        refusal = stop_refusal(
            state, now, stopping=self._stopping(), exiting=ctx.flags.shutdown.is_set()
        )
        if refusal is not None:
            raise steering.SteeringError(refusal, status=steering.CONFLICT)
        held = _held_note(state, now)
        ctx.flags.stop_job.set()
        state.steering.append({"at": now, "action": "stop", "phase": phase.value})
        ctx.save()
        ctx.events.publish("steering", action="stop")
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
        ctx = self.ctx
        reason = ctx.state.reason
        if reason is None:
            return "as the job's [teardown] says"
        action, why = teardown_action(ctx, reason, can_stop=ctx.job.teardown.can_stop)
        return f"{action}: {why}"

    # ------------------------------------------------------------------ status

    def status_dict(self) -> dict[str, Any]:
        """The ``/status`` document (agent/status/document.py) of this run, now."""
        ctx = self.ctx
        return status_document(
            StatusInputs(
                job=ctx.job,
                state=ctx.state,
                status=ctx.status,
                run_dir=ctx.run_dir,
                sync=ctx.sync.status() if ctx.sync else None,
                last_synced_epoch=ctx.sync.last_synced_epoch if ctx.sync else None,
                preflight=ctx.preflight_report,
                staging=ctx.staging_report,
                state_write_error=ctx.state_write_error,
                now=ctx.clock(),
                limits=ctx.limits(),
                reserve_s=reserve_s(ctx),
                supervision=self._supervision(),
                notify=ctx.notifier.status() if ctx.notifier else None,
                sizing=self.sizing.status(),
                ledger=list(ctx.sync.ledger.entries.values()) if ctx.sync else (),
                actions=self.actions(),
                # Only while HELD: the decision reads the run directory (anything to save?).
                teardown_preview=self._teardown_preview()
                if ctx.state.phase is Phase.HELD and ctx.state.reason
                else None,
                token_file=str(ctx.store.path("token")),
                hub_endpoint=ctx.env.hf_endpoint,
            )
        )

    def actions(self) -> dict[str, dict[str, Any]]:
        """``actions`` of ``/status``: whether each steering action would be acted on now, and
        why not (the reason a 409 would give), so the page's buttons and the server agree."""
        ctx = self.ctx
        return available_actions(
            ctx.state,
            ctx.clock(),
            max_runtime_s=ctx.job.limits.max_runtime_s,
            stopping=self._stopping(),
            exiting=ctx.flags.shutdown.is_set(),
        )

    def _supervision(self) -> dict[str, Any]:
        ctx = self.ctx
        return {
            "resumes": ctx.state.resumes,
            "max_restarts": ctx.job.limits.max_restarts,
            "rebooted": ctx.rebooted,
            "preempted": ctx.state.preempted,
            "preemption": ctx.watcher.status() if ctx.watcher else None,
            "box_fault": ctx.box_fault,
            "stall": ctx.progress.snapshot() if ctx.progress else None,
            "disk_stop": ctx.disk_stop,
        }

    # ------------------------------------------------------------------ what the page reads

    def _log_tails(self, n: int) -> dict[str, list[str]]:
        """GET /logs (runs in a thread): the last n lines of agent.log and trainer.log."""
        ctx = self.ctx
        return {
            "agent": tail_lines(ctx.store.path("agent.log"), n),
            "trainer": tail_lines(ctx.store.path("trainer.log"), n),
        }

    def _history_rows(self) -> list[dict[str, Any]]:
        """GET /history (runs in a thread): the run's metrics.jsonl rows, each with the GPUs'
        utilisation, power and memory at the epoch's end where NVML gave them (``gpu/util_pct``,
        ``gpu/power_w``, ``gpu/memory_used_bytes``, ``gpu/memory_total_bytes``; this agent's
        epochs only: they are kept in memory)."""
        ctx = self.ctx
        run_dir = ctx.run_dir
        rows = read_metrics(run_dir) if run_dir is not None else []
        gpu = dict(self.gpu_by_epoch)
        return [{**r, **gpu.get(r.get("epoch"), {})} for r in rows]  # type: ignore[arg-type]

    def _note_gpu(self, event: Event) -> None:
        """At each epoch's end, the stall watch's latest NVML sample (no NVML call of its own)."""
        progress = self.ctx.progress
        if event.kind != "epoch" or progress is None:
            return
        epoch = event.data.get("epoch")
        summary = gpu_summary(progress.snapshot().get("gpus") or [])
        if isinstance(epoch, int) and summary:
            self.gpu_by_epoch[epoch] = summary


# ---------------------------------------------------------------------- which actions act now


def _held_note(state: RunState, now: float) -> str:
    """What a stop's answer adds when a hold is set: the box is HELD after the run."""
    if steering.hold_active(state, now) and state.hold is not None:
        return (
            f"; the box is then HELD until {steering.utc_iso(float(state.hold['until']))} "
            "as asked (`release` lets the teardown go ahead)"
        )
    return ""


def stop_refusal(state: RunState, now: float, *, stopping: str | None, exiting: bool) -> str | None:
    """Why ``POST /stop`` is refused (409) in the run's present state; None where it acts.
    HELD acts while the hold holds (:func:`agent.policy.steering.stop_held`)."""
    phase = state.phase
    if phase is Phase.HELD:
        if steering.hold_active(state, now):
            return None
        return "nothing to stop: the hold has ended and the teardown goes ahead"
    if phase.terminal:
        return f"nothing to stop: the run has ended ({phase.value})"
    if phase is Phase.TEARDOWN:
        return "nothing to stop: the run has ended and its teardown is under way"
    if phase is Phase.FINISHING:
        return "nothing to stop: training is over and the final sync runs, then the teardown" + (
            _held_note(state, now) or " follows on its own"
        )
    if exiting:
        return (
            "the agent is exiting (state.json keeps the run; the trainer goes on unless "
            "job.stop_trainer_on_exit): send stop again to the next agent"
        )
    if stopping is not None:
        return (
            f"a stop is already under way ({stopping}): the final sync, then the teardown"
            + _held_note(state, now)
        )
    return None


def available_actions(
    state: RunState,
    now: float,
    *,
    max_runtime_s: float | None,
    stopping: str | None,
    exiting: bool,
) -> dict[str, dict[str, Any]]:
    """For each of stop, extend, hold and release: ``{"ok": True}`` where the agent would act
    on it now, else ``{"ok": False, "reason": ...}`` with the 409's reason. The same rules as
    the requests (:func:`stop_refusal`, :mod:`agent.policy.steering`); what depends on the
    request's duration (an extension past 30 days in all) is left to the answer."""
    phase = state.phase
    extend: str | None = None
    if phase not in steering._EXTENDABLE:
        extend = steering._not_extendable(phase)
    elif stopping is not None:
        extend = f"cannot extend: the run is already stopping ({stopping})"
    elif max_runtime_s is None:
        extend = "nothing to extend: the job has no limits.max_runtime"
    elif state.extended_s >= MAX_STEERING_S:
        extend = "cannot extend: the run's extensions already add up to the 30-day cap"
    hold: str | None = None
    decided = (state.teardown or {}).get("action") if phase is Phase.TEARDOWN else None
    if phase.terminal:
        hold = f"cannot hold: the run has ended ({phase.value}) and its teardown is done"
    elif decided:
        hold = f"cannot hold: the teardown is under way ({decided}, decided already)"
    release = None if steering.hold_active(state, now) else steering._nothing_held(state, now)
    refusals = {
        "stop": stop_refusal(state, now, stopping=stopping, exiting=exiting),
        "extend": extend,
        "hold": hold,
        "release": release,
    }
    return {
        name: {"ok": True} if why is None else {"ok": False, "reason": why}
        for name, why in refusals.items()
    }


def gpu_summary(gpus: list[dict[str, Any]]) -> dict[str, float]:
    """``gpu/util_pct`` (the mean over the GPUs), ``gpu/power_w`` and
    ``gpu/memory_used_bytes``/``gpu/memory_total_bytes`` (their sums) of NVML samples
    (:meth:`agent.gpu.health.GpuSample.as_dict`); a figure NVML did not give is left out.
    """
    out: dict[str, float] = {}
    for key, field, mean in (
        ("gpu/util_pct", "util_pct", True),
        ("gpu/power_w", "power_w", False),
        ("gpu/memory_used_bytes", "memory_used_bytes", False),
        ("gpu/memory_total_bytes", "memory_total_bytes", False),
    ):
        values = [float(g[field]) for g in gpus if isinstance(g.get(field), int | float)]
        if values:
            out[key] = sum(values) / len(values) if mean else sum(values)
    return out
