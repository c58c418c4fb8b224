"""A diverged run stops at once, keeping its last good checkpoint.

While the trainer runs, every turn of the training loop reads ``metrics.jsonl`` when it moved
(:func:`agent.trainer.finite.scan_losses`: a ``null``, NaN or inf loss is divergence), and each
epoch's ``last.pt`` is copied and its own tensors read, without torch, in a thread
(:func:`agent.trainer.finite.check_weights`): a checkpoint is *good* only when its tensors and
its epoch's losses (and every earlier epoch's) are all finite. The newest good one is kept on
this box in the state directory as ``finite/last-good.pt`` (replaced only by a newer good one);
when the run diverges it goes to the sync target as ``weights/last-good.pt``, through the sync
engine's own queue and verification. Uploaded then, not every epoch: a healthy run's
``last.pt`` is already its last good checkpoint, and a second copy of it every epoch would
double the upload and the commits.

The verdict (the first epoch that was not finite, and what was seen) is written to
``finite/finite.json`` before anyone acts on it, so an agent restarted meanwhile stops the
trainer again and never resumes it (:mod:`agent.daemon.relaunch`).

After a trainer ended by itself (:meth:`DivergenceWatch.after_exit`) the same checks run once
more on what it left: LibreYOLO's ``yolo9-t`` trains on through NaN and exits 0, ``yolox-n``
dies at the first NaN with exit 1; both are ``diverged``, never ``completed`` or a failure to
resume. A run that completed is judged on its losses alone there (nothing more to read on the
way from its exit to the teardown).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.daemon.context import RunContext
from agent.sync.ledger import ItemKind
from agent.sync.uploads import Item
from agent.trainer.finite import (
    WeightsCheck,
    check_weights,
    crash_looks_diverged,
    is_torch_checkpoint,
    scan_losses,
)
from agent.trainer.outcome import Outcome, OutcomeKind
from agent.trainer.rundir import METRICS, is_valid_checkpoint, read_metrics
from agent.util.text import os_error

log = logging.getLogger(__name__)

#: The folder of the state directory this module keeps its files in.
FOLDER = "finite"
#: Where the last good checkpoint goes on the sync target.
REMOTE_GOOD = "weights/last-good.pt"
#: Bytes of the trainer's log read for a NaN crash's words.
LOG_TAIL_BYTES = 64 * 1024


@dataclass(frozen=True)
class Diverged:
    """The run diverged: the first epoch whose losses or weights were not finite."""

    epoch: int
    #: What was seen (``train/loss = null in metrics.jsonl``, the tensors that hold NaN...).
    why: str


class DivergenceWatch:
    """Divergence checks of one run (see the module docstring); owned by the TRAINING phase."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.dir = ctx.store.path(FOLDER)
        self.record_path = self.dir / "finite.json"
        self.good_path = self.dir / "last-good.pt"
        #: Set when the verdict is reached: wakes the training loop.
        self.changed = asyncio.Event()
        self.verdict: Diverged | None = None
        #: The epoch of ``last-good.pt``, None before one is good.
        self.good_epoch: int | None = None
        #: The newest epoch whose checkpoint was read (good or not).
        self.checked_epoch = 0
        #: The latest weights check (what it found, what it cost).
        self.last_check: WeightsCheck | None = None
        self._task: asyncio.Task[None] | None = None
        self._again = False
        self._metrics_key: tuple[int, int] | None = None
        self._loaded = False

    # ------------------------------------------------------------------ the record

    def _load(self) -> None:
        """Read the record on first use: by then the run's state is the adopted one (a restarted
        agent's), and a record of an earlier run in this state directory (its ``state.json``
        removed to run the job again) is told apart by the run's start time and ignored."""
        if self._loaded:
            return
        self._loaded = True
        try:
            doc = json.loads(self.record_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if not isinstance(doc, dict):
            return
        if doc.get("run_started_at") != self.ctx.state.started_at:
            log.info("%s is an earlier run's: ignored", self.record_path)
            return
        good = doc.get("good_epoch")
        if isinstance(good, int) and self.good_path.exists():
            self.good_epoch = good
            self.checked_epoch = good
        bad = doc.get("diverged")
        if isinstance(bad, dict) and isinstance(bad.get("epoch"), int):
            self.verdict = Diverged(int(bad["epoch"]), str(bad.get("why") or ""))
            self.changed.set()

    def _save(self) -> None:
        doc: dict[str, Any] = {
            "run_started_at": self.ctx.state.started_at,
            "good_epoch": self.good_epoch,
            "diverged": None
            if self.verdict is None
            else {"epoch": self.verdict.epoch, "why": self.verdict.why},
        }
        tmp = self.record_path.with_name(self.record_path.name + ".tmp")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
            os.replace(tmp, self.record_path)
        except OSError as exc:
            log.error("cannot write %s: %s", self.record_path, os_error(exc))

    def cause(self) -> str:
        """The run's cause once it diverged: which epoch, what was seen, what was kept."""
        assert self.verdict is not None
        v = self.verdict
        if self.good_epoch is not None:
            kept = f"last good checkpoint: epoch {self.good_epoch}, kept as {REMOTE_GOOD}"
        else:
            kept = "no checkpoint of this run was good: no last-good.pt"
        return f"diverged at epoch {v.epoch}: {v.why}; {kept}; not resumed"

    # ------------------------------------------------------------------ while training

    def _diverged(self, epoch: int, why: str) -> None:
        if self.verdict is not None:
            return
        self.verdict = Diverged(epoch, why)
        self._save()  # before anyone acts on it: a restarted agent must not resume it
        log.error("diverged at epoch %d: %s", epoch, why)
        self.changed.set()

    async def poll(self, run_dir: Path | None) -> Diverged | None:
        """A turn of the loop: read ``metrics.jsonl`` when it moved. The verdict, or None."""
        self._load()
        if self.verdict is None and run_dir is not None:
            await self._scan_metrics(run_dir)
        return self.verdict

    async def _scan_metrics(self, run_dir: Path) -> None:
        try:
            st = (run_dir / METRICS).stat()
        except OSError:
            return
        key = (st.st_size, st.st_mtime_ns)
        if key == self._metrics_key:
            return
        self._metrics_key = key
        losses = scan_losses(await asyncio.to_thread(read_metrics, run_dir))
        if losses.bad_epoch is not None:
            self._diverged(losses.bad_epoch, f"{losses.problem} in {METRICS}")

    def on_epoch(self, run_dir: Path) -> None:
        """An epoch ended: read its ``last.pt`` (one check at a time; epochs that end during a
        check are coalesced into one check of the newest)."""
        self._load()
        if self.verdict is not None:
            return
        if self._task is not None and not self._task.done():
            self._again = True
            return
        self._task = asyncio.create_task(self._check_newest(run_dir), name="finite-check")

    async def _check_newest(self, run_dir: Path) -> None:
        while True:
            self._again = False
            try:
                await self._check_last(run_dir)
            except OSError as exc:
                log.warning("weights check skipped: %s", os_error(exc))
            if not self._again or self.verdict is not None:
                return

    async def _check_last(self, run_dir: Path) -> None:
        """Copy ``last.pt`` (a stable copy: the trainer writes it in place) and judge it;
        nothing with ``train.check_weights = false`` (the losses alone are watched then, and no
        last good checkpoint is kept)."""
        if not self.ctx.job.train.check_weights:
            return
        candidate = self.dir / "candidate.pt"
        self.dir.mkdir(parents=True, exist_ok=True)
        if not await asyncio.to_thread(_copy_stable, run_dir / "weights" / "last.pt", candidate):
            return
        try:
            check = await check_weights(candidate)
            self.last_check = check
            await self._judge(check, candidate, run_dir)
        finally:
            with contextlib.suppress(OSError):
                candidate.unlink()

    async def _judge(self, check: WeightsCheck, candidate: Path, run_dir: Path) -> None:
        status = self.ctx.status
        epoch = check.epoch or (status.completed_epochs if status else 0)
        (log.info if check.finite else log.warning)("weights check: %s", check.describe())
        if check.finite is None:
            return
        self.checked_epoch = max(self.checked_epoch, epoch)
        if not check.finite:
            self._diverged(epoch, check.describe())
            return
        losses = scan_losses(await asyncio.to_thread(read_metrics, run_dir))
        if losses.bad_epoch is not None and losses.bad_epoch <= epoch:
            self._diverged(losses.bad_epoch, f"{losses.problem} in {METRICS}")
            return
        if losses.finite_through is None or losses.finite_through < epoch:
            return  # its epoch's losses are not written yet: not called good on weights alone
        if self.good_epoch is not None and epoch <= self.good_epoch:
            return
        await asyncio.to_thread(os.replace, candidate, self.good_path)
        self.good_epoch = epoch
        self._save()
        log.info("last good checkpoint: epoch %d (%s)", epoch, self.good_path)

    # ------------------------------------------------------------------ after the trainer

    async def after_exit(self, run_dir: Path | None, outcome: Outcome | None) -> Diverged | None:
        """The trainer ended by itself (or the agent stopped it): finish the check under way,
        read the losses, and the final ``last.pt`` when no check has read it; a crash (exit 1)
        whose words say NaN is divergence too. The verdict, or None.

        A run that completed takes the fast path: its losses only, no copy and read of its
        final checkpoint unless they say it diverged (the trainer's exit -> FINISHING ->
        teardown path of every finished run waits for nothing it can skip; the checks of the
        epochs before ran while it trained)."""
        self._load()
        if outcome is not None and outcome.completed and run_dir is not None:
            if self.verdict is None:
                self._metrics_key = None
                await self._scan_metrics(run_dir)
            if self.verdict is None:
                await self.close()
                return None
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if run_dir is None:
            return self.verdict
        if self.verdict is None:
            self._metrics_key = None
            await self._scan_metrics(run_dir)
        newest = self.ctx.status.completed_epochs if self.ctx.status else 0
        if self.verdict is None and newest > self.checked_epoch:
            try:
                await self._check_last(run_dir)
            except OSError as exc:
                log.warning("final weights check skipped: %s", os_error(exc))
        if (
            self.verdict is None
            and outcome is not None
            and outcome.kind == OutcomeKind.RUNTIME
            and crash_looks_diverged(outcome.message, self._log_tail(run_dir))
        ):
            self._diverged(newest + 1, f"the trainer crashed on NaN ({outcome.message})")
        return self.verdict

    def _log_tail(self, run_dir: Path) -> str:
        text = ""
        for path in (self.ctx.store.path("trainer.log"), run_dir / "train.log"):
            try:
                with open(path, "rb") as f:
                    f.seek(max(0, path.stat().st_size - LOG_TAIL_BYTES))
                    text += f.read().decode(errors="replace")
            except OSError:
                continue
        return text

    async def keep_last_good(self) -> bool:
        """The run diverged: queue ``last-good.pt`` for the target (verified like every upload;
        never a bad one: only a checked file is ever there). Whether it was queued."""
        sync = self.ctx.sync
        if self.good_epoch is None or sync is None:
            return False
        snap = await asyncio.to_thread(sync.snapshots.take, self.good_path, checkpoint=True)
        if snap is None:
            log.error("last-good.pt (epoch %d) could not be copied for upload", self.good_epoch)
            return False
        sync.submit(
            Item(
                REMOTE_GOOD,
                snap.path,
                snap.sha256,
                snap.size,
                self.good_epoch,
                ItemKind.BEST,
                snapshot=not snap.live,
                mtime_ns=snap.mtime_ns if snap.live else None,
            )
        )
        log.info("queued %s (epoch %d) for %s", REMOTE_GOOD, self.good_epoch, sync.sink.description)
        return True

    async def close(self) -> None:
        """Cancel a check still running (the agent is exiting); its thread stops at its next
        chunk."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _copy_stable(src: Path, dst: Path) -> bool:
    """Copy the live ``src`` to ``dst``: True when the copy is whole (``src`` unchanged while
    copied, a valid zip, a torch pickle inside)."""
    tmp = dst.with_name(dst.name + ".tmp")
    try:
        before = src.stat()
        shutil.copyfile(src, tmp)
        after = src.stat()
    except FileNotFoundError:
        tmp.unlink(missing_ok=True)
        return False
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk leaves no partial copy behind
        raise
    stable = (before.st_size, before.st_mtime_ns) == (after.st_size, after.st_mtime_ns)
    if not stable or not is_valid_checkpoint(tmp) or not is_torch_checkpoint(tmp):
        tmp.unlink(missing_ok=True)
        return False
    os.replace(tmp, dst)
    return True
