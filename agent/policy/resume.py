"""Whether a trainer that ended without a clean end is resumed, and from what.

The agent resumes a trainer that died (crash, SIGKILL, the OOM killer, a reboot, a preemption)
from the run's own ``weights/last.pt`` with ``resume=true`` and the original total epochs, in
the same run dir (:func:`agent.trainer.process.build_argv`), at most ``limits.max_restarts`` times
with a doubling backoff. It never resumes:

- a run that completed (status.json says so, or every epoch's weights are written, or LibreYOLO
  refuses a resume from a ``last.pt`` that holds every epoch: :data:`ALREADY_TRAINED`);
- a run the agent stopped itself (a limit, a stop request, a preemption it handled);
- an exit a restart cannot fix: LibreYOLO's config (2), data (3) and model (4) errors;
- a SIGINT it did not send (a person pressed Ctrl-C: that is a stop);
- a box fault (a GPU that threw Xid/ECC errors or fell off the bus): the same box fails again;
- the same failure at the same epoch twice: that is deterministic, retrying only bills.

A reboot is told by the kernel's boot id (kept in state.json): after one, no pid recorded
before it means anything. When ``last.pt`` is missing or not a valid zip archive but the sync
target holds a verified copy, that copy is downloaded first (a box that lost its disk, or a new
box running the same job against the same target).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent.config.model import LimitsSection
from agent.state import Reason
from agent.trainer.outcome import Outcome, OutcomeKind
from agent.trainer.rundir import RunStatus, is_valid_checkpoint
from agent.util.backoff import doubling_s

if TYPE_CHECKING:
    from agent.staterecords import ResumeRecord

log = logging.getLogger(__name__)

#: Tests simulate a reboot by giving the agent another boot id.
BOOT_ID_ENV = "LIBREYOLO_AGENT_BOOT_ID"
_BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
#: The longest wait between two resumes, seconds.
MAX_BACKOFF_S = 600.0
#: Exits a restart cannot fix (LibreYOLO's exit codes 2, 3 and 4).
_NOT_FIXABLE = {OutcomeKind.CONFIG, OutcomeKind.DATA, OutcomeKind.MODEL}
#: Resume kinds that are not the run's failure: they do not count towards ``max_restarts``.
NOT_COUNTED = frozenset({"preempted"})
#: LibreYOLO's (1.6.0) refusal to resume from a ``last.pt`` whose run trained every epoch.
#: LibreYOLO saves an epoch's ``last.pt`` before ``epoch_N.pt``, ``best.pt`` and
#: ``status.json``: a trainer killed in between in its last epoch (a reboot) leaves a
#: ``status.json`` an epoch short, so the agent resumes, and LibreYOLO says there is nothing
#: left to train (exit 2, a config error). Seen under load in tests/test_restart.py.
ALREADY_TRAINED = "so nothing is left to resume"


def boot_id() -> str | None:
    """This boot's id (Linux: a random UUID per boot), or None where there is none."""
    forced = os.environ.get(BOOT_ID_ENV)
    if forced:
        return forced
    try:
        return _BOOT_ID_PATH.read_text(encoding="ascii").strip() or None
    except OSError:
        return None


#: A ``.pt`` is a zip archive: a torn write (SIGKILL in ``torch.save``) fails this check.
valid_checkpoint = is_valid_checkpoint


@dataclass(frozen=True)
class Decision:
    resume: bool
    #: One line for the log, /status and the teardown record.
    why: str
    #: Seconds to wait before relaunching.
    wait_s: float = 0.0
    #: Every epoch's weights are written: the run counts as completed.
    completed: bool = False


def death_record(
    outcome: Outcome, status: RunStatus | None, *, now: float, cause: str | None
) -> ResumeRecord:
    """What a resume remembers of the death it resumes from (state.json ``resumes``).
    ``cause``: ``reboot``, ``stalled``, ``preempted`` when the agent knows better than the exit."""
    return {
        "at": now,
        "epoch": status.completed_epochs if status is not None else 0,
        "kind": cause or outcome.kind.value,
        "message": outcome.message[:300],
    }


class AlreadyDone(Exception):
    """The sync target holds this job's run with every epoch the job asks for: nothing to
    train on this box."""


