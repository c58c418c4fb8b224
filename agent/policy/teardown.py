"""The teardown decision: destroy, stop or keep the box, and why.

The one rule that costs the most when wrong: **every destroy passes the verified-sync gate**.
Destroying the only copy of the checkpoints is the one mistake that cannot be undone, so with
``teardown.require_verified_sync`` a destroy whose sync is not verified becomes a stop (the disk
survives for a few cents an hour). Only a failure before anything was trained - no trainer ever
started, no checkpoint of this job on disk - has nothing to save.

The same for a checkpoint that is on the target and does not load: with
``teardown.require_restore_drill`` a destroy after a restore drill that failed or timed out
(:mod:`agent.sync.restore`: the final ``best.pt``/``last.pt`` fetched back and loaded with
LibreYOLO) becomes a stop. ``on_success = "auto"`` picks stop or destroy from this box's
figures (:mod:`agent.policy.autoteardown`), and its destroy passes both gates.

The rule that costs the most when forgotten: **a teardown is done only when the provider confirms
it** (a read of the instance shows it stopped or gone; for ``command``, its exit status 0), or when
the plan was ``keep`` (or the ``none`` dry run). Until then it stays *open*
(:func:`carry_until_confirmed`): tried again with backoff (:data:`OPEN_FIRST_S` doubling to
:data:`OPEN_MAX_S`), for as long as it takes, reading back before every send (a call the provider
accepted is never sent again: only read back), with the record in state.json saying so
(``open: true``), so a restarted agent, the supervisor or the guard carries on from there.

Timing can be shrunk for tests through ``LIBREYOLO_AGENT_TEARDOWN_TIMING``: comma-separated
``name=seconds`` pairs, each a field of :class:`agent.providers.api.Timing` (``retry_s``,
``confirm_s``, ``backoff_max_s``...) or ``open_first_s`` / ``open_max_s`` (the pause between
attempts of an open teardown).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.config.jobvalues import ConfigError
from agent.config.model import Env, JobSection, TeardownAction, TeardownSection, as_action
from agent.policy.autoteardown import AutoDecision
from agent.providers import Provider, ProviderError, TeardownResult, make_provider
from agent.state import NOT_CONFIRMED, Reason, RunState
from agent.util.backoff import delay_s
from agent.util.crashpoints import crashpoint
from agent.util.text import format_when

if TYPE_CHECKING:
    from agent.providers.api import Timing
    from agent.staterecords import TeardownRecord

log = logging.getLogger(__name__)

#: The first pause before an open teardown is tried again, seconds; doubled (jittered) up to
#: :data:`OPEN_MAX_S`: a provider down for hours is asked every five minutes.
OPEN_FIRST_S = 15.0
OPEN_MAX_S = 300.0
TIMING_ENV = "LIBREYOLO_AGENT_TEARDOWN_TIMING"
_OPEN_KEYS = ("open_first_s", "open_max_s")
#: The agent's exit code when it was made to exit (a signal) with its teardown open: not 0, so
#: systemd (``Restart=on-failure``) and ``libreyolo-agent supervise`` start it again, and the new
#: agent carries the teardown on from state.json (phase TEARDOWN).
EXIT_TEARDOWN_OPEN = 3


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
    restore_failure: str | None = None,
    auto: AutoDecision | None = None,
) -> Decision:
    """What to do with the box once the run ended for ``reason``. ``restore_failure``: the
    restore drill's line when it failed or timed out (:mod:`agent.sync.restore`), None when it
    passed or was skipped; ``auto``: the decision of ``on_success = "auto"`` from this box's
    figures (:mod:`agent.policy.autoteardown`), None while it is not made yet."""
    if reason == Reason.PREFLIGHT_FAILED and not anything_to_save:
        return Decision(
            cfg.on_preflight_failure, "preflight failed: nothing trained, nothing to save"
        )
    if reason == Reason.PREFLIGHT_FAILED:
        action = cfg.on_preflight_failure
        why = f"teardown.on_preflight_failure = {action} (a trainer ran or checkpoints exist)"
    elif reason == Reason.COMPLETED and cfg.on_success == "auto":
        if auto is None:  # a preview before the teardown: the figures are read then
            action = "stop"
            why = (
                "teardown.on_success = auto: stop or destroy, decided at the teardown from "
                "this box's figures (stop until then)"
            )
        else:
            action, why = auto.action, f"teardown.on_success = {auto.why}"
    elif reason == Reason.COMPLETED:
        action = as_action(cfg.on_success)
        why = f"teardown.on_success = {cfg.on_success}"
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
    if action == "destroy" and cfg.require_restore_drill and restore_failure:
        if can_stop:
            return Decision(
                "stop",
                f"destroy downgraded to stop: {restore_failure} (teardown.require_restore_drill)",
            )
        return Decision(
            "keep",
            f"destroy refused and the box KEPT (still billing): {restore_failure}, and provider "
            f"{cfg.provider!r} has no stop; fetch the checkpoints, then destroy it by hand "
            "(teardown.require_restore_drill)",
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
    record: TeardownRecord,
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
        log.info(
            "teardown resumed: %s was decided at %s", action, format_when(record.get("started_at"))
        )
        if record.get("confirmed"):
            return TeardownResult(
                action, bool(record.get("performed")), True, str(record.get("detail", ""))
            )
        if record.get("sent_at"):
            log.info(
                "teardown: %s was sent at %s; reading back only",
                action,
                format_when(record["sent_at"]),
            )
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


# ----------------------------------------------------------------------------- open teardowns


def note_result(record: TeardownRecord, result: TeardownResult) -> None:
    """Copy the provider's answer into the record (what state.json and guard.json keep)."""
    record.update(
        {
            "action": result.action,
            "performed": result.performed,
            "confirmed": result.confirmed,
            "detail": result.detail,
        }
    )


