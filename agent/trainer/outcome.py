"""How the trainer ended: its exit code, status.json's ``error`` and its json result, classified.

Every exit gets one :class:`OutcomeKind` (STYLE.md: asked to stop, finished, failed with a known
cause, killed): the relaunch policy, the status document and the post-mortem all read it. The
exit codes are LibreYOLO's (:data:`EXIT_KINDS`); a trainer the agent re-attached to is not its
child, so then status.json is all there is.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.state import Reason
from agent.trainer.rundir import RunStatus

if TYPE_CHECKING:
    from agent.staterecords import OutcomeRecord


class OutcomeKind(StrEnum):
    COMPLETED = "completed"  #: trained all its epochs
    INTERRUPTED = "interrupted"  #: stopped with SIGINT (LibreYOLO's clean stop)
    OOM = "oom"  #: out of memory (CUDA or host)
    RUNTIME = "runtime"  #: any other error while training (exit 1)
    CONFIG = "config"  #: LibreYOLO refused an option (exit 2)
    DATA = "data"  #: the dataset is broken (exit 3)
    MODEL = "model"  #: the model could not be built or loaded (exit 4)
    KILLED = "killed"  #: a signal ended it (SIGKILL, the OOM killer, a stop that escalated)
    LOST = "lost"  #: it is gone and left no status.json to tell how
    #: it ended by itself with NaN/inf losses or weights (exit 0 through NaN, or a crash on NaN)
    DIVERGED = "diverged"


#: LibreYOLO CLI exit codes (1.6.0).
EXIT_KINDS = {
    0: OutcomeKind.COMPLETED,
    1: OutcomeKind.RUNTIME,
    2: OutcomeKind.CONFIG,
    3: OutcomeKind.DATA,
    4: OutcomeKind.MODEL,
    130: OutcomeKind.INTERRUPTED,
}


@dataclass(frozen=True)
class Outcome:
    """How the trainer ended."""

    kind: OutcomeKind
    exit_code: int | None
    message: str

    @property
    def completed(self) -> bool:
        return self.kind == OutcomeKind.COMPLETED

    def reason(self, stop_reason: Reason | None, breach: str | None) -> tuple[Reason, str]:
        """Why the run ended, and the one-line cause: the stop's reason when the agent stopped
        it (a limit's message, or the stop request), else completed or training_failed."""
        if stop_reason is not None:
            return stop_reason, breach or f"stop requested; trainer {self.kind.value}"
        if self.completed:
            return Reason.COMPLETED, self.message
        return Reason.TRAINING_FAILED, f"trainer {self.kind.value}: {self.message}"

    def to_dict(self) -> OutcomeRecord:
        return {"kind": self.kind.value, "exit_code": self.exit_code, "message": self.message}


def read_result(path: Path) -> dict[str, Any] | None:
    """The one JSON object ``json=true`` prints on stdout (the last JSON line, to be safe)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                return doc
    return None


def _is_oom(*texts: str | None) -> bool:
    joined = " ".join(t for t in texts if t).lower()
    return "out of memory" in joined or "outofmemoryerror" in joined


def classify(
    exit_code: int | None,
    status: RunStatus | None,
    result: dict[str, Any] | None,
    *,
    stop_requested: bool = False,
) -> Outcome:
    """Classify an exit with LibreYOLO's exit codes, status.json ``error`` and the json result.

    ``exit_code`` is None when the agent re-attached and is not the trainer's parent; negative
    when a signal killed it (asyncio's convention).
    """
    err_type = status.error_type if status else None
    err_msg = status.error_message if status else None
    res_err = str(result.get("error")) if result and result.get("error") else None
    res_msg = str(result.get("message")) if result and result.get("message") else None
    message = res_msg or (f"{err_type}: {err_msg}" if err_type else "") or ""

    if exit_code is None:
        # Not our child: status.json is all there is.
        if status is None:
            return Outcome(OutcomeKind.LOST, None, "trainer exited and left no status.json")
        if status.state == "completed":
            return Outcome(OutcomeKind.COMPLETED, None, "status.json says completed")
        if err_type == "KeyboardInterrupt":
            return Outcome(OutcomeKind.INTERRUPTED, None, "stopped with SIGINT")
        if status.state == "failed":
            kind = OutcomeKind.OOM if _is_oom(err_type, err_msg) else OutcomeKind.RUNTIME
            return Outcome(kind, None, f"{err_type}: {err_msg}")
        return Outcome(
            OutcomeKind.KILLED,
            None,
            f"trainer died without a word at epoch {status.completed_epochs}"
            " (status.json still says running: killed by a signal or the OOM killer?)",
        )

    if exit_code == 0:
        if status is not None and status.state == "failed":
            return Outcome(OutcomeKind.RUNTIME, 0, message or "status.json says failed")
        return Outcome(OutcomeKind.COMPLETED, 0, "training completed")
    if exit_code == -signal.SIGINT and err_type == "KeyboardInterrupt":
        # A Python trainer that lets KeyboardInterrupt escape dies *by* SIGINT, not with 130.
        return Outcome(OutcomeKind.INTERRUPTED, exit_code, "stopped with SIGINT")
    if exit_code < 0:
        sig = -exit_code
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if stop_requested:
            return Outcome(OutcomeKind.KILLED, exit_code, f"killed by {name} after a stop request")
        hint = " (the kernel OOM killer sends SIGKILL)" if sig == signal.SIGKILL else ""
        return Outcome(OutcomeKind.KILLED, exit_code, f"killed by {name}{hint}")
    if exit_code == 130 or err_type == "KeyboardInterrupt":
        return Outcome(OutcomeKind.INTERRUPTED, exit_code, "stopped with SIGINT")
    if exit_code == 1 and _is_oom(err_type, err_msg, res_err, res_msg):
        return Outcome(OutcomeKind.OOM, 1, message or "CUDA out of memory")
    kind = EXIT_KINDS.get(exit_code, OutcomeKind.RUNTIME)
    suggestion = str(result.get("suggestion")) if result and result.get("suggestion") else ""
    text = message or f"exit code {exit_code}"
    if suggestion:
        text = f"{text} -- {suggestion}"
    return Outcome(kind, exit_code, text)
