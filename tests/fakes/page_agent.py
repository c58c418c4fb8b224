"""A run at a chosen moment, served as the agent serves it: the dashboard's tests and
``scripts/page_screenshots.py`` open the page against it without training anything.

Nothing here imitates the document: :class:`Scene` holds a real job (parsed from TOML), a real
``RunState``, a real sync ledger file, a real run directory (status.json, metrics.jsonl shaped as
LibreYOLO writes them), and :meth:`Scene.document` is :func:`agent.status.document.status_document`
over them, with the actions of :func:`agent.daemon.control.available_actions`. The HTTP server is
the real :class:`~agent.status.server.StatusServer`; its POST routes answer as the daemon's
would for a run in that state (a refusal is a 409 with the rule's reason).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil

from agent.config.jobfile import parse_job
from agent.config.model import Job
from agent.daemon.control import available_actions, stop_refusal
from agent.events import EventBus
from agent.policy import steering
from agent.state import Phase, Reason, RunState, TrainerRecord
from agent.status.document import StatusInputs, status_document
from agent.status.server import StatusServer
from agent.sync.ledger import ItemKind, Ledger, LedgerStatus
from agent.trainer.rundir import read_metrics, read_status

Moment = Literal["start", "mid", "held", "done"]
MOMENTS: tuple[Moment, ...] = ("start", "mid", "held", "done")
TOKEN = "page-test-token"
EPOCHS = 40
#: Seconds one epoch of the scene takes (the run's clock is made from it).
EPOCH_S = 95.0


def metrics_row(epoch: int) -> dict[str, Any]:
    """One /history row: metrics.jsonl's as LibreYOLO 1.6 writes it (validated every 2nd
    epoch), with the GPU figures the agent adds."""
    loss = round(9.0 * 0.93**epoch + 1.2, 4)
    row: dict[str, Any] = {
        "epoch": epoch,
        "time": EPOCH_S + (25.0 if epoch == 1 else (epoch % 3) * 1.5),
        "train/loss": loss,
        "validated": epoch % 2 == 0,
        "is_best": epoch % 2 == 0,
        "current_metric": None,
        "current_metric_name": None,
        "train/iou_loss": round(loss * 0.45, 4),
        "train/obj_loss": round(loss * 0.4, 4),
        "train/cls_loss": round(loss * 0.15, 4),
        "lr/group0": 0.01,
        # Merged in by the agent's /history (agent/daemon/control.py), not LibreYOLO's.
        "gpu/util_pct": 86.0 + (epoch % 4) * 2.5,
        "gpu/power_w": 590.0 + (epoch % 3) * 12.0,
        # PyTorch's caching allocator grows over the first epochs, then holds.
        "gpu/memory_used_bytes": float(round((48 + 4 * (1 - 0.7**epoch)) * (1 << 30))),
        "gpu/memory_total_bytes": 150_754_820_096.0,  # one H200
    }
    if row["validated"]:
        m = round(0.62 * (1 - 0.9**epoch), 4)
        row.update(
            {
                "current_metric": m,
                "current_metric_name": "metrics/mAP50-95",
                "best_metric": m,
                "best_epoch": epoch,
                "metrics/mAP50": round(min(0.99, m * 1.45), 4),
                "metrics/mAP50-95": m,
                "metrics/precision": round(min(0.99, m * 1.3), 4),
                "metrics/recall": round(min(0.99, m * 1.2), 4),
            }
        )
    return row


@dataclass
class Scene:
    """One run frozen at ``moment``; :meth:`document` is its /status."""

    job: Job
    state: RunState
    ledger: Ledger
    run_dir: Path
    state_dir: Path
    now: float
    events: EventBus = field(default_factory=EventBus)
    #: The state directory the document names (the token's folder); None: ``state_dir``.
    #: Screenshots show the default one, not a temporary folder.
    shown_state_dir: Path | None = None

    def document(self) -> dict[str, Any]:
        st = read_status(self.run_dir)
        return status_document(
            StatusInputs(
                job=self.job,
                state=self.state,
                status=st,
                run_dir=self.run_dir,
                sync={
                    "target": self.job.sync.target if self.job.sync else None,
                    "uploads_done": sum(
                        e.status is LedgerStatus.VERIFIED for e in self.ledger.entries.values()
                    ),
                    "last_verified_checkpoint": _last(self.ledger),
                    "queue": [],
                    "in_flight": [],
                    "failures": [],
                },
                last_synced_epoch=st.completed_epochs if st and st.completed_epochs else None,
                preflight=None,
                staging=None,
                state_write_error=None,
                now=self.now,
                ledger=list(self.ledger.entries.values()),
                actions=available_actions(
                    self.state,
                    self.now,
                    max_runtime_s=self.job.limits.max_runtime_s,
                    stopping=None,
                    exiting=False,
                ),
                teardown_preview="destroy: teardown.on_success = destroy"
                if self.state.phase is Phase.HELD
                else None,
                token_file=str((self.shown_state_dir or self.state_dir) / "token"),
            )
        )

    def history(self) -> list[dict[str, Any]]:
        return read_metrics(self.run_dir)

    def server(self) -> StatusServer:
        """The real endpoint over this scene; an action the rules refuse answers 409."""

        def action(name: str) -> Any:
            # The daemon's own rules decide (agent/policy/steering.py, control.stop_refusal).
            async def act(body: str) -> dict[str, Any]:
                st, now = self.state, self.now
                if name == "extend":
                    seconds = steering.parse_request_duration(body)
                    return steering.extend(
                        st, seconds, now=now, max_runtime_s=self.job.limits.max_runtime_s
                    )
                if name == "hold":
                    return steering.hold(
                        st, now=now, timeout_s=steering.parse_request_duration(body, default=3600)
                    )
                if name == "release":
                    return steering.release(st, now=now)
                if st.phase is Phase.HELD:
                    return steering.stop_held(st, now=now, teardown="destroy")
                why = stop_refusal(st, now, stopping=None, exiting=False)
                if why:
                    raise steering.SteeringError(why, status=steering.CONFLICT)
                return {"ok": True, "action": "stop", "message": "stop requested"}

            return act

        return StatusServer(
            "127.0.0.1",
            0,
            token=TOKEN,
            status=self.document,
            actions={n: action(n) for n in ("stop", "extend", "hold", "release")},
            events=self.events,
            logs=lambda n: {"agent": ["agent.log line"][-n:], "trainer": []},
            history=self.history,
        )


def make_scene(
    tmp: Path, moment: Moment, *, target: str = "hf://acme/yolox-coco", now: float | None = None
) -> Scene:
    """The run at ``moment``: ``start`` (TRAINING, no epoch done), ``mid`` (epoch 17 of 40, a
    hold that lapses before the end), ``held`` (training stopped, the box HELD) or ``done``."""
    tmp.mkdir(parents=True, exist_ok=True)
    job = parse_job(
        f"""
