"""The teardown decision: destroy, stop or keep the box, and why.

The one rule that costs the most when wrong: **every destroy passes the verified-sync gate**.
Destroying the only copy of the checkpoints is the one mistake that cannot be undone, so with
``teardown.require_verified_sync`` a destroy whose sync is not verified becomes a stop (the disk
survives for a few cents an hour). Only a failure before anything was trained - no trainer ever
started, no checkpoint of this job on disk - has nothing to save.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

from .config import JobSection, TeardownAction, TeardownSection, as_action
from .crashpoints import crashpoint
from .providers import Provider, ProviderError, TeardownResult
from .state import Reason, RunState

log = logging.getLogger("agent.daemon")


@dataclass(frozen=True)
class Decision:
    action: TeardownAction
    #: One line for state.json, /status and the log.
    why: str


def decide(
    reason: Reason,
    cfg: TeardownSection,
    *,
    sync_verified: bool,
    anything_to_save: bool,
    can_stop: bool = True,
) -> Decision:
    """What to do with the box once the run ended for ``reason``."""
    if reason == Reason.PREFLIGHT_FAILED and not anything_to_save:
        return Decision(
            cfg.on_preflight_failure, "preflight failed: nothing trained, nothing to save"
        )
    if reason == Reason.PREFLIGHT_FAILED:
        action = cfg.on_preflight_failure
        why = f"teardown.on_preflight_failure = {action} (a trainer ran or checkpoints exist)"
    elif reason == Reason.COMPLETED:
        action, why = cfg.on_success, f"teardown.on_success = {cfg.on_success}"
    else:
        action, why = cfg.on_failure, f"teardown.on_failure = {cfg.on_failure}"
    if action == "destroy" and cfg.require_verified_sync and not sync_verified:
        if can_stop:
            return Decision(
                "stop",
                "destroy downgraded to stop: checkpoints are not verified off the box "
                "(teardown.require_verified_sync)",
            )
        # This provider cannot stop (Lambda): the only safe thing is to keep the box, loudly.
        return Decision(
            "keep",
            f"destroy refused and the box KEPT (still billing): checkpoints are not verified off "
            f"the box and provider {cfg.provider!r} has no stop; fetch the checkpoints, then "
            "destroy it by hand (teardown.require_verified_sync)",
        )
    if action == "stop" and not can_stop:
        return Decision("keep", f"{why}, but provider {cfg.provider!r} has no stop: box kept")
    return Decision(action, why)


def anything_to_save(state: RunState, run_dir: Path | None, job: JobSection) -> bool:
    """A trainer was started (or about to be), or this job's runs hold a checkpoint."""
    if state.trainer is not None or state.launch is not None:
        return True
    if run_dir is not None and any((run_dir / "weights").glob("*.pt")):
        return True
    try:
        return any(job.runs_dir.glob(f"{glob_escape(job.name)}*/weights/*.pt"))
    except OSError:
        return True  # cannot tell: assume there is


async def carry_out(
    provider: Provider,
    record: dict[str, Any],
    reason: Reason,
    *,
    resumed: bool,
    save: Callable[[], None] | None = None,
) -> TeardownResult:
    """Send ``record["action"]`` to the provider and read it back, keeping the record durable at
    each step: requested (``started_at``, saved by the caller) -> sent (``sent_at``, saved the
    moment the provider accepted) -> confirmed or not (the read-back, the caller saves).

    ``resumed``: a previous agent decided (and maybe sent) it already. The decision stands; a
    record that says "sent" is only read back (never a second destroy); one that never got as
    far asks the provider where things stand before anything is sent."""
    action = as_action(str(record["action"]))
    if resumed:
        log.info("teardown resumed: %s was decided at %s", action, record.get("started_at"))
        if record.get("confirmed"):
            return TeardownResult(
                action, bool(record.get("performed")), True, str(record.get("detail", ""))
            )
        if record.get("sent_at"):
            log.info("teardown: %s was sent at %s; reading back only", action, record["sent_at"])
            return await provider.confirm(action)
        found = await provider.read_back(action)
        if found is not None:
            return found

    def on_sent(detail: str) -> None:
        record["sent_at"] = time.time()
        record["sent"] = detail
        if save is not None:
            save()
        crashpoint("teardown-sent")

    crashpoint("teardown-sending")
    return await provider.teardown(action, reason.value, on_sent=on_sent)


async def instance_id(provider: Provider) -> str | None:
    """This box's id at the provider, for the record (a restart reads back that one)."""
    try:
        return (await provider.identify()).instance_id
    except ProviderError as exc:
        log.warning("teardown: cannot identify this instance: %s", exc)
        return None
