"""The document ``GET /status`` serves (and ``libreyolo-agent status`` prints): one function of
what the daemon knows, so the server imports nothing of the agent and the shape is in one place.
No secret is ever part of it: the state holds none, the sync status names paths and errors only.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.config.model import DEFAULT_HF_ENDPOINT, Job, LimitsSection, SyncSection
from agent.policy.cost import stopped_usd_per_hour
from agent.policy.limits import deadlines
from agent.policy.steering import steering_status
from agent.state import NOT_CONFIRMED, RunState, teardown_open
from agent.sync.ledger import ItemKind, LedgerEntry, LedgerStatus
from agent.trainer.rundir import RunStatus, effective_state, pid_alive, read_metrics
from agent.util.disk import nearest_existing


@dataclass(frozen=True)
class StatusInputs:
    job: Job
    state: RunState
    status: RunStatus | None
    run_dir: Path | None
    sync: dict[str, Any] | None
    last_synced_epoch: int | None
    preflight: dict[str, Any] | None
    staging: dict[str, Any] | None
    state_write_error: str | None
    now: float
    #: The job's limits with the real price where it is ``auto``.
    limits: LimitsSection | None = None
    #: Seconds kept before the deadline for the final sync (agent/policy/limits.py).
    reserve_s: float = 0.0
    #: Resumes, stall watch, GPU faults, preemption: what the supervision knows.
    supervision: dict[str, Any] | None = None
    #: The webhook notifier's counters (no URL), or None without ``[notify]``.
    notify: dict[str, Any] | None = None
    #: "Is this the right box?": the verdict, the projection, the profiler's result.
    sizing: dict[str, Any] | None = None
    #: The sync ledger's entries (agent/sync/ledger.py): the ``checkpoints`` list is made of them.
    ledger: Iterable[LedgerEntry] = ()
    #: Which steering actions the agent would act on now, each ``{"ok": bool, "reason": str}``
    #: (agent/daemon/control.py's rules, the same that answer 409), or None where unknown.
    actions: dict[str, dict[str, Any]] | None = None
    #: What the teardown will do for the run's reason (``destroy: teardown.on_success = destroy``),
    #: shown while HELD; None before the reason is known.
    teardown_preview: str | None = None
    #: Where the control token is (a path, never the token): the page tells people where to look.
    token_file: str | None = None
    #: The Hub the agent uploads to (``HF_ENDPOINT``, :attr:`agent.config.model.Env.hf_endpoint`):
    #: the checkpoints' and the post-mortem's links point there, a mirror or a private Hub too.
    hub_endpoint: str = DEFAULT_HF_ENDPOINT


#: At most this many checkpoints are listed in ``/status`` (newest first); the rest are counted.
MAX_CHECKPOINTS = 50
#: Where the post-mortem lands on the target (the engine stores state files under ``agent/``).
REPORT_REMOTE_PATH = "agent/report.md"
#: Ledger kinds that are checkpoints (``.pt``); logs and small files are not listed.
_CHECKPOINT_KINDS = frozenset({ItemKind.LAST, ItemKind.BEST, ItemKind.EPOCH})


def latest_metrics(run_dir: Path) -> dict[str, Any] | None:
    """The newest row of metrics.jsonl (the full per-epoch history LibreYOLO keeps)."""
    rows = read_metrics(run_dir)
    return rows[-1] if rows else None


def status_document(i: StatusInputs) -> dict[str, Any]:
    st, state, trainer = i.status, i.state, i.state.trainer
    alive = bool(trainer and pid_alive(trainer.pid, trainer.create_time))
    eta = st.eta_seconds if st and st.state == "running" else None
    ledger = list(i.ledger)
    return {
        "job": i.job.job.name,
        "phase": state.phase.value,
        "reason": state.reason.value if state.reason else None,
        "cause": state.cause,
        "epoch": st.completed_epochs if st else None,
        "total_epochs": (st.total_epochs if st and st.total_epochs else i.job.train.epochs),
        "eta_seconds": eta,
        "eta_at": i.now + eta if eta is not None else None,
        # "running" in status.json is only true while the trainer lives (a kill leaves it).
        "training_state": effective_state(st, alive=alive) if st else None,
        "metrics": latest_metrics(i.run_dir) if i.run_dir else None,
        "best_epoch": st.best_epoch if st else None,
        "best_metric": st.best_metric if st else None,
        "run_dir": str(i.run_dir) if i.run_dir else None,
        "trainer": {"pid": trainer.pid, "alive": alive, "started_at": trainer.started_at}
        if trainer
        else None,
        "outcome": state.outcome,
        "last_synced_epoch": i.last_synced_epoch,
        "sync": i.sync,
        # Milestones deferred near the target's commit limit (agent/sync/commits.py).
        "sync_cadence": (i.sync or {}).get("cadence"),
        "preflight": i.preflight,
        "staging": i.staging,
        "limits": deadlines(
            i.limits or i.job.limits,
            job_started_at=state.started_at,
            extended_s=state.extended_s,
            reserve_s=i.reserve_s,
        ),
        "supervision": i.supervision,
        "notify": i.notify,
        "sizing": i.sizing,
        **checkpoint_list(ledger, i.job.sync, hub_endpoint=i.hub_endpoint),
        "post_mortem": post_mortem(ledger, i.job.sync, hub_endpoint=i.hub_endpoint),
        "actions": i.actions,
        "teardown_preview": i.teardown_preview,
        "token_file": i.token_file,
        # What the teardown will do, before it is decided (then ``teardown`` has the record).
        "teardown_plan": {
            "provider": i.job.teardown.provider,
            "on_success": i.job.teardown.on_success,
            "on_failure": i.job.teardown.on_failure,
            "require_verified_sync": i.job.teardown.require_verified_sync,
            "require_restore_drill": i.job.teardown.require_restore_drill,
            "expected_gap_s": i.job.teardown.expected_gap_s,
        },
        "now": i.now,
        "steering": steering_status(state, i.now),
        "money": money(i, eta),
        "teardown": state.teardown,
        # A teardown decided and not confirmed by the provider: the box may still bill.
        "teardown_open": teardown_open(state.teardown),
        "teardown_warning": NOT_CONFIRMED if teardown_open(state.teardown) else None,
        "started_at": state.started_at,
        "updated_at": state.updated_at,
        "agent_pid": state.agent_pid,
        "state_write_error": i.state_write_error,
    }


def money(i: StatusInputs, eta_s: float | None) -> dict[str, Any]:
    """Spent so far at the job's price (from the job's first boot), projected to the end of
    training, and what the box would cost per hour once stopped (disk only: allocated GB x
    storage price / 720, the figure ``libreyolo-agent cost`` uses; ``stopped_rate_source``
    says whether the disk is the provider's own figure or an estimate). None where unknown."""
    lim = i.limits or i.job.limits
    price = lim.price_usd_per_hour
    elapsed_h = max(0.0, i.now - i.state.started_at) / 3600.0
    spent = projected = None
    if price is not None:
        spent = price * elapsed_h
        projected = spent + price * (eta_s or 0.0) / 3600.0
    # The stopped rate from the provider's own disk figures where it gives them (Vast's
    # disk_space and storage_cost, read by preflight), else an estimate: this filesystem's size.
    disk_gb, storage = provider_disk(i.preflight)
    storage = storage if storage is not None else lim.storage_usd_per_gb_month
    source = "provider" if disk_gb is not None else "estimate"
    stopped = None
    if storage is not None and disk_gb is None:
        try:
            disk_gb = shutil.disk_usage(nearest_existing(i.job.job.runs_dir)).total / 1e9
        except OSError:
            disk_gb = None
    if storage is not None and disk_gb is not None:
        stopped = stopped_usd_per_hour(disk_gb, storage)
    return {
        "price_usd_per_hour": price,
        "price_from_provider": lim.price_auto,
        "spent_usd": spent,
        "projected_usd": projected,
        "budget_usd": lim.budget_usd,
        "stopped_usd_per_hour": stopped,
        "stopped_rate_source": source if stopped is not None else None,
    }


def provider_disk(preflight: dict[str, Any] | None) -> tuple[float | None, float | None]:
    """``(disk GB, storage USD per GB-month)`` as the provider reported them at preflight (the
    ``provider.*`` check's details), each None where it did not."""
    for check in (preflight or {}).get("checks") or ():
        if str(check.get("name", "")).startswith("provider."):
            details = check.get("details") or {}
            disk, storage = details.get("disk_gb"), details.get("storage_usd_per_gb_month")
            return (
                float(disk) if isinstance(disk, int | float) else None,
                float(storage) if isinstance(storage, int | float) else None,
            )
    return None, None


def target_location(
    sync: SyncSection | None, remote_path: str, *, hub_endpoint: str = DEFAULT_HF_ENDPOINT
) -> str | None:
    """Where ``remote_path`` is on the target, as a person opens it: the page of the file on
    the Hub the sink uploads to (``<hub_endpoint>/<repo>/blob/main/<path>``, the sink writes to
    ``main``) or the file's path in the ``file://`` folder. None without a target."""
    if sync is None:
        return None
    if sync.scheme == "hf":
        return f"{hub_endpoint.rstrip('/')}/{sync.location}/blob/main/{remote_path}"
    return str(Path(sync.location) / remote_path)


def checkpoint_list(
    entries: Iterable[LedgerEntry],
    sync: SyncSection | None,
    limit: int = MAX_CHECKPOINTS,
    *,
    hub_endpoint: str = DEFAULT_HF_ENDPOINT,
) -> dict[str, Any]:
    """``checkpoints``: the ``.pt`` files of the ledger, newest first (verified time, else
    queued time), at most ``limit``, each with its place on the target, size, sha256 prefix and
    verified time; ``checkpoints_more``: how many more the ledger has. Kept small: /status is
    polled every few seconds and a long run keeps hundreds of ``epoch_N.pt``."""
    pts = [e for e in entries if e.kind in _CHECKPOINT_KINDS]
    pts.sort(key=lambda e: (e.verified_at or e.queued_at, e.remote_path), reverse=True)
    return {
        "checkpoints": [
            {
                "path": e.remote_path,
                "location": target_location(sync, e.remote_path, hub_endpoint=hub_endpoint),
                "epoch": e.epoch,
                "kind": e.kind.value,
                "size": e.size,
                "sha256": e.sha256[:12],
                "status": e.status.value,
                "verified_at": e.verified_at if e.status is LedgerStatus.VERIFIED else None,
            }
            for e in pts[:limit]
        ],
        "checkpoints_more": max(0, len(pts) - limit),
    }


def post_mortem(
    entries: Iterable[LedgerEntry],
    sync: SyncSection | None,
    *,
    hub_endpoint: str = DEFAULT_HF_ENDPOINT,
) -> dict[str, Any] | None:
    """Where ``report.md`` is (or will be) on the target, and whether it was verified there:
    the link a person follows once the agent has gone. None without a target."""
    location = target_location(sync, REPORT_REMOTE_PATH, hub_endpoint=hub_endpoint)
    if location is None:
        return None
    entry = next((e for e in entries if e.remote_path == REPORT_REMOTE_PATH), None)
    return {
        "location": location,
        "verified": entry is not None and entry.status is LedgerStatus.VERIFIED,
    }
