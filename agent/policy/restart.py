"""Where a restarted agent carries on, and how it tells a crash loop from a restart.

A restart resumes the phase it was in: TRAINING re-attaches to the live trainer (or, if it is
gone, syncs everything its run wrote), FINISHING finishes, TEARDOWN reads back before it sends
anything again. Only a run that never started a trainer starts over at PREFLIGHT. An agent that
crashed ``MAX_CRASHES`` times with no progress in between does not go round again: the caller
takes the (gated) teardown decision, so a bug never becomes a restart loop that bills.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from agent.state import NOT_CONFIRMED, SPINE, Phase, Reason, RunState, teardown_open

if TYPE_CHECKING:
    from agent.staterecords import CrashRecord

log = logging.getLogger(__name__)

#: This many agent crashes in a row, with no progress between them, is a crash loop.
MAX_CRASHES = 3


def resume_phase(was: Phase, previous: RunState) -> Phase:
    """The phase to carry on in after an agent left ``previous`` in phase ``was``; FAILED means
    a crash loop (take the teardown decision, do not try again)."""
    if len(previous.crashes) >= MAX_CRASHES:
        return Phase.FAILED
    started_trainer = previous.trainer is not None or previous.launch is not None
    if was == Phase.TRAINING or (
        was in (Phase.BOOTING, Phase.PREFLIGHT, Phase.STAGING) and started_trainer
    ):
        return Phase.TRAINING
    if was == Phase.FINISHING:
        return Phase.FINISHING
    if was in (Phase.TEARDOWN, Phase.HELD):
        return Phase.TEARDOWN
    return Phase.PREFLIGHT


def reopen_unconfirmed(previous: RunState, now: float, *, say: bool = True) -> bool:
    """A state.json that says DONE with a teardown never confirmed (written by an older agent,
    which called that final) goes back to TEARDOWN: the box may still bill. True when it did."""
    if previous.phase != Phase.DONE or not teardown_open(previous.teardown):
        return False
    if say:
        log.error(
            "job %s: DONE, but its teardown is %s: reopening it", previous.job_name, NOT_CONFIRMED
        )
    previous.phase = Phase.TEARDOWN  # no transition leaves DONE: this repairs an old record
    previous.reason = previous.reason or Reason.AGENT_FAILED
    previous.history.append({"at": now, "event": "teardown reopened: it was never confirmed"})
    return True


def crash_record(state: RunState, exc: BaseException, now: float) -> CrashRecord:
    """The entry a crashed agent leaves in ``state.crashes``."""
    return {"at": now, "phase": state.phase.value, "error": f"{type(exc).__name__}: {exc}"[:300]}


def crash_loop_cause(state: RunState) -> str:
    last = state.crashes[-1]
    return (
        f"the agent crashed {len(state.crashes)} times in a row "
        f"(last in {last['phase']}: {last['error']}); not restarting into it again"
    )


def note_progress(state: RunState, phase: Phase) -> None:
    """Real progress (a later phase than any crash was in): forget the crashes."""
    if not state.crashes:
        return
    crashed_at = max(SPINE.index(Phase(c["phase"])) for c in state.crashes)
    if phase not in SPINE or SPINE.index(phase) > crashed_at:
        state.crashes.clear()
