"""Is a run's arithmetic still finite? Its losses in ``metrics.jsonl``, and its checkpoints'
tensors, read without torch (:mod:`agent.trainer.ckptscan`).

LibreYOLO 1.6.0 shows a diverged run two ways (docs: the tiny dataset, ``warmup_epochs=0``):
``yolo9-t`` at ``lr0=1e5`` trains on with ``null`` losses in ``metrics.jsonl`` and NaN weights
and exits 0; ``yolox-n`` at ``lr0=10`` crashes at the first NaN, exit 1 with "all elements of
input should be between 0 and 1" (a BCE fed NaN). And a checkpoint can hold inf tensors while
its epoch's losses are still finite: losses alone never prove a checkpoint good, so a
checkpoint counts as good only once its own tensors were read.

The agent process never imports torch (memory, start time), and no child does it either:
:func:`check_weights` reads the checkpoint's own bytes (:mod:`agent.trainer.ckptscan`: the
zip ``torch.save`` writes, its pickle read inertly, each floating storage's exponent bits
compared in C) in a daemon thread of the agent. A checkpoint of tens of MB takes tens of
milliseconds and one MiB of memory; the child that imported torch for each epoch cost 3-6 s of
CPU and about 1 GB beside the training. ``bench/finite_check.py`` prints the cost per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.trainer import ckptscan
from agent.util.text import os_error

#: Seconds one weights check may take before it counts as "cannot tell" (a disk that stopped
#: answering): the scan reads at disk speed, a multi-GB checkpoint on a slow disk in minutes.
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
    """One checkpoint's tensors, as :func:`check_weights` read them."""

    #: True: every floating tensor finite; False: some are not; None: could not tell (not a
    #: checkpoint, torn, a type the scan does not know, no answer in time) - ``error`` says why.
    finite: bool | None
    #: The epoch the checkpoint says it holds (1-based), when it says.
    epoch: int | None
    tensors: int
    #: How many tensors hold NaN or inf, and the first few names.
    bad_count: int
    bad: tuple[str, ...]
    #: The whole check, start to answer, seconds (what a checkpoint costs).
    seconds: float
    #: The scan's own time, seconds, and the bytes of floating storage it read.
    scan_s: float | None = None
    error: str | None = None
    bytes_read: int = 0

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


async def check_weights(path: Path, *, timeout_s: float = CHECK_TIMEOUT_S) -> WeightsCheck:
    """Look at every floating tensor of the checkpoint ``path`` (:func:`ckptscan.scan`) in a
    daemon thread: past ``timeout_s`` (a hung disk) the answer is "cannot tell" and the thread
    is left to its read, never joined at exit; a cancelled check stops at its next chunk.
    Never raises for a bad file."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[WeightsCheck] = loop.create_future()
    cancel = threading.Event()
    started = time.monotonic()

    def answer(check: WeightsCheck) -> None:
        if not done.done():
            done.set_result(check)

    def work() -> None:
        check = _scan(path, cancel, started)
        if check is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(answer, check)

    threading.Thread(target=work, name="weights-check", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(done), timeout_s)
    except TimeoutError:
        cancel.set()
        why = f"no answer in {timeout_s:g}s (the disk stopped answering?)"
        return WeightsCheck(None, None, 0, 0, (), time.monotonic() - started, error=why)
    finally:
        cancel.set()  # cancelled or timed out: the thread stops at its next chunk


def _scan(path: Path, cancel: threading.Event, started: float) -> WeightsCheck | None:
    try:
        found = ckptscan.scan(path, cancel=cancel)
    except ckptscan.Cancelled:
        return None
    except ckptscan.ScanError as exc:
        return WeightsCheck(None, None, 0, 0, (), time.monotonic() - started, error=str(exc))
    except OSError as exc:
        return WeightsCheck(None, None, 0, 0, (), time.monotonic() - started, error=os_error(exc))
    seconds = time.monotonic() - started
    return WeightsCheck(
        found.bad_count == 0,
        found.epoch,
        found.tensors,
        found.bad_count,
        found.bad,
        seconds,
        scan_s=seconds,
        bytes_read=found.bytes_read,
    )


def is_torch_checkpoint(path: Path) -> bool:
    """A zip whose ``data.pkl`` is a pickle (what ``torch.save`` writes): anything else is not
    worth a copy and a check (it could only answer "cannot tell")."""
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
