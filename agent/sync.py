"""Getting checkpoints off the box: milestone policy, snapshots, a coalescing upload queue with
timeouts and backoff, a persisted ledger, and verification by reading back size and sha256.

Consistency rule (DESIGN.md): LibreYOLO writes checkpoints in place, before that epoch's
status.json. When status.json says ``completed_epochs = N`` the weights of epoch N are whole, so
the agent copies them to a snapshot then, checks the copy is a valid zip with an unchanged
source, and uploads the snapshot - never the live file.

Queue rule: one pending item per remote path (a newer snapshot supersedes a queued older one) and
never two uploads of the same path in flight, even after a timeout gave up waiting for a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .config import SyncSection
from .rundir import SMALL_FILES, RunStatus, epoch_snapshots, is_valid_checkpoint
from .sinks import RemoteFile, Sink, SinkError, sha256_file
from .state import atomic_write_json

log = logging.getLogger("agent.sync")

#: Extra files from the state directory that ride along under ``agent/`` in the target.
AGENT_FILES = ("state.json", "trainer.log", "preflight.json", "staging.json", "agent.log")


@dataclass
class Item:
    """One file to store: a snapshot on local disk and where it goes."""

    remote_path: str
    local: Path
    sha256: str
    size: int
    epoch: int | None
    kind: str  #: last | best | epoch | small | agent
    created_at: float = field(default_factory=time.time)
    attempts: int = 0
    not_before: float = 0.0
    last_error: str | None = None


@dataclass
class LedgerEntry:
    remote_path: str
    sha256: str
    size: int
    epoch: int | None
    kind: str
    status: str  #: pending | verified | failed
    queued_at: float
    uploaded_at: float | None = None
    verified_at: float | None = None
    attempts: int = 0
    error: str | None = None


class Ledger:
    """What the target is expected to hold: the newest version of each remote path, persisted
    in the state directory so a restarted agent still knows what it promised."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, LedgerEntry] = {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            for d in data.get("entries", []):
                e = LedgerEntry(**d)
                self.entries[e.remote_path] = e
        except FileNotFoundError:
            pass

    def save(self) -> None:
        atomic_write_json(
            self.path, {"entries": [asdict(e) for e in sorted_entries(self.entries.values())]}
        )

    def expect(self, item: Item) -> None:
        self.entries[item.remote_path] = LedgerEntry(
            remote_path=item.remote_path,
            sha256=item.sha256,
            size=item.size,
            epoch=item.epoch,
            kind=item.kind,
            status="pending",
            queued_at=item.created_at,
        )
        self.save()

    def update(self, remote_path: str, sha256: str, **changes: Any) -> None:
        e = self.entries.get(remote_path)
        # A result for an older snapshot must not overwrite the entry of a newer one.
        if e is None or e.sha256 != sha256:
            return
        for k, v in changes.items():
            setattr(e, k, v)
        self.save()

    def last_verified_checkpoint(self) -> LedgerEntry | None:
        done = [
            e
            for e in self.entries.values()
            if e.status == "verified" and e.remote_path.endswith(".pt") and e.verified_at
        ]
        return max(done, key=lambda e: e.verified_at or 0.0) if done else None


def sorted_entries(entries: Iterable[LedgerEntry]) -> list[LedgerEntry]:
    return sorted(entries, key=lambda e: e.remote_path)


@dataclass(frozen=True)
class VerifyResult:
    """What the teardown gate reads: everything the ledger expects is on the target, intact."""

    sync_verified: bool
    checked: int
    missing: list[dict[str, Any]]
    at: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Snapshotter:
    """Copies live files to stable snapshots at the safe moment."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._seq = 0

    def take(self, src: Path, *, checkpoint: bool) -> tuple[Path, str, int] | None:
        """Copy ``src``; None when it is missing or changed while copied (torn)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        dst = self.root / f"{self._seq:06d}-{src.name}"
        try:
            before = src.stat()
            shutil.copyfile(src, dst)
            after = src.stat()
        except FileNotFoundError:
            return None
        if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
            log.warning("snapshot of %s skipped: it changed while being copied", src.name)
            dst.unlink(missing_ok=True)
            return None
        if checkpoint and not is_valid_checkpoint(dst):
            log.warning("snapshot of %s skipped: not a valid zip archive (torn write?)", src.name)
            dst.unlink(missing_ok=True)
            return None
        return dst, sha256_file(dst), dst.stat().st_size


