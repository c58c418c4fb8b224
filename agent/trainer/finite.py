"""Is a run's arithmetic still finite? Its losses in ``metrics.jsonl``, and its checkpoints'
tensors, looked at in a child process (:mod:`agent.trainer.finite_entry`).

LibreYOLO 1.6.0 shows a diverged run two ways (docs: the tiny dataset, ``warmup_epochs=0``):
``yolo9-t`` at ``lr0=1e5`` trains on with ``null`` losses in ``metrics.jsonl`` and NaN weights
and exits 0; ``yolox-n`` at ``lr0=10`` crashes at the first NaN, exit 1 with "all elements of
input should be between 0 and 1" (a BCE fed NaN). And a checkpoint can hold inf tensors while
its epoch's losses are still finite: losses alone never prove a checkpoint good, so a
checkpoint counts as good only once its own tensors were read.

The agent process never imports torch (memory, start time): :func:`check_weights` starts
``python -m agent.trainer.finite_entry CHECKPOINT`` and reads its one JSON line. What that costs
(interpreter, ``import torch``, the mapped load, the scan) is measured per call
(:attr:`WeightsCheck.seconds`); ``bench/finite_check.py`` prints it.
"""

from __future__ import annotations

import json
import math
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.util.procs import run_check_child

#: Seconds one weights check may take (interpreter, ``import torch``, load, scan) before the
#: child is killed and the check counts as "cannot tell". Generous: a loaded 2-core box takes
#: ~5 s for a 35 MB checkpoint; a multi-GB one on a slow disk much longer.
CHECK_TIMEOUT_S = 600.0

#: Error messages of a trainer that died of NaN rather than of a bug: torch's BCE fed NaN
#: (``yolox`` in LibreYOLO 1.6.0), and the anomaly/assert wording other models use.
NAN_CRASH_MARKERS = (
    "all elements of input should be between 0 and 1",
    "nan or inf",
    "non-finite",
    "returned nan",
    "loss is nan",
)


def _finite(value: Any) -> bool:
    """A JSON loss value that is a real number (``null``, ``NaN``, ``Infinity`` and the
    strings ``"nan"``/``"inf"`` are not)."""
    if isinstance(value, bool):
        return True
    if isinstance(value, int | float):
        return math.isfinite(value)
    if isinstance(value, str):
        try:
            return math.isfinite(float(value))
        except ValueError:
            return True  # not a number at all: not a loss value we can judge
    return value is not None


def is_loss_key(key: str) -> bool:
    """``train/loss``, ``train/box_loss``, ``val/loss``... (not ``lr/*`` or the metrics)."""
    return key.rpartition("/")[2].endswith("loss") or key.endswith("_loss")


def loss_problem(row: dict[str, Any]) -> str | None:
    """What is not finite among one metrics row's losses (``train/loss = null``), or None."""
    bad = [f"{k} = {json.dumps(v)}" for k, v in row.items() if is_loss_key(k) and not _finite(v)]
    return ", ".join(bad) if bad else None


def row_epoch(row: dict[str, Any]) -> int | None:
    epoch = row.get("epoch")
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


@dataclass(frozen=True)
class LossVerdict:
    """What :func:`scan_losses` found in the rows it was given."""

    #: The newest epoch whose row was read and whose losses (and every earlier row's) are
    #: finite; None when no such row.
    finite_through: int | None
    #: The first epoch whose losses are not finite, and which ones; None when all are.
    bad_epoch: int | None = None
    problem: str | None = None


def scan_losses(rows: Iterable[dict[str, Any]]) -> LossVerdict:
    """Read ``metrics.jsonl`` rows oldest first: the epochs whose losses are all finite, and the
    first that is not (a resumed run appends its rows: the file holds every epoch once)."""
    finite_through: int | None = None
    for row in rows:
        epoch = row_epoch(row)
        if epoch is None:
            continue
        problem = loss_problem(row)
        if problem is not None:
            return LossVerdict(finite_through, epoch, problem)
        finite_through = epoch if finite_through is None else max(finite_through, epoch)
    return LossVerdict(finite_through)


