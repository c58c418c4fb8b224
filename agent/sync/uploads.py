"""The upload queue: one worker that sends snapshots to the sink, with timeouts, backoff and a
read-back of size and sha256 after every upload, recording each outcome in the ledger.

Queue rule: one pending item per remote path (a newer snapshot supersedes a queued older one) and
never two uploads of the same path in flight, even after a timeout gave up waiting for a thread.

Failure rule: nothing that fails while recording (a ledger write hitting EMFILE or ENOSPC) drops
an item: items are re-queued first, the ledger stays dirty in memory and is written again later.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agent.config.model import SyncSection
from agent.sinks import Sink, SinkError
from agent.sync.ledger import ItemKind, Ledger
from agent.sync.snapshots import live_snapshot, unlink_quietly
from agent.util import backoff
from agent.util.crashpoints import crashpoint
from agent.util.logutil import RateLimiter
from agent.util.text import os_error
from agent.util.threads import in_daemon_thread

# One logger for all of sync: its lines are grepped and asserted as ``agent.sync.engine``.
log = logging.getLogger(__name__)

#: What became of one file offered to the queue: queued, already there (or on its way), or
#: not to be had (missing, torn, not a valid zip).
Queued = Literal["queued", "unchanged", "unavailable"]


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


@dataclass
class _Flight:
    """An upload whose thread has not ended yet."""

    item: Item
    future: concurrent.futures.Future[Any]
    started_at: float


class Throttle:
    """At most one log line per key per ``interval_s``: a target down for hours, retried every
    few seconds, must not write megabytes of the same warning. Counts what it held back."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._limiter = RateLimiter(interval_s, clock=clock)

    def allow(self, path: str, error: str) -> int | None:
        """None: suppress this line; else log it, with this many similar lines held back."""
        # Numbers and hashes differ between otherwise identical errors (sizes, request ids).
        passed = self._limiter.admit((path, re.sub(r"[0-9a-f]*\d[0-9a-f.]*", "#", error)))
        return None if passed is None else passed[0]

    def warning(self, path: str, error: str, fmt: str, *args: Any) -> None:
        """A warning, at most once per path and distinct error per ``interval_s``."""
        suppressed = self.allow(path, error)
        if suppressed is None:
            return
        if suppressed:
            fmt += " (%d more like this not logged)"
            args = (*args, suppressed)
        log.warning(fmt, *args)


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
    ) -> None:
        self.sink = sink
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
        items = [*self._pending.values(), *(f.item for f in self._in_flight.values())]
        return sum(i.size for i in items)

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
            return flight.item.sha256, flight.item.size
        return None

    def snapshot_files(self) -> set[Path]:
        """The snapshot files of the uploads still owed (queued or in flight)."""
        items = [*self._pending.values(), *(f.item for f in self._in_flight.values())]
        return {i.local for i in items if i.snapshot}

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
                    "epoch": f.item.epoch,
                    "attempt": f.item.attempts,
                    "started_at": f.started_at,
                    "seconds": round(now - f.started_at, 1),
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
            now = self._clock()
            next_due: float | None = None
            for path, item in list(self._pending.items()):
                if path in self._in_flight:
                    continue
                if len(self._in_flight) >= self.max_parallel:
                    break
                if item.not_before > now:
                    next_due = (
                        item.not_before if next_due is None else min(next_due, item.not_before)
                    )
                    continue
                del self._pending[path]
                self._start(item)
            if not self._pending and not self._in_flight:
                self._idle.set()
            timeout = None if next_due is None else max(0.0, next_due - self._clock())
            if self.ledger.dirty:
                retry = max(0.0, self._ledger_retry_at - time.monotonic())
                timeout = retry if timeout is None else min(timeout, retry)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _start(self, item: Item) -> None:
        item.attempts += 1
        # A daemon thread: one upload hung on a dead target must not keep the finished agent
        # (and the box's bill) alive; the ledger is persisted, abandoning it loses nothing.
        fut = in_daemon_thread(
            self._upload_and_verify, item, name=f"sync-upload:{item.remote_path}"
        )
        flight = _Flight(item, fut, self._clock())
        self._in_flight[item.remote_path] = flight
        task = asyncio.create_task(self._watch(flight), name=f"upload:{item.remote_path}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, flight: _Flight) -> None:
        item, fut = flight.item, flight.future
        try:
            sha256, size = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(fut)), self.cfg.upload_timeout_s
            )
        except TimeoutError:
            self._failed(item, f"timed out after {self.cfg.upload_timeout_s:.0f}s")
            # The thread may still be sending: the path stays in flight until it really ends.
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(fut)
        except SinkError as exc:
            self._failed(item, str(exc), retryable=exc.retryable, retry_after_s=exc.retry_after_s)
        except OSError as exc:  # a sink that lets EMFILE/ENOSPC through: retried like any other
            self._failed(item, os_error(exc))
        except Exception as exc:  # a sink bug must not kill the queue
            error = f"{type(exc).__name__}: {exc}"
            if self._throttle.allow(f"crash:{item.remote_path}", error) is not None:
                log.exception("upload of %s crashed", item.remote_path)
            self._failed(item, error)
        else:
            self._succeeded(item, sha256, size)
            self._note_speed(size, self._clock() - flight.started_at)
        finally:
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

    def _succeeded(self, item: Item, sha256: str, size: int) -> None:
        self.uploads_done += 1
        self.uploaded_bytes += size
        now = self._clock()
        self.last_success_at = now
        # A live file (no snapshot) may have been re-hashed before this attempt: the ledger
        # records what really went up.
        recorded = item.sha256
        item.sha256, item.size = sha256, size
        self.ledger.mark_verified(
            item.remote_path, recorded, sha256=sha256, size=size, at=now, attempts=item.attempts
        )
        if item.epoch is not None and item.kind in (ItemKind.LAST, ItemKind.EPOCH):
            self.last_synced_epoch = max(self.last_synced_epoch or 0, item.epoch)
        log.info(
            "uploaded+verified %s epoch=%s size=%d sha256=%s attempt=%d%s",
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

    def _upload_and_verify(self, item: Item) -> tuple[str, int]:
        """Runs in a worker thread: one attempt, then read back size and sha256. Returns the
        (sha256, size) that went up."""
        if not self._prepared:
            self.sink.prepare()
            self._prepared = True
        sha256, size = item.sha256, item.size
        if not item.snapshot:
            # No snapshot: the live file may have moved on since it was hashed (a retry after
            # a read-back mismatch): hash what is there now.
            st = item.local.stat()
            if item.attempts > 1 or (st.st_size, st.st_mtime_ns) != (item.size, item.mtime_ns):
                fresh = live_snapshot(item.local, checkpoint=item.remote_path.endswith(".pt"))
                if fresh is None:
                    raise SinkError(f"{item.local} is being rewritten; trying again later")
                sha256, size = fresh.sha256, fresh.size
        self.sink.upload(item.local, item.remote_path)
        crashpoint("upload-sent")
        remote = self.sink.stat(item.remote_path)
        if remote is None:
            raise SinkError(f"{item.remote_path} was accepted but is not on the target")
        if remote.sha256 != sha256 or remote.size != size:
            raise SinkError(
                f"{item.remote_path} read back as size={remote.size} sha256={remote.sha256[:12]}, "
                f"expected size={size} sha256={sha256[:12]}"
            )
        return sha256, size

    def _failed(
        self,
        item: Item,
        error: str,
        *,
        retryable: bool = True,
        retry_after_s: float | None = None,
    ) -> None:
        self.uploads_failed += 1
        self._tell(item, ok=False, error=error)
        delay = self.backoff(item.attempts)
        if not retryable:
            # Waiting cannot fix a bad token, but a person can; retry slowly, never give up.
            delay = self.cfg.max_backoff_s
        elif retry_after_s is not None:
            # The target said when to come back (HTTP 429 Retry-After): not sooner.
            delay = max(delay, min(retry_after_s, self.cfg.max_backoff_s))
        now = self._clock()
        item.last_error = error
        item.not_before = now + delay
        # Re-queue first: nothing below (the ledger write above all) may lose the item.
        newer = self._pending.get(item.remote_path)
        if newer is None:
            self._pending[item.remote_path] = item
        elif newer is not item:
            # A newer snapshot arrived while this one was failing: it wins.
            self._discard(item)
            newer.attempts, newer.not_before = item.attempts, item.not_before
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
            item.not_before = 0.0
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