[job]
name = "yolox-coco"
runs_dir = "{tmp / "runs"}"
[train]
model = "yolox-s"
data = "{tmp / "data"}"
epochs = {EPOCHS}
[sync]
target = "{target}"
[limits]
price_usd_per_hour = 2.49
budget_usd = 150
max_runtime = "20h"
[teardown]
provider = "vast"
on_success = "destroy"
""",
        source="scene",
        base_dir=tmp,
    )
    state_dir = tmp / "state"
    state_dir.mkdir(exist_ok=True)
    run_dir = tmp / "runs" / "yolox-coco"
    (run_dir / "weights").mkdir(parents=True, exist_ok=True)
    epoch = {"start": 0, "mid": 17, "held": 23, "done": EPOCHS}[moment]
    # The page counts from the browser's clock: the scene's "now" is the wall clock's.
    now = time.time() if now is None else now
    t0 = now - (600 + epoch * EPOCH_S + (900 if moment == "held" else 0))
    state = RunState(job_name="yolox-coco", job_source="scene", started_at=t0, updated_at=now)
    state.phase = Phase.TRAINING
    me = psutil.Process()
    state.trainer = TrainerRecord(
        pid=os.getpid(), create_time=me.create_time(), started_at=t0 + 600, argv=["libreyolo"]
    )
    rows = [metrics_row(e) for e in range(1, epoch + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    best = max((r for r in rows if r["validated"]), key=lambda r: r["current_metric"], default=None)
    running = moment in ("start", "mid")
    (run_dir / "status.json").write_text(
        json.dumps(
            {
                "state": "running" if running else ("completed" if moment == "done" else "stopped"),
                "pid": os.getpid(),
                "completed_epochs": epoch,
                "total_epochs": EPOCHS,
                "current_epoch": epoch + 1 if running else epoch,
                "eta_seconds": (EPOCHS - epoch) * EPOCH_S if running else None,
                "best_epoch": best["epoch"] if best else None,
                "best_metric": best["current_metric"] if best else None,
            }
        )
    )
    ledger = Ledger(state_dir / "sync-ledger.json")
    for e in range(1, epoch + 1):
        at = t0 + 600 + e * EPOCH_S - 30  # read back intact before the next epoch ends
        if not (moment == "mid" and e == epoch):
            put(ledger, "weights/last.pt", e, ItemKind.LAST, at)
        if e % 2 == 0:
            put(ledger, "weights/best.pt", e, ItemKind.BEST, at + 1)
        if e % 5 == 0:
            put(ledger, f"weights/epoch_{e}.pt", e, ItemKind.EPOCH, at + 2)
        put(ledger, "metrics.jsonl", e, ItemKind.SMALL, at + 3)
    if moment == "mid":
        # Queued, not verified yet: listed as such.
        ledger.expect(_Promise("weights/last.pt", epoch, ItemKind.LAST, now - 5))
        # Ends before training does (ETA: 23 epochs): the page warns.
        state.hold = {"at": now - 60, "until": now + 1800, "released_at": None}
        state.steering.append({"at": now - 60, "action": "hold", "seconds": 1860.0})
    if moment in ("held", "done"):
        state.reason = Reason.STOPPED_BY_USER if moment == "held" else Reason.COMPLETED
        state.trainer = None
        state.outcome = {
            "kind": "stopped" if moment == "held" else "completed",
            "exit_code": 0,
            "message": "stopped at the end of epoch 23"
            if moment == "held"
            else f"completed {EPOCHS} epochs",
        }
    if moment == "held":
        state.phase = Phase.HELD
        state.hold = {"at": now - 1200, "until": now + 5400, "released_at": None}
        state.steering.append({"at": now - 1200, "action": "hold", "seconds": 6600.0})
    if moment == "done":
        put(ledger, "agent/report.md", epoch, ItemKind.AGENT, now - 30)
        state.phase = Phase.DONE
        state.teardown = {
            "action": "destroy",
            "why": "teardown.on_success = destroy",
            "provider": "vast",
            "performed": True,
            "confirmed": True,
        }
    scene = Scene(job, state, ledger, run_dir, state_dir, now)
    tell(scene.events, moment, epoch)
    return scene


def tell(bus: EventBus, moment: Moment, epoch: int) -> None:
    """The events the page's feed replays: phases, the last epochs and their uploads."""
    bus.publish("phase", **{"from": "STAGING", "to": "TRAINING"})
    for e in range(max(1, epoch - 4), epoch + 1):
        row = metrics_row(e)
        bus.publish(
            "epoch",
            epoch=e,
            total_epochs=EPOCHS,
            loss=row["train/loss"],
            metric=row["current_metric"],
            metric_name=row["current_metric_name"],
        )
        bus.publish("upload", path="weights/last.pt", epoch=e, ok=True)
        bus.publish("upload", path="metrics.jsonl", epoch=e, ok=True)
    if moment == "held":
        bus.publish("steering", action="hold", seconds=6600.0)
        bus.publish("steering", action="stop")
        bus.publish("phase", **{"from": "TRAINING", "to": "FINISHING", "reason": "stopped_by_user"})
        bus.publish("phase", **{"from": "FINISHING", "to": "HELD"})
    if moment == "done":
        bus.publish("phase", **{"from": "TRAINING", "to": "FINISHING", "reason": "completed"})
        bus.publish("phase", **{"from": "FINISHING", "to": "TEARDOWN"})
        bus.publish("teardown", action="destroy", why="teardown.on_success = destroy")
        bus.publish("phase", **{"from": "TEARDOWN", "to": "DONE"})


@dataclass(frozen=True)
class _Promise:
    remote_path: str
    epoch: int | None
    kind: ItemKind
    created_at: float

    @property
    def sha256(self) -> str:
        return hashlib.sha256(f"{self.remote_path}@{self.epoch}".encode()).hexdigest()

    @property
    def size(self) -> int:
        return 0 if self.kind is ItemKind.SMALL else 71_250_000 + (self.epoch or 0) * 1000


def put(ledger: Ledger, remote: str, epoch: int, kind: ItemKind, at: float) -> None:
    """``remote`` queued and verified at ``at``, as the engine records an upload."""
    p = _Promise(remote, epoch, kind, at - 15)
    ledger.expect(p)
    ledger.mark_verified(remote, p.sha256, sha256=p.sha256, size=p.size, at=at, attempts=1)


def _last(ledger: Ledger) -> dict[str, Any] | None:
    e = ledger.last_verified_checkpoint()
    return {"path": e.remote_path, "epoch": e.epoch, "at": e.verified_at} if e else None