def open_words(record: Mapping[str, Any]) -> str:
    """One line for ``status`` and the notices: ``destroy NOT confirmed: the box may still bill
    (attempt 3; next in 4m)``."""
    tries = record.get("attempts")
    return f"{record.get('action')} {NOT_CONFIRMED}" + (f" (attempt {tries})" if tries else "")


def timing_from_env(
    environ: Mapping[str, str] | None = None,
) -> tuple[Timing | None, tuple[float, float]]:
    """The provider timing and the open teardown's ``(first, max)`` pause from
    ``LIBREYOLO_AGENT_TEARDOWN_TIMING`` (None and the defaults when unset). Raises
    :class:`ConfigError` naming the variable and the bad pair."""
    raw = (os.environ if environ is None else environ).get(TIMING_ENV, "").strip()
    pause = (OPEN_FIRST_S, OPEN_MAX_S)
    if not raw:
        return None, pause
    from dataclasses import fields, replace

    from agent.providers.api import Timing

    known = {f.name for f in fields(Timing)}
    values: dict[str, float] = {}
    for pair in raw.split(","):
        name, _, text = pair.strip().partition("=")
        name = name.strip()
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if name not in known and name not in _OPEN_KEYS:
            raise ConfigError(
                TIMING_ENV, f"{name!r} is not one of {', '.join(sorted(known) + list(_OPEN_KEYS))}"
            )
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(TIMING_ENV, f"{pair.strip()!r}: the seconds must be a number > 0")
        values[name] = value
    first = values.pop("open_first_s", OPEN_FIRST_S)
    cap = values.pop("open_max_s", OPEN_MAX_S)
    return (replace(Timing(), **values) if values else None), (first, max(first, cap))


def make_teardown_provider(cfg: TeardownSection, env: Env | None = None) -> Provider:
    """:func:`agent.providers.make_provider` with the timing of ``LIBREYOLO_AGENT_TEARDOWN_TIMING``
    (what the agent and the guard use)."""
    timing, _ = timing_from_env()
    return make_provider(cfg, env, timing=timing)


def _reads_back(provider: Provider) -> bool:
    """Whether the provider can read its instance back. A command cannot: only running it again
    can finish a failed one."""
    return provider.name != "command"


async def carry_until_confirmed(
    provider: Provider,
    record: TeardownRecord,
    reason: Reason,
    *,
    resumed: bool,
    save: Callable[[], None],
    wait: Callable[[float], Awaitable[bool]],
    on_open: Callable[[TeardownResult], object] | None = None,
    clock: Callable[[], float] = time.time,
) -> TeardownResult:
    """:func:`carry_out` until the provider confirms, however long that takes. After each
    unconfirmed attempt the record says ``open: true``, ``attempts``, ``next_attempt_at`` and the
    result (saved), ``on_open`` hears of it, and ``wait(seconds)`` pauses; it returns False when
    the caller must stop (the agent exits): the unconfirmed result is returned then, the record
    still open, and the next agent (or the guard) carries on."""
    _, (first_s, max_s) = timing_from_env()
    attempt = int(record.get("attempts") or 0)
    while True:
        result = await carry_out(provider, record, reason, resumed=resumed, save=save)
        note_result(record, result)
        if result.confirmed:
            record["open"] = False
            record.pop("next_attempt_at", None)
            return result
        attempt += 1
        if not _reads_back(provider):
            record.pop("sent_at", None)  # nothing to read back: the command runs again
        pause = delay_s(attempt, first_s=first_s, cap_s=max_s)
        record.update({"open": True, "attempts": attempt, "next_attempt_at": clock() + pause})
        log.error(
            "teardown: %s; trying again in %.0fs, reading back first", open_words(record), pause
        )
        save()
        if on_open is not None:
            on_open(result)
        if not await wait(pause):
            return result
        resumed = True