class SyncEngine:
    """The upload queue, its worker, verification and the milestone policy."""

    def __init__(
        self,
        sink: Sink,
        cfg: SyncSection,
        *,
        state_dir: Path,
        max_parallel: int = 2,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sink = sink
        self.cfg = cfg
        self.state_dir = state_dir
        self.ledger = Ledger(state_dir / "sync-ledger.json")
        self.snapshots = Snapshotter(state_dir / "snapshots")
        self.max_parallel = max_parallel
        self._rng = rng or random.Random()
        self._clock = clock
        self._pending: dict[str, Item] = {}
        self._in_flight: dict[str, concurrent.futures.Future[Any]] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._prepared = False
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.failures: list[dict[str, Any]] = []
        self.uploads_done = 0
        # Milestone state
        self.last_epoch_seen = 0
        self.last_synced_epoch: int | None = None
        self._best_epoch_sent: int | None = None
        self._epoch_files_sent: set[int] = set()
        self.verify_result: VerifyResult | None = None

    # ---------------------------------------------------------------- milestones

    def on_epoch(
        self, run_dir: Path, status: RunStatus, *, extra_files: Iterable[Path] = ()
    ) -> int:
        """status.json moved on: snapshot what this epoch's milestone policy asks for and queue
        it. Returns how many items were queued."""
        n = status.completed_epochs
        if n <= self.last_epoch_seen:
            return 0
        self.last_epoch_seen = n
        weights = run_dir / "weights"
        queued = 0
        total = status.total_epochs
        if n % self.cfg.every_epochs == 0 or (total is not None and n >= total):
            queued += self._queue_file(weights / "last.pt", "weights/last.pt", n, "last")
        best = status.best_epoch
        if (
            best is not None
            and best != self._best_epoch_sent
            and self._queue_file(weights / "best.pt", "weights/best.pt", best, "best")
        ):
            self._best_epoch_sent = best
            queued += 1
        queued += self._queue_epoch_files(run_dir)
        queued += self._queue_small(run_dir, n, extra_files)
        if queued:
            log.info("milestone epoch=%d: %d file(s) queued", n, queued)
        return queued

    def final(
        self,
        run_dir: Path | None,
        status: RunStatus | None,
        extra_files: Iterable[Path],
        *,
        clean_exit: bool = True,
    ) -> int:
        """The end of training: everything, whatever the policy skipped.

        ``clean_exit`` False (interrupted, killed, failed): last.pt/best.pt may have been written
        at an unsafe moment - a SIGINT during ``torch.save`` can leave a structurally valid but
        incomplete zip. Such a file never replaces a verified checkpoint: it goes up beside it
        as ``weights/<name>.at-exit.pt``."""
        queued = 0
        n = status.completed_epochs if status else None
        if run_dir is not None:
            # The trainer has exited: every epoch file on disk is final, seen or not (a
            # restarted agent, epochs that went by between two reads of status.json, or a
            # failed run whose status.json has no completed_epochs). Torn ones fail the zip check.
            on_disk = epoch_snapshots(run_dir)
            self.last_epoch_seen = max(self.last_epoch_seen, n or 0, *on_disk, 0)
            weights = run_dir / "weights"
            for name in ("last.pt", "best.pt"):
                kind = name.removesuffix(".pt")
                epoch = status.best_epoch if (status and kind == "best") else n
                remote = f"weights/{name}"
                if not self._differs(weights / name, remote):
                    continue
                entry = self.ledger.entries.get(remote)
                if not clean_exit and entry is not None and entry.status == "verified":
                    remote = f"weights/{kind}.at-exit.pt"
                    log.warning(
                        "%s changed after the last verified epoch and the trainer did not exit "
                        "cleanly: uploading it as %s, keeping the verified one",
                        name,
                        remote,
                    )
                queued += self._queue_file(weights / name, remote, epoch, kind)
            queued += self._queue_epoch_files(run_dir)
        queued += self._queue_small(run_dir, n, extra_files)
        log.info("final sync: %d file(s) queued", queued)
        return queued

    def _differs(self, local: Path, remote_path: str) -> bool:
        entry = self.ledger.entries.get(remote_path)
        if entry is None or not local.exists():
            return True
        pending = self._pending.get(remote_path)
        if pending is None and entry.status != "verified":
            # Promised by the ledger (a previous agent queued it) but not delivered yet.
            return True
        expected = pending.sha256 if pending is not None else entry.sha256
        size = pending.size if pending is not None else entry.size
        try:
            # Compared with what is already queued too: a failing target must not make the
            # final sync copy every unchanged checkpoint again.
            return local.stat().st_size != size or sha256_file(local) != expected
        except OSError:
            return True

    def _queue_epoch_files(self, run_dir: Path) -> int:
        queued = 0
        for epoch, path in sorted(epoch_snapshots(run_dir).items()):
            if epoch in self._epoch_files_sent or epoch > max(self.last_epoch_seen, 0):
                continue
            if self._queue_file(path, f"weights/{path.name}", epoch, "epoch"):
                self._epoch_files_sent.add(epoch)
                queued += 1
        return queued

    def _queue_small(self, run_dir: Path | None, epoch: int | None, extra: Iterable[Path]) -> int:
        queued = 0
        if run_dir is not None:
            for name in SMALL_FILES:
                queued += self._queue_file(run_dir / name, name, epoch, "small", checkpoint=False)
        for path in extra:
            queued += self._queue_file(path, f"agent/{path.name}", epoch, "agent", checkpoint=False)
        return queued

    def _queue_file(
        self, src: Path, remote_path: str, epoch: int | None, kind: str, *, checkpoint: bool = True
    ) -> int:
        snap = self.snapshots.take(src, checkpoint=checkpoint)
        if snap is None:
            return 0
        local, digest, size = snap
        entry = self.ledger.entries.get(remote_path)
        if entry is not None and entry.sha256 == digest and entry.status == "verified":
            local.unlink(missing_ok=True)
            return 0
        self.submit(Item(remote_path, local, digest, size, epoch, kind))
        return 1

    # ---------------------------------------------------------------- queue

    def submit(self, item: Item) -> None:
        """Queue ``item``; a queued older version of the same path is dropped (superseded)."""
        old = self._pending.get(item.remote_path)
        if old is not None:
            log.info(
                "superseded queued %s (epoch %s -> %s)", item.remote_path, old.epoch, item.epoch
            )
            old.local.unlink(missing_ok=True)
            # Keep the backoff of a failing path: a new version is no reason to hammer the target.
            item.attempts, item.not_before = old.attempts, old.not_before
        self._pending[item.remote_path] = item
        self.ledger.expect(item)
        self._idle.clear()
        self._wake.set()

    @property
    def queue(self) -> list[dict[str, Any]]:
        return [
            {"path": i.remote_path, "epoch": i.epoch, "attempts": i.attempts, "error": i.last_error}
            for i in self._pending.values()
        ]

    async def run(self) -> None:
        """The worker: starts uploads for paths not in flight, respecting backoff. Ends once
        :meth:`close` was called (no upload may start after the executor is shut down)."""
        while not self._closed:
            self._wake.clear()
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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _start(self, item: Item) -> None:
        item.attempts += 1
        fut = _in_daemon_thread(self._upload_and_verify, item, name=f"upload:{item.remote_path}")
        self._in_flight[item.remote_path] = fut
        task = asyncio.create_task(self._watch(item, fut), name=f"upload:{item.remote_path}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, item: Item, fut: concurrent.futures.Future[Any]) -> None:
        try:
            await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(fut)), self.cfg.upload_timeout_s
            )
        except TimeoutError:
            self._failed(item, f"timed out after {self.cfg.upload_timeout_s:.0f}s")
            # The thread may still be sending: the path stays in flight until it really ends.
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(fut)
        except SinkError as exc:
            self._failed(item, str(exc), retryable=exc.retryable, retry_after_s=exc.retry_after_s)
        except Exception as exc:  # a sink bug must not kill the queue
            log.exception("upload of %s crashed", item.remote_path)
            self._failed(item, f"{type(exc).__name__}: {exc}")
        else:
            self.uploads_done += 1
            now = self._clock()
            self.ledger.update(
                item.remote_path,
                item.sha256,
                status="verified",
                uploaded_at=now,
                verified_at=now,
                attempts=item.attempts,
                error=None,
            )
            if item.epoch is not None and item.kind in ("last", "epoch"):
                self.last_synced_epoch = max(self.last_synced_epoch or 0, item.epoch)
            log.info(
                "uploaded+verified %s epoch=%s size=%d sha256=%s attempt=%d",
                item.remote_path,
                item.epoch,
                item.size,
                item.sha256[:12],
                item.attempts,
            )
            # The ledger keeps the hash; the snapshot is no longer needed unless superseded later.
            item.local.unlink(missing_ok=True)
        finally:
            self._in_flight.pop(item.remote_path, None)
            self._wake.set()

    def _upload_and_verify(self, item: Item) -> None:
        """Runs in a worker thread: one attempt, then read back size and sha256."""
        if not self._prepared:
            self.sink.prepare()
            self._prepared = True
        self.sink.upload(item.local, item.remote_path)
        remote = self.sink.stat(item.remote_path)
        if remote is None:
            raise SinkError(f"{item.remote_path} was accepted but is not on the target")
        if remote.sha256 != item.sha256 or remote.size != item.size:
            raise SinkError(
                f"{item.remote_path} read back as size={remote.size} sha256={remote.sha256[:12]}, "
                f"expected size={item.size} sha256={item.sha256[:12]}"
            )

    def _failed(
        self,
        item: Item,
        error: str,
        *,
        retryable: bool = True,
        retry_after_s: float | None = None,
    ) -> None:
        delay = self.backoff(item.attempts)
        if not retryable:
            # Waiting cannot fix a bad token, but a person can; retry slowly, never give up.
            delay = self.cfg.max_backoff_s
        elif retry_after_s is not None:
            # The target said when to come back (HTTP 429 Retry-After): not sooner.
            delay = max(delay, min(retry_after_s, self.cfg.max_backoff_s))
        item.last_error = error
        item.not_before = self._clock() + delay
        log.warning(
            "upload of %s failed (attempt %d): %s; retry in %.1fs",
            item.remote_path,
            item.attempts,
            error,
            delay,
        )
        self.failures.append(
            {
                "path": item.remote_path,
                "at": self._clock(),
                "error": error,
                "attempt": item.attempts,
                "retryable": retryable,
            }
        )
        del self.failures[:-20]
        self.ledger.update(item.remote_path, item.sha256, attempts=item.attempts, error=error)
        newer = self._pending.get(item.remote_path)
        if newer is None:
            self._pending[item.remote_path] = item
        else:
            # A newer snapshot arrived while this one was failing: it wins.
            item.local.unlink(missing_ok=True)
            newer.attempts, newer.not_before = item.attempts, item.not_before

    def backoff(self, attempts: int) -> float:
        """Exponential backoff with full jitter: ~1s, 2s, 4s ... capped at ``max_backoff_s``."""
        base = min(self.cfg.max_backoff_s, 1.0 * (2 ** max(attempts - 1, 0)))
        return float(base * self._rng.uniform(0.5, 1.0))

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

    # ---------------------------------------------------------------- verification

    async def verify_all(self) -> VerifyResult:
        """Read back every path the ledger expects and compare size and sha256."""
        entries = list(self.ledger.entries.values())
        missing: list[dict[str, Any]] = []
        for e in entries:
            try:
                remote: RemoteFile | None = await asyncio.wait_for(
                    asyncio.wrap_future(
                        _in_daemon_thread(self.sink.stat, e.remote_path, name="read-back")
                    ),
                    self.cfg.upload_timeout_s,
                )
            except (SinkError, TimeoutError) as exc:
                missing.append({"path": e.remote_path, "problem": f"read-back failed: {exc}"})
                continue
            if remote is None:
                missing.append({"path": e.remote_path, "problem": "not on the target"})
            elif remote.sha256 != e.sha256 or remote.size != e.size:
                missing.append(
                    {
                        "path": e.remote_path,
                        "problem": f"hash mismatch: remote {remote.sha256[:12]} "
                        f"size {remote.size}, expected {e.sha256[:12]} size {e.size}",
                    }
                )
        result = VerifyResult(not missing and bool(entries), len(entries), missing, self._clock())
        self.verify_result = result
        atomic_write_json(self.state_dir / "sync-result.json", result.to_dict())
        return result

    def status(self) -> dict[str, Any]:
        last = self.ledger.last_verified_checkpoint()
        return {
            "target": self.sink.description,
            "last_synced_epoch": self.last_synced_epoch,
            "last_verified_checkpoint": (
                {"path": last.remote_path, "epoch": last.epoch, "at": last.verified_at}
                if last
                else None
            ),
            "queue": self.queue,
            "in_flight": sorted(self._in_flight),
            "uploads_done": self.uploads_done,
            "failures": self.failures[-5:],
            "verified": self.verify_result.to_dict() if self.verify_result else None,
        }

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


def _in_daemon_thread(
    fn: Callable[..., Any], *args: Any, name: str
) -> concurrent.futures.Future[Any]:
    """Run ``fn`` in a daemon thread. Not a ThreadPoolExecutor: its threads are joined at
    interpreter exit, so one upload hung on a dead Hub would keep the finished agent (and the
    box's bill) alive. The ledger is persisted; abandoning such a thread loses nothing."""
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def target() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:
            fut.set_exception(exc)

    threading.Thread(target=target, name=f"sync-{name}", daemon=True).start()
    return fut