@dataclass(frozen=True)
class WeightsCheck:
    """One checkpoint's tensors, as the child read them."""

    #: True: every floating tensor finite; False: some are not; None: could not tell (not a
    #: checkpoint, torn, the child crashed or timed out) - ``error`` says why.
    finite: bool | None
    #: The epoch the checkpoint says it holds (1-based), when it says.
    epoch: int | None
    tensors: int
    #: How many tensors hold NaN or inf, and the first few names.
    bad_count: int
    bad: tuple[str, ...]
    #: The whole check, child start to answer, seconds (what a checkpoint costs).
    seconds: float
    #: The child's own load and scan times, seconds (the rest is interpreter and import).
    load_s: float | None = None
    scan_s: float | None = None
    error: str | None = None

    def describe(self) -> str:
        """One line for the log and the cause."""
        where = f"epoch {self.epoch}'s checkpoint" if self.epoch is not None else "checkpoint"
        if self.finite is None:
            return f"{where}: cannot tell ({self.error})"
        if self.finite:
            return f"{where}: {self.tensors} tensors, all finite ({self.seconds:.1f}s)"
        names = ", ".join(self.bad)
        more = (
            f" and {self.bad_count - len(self.bad)} more" if self.bad_count > len(self.bad) else ""
        )
        return (
            f"{where} holds NaN/inf in {self.bad_count} of {self.tensors} tensors ({names}{more})"
        )


def _answer(stdout: bytes, code: int | None, seconds: float) -> WeightsCheck:
    line = next((ln for ln in reversed(stdout.decode(errors="replace").splitlines()) if ln), "")
    try:
        doc = json.loads(line)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        why = f"the check exited {code} without an answer"
        return WeightsCheck(None, None, 0, 0, (), seconds, error=why)
    if doc.get("error") or code != 0:
        why = str(doc.get("error") or f"the check exited {code}")
        return WeightsCheck(None, None, 0, 0, (), seconds, error=why)
    bad_count = int(doc.get("bad_count") or 0)
    epoch = doc.get("epoch")
    return WeightsCheck(
        bad_count == 0,
        epoch if isinstance(epoch, int) else None,
        int(doc.get("tensors") or 0),
        bad_count,
        tuple(str(n) for n in doc.get("bad") or ()),
        seconds,
        load_s=doc.get("load_s"),
        scan_s=doc.get("scan_s"),
    )


async def check_weights(
    path: Path, *, python: str = sys.executable, timeout_s: float = CHECK_TIMEOUT_S
) -> WeightsCheck:
    """Look at every floating tensor of the checkpoint ``path`` in a child process (its own
    session, killed with its group past ``timeout_s``). Never raises for a bad file or child."""
    run = await run_check_child(
        [python, "-m", "agent.trainer.finite_entry", str(path)], timeout_s=timeout_s
    )
    if run.failure == "start":
        why = f"cannot start the check: {run.why}"
        return WeightsCheck(None, None, 0, 0, (), run.elapsed_s, error=why)
    if run.failure == "timeout":
        why = f"the check {run.why}"
        return WeightsCheck(None, None, 0, 0, (), run.elapsed_s, error=why)
    return _answer(run.stdout, run.returncode, run.elapsed_s)


def is_torch_checkpoint(path: Path) -> bool:
    """A zip whose ``data.pkl`` is a pickle (what ``torch.save`` writes): anything else is not
    worth a child that imports torch (it could only answer "cannot tell")."""
    try:
        with zipfile.ZipFile(path) as zf:
            name = next((n for n in zf.namelist() if n.rpartition("/")[2] == "data.pkl"), None)
            if name is None:
                return False
            with zf.open(name) as f:
                return f.read(1) == b"\x80"  # the PROTO opcode every pickle since 2 starts with
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return False


def crash_looks_diverged(message: str | None, log_tail: str = "") -> bool:
    """A trainer's error (status.json, its json result) or its log's tail says it died of NaN:
    the crash form of divergence (exit 1), told apart from a bug or an out-of-memory."""
    text = f"{message or ''}\n{log_tail}".lower()
    return any(marker in text for marker in NAN_CRASH_MARKERS)