def new_box_epochs(remote: RunStatus | None, wanted: int | None) -> int | None:
    """The total epochs a new box resumes the sync target's run to: the job's own ``epochs``
    (LibreYOLO trains to the ``epochs`` it is given, whatever the checkpoint's run was started
    for), else the run's. Raises :class:`AlreadyDone` when that run completed, or has trained
    every epoch the job asks for (naming both numbers)."""
    if remote is None:
        return wanted
    done = remote.completed_epochs
    if remote.state == "completed":
        # A resumed run's final status.json counts that invocation's epochs only: the total.
        trained = remote.total_epochs or done
        asks = f"; this job asks for {wanted}" if wanted not in (None, trained) else ""
        raise AlreadyDone(
            f"the sync target already holds this job's completed run ({trained} epochs{asks}); "
            "nothing to train (use another sync.target or job.name to train again)"
        )
    if wanted is not None and done >= wanted:
        raise AlreadyDone(
            f"the sync target's run of this job has already trained {done} epochs and this "
            f"job asks for {wanted}: the job is done, nothing to train (raise train.epochs to "
            "train on, or use another sync.target or job.name to train again)"
        )
    return wanted if wanted is not None else remote.total_epochs


def counted(resumes: list[ResumeRecord]) -> int:
    """Resumes that count towards ``max_restarts`` (a handled preemption does not)."""
    return sum(1 for r in resumes if r.get("kind") not in NOT_COUNTED)


def decide(
    outcome: Outcome,
    status: RunStatus | None,
    *,
    cfg: LimitsSection,
    resumes: list[ResumeRecord],
    stop_reason: Reason | None,
    box_fault: str | None = None,
    cause: str | None = None,
) -> Decision:
    """Resume or not, and why (see the module docstring for the rules). ``cause`` is what the
    agent knows of the death beyond the exit: ``reboot`` (another boot id), ``stalled`` (the
    agent stopped a stalled trainer), ``preempted`` (it stopped it on a notice)."""
    if stop_reason is not None:
        return Decision(False, f"the agent stopped the trainer ({stop_reason.value})")
    if outcome.completed:
        return Decision(False, "training completed")
    epoch = status.completed_epochs if status is not None else 0
    total = status.total_epochs if status is not None else None
    if total and epoch >= total:
        return Decision(
            False,
            f"every epoch's weights are written ({epoch}/{total}); the trainer died after "
            "training, so the run counts as completed",
            completed=True,
        )
    if outcome.kind == OutcomeKind.CONFIG and ALREADY_TRAINED in outcome.message:
        return Decision(
            False,
            "last.pt holds every epoch (the trainer died after saving it, before status.json "
            "said so); the run counts as completed",
            completed=True,
        )
    if cause == "preempted":
        return Decision(True, f"resume after a preemption at epoch {epoch}")
    if box_fault:
        return Decision(False, f"box fault, resuming on this box is pointless: {box_fault}")
    if outcome.kind in _NOT_FIXABLE:
        return Decision(False, f"a restart cannot fix a {outcome.kind.value} error")
    if outcome.kind == OutcomeKind.INTERRUPTED and cause is None:
        return Decision(False, "the trainer was stopped with SIGINT by someone else: a stop")
    done = counted(resumes)
    if done >= cfg.max_restarts:
        return Decision(
            False,
            f"gave up after {done} resume(s) (limits.max_restarts = {cfg.max_restarts})",
        )
    kind = cause or outcome.kind.value
    for earlier in resumes:
        if (
            kind != "reboot"
            and earlier.get("kind") == kind
            and earlier.get("epoch") == epoch
            and earlier.get("message") == outcome.message[:300]
        ):
            return Decision(
                False,
                f"the same failure at the same epoch twice ({kind} at epoch {epoch}: "
                f"{outcome.message[:120]}): deterministic, not retrying",
            )
    wait = doubling_s(done + 1, first_s=cfg.restart_backoff_s, cap_s=MAX_BACKOFF_S)
    return Decision(
        True,
        f"resume {done + 1}/{cfg.max_restarts} after {kind} at epoch {epoch}",
        wait_s=wait,
    )
