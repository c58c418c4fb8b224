"""The end of a run: FINISHING (the final sync and its verification), TEARDOWN (the gated
decision, carried out until the provider confirms it), HELD (a person keeps the box up), and the
post-mortem report that outlives the box.

One :class:`Ending` per run, over the run context; each phase returns its result (whether the
final sync finished, the agent's exit code).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.config.model import TeardownAction
from agent.daemon.context import RunContext
from agent.daemon.prepare import drop_warm
from agent.events import Event
from agent.policy import autoteardown, steering, teardown
from agent.policy.autoteardown import AutoDecision
from agent.providers import Provider, ProviderError
from agent.state import Phase, Reason, transition
from agent.status import report
from agent.status.document import provider_disk
from agent.sync import restore
from agent.sync.restore import RestoreDrill
from agent.trainer.rundir import read_metrics, read_status
from agent.util.text import os_error

log = logging.getLogger(__name__)

#: Warnings kept for the post-mortem report.
MAX_WARNINGS = 200


def teardown_action(
    ctx: RunContext,
    reason: Reason,
    *,
    can_stop: bool = True,
    drill: RestoreDrill | None = None,
    auto: AutoDecision | None = None,
) -> tuple[TeardownAction, str]:
    """What the teardown does for ``reason`` (:func:`agent.policy.teardown.decide`), and why."""
    verified = bool(ctx.sync and ctx.sync.verify_result and ctx.sync.verify_result.sync_verified)
    decision = teardown.decide(
        reason,
        ctx.job.teardown,
        sync_verified=verified,
        anything_to_save=teardown.anything_to_save(ctx.state, ctx.run_dir, ctx.job.job),
        can_stop=can_stop,
        restore_failure=drill.why if drill is not None and drill.blocks_destroy else None,
        auto=auto,
    )
    return decision.action, decision.why


async def restore_drill(ctx: RunContext) -> RestoreDrill:
    """The restore drill of the run's final checkpoints (agent/sync/restore.py), or why not."""
    cfg = ctx.job.teardown
    if not cfg.require_restore_drill:
        return restore.skipped("teardown.require_restore_drill = false", ctx.clock())
    if ctx.sync is None:
        return restore.skipped("no [sync] target", ctx.clock())
    return await restore.run_drill(
        ctx.sync.sink,
        ctx.env.state_dir / "scratch",
        timeout_s=cfg.restore_drill_timeout_s,
        now=ctx.clock,
    )


async def auto_decision(ctx: RunContext, provider: Provider) -> AutoDecision:
    """``on_success = "auto"``: this box's figures (agent/policy/autoteardown.py) and the
    decision they give for ``teardown.expected_gap``."""
    cfg = ctx.job.teardown
    disk_gb = storage = None
    try:
        ident = await provider.identify()
        disk_gb, storage = ident.disk_gb, ident.storage_usd_per_gb_month
    except ProviderError as exc:
        log.warning("auto teardown: the provider does not say its disk: %s", exc)
    if disk_gb is None:
        disk_gb, storage_then = provider_disk(ctx.preflight_report)
        storage = storage if storage is not None else storage_then
    storage_source = "provider" if storage is not None else None
    if storage is None and ctx.job.limits.storage_usd_per_gb_month is not None:
        storage, storage_source = ctx.job.limits.storage_usd_per_gb_month, "job"
    price = ctx.state.price_usd_per_hour
    if price is None:
        price = ctx.job.limits.price_usd_per_hour
    decision = autoteardown.decide_auto(
        autoteardown.AutoInputs(
            gap_s=cfg.expected_gap_s or 0.0,
            setup_s=autoteardown.setup_seconds(ctx.state),
            price_usd_per_hour=price,
            data_gb=autoteardown.staged_gb(ctx.staging_report),
            disk_gb=disk_gb,
            storage_usd_per_gb_month=storage,
            disk_source="provider" if disk_gb is not None else None,
            storage_source=storage_source,
            can_stop=provider.can_stop,
        )
    )
    log.info("teardown %s", decision.why)
    log.warning("teardown auto: %s", decision.warning)
    return decision


