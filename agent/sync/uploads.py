"""The upload queue: one worker that sends snapshots to the sink, with timeouts, backoff and a
read-back of size and sha256 after every upload, recording each outcome in the ledger.

Queue rule: one pending item per remote path (a newer snapshot supersedes a queued older one) and
never two uploads of the same path in flight, even after a timeout gave up waiting for a thread.

Grouping rule: where each upload is a commit the target counts (the Hub,
``sink.max_files_per_upload`` > 1), everything due goes in one ``upload_many`` - one commit - and
only one such batch is in flight at a time; the engine holds the worker (:meth:`UploadQueue.hold`)
while it queues a milestone, so the milestone's files leave together. Each file of a batch is
still read back on its own and succeeds or fails on its own; a failed commit fails each of its
files, and they are retried together (one delay for the batch). An item that failed, or that a
restarted agent found owed, is first looked for on the target (``check_first``): a commit that
landed while its answer was lost, or while the agent was dead, is verified, not made again.

Failure rule: nothing that fails while recording (a ledger write hitting EMFILE or ENOSPC) drops
an item: items are re-queued first, the ledger stays dirty in memory and is written again later.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agent.config.model import SyncSection
from agent.sinks import Sink, SinkError
from agent.sync.batch import Outcome, Sent, failure_of, send_batch
from agent.sync.commits import CommitWindow
from agent.sync.ledger import ItemKind, Ledger, LedgerStatus
from agent.sync.snapshots import unlink_quietly
from agent.sync.throttle import Throttle
from agent.util import backoff
from agent.util.threads import in_daemon_thread

# One logger for all of sync: its lines are grepped and asserted as ``agent.sync.engine``.
log = logging.getLogger(__name__)

#: What became of one file offered to the queue: queued, already there (or on its way), or
#: not to be had (missing, torn, not a valid zip).
Queued = Literal["queued", "unchanged", "unavailable"]

#: The longest ``Retry-After`` believed, seconds: the Hub's commit window (an hour).
RETRY_AFTER_MAX_S = 3600.0
#: A batch also takes what is due this soon after its own backoff, seconds (never what waits
#: out the target's ``Retry-After``): two commits a second apart would cost one commit more.
BATCH_SLACK_S = 5.0


@dataclass
class Item:
    """One file to store: a snapshot on local disk and where it goes."""

    remote_path: str
    local: Path
    sha256: str
    size: int
    epoch: int | None
    kind: ItemKind
    created_at: float = field(default_factory=time.time)
    attempts: int = 0
    not_before: float = 0.0
    last_error: str | None = None
    #: False when no snapshot could be made (disk full): ``local`` is then the live file, which
    #: is never deleted and is hashed again before a retry.
    snapshot: bool = True
    #: The live file's mtime when it was hashed (``snapshot`` False only).
    mtime_ns: int | None = None
    #: Read the target before sending: an earlier attempt (or a killed agent's) may have landed.
    check_first: bool = False
    #: Not before this (clock), whatever :meth:`UploadQueue.retry_now` says: the target's own
    #: ``Retry-After``.
    asked_until: float = 0.0


@dataclass(eq=False)
class _Flight:
    """A batch (one file, or one commit's files) whose thread has not ended yet."""

    items: list[Item]
    future: concurrent.futures.Future[list[Outcome]]
    started_at: float

    def item_of(self, remote_path: str) -> Item:
        return next(i for i in self.items if i.remote_path == remote_path)


class UploadQueue:
    """The queue and its worker: uploads for paths not in flight, respecting backoff; a success
    is read back and recorded as verified, a failure re-queued and recorded."""

    def __init__(
        self,
        sink: Sink,
        cfg: SyncSection,
        ledger: Ledger,
        *,
        throttle: Throttle,
        max_parallel: int,
        rng: random.Random,
        clock: Callable[[], float],
        ledger_retry_s: float,
        stalled_after_s: float,
        commits: CommitWindow | None = None,
    ) -> None:
        self.sink = sink
        #: The commits made to the target this hour (counted after each ``upload_many``).
        self.commits = commits
        #: Group what is due into one ``upload_many`` (one commit), one batch at a time.
        self.batching = sink.max_files_per_upload > 1
        #: :meth:`hold` depth: while above 0 a batching worker starts nothing (a milestone is
        #: being queued and must leave as one commit).
        self._held = 0
        self.cfg = cfg
        self.ledger = ledger
        self.max_parallel = max_parallel
        self.ledger_retry_s = ledger_retry_s
        self.stalled_after_s = stalled_after_s
        self._throttle = throttle
        self._rng = rng
        self._clock = clock
        self._pending: dict[str, Item] = {}
        self._in_flight: dict[str, _Flight] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._prepared = False
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._ledger_retry_at = 0.0
        self._busy_since: float | None = None
        self.failures: list[dict[str, Any]] = []
        self.uploads_done = 0
        #: Failed upload attempts, and bytes verified on the target, since this agent started.
        self.uploads_failed = 0
        self.uploaded_bytes = 0
        #: Called with each outcome (``path, epoch, size, ok, error``): the daemon's event bus.
        self.on_outcome: Callable[..., object] | None = None
        self.last_success_at: float | None = None
        self.last_error: dict[str, Any] | None = None
        #: The newest epoch whose ``last.pt`` or ``epoch_N.pt`` is verified on the target.
        self.last_synced_epoch: int | None = None
        #: Observed upload speed of checkpoints (bytes/s, a moving average; None until one of
        #: at least 1 MiB went up): the finish reserve before a deadline is sized from it.
        self.bytes_per_s: float | None = None

    @property
    def pending_bytes(self) -> int:
        """Bytes still owed: queued and in flight."""
        return sum(i.size for i in self._owed())

    def _owed(self) -> list[Item]:
        """The items queued and in flight."""
        flying = [f.item_of(path) for path, f in self._in_flight.items()]
        return [*self._pending.values(), *flying]

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """While inside, a batching worker starts no upload: what is queued meanwhile leaves
        together (one commit per milestone)."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held:
                self._wake.set()

    def check_first(self, remote_path: str) -> None:
        """Look for the queued ``remote_path`` on the target before sending it (a killed agent's
        commit may have landed)."""
        item = self._pending.get(remote_path)
        if item is not None:
            item.check_first = True

    # ---------------------------------------------------------------- what is owed

    def submit(self, item: Item) -> None:
        """Queue ``item``; a queued older version of the same path is dropped (superseded)."""
        if not self._pending and not self._in_flight:
            self._busy_since = self._clock()
        old = self._pending.get(item.remote_path)
        if old is not None:
            log.info(
                "superseded queued %s (epoch %s -> %s)", item.remote_path, old.epoch, item.epoch
            )
            self._discard(old)
            # Keep the backoff of a failing path: a new version is no reason to hammer the target.
            item.attempts, item.not_before = old.attempts, old.not_before
            item.asked_until, item.check_first = old.asked_until, old.check_first
        self._pending[item.remote_path] = item
        self._idle.clear()
        self._wake.set()
        # Queued first, recorded second: a failed ledger write must not lose the item.
        self.ledger.expect(item)

    def queued_or_in_flight(self, remote_path: str) -> bool:
        return remote_path in self._pending or remote_path in self._in_flight

    def expected(self, remote_path: str) -> tuple[str, int] | None:
        """(sha256, size) of the queued version of ``remote_path``, else of the one being sent;
        None when neither."""
        pending = self._pending.get(remote_path)
        if pending is not None:
            return pending.sha256, pending.size
        flight = self._in_flight.get(remote_path)
        if flight is not None:
            item = flight.item_of(remote_path)
            return item.sha256, item.size
        return None

    def raise_epoch(self, remote_path: str, sha256: str, epoch: int) -> None:
        """A milestone found ``remote_path`` unchanged since it was queued under an older epoch
        (the trainer wrote the next epoch's checkpoint before the agent read the status of the
        one before): the version queued, in flight or verified holds ``epoch``. Its label goes
        up, so ``last_synced_epoch`` says what the target holds."""
        owed = [self._pending.get(remote_path)]
        flight = self._in_flight.get(remote_path)
        if flight is not None:
            owed.append(flight.item_of(remote_path))
        for item in owed:
            if item is not None and item.sha256 == sha256 and (item.epoch or 0) < epoch:
                item.epoch = epoch
        entry = self.ledger.raise_epoch(remote_path, sha256, epoch)
        if entry is None:
            return
        if entry.status == LedgerStatus.VERIFIED and entry.kind in (ItemKind.LAST, ItemKind.EPOCH):
            self.last_synced_epoch = max(self.last_synced_epoch or 0, epoch)
        log.info("%s on the target holds epoch %d (its label said less)", remote_path, epoch)

    def snapshot_files(self) -> set[Path]:
        """The snapshot files of the uploads still owed (queued or in flight)."""
        return {i.local for i in self._owed() if i.snapshot}

    @property
    def queue(self) -> list[dict[str, Any]]:
        return [
            {"path": i.remote_path, "epoch": i.epoch, "attempts": i.attempts, "error": i.last_error}
            for i in self._pending.values()
        ]

    def status(self) -> dict[str, Any]:
        """The queue's part of the sync status: queued, in flight (since when, which attempt),
        done, whether uploads are stalled, and the latest failures."""
        now = self._clock()
        stalled_since: float | None = None
        if self._pending or self._in_flight:
            since = max(self._busy_since or now, self.last_success_at or 0.0)
            if now - since >= self.stalled_after_s:
                stalled_since = since
        return {
            "queue": self.queue,
            "in_flight": [
                {
                    "path": path,
                    "epoch": f.item_of(path).epoch,
                    "attempt": f.item_of(path).attempts,
                    "started_at": f.started_at,
                    "seconds": round(now - f.started_at, 1),
                    # Files going up in the same commit (1 where each file goes alone).
                    "batch": len(f.items),
                }
                for path, f in sorted(self._in_flight.items())
            ],
            "uploads_done": self.uploads_done,
            "uploads_failed": self.uploads_failed,
            "uploaded_bytes": self.uploaded_bytes,
            "bytes_per_s": self.bytes_per_s,
            "last_success_at": self.last_success_at,
            "stalled_since": stalled_since,
            "last_error": self.last_error,
            "failures": self.failures[-5:],
        }

    # ---------------------------------------------------------------- the worker

    async def run(self) -> None:
        """The worker: starts uploads for paths not in flight, respecting backoff, and saves a
        ledger that could not be saved. Ends once :meth:`close` was called (no upload may start
        after the executor is shut down)."""
        while not self._closed:
            self._wake.clear()
            if self.ledger.dirty and time.monotonic() >= self._ledger_retry_at:
                self.ledger.persist()
                self._ledger_retry_at = time.monotonic() + self.ledger_retry_s
            next_due = self._start_due()
            if not self._pending and not self._in_flight:
                self._idle.set()
            timeout = None if next_due is None else max(0.0, next_due - self._clock())
            if self.ledger.dirty:
                retry = max(0.0, self._ledger_retry_at - time.monotonic())
                timeout = retry if timeout is None else min(timeout, retry)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _start_due(self) -> float | None:
        """Start what is due, as the sink takes it: one file per upload, up to ``max_parallel``
        at once; or (batching) everything due in one batch, when none is in flight and the
        engine does not hold the worker. Returns when the next waiting item is due (None: no
        need to wake before something changes)."""
        if self.batching:
            if self._held or self._in_flight:
                return None  # the flight's end (or the hold's) wakes the worker
            batch, first_due = self._due(
                self._clock(), self.sink.max_files_per_upload, slack_s=BATCH_SLACK_S
            )
            if batch:
                self._start(batch)
            return first_due
        next_due: float | None = None
        flights = len(self._in_flight)
        while flights < self.max_parallel:
            batch, due = self._due(self._clock(), 1)
            if due is not None:
                next_due = due if next_due is None else min(next_due, due)
            if not batch:
                break
            self._start(batch)
            flights += 1
        return next_due

    def _due(
        self, now: float, most: int, *, slack_s: float = 0.0
    ) -> tuple[list[Item], float | None]:
        """Up to ``most`` pending items not in flight and not waiting out a backoff (taken off
        the queue), and when the first waiting one is due. Once one item is due, the batch also
        takes those due within ``slack_s`` whose target did not ask them to wait longer."""
        waiting = [(p, i) for p, i in self._pending.items() if p not in self._in_flight]
        any_due = any(i.not_before <= now for _, i in waiting)
        batch: list[Item] = []
        next_due: float | None = None
        for path, item in waiting:
            early = any_due and item.not_before <= now + slack_s and item.asked_until <= now
            if item.not_before > now and not early:
                next_due = item.not_before if next_due is None else min(next_due, item.not_before)
                continue
            if len(batch) < most:
                del self._pending[path]
                batch.append(item)
        return batch, next_due

    def _start(self, batch: list[Item]) -> None:
        for item in batch:
            item.attempts += 1
        name = batch[0].remote_path + (f" +{len(batch) - 1}" if len(batch) > 1 else "")
        # A daemon thread: one upload hung on a dead target must not keep the finished agent
        # (and the box's bill) alive; the ledger is persisted, abandoning it loses nothing.
        fut = in_daemon_thread(self._send, batch, name=f"sync-upload:{name}")
        flight = _Flight(batch, fut, self._clock())
        for item in batch:
            self._in_flight[item.remote_path] = flight
        task = asyncio.create_task(self._watch(flight), name=f"upload:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, flight: _Flight) -> None:
        items, fut = flight.items, flight.future
        # One upload is one commit, whatever it carries: its thread goes on after a timeout, and
        # the retry reads back first what it may have landed.
        timeout = self.cfg.upload_timeout_s
        try:
            outcomes = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), timeout)
        except TimeoutError:
            self._failed_batch(items, f"timed out after {timeout:.0f}s")
            # The thread may still be sending: the paths stay in flight until it really ends.
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(fut)
        except Exception as exc:  # the batch as a whole (preparing the target)
            self._failed_batch(items, exc)
        else:
            sent = 0
            # One error failed these together (a refused commit): retried together.
            failed: dict[int, tuple[BaseException, list[Item]]] = {}
            for item, outcome in zip(items, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    failed.setdefault(id(outcome), (outcome, []))[1].append(item)
                else:
                    self._succeeded(item, outcome)
                    sent += outcome.size if outcome.sent else 0
            for error, group in failed.values():
                self._failed_batch(group, error)
            self._note_speed(sent, self._clock() - flight.started_at)
        finally:
            for item in items:
                self._in_flight.pop(item.remote_path, None)
            self._wake.set()

    def _note_speed(self, size: int, seconds: float) -> None:
        if size < 1 << 20 or seconds <= 0:
            return  # small files measure latency, not bandwidth
        speed = size / seconds
        self.bytes_per_s = (
            speed if self.bytes_per_s is None else 0.7 * self.bytes_per_s + 0.3 * speed
        )

    def _tell(self, item: Item, *, ok: bool, error: str | None = None) -> None:
        if self.on_outcome is not None:
            try:
                self.on_outcome(
                    path=item.remote_path, epoch=item.epoch, size=item.size, ok=ok, error=error
                )
            except Exception:  # an observer must never cost an upload
                log.exception("upload observer failed")

    def _succeeded(self, item: Item, sent: Sent) -> None:
        self.uploads_done += 1
        self.uploaded_bytes += sent.size if sent.sent else 0
        now = self._clock()
        self.last_success_at = now
        # A live file (no snapshot) may have been re-hashed before this attempt: the ledger
        # records what really went up.
        recorded = item.sha256
        item.sha256, item.size = sent.sha256, sent.size
        self.ledger.mark_verified(
            item.remote_path,
            recorded,
            sha256=sent.sha256,
            size=sent.size,
            at=now,
            attempts=item.attempts,
        )
        if item.epoch is not None and item.kind in (ItemKind.LAST, ItemKind.EPOCH):
            self.last_synced_epoch = max(self.last_synced_epoch or 0, item.epoch)
        log.info(
            "%s %s epoch=%s size=%d sha256=%s attempt=%d%s",
            "uploaded+verified" if sent.sent else "verified, already on the target:",
            item.remote_path,
            item.epoch,
            item.size,
            item.sha256[:12],
            item.attempts,
            "" if item.snapshot else " (from the live file)",
        )
        self._tell(item, ok=True)
        # The ledger keeps the hash; the snapshot is no longer needed unless superseded later.
        self._discard(item)

    def _send(self, items: list[Item]) -> list[Outcome]:
        """Runs in a worker thread: prepare the target once, then :func:`send_batch`."""
        if not self._prepared:
            self.sink.prepare()
            self._prepared = True
        return send_batch(self.sink, items, commits=self.commits)

    def _failed_batch(self, items: list[Item], error: str | BaseException) -> None:
        """``items`` failed together: each is re-queued and recorded, all with one delay (so
        that they are retried together, one commit again)."""
        text, retryable, retry_after_s = failure_of(error)
        # A sink bug must not kill the queue, but it must be seen.
        if (
            isinstance(error, BaseException)
            and not isinstance(error, SinkError | OSError)
            and self._throttle.allow(f"crash:{items[0].remote_path}", text) is not None
        ):
            log.error("upload of %s crashed", items[0].remote_path, exc_info=error)
        attempts = max(i.attempts for i in items)
        delay = self._delay(attempts, retryable=retryable, retry_after_s=retry_after_s)
        now = self._clock()
        alone = len(items) == 1
        for item in items:
            self._failed(
                item,
                text,
                retryable=retryable,
                retry_after_s=retry_after_s,
                delay=delay,
                now=now,
                say=alone,
            )
        if not alone:
            # One line for the batch (its error names the files), not one per file.
            self._throttle.warning(
                "batch",
                text,
                "upload of %d files together failed (attempt %d): %s; retry in %.1fs",
                len(items),
                attempts,
                text,
                delay,
            )

    def _delay(self, attempts: int, *, retryable: bool, retry_after_s: float | None) -> float:
        """Seconds before the next attempt: backoff, the longest one when waiting cannot help
        (a person may fix a token: retried slowly, never given up), never sooner than the
        target asked (HTTP 429 ``Retry-After``: retrying sooner only earns another 429)."""
        delay = self.backoff(attempts) if retryable else self.cfg.max_backoff_s
        return backoff.honouring_s(delay, retry_after_s, max_s=RETRY_AFTER_MAX_S)

    def _failed(
        self,
        item: Item,
        error: str,
        *,
        retryable: bool = True,
        retry_after_s: float | None = None,
        delay: float | None = None,
        now: float | None = None,
        say: bool = True,
    ) -> None:
        self.uploads_failed += 1
        self._tell(item, ok=False, error=error)
        if delay is None:
            delay = self._delay(item.attempts, retryable=retryable, retry_after_s=retry_after_s)
        now = self._clock() if now is None else now
        item.last_error = error
        item.not_before = now + delay
        if retry_after_s is not None:
            item.asked_until = now + min(retry_after_s, RETRY_AFTER_MAX_S)
            if self.commits is not None:
                self.commits.asked_to_wait(item.asked_until)
        # The attempt may have landed (an answer lost after the commit): look before resending.
        item.check_first = True
        # Re-queue first: nothing below (the ledger write above all) may lose the item.
        newer = self._pending.get(item.remote_path)
        if newer is None:
            self._pending[item.remote_path] = item
        elif newer is not item:
            # A newer snapshot arrived while this one was failing: it wins.
            self._discard(item)
            newer.attempts, newer.not_before = item.attempts, item.not_before
            newer.asked_until = item.asked_until
        self.last_error = {"path": item.remote_path, "error": error, "at": now}
        self.failures.append(
            {
                "path": item.remote_path,
                "at": now,
                "error": error,
                "attempt": item.attempts,
                "retryable": retryable,
            }
        )
        del self.failures[:-20]
        if say:
            self._throttle.warning(
                item.remote_path,
                error,
                "upload of %s failed (attempt %d): %s; retry in %.1fs",
                item.remote_path,
                item.attempts,
                error,
                delay,
            )
        self.ledger.note_attempt(item.remote_path, item.sha256, attempts=item.attempts, error=error)

    def _discard(self, item: Item) -> None:
        """Drop ``item``'s snapshot file; a live checkpoint is never deleted."""
        if item.snapshot:
            unlink_quietly(item.local)

    def backoff(self, attempts: int) -> float:
        """Exponential backoff with jitter: ~1s, 2s, 4s ... capped at ``max_backoff_s``."""
        return backoff.delay_s(attempts, first_s=1.0, cap_s=self.cfg.max_backoff_s, rng=self._rng)

    # ---------------------------------------------------------------- control

    async def drain(self, timeout: float) -> bool:
        """Wait until nothing is queued or in flight; False when ``timeout`` ran out first."""
        self._wake.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def retry_now(self) -> None:
        """Forget backoff (the final sync should not wait out a long pause)."""
        for item in self._pending.values():
            # The target's own Retry-After stands: sooner only earns another 429.
            item.not_before = item.asked_until
        self._wake.set()

    async def close(self) -> None:
        """Stop the worker, cancel watchers; threads still sending are left to finish on their
        own."""
        # Cancelled watchers free their paths and wake the worker: it must not start new uploads.
        self._closed = True
        self._wake.set()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.ledger.dirty:
            self.ledger.persist()