class Ending:
    """FINISHING, TEARDOWN and HELD of one run, and its post-mortem report."""

    def __init__(self, ctx: RunContext, status_doc: Callable[[], dict[str, Any]]) -> None:
        self.ctx = ctx
        #: The ``/status`` document (the report holds it as the run ended).
        self.status_doc = status_doc
        #: Warnings of this run, for the post-mortem report.
        self.warnings: list[str] = []
        ctx.events.listen(self._note_warning)

    # ------------------------------------------------------------------ FINISHING

    async def finishing(self) -> bool:
        """Final sync of everything, then verification of everything the ledger expects.
        False when the agent was asked to exit meanwhile (a restarted agent finishes it)."""
        ctx = self.ctx
        if ctx.sync is None or ctx.job.sync is None:
            log.info("no [sync] target: nothing to upload")
            return True
        if ctx.run_dir is not None:
            ctx.status = read_status(ctx.run_dir) or ctx.status
        ctx.save()
        clean = bool(ctx.state.outcome and ctx.state.outcome.get("kind") == "completed")
        finished = await ctx.sync.finish(
            ctx.run_dir,
            ctx.status,
            ctx.agent_files(),
            clean_exit=clean,
            timeout_s=ctx.job.sync.finish_timeout_s,
            exiting=ctx.flags.shutdown,
        )
        if not finished:
            return False  # state.json still says FINISHING: the next agent carries on
        ctx.save()
        return True

    # ------------------------------------------------------------------ TEARDOWN

    async def teardown(self, reason: Reason, *, resumed: bool = False) -> int:
        """Decide (gated by the verified sync), record, and carry out the teardown until the
        provider confirms it; returns the agent's exit code."""
        ctx = self.ctx
        await drop_warm(ctx)
        if not resumed:
            transition(ctx.state, Phase.TEARDOWN, reason=reason)  # ... -> TEARDOWN
        else:
            transition(ctx.state, Phase.TEARDOWN, note="resumed")  # BOOTING -> TEARDOWN
        ctx.save()
        if not await self.held():
            return 0  # the agent exits while HELD; the next agent holds on
        record = ctx.state.teardown
        resumed = resumed and record is not None and bool(record.get("action"))
        cfg = ctx.job.teardown
        if resumed and record is not None and record.get("instance_id") and not cfg.instance_id:
            # The instance the first agent identified (Lambda finds itself by IP, and a
            # terminated instance can leave the list).
            cfg = dataclasses.replace(cfg, instance_id=str(record["instance_id"]))
        provider = ctx.provider_factory(cfg, ctx.env)
        if not resumed or record is None:
            auto = None
            if reason == Reason.COMPLETED and cfg.on_success == "auto":
                auto = await auto_decision(ctx, provider)
            action, why = teardown_action(ctx, reason, can_stop=provider.can_stop, auto=auto)
            # The drill can only turn a destroy into a stop: a box that keeps its disk does
            # not pay for it.
            drill = (
                await self._drill_unless_exiting()
                if action == "destroy"
                else restore.skipped(f"the teardown is {action}, not a destroy", ctx.clock())
            )
            if drill is None:  # asked to exit: the next agent decides and drills
                return 0
            action, why = teardown_action(
                ctx, reason, can_stop=provider.can_stop, drill=drill, auto=auto
            )
            (log.error if "KEPT" in why else log.info)("teardown decision: %s (%s)", action, why)
            ctx.events.publish(
                "teardown",
                action=action,
                why=why,
                provider=provider.name,
                downgraded="downgraded" in why or "KEPT" in why,
            )
            ctx.state.teardown = record = {
                "provider": provider.name,
                "action": action,
                "why": why,
                "started_at": ctx.clock(),
                "instance_id": await teardown.instance_id(provider),
                "restore_drill": drill.to_dict(),
            }
            if auto is not None:
                record["auto"] = auto.to_dict()
            ctx.save(required=True)  # irreversible steps are recorded as started first
        # The story of the run leaves the box before a destroy may end this agent with it.
        await self._send_report(self._write_report())
        if ctx.notifier is not None:
            await ctx.notifier.flush(10.0)  # the last word leaves before the box may be gone
        # Done only when the provider confirms: until then the teardown stays open, tried
        # again with backoff for as long as it takes (agent/policy/teardown.py).
        result = await teardown.carry_until_confirmed(
            provider,
            record,
            reason,
            resumed=resumed,
            save=ctx.save,
            wait=self._teardown_wait,
            on_open=lambda r: ctx.events.publish(
                "teardown_confirmed", **r.to_dict(), open=True, attempts=record.get("attempts")
            ),
            clock=ctx.clock,
        )
        if ctx.box_fault:  # resuming on this box would fail again: a new box is needed
            record["box_fault"] = ctx.box_fault
        if not result.confirmed:  # the agent was asked to exit: state.json says TEARDOWN
            ctx.save()
            log.error(
                "exiting with the teardown open (%s): exit %d",
                result.detail,
                teardown.EXIT_TEARDOWN_OPEN,
            )
            return teardown.EXIT_TEARDOWN_OPEN
        ctx.events.publish("teardown_confirmed", **result.to_dict())
        record["finished_at"] = ctx.clock()
        transition(ctx.state, Phase.DONE)  # TEARDOWN -> DONE
        ctx.save()
        for beat in [t for t in ctx.tasks if t.get_name() == "heartbeat"]:
            beat.cancel()  # the job ended: its guard exits, and no beat may start another
        paths = self._write_report()  # before anyone can read DONE and look for it
        if record.get("action") != "destroy":
            await self._send_report(paths)  # the box is still there: the final version too
        if ctx.sync is not None:
            await ctx.sync.cleanup()
        log.info("job %s done: reason=%s cause=%s", ctx.job.job.name, reason.value, ctx.state.cause)
        if reason != Reason.COMPLETED:
            ctx.events.publish("failure", reason=reason.value, cause=ctx.state.cause)
        ctx.events.publish("done", reason=reason.value, cause=ctx.state.cause)
        return 0

    async def _drill_unless_exiting(self) -> RestoreDrill | None:
        """:func:`restore_drill`, or None when the agent is asked to exit meanwhile (the child
        is killed; state.json says TEARDOWN with nothing decided)."""
        shutdown = self.ctx.flags.shutdown
        drill = asyncio.ensure_future(restore_drill(self.ctx))
        exiting = asyncio.ensure_future(shutdown.wait())
        try:
            await asyncio.wait([drill, exiting], return_when=asyncio.FIRST_COMPLETED)
        finally:
            exiting.cancel()
            if not drill.done():
                drill.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drill
        if drill.cancelled():
            return None
        return drill.result()

    async def _teardown_wait(self, seconds: float) -> bool:
        """The pause between attempts of an open teardown; False when the agent must exit."""
        shutdown = self.ctx.flags.shutdown
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(shutdown.wait(), seconds)
        return not shutdown.is_set()

    # ------------------------------------------------------------------ HELD

    async def held(self) -> bool:
        """``hold``: keep the box up (phase HELD, nothing torn down) until ``release`` or the
        hold's own timeout. False when the agent exits meanwhile (state.json says HELD)."""
        ctx = self.ctx
        flags = ctx.flags
        if not steering.hold_active(ctx.state, ctx.clock()):
            return True
        transition(ctx.state, Phase.HELD, note="held by a person")  # TEARDOWN -> HELD
        ctx.save()
        while steering.hold_active(ctx.state, ctx.clock()):
            left = steering.hold_remaining_s(ctx.state, ctx.clock()) or 0.0
            log.info("HELD: the box stays up until release or %.0fs from now", left)
            flags.release.clear()
            waiters = [
                asyncio.ensure_future(flags.release.wait()),
                asyncio.ensure_future(flags.shutdown.wait()),
            ]
            try:
                await asyncio.wait(
                    waiters, timeout=min(max(left, 0.0), 600.0), return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for w in waiters:
                    w.cancel()
            if flags.shutdown.is_set():
                return False
        why = "released" if (ctx.state.hold or {}).get("released_at") else "hold timed out"
        # transition() logs the change ("phase HELD -> TEARDOWN (released)"): not twice.
        transition(ctx.state, Phase.TEARDOWN, note=why)  # HELD -> TEARDOWN
        ctx.save()
        return True

    # ------------------------------------------------------------------ post-mortem

    def _note_warning(self, event: Event) -> None:
        if event.kind in ("warning", "stall", "failure") and len(self.warnings) < MAX_WARNINGS:
            self.warnings.append(str(event.data.get("message") or event.data.get("cause") or ""))

    def _write_report(self) -> list[Path]:
        """report.json + report.md in the state directory (agent/status/report.py): the story of
        the run, written before the teardown call (a destroy may end this agent) and at DONE."""
        ctx = self.ctx
        try:
            doc = report.build(
                ctx.state,
                self.status_doc(),
                list(ctx.sync.ledger.entries.values()) if ctx.sync else [],
                read_metrics(ctx.run_dir) if ctx.run_dir else [],
                self.warnings,
            )
            return list(report.write(ctx.env.state_dir, doc))
        except OSError as exc:
            log.error("post-mortem report not written: %s", os_error(exc, filename=True))
        except Exception:  # the report must never cost the teardown
            log.exception("post-mortem report failed")
        return []

    async def _send_report(self, paths: list[Path]) -> None:
        if self.ctx.sync is not None and paths and self.ctx.reports_can_leave():
            await self.ctx.sync.send_reports(paths)
