"""Getting checkpoints off the box: milestone policy, snapshots, a coalescing upload queue with
timeouts and backoff, a persisted ledger, and verification by reading back size and sha256.

Consistency rule (DESIGN.md): LibreYOLO writes checkpoints in place, before that epoch's
status.json. When status.json says ``completed_epochs = N`` the weights of epoch N are whole, so
the agent copies them to a snapshot then, checks the copy is a valid zip with an unchanged
source, and uploads the snapshot - never the live file. The one exception is a disk too full to
copy to: then the live file is checked the same way in place, uploaded, and re-hashed before any
retry (the read-back catches a file rewritten while it was sent).

Queue rule: one pending item per remote path (a newer snapshot supersedes a queued older one) and
never two uploads of the same path in flight, even after a timeout gave up waiting for a thread.

Failure rule: nothing that fails while recording (a ledger write hitting EMFILE or ENOSPC) drops
an item: items are re-queued first, the ledger stays dirty in memory and is written again later.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import json
import logging
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from .config import SyncSection
from .crashpoints import crashpoint
from .rundir import SMALL_FILES, RunStatus, epoch_snapshots, is_valid_checkpoint
from .sinks import RemoteFile, Sink, SinkError, sha256_file
from .state import atomic_write_json

log = logging.getLogger("agent.sync")

#: Extra files from the state directory that ride along under ``agent/`` in the target.
AGENT_FILES = ("state.json", "trainer.log", "preflight.json", "staging.json", "agent.log")
#: At most one warning line per path and distinct error in this many seconds.
LOG_EVERY_S = 60.0
#: How often a ledger that could not be written is tried again, seconds.
LEDGER_RETRY_S = 5.0
#: ``status()`` reports the queue as stalled when no upload completed for this long while
#: work was waiting, seconds.
STALLED_AFTER_S = 120.0

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_SEQ = re.compile(r"(\d+)-(.+)")
_AT_EXIT = re.compile(r"(last|best)\.at-exit\.pt")

#: What became of one file the milestone policy asked for.
Queued = Literal["queued", "unchanged", "unavailable"]


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
    #: False when no snapshot could be made (disk full): ``local`` is then the live file, which
    #: is never deleted and is hashed again before a retry.
    snapshot: bool = True
    #: The live file's mtime when it was hashed (``snapshot`` False only).
    mtime_ns: int | None = None


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
    in the state directory so a restarted agent still knows what it promised.

    Changes are saved at once; a save that fails (no descriptors, no disk) leaves the ledger
    ``dirty`` in memory, says so once per distinct error, and the engine saves it again later."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, LedgerEntry] = {}
        #: In memory but not on disk yet: a save failed.
        self.dirty = False
        #: Why the newest save failed; None once one succeeds.
        self.save_error: str | None = None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            for d in data.get("entries", []):
                e = LedgerEntry(**d)
                self.entries[e.remote_path] = e
        except FileNotFoundError:
            pass
        except (ValueError, TypeError, AttributeError) as exc:
            # Unreadable (a disk error, a hand edit): keep it for a person and start empty.
            # The final sync then compares every file on disk with the target again, so a
            # forgotten promise costs a re-upload, never a lost checkpoint.
            aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
            with contextlib.suppress(OSError):
                os.replace(path, aside)
            log.error("sync ledger %s unreadable (%s); moved to %s", path, exc, aside.name)
            self.entries.clear()

    def save(self) -> None:
        """Write the ledger atomically; raises OSError (see :meth:`persist`)."""
        atomic_write_json(
            self.path,
            {"entries": [asdict(e) for e in sorted_entries(self.entries.values())]},
            mode=0o600,
        )

    def persist(self) -> bool:
        """Save, never raising OSError: False when the ledger stays dirty in memory."""
        try:
            self.save()
        except OSError as exc:
            self.dirty = True
            message = describe(exc)
            if message != self.save_error:
                log.error("sync ledger not saved (%s): kept in memory, saved again later", message)
            self.save_error = message
            return False
        if self.save_error is not None:
            log.info("sync ledger saved again (it had failed: %s)", self.save_error)
        self.dirty = False
        self.save_error = None
        return True

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
        self.persist()

    def update(self, remote_path: str, sha256: str, /, **changes: Any) -> None:
        """Change the entry of ``remote_path`` if it still expects ``sha256``."""
        e = self.entries.get(remote_path)
        # A result for an older snapshot must not overwrite the entry of a newer one.
        if e is None or e.sha256 != sha256:
            return
        for k, v in changes.items():
            setattr(e, k, v)
        self.persist()

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
    """What the teardown gate reads: everything the ledger expects and every completed
    checkpoint on disk is on the target, intact."""

    sync_verified: bool
    checked: int
    missing: list[dict[str, Any]]
    at: float
    #: Files on disk that were not checked, and why (a checkpoint torn at exit).
    skipped: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Snapshot:
    """A checked, hashed copy of a live file; ``live`` when no copy could be made and ``path``
    is the live file itself, checked in place."""

    path: Path
    sha256: str
    size: int
    mtime_ns: int
    live: bool = False
    #: Why no copy was made (``live`` only): ENOSPC and friends.
    copy_error: OSError | None = None


class Snapshotter:
    """Copies live files to stable snapshots at the safe moment. ``copy`` is the one call that
    writes to the snapshot folder (tests inject a full disk there)."""

    def __init__(
        self, root: Path, *, copy: Callable[[Path, Path], object] = shutil.copyfile
    ) -> None:
        self.root = root
        self.copy = copy
        self._seq: int | None = None
        self._lock = threading.Lock()

    def files(self) -> list[Path]:
        """Every file in the snapshot folder (partial ``.tmp`` copies included)."""
        try:
            return sorted(p for p in self.root.iterdir() if p.is_file())
        except FileNotFoundError:
            return []

    def _next(self, name: str) -> Path:
        with self._lock:
            if self._seq is None:
                # A killed agent may have left snapshots behind: never reuse their names.
                seqs = (int(m.group(1)) for p in self.files() if (m := _SEQ.fullmatch(p.name)))
                self._seq = max(seqs, default=0)
            self._seq += 1
            return self.root / f"{self._seq:06d}-{name}"

    def take(self, src: Path, *, checkpoint: bool) -> Snapshot | None:
        """Copy ``src``; None when it is missing, changed while copied (torn) or not a valid
        zip. When the copy itself fails (a full disk), the partial copy is deleted and the
        live file is checked in place instead (``live``). Never raises OSError."""
        try:
            before = src.stat()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("snapshot of %s skipped: %s", src.name, describe(exc))
            return None
        dst = self._next(src.name)
        tmp = dst.with_name(dst.name + ".tmp")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.copy(src, tmp)
            after = src.stat()
        except OSError as exc:
            unlink_quietly(tmp)
            if not src.exists():
                return None
            live = live_snapshot(src, checkpoint=checkpoint)
            if live is None:
                log.warning(
                    "snapshot of %s failed (%s), the live file too", src.name, describe(exc)
                )
                return None
            return dataclasses.replace(live, copy_error=exc)
        if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
            log.warning("snapshot of %s skipped: it changed while being copied", src.name)
            unlink_quietly(tmp)
            return None
        if checkpoint and not is_valid_checkpoint(tmp):
            log.warning("snapshot of %s skipped: not a valid zip archive (torn write?)", src.name)
            unlink_quietly(tmp)
            return None
        try:
            tmp.replace(dst)
            return Snapshot(dst, sha256_file(dst), dst.stat().st_size, after.st_mtime_ns)
        except OSError as exc:
            log.warning("snapshot of %s skipped: %s", src.name, describe(exc))
            unlink_quietly(tmp)
            unlink_quietly(dst)
            return None

    def remove_except(self, keep: set[Path]) -> tuple[int, int]:
        """Delete every file in the snapshot folder that is not in ``keep``; (files, bytes)."""
        files = size = 0
        for p in self.files():
            if p in keep:
                continue
            with contextlib.suppress(OSError):
                size += p.stat().st_size
            if unlink_quietly(p):
                files += 1
        return files, size


def live_snapshot(src: Path, *, checkpoint: bool) -> Snapshot | None:
    """Check and hash ``src`` where it is: a valid zip (checkpoints) whose size and mtime are
    the same before and after hashing. None (logged) when it is not."""
    try:
        before = src.stat()
        if checkpoint and not is_valid_checkpoint(src):
            log.warning("%s not used: not a valid zip archive (torn write?)", src.name)
            return None
        digest = sha256_file(src)
        after = src.stat()
    except OSError as exc:
        log.warning("%s not used: %s", src.name, describe(exc))
        return None
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
        log.warning("%s not used: it changed while being hashed", src.name)
        return None
    return Snapshot(src, digest, after.st_size, after.st_mtime_ns, live=True)


@dataclass
class _Flight:
    """An upload whose thread has not ended yet."""

    item: Item
    future: concurrent.futures.Future[Any]
    started_at: float


@dataclass
class _Seen:
    at: float
    suppressed: int = 0


class _Throttle:
    """At most one log line per key per ``interval_s``: a target down for hours, retried every
    few seconds, must not write megabytes of the same warning. Counts what it held back."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._seen: dict[tuple[str, str], _Seen] = {}

    def allow(self, path: str, error: str) -> int | None:
        """None: suppress this line; else log it, with this many similar lines held back."""
        now = self._clock()
        # Numbers and hashes differ between otherwise identical errors (sizes, request ids).
        key = (path, re.sub(r"[0-9a-f]*\d[0-9a-f.]*", "#", error))
        seen = self._seen.get(key)
        if seen is not None and now - seen.at < self.interval_s:
            seen.suppressed += 1
            return None
        if len(self._seen) > 512:
            self._seen = {k: s for k, s in self._seen.items() if now - s.at < self.interval_s}
        self._seen[key] = _Seen(now)
        return seen.suppressed if seen is not None else 0


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
        log_every_s: float = LOG_EVERY_S,
        ledger_retry_s: float = LEDGER_RETRY_S,
        stalled_after_s: float = STALLED_AFTER_S,
    ) -> None:
        self.sink = sink
        self.cfg = cfg
        self.state_dir = state_dir
        self.ledger = Ledger(state_dir / "sync-ledger.json")
        self.snapshots = Snapshotter(state_dir / "snapshots")
        self.max_parallel = max_parallel
        self.ledger_retry_s = ledger_retry_s
        self.stalled_after_s = stalled_after_s
        self._rng = rng or random.Random()
        self._clock = clock
        self._throttle = _Throttle(log_every_s)
        self._pending: dict[str, Item] = {}
        self._in_flight: dict[str, _Flight] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        # Snapshot work runs in threads: one batch at a time, so milestones stay in order.
        self._files = asyncio.Lock()
        self._prepared = False
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._ledger_retry_at = 0.0
        self._busy_since: float | None = None
        self.failures: list[dict[str, Any]] = []
        self.uploads_done = 0
        self.last_success_at: float | None = None
        self.last_error: dict[str, Any] | None = None
        #: ``{"since", "message"}`` while snapshots cannot be written (uploads go from the
        #: live files), else None.
        self.disk_full: dict[str, Any] | None = None
        #: Remote paths the ledger still owes but whose snapshot and source are both gone.
        self.sources_gone: list[str] = []
        # Milestone state
        self.last_epoch_seen = 0
        self.last_synced_epoch: int | None = None
        self._best_epoch_sent: int | None = None
        self._epoch_files_sent: set[int] = set()
        self.verify_result: VerifyResult | None = None

    # ---------------------------------------------------------------- milestones

    async def on_epoch(
        self, run_dir: Path, status: RunStatus, *, extra_files: Iterable[Path] = ()
    ) -> int:
        """status.json moved on: snapshot what this epoch's milestone policy asks for and queue
        it (the copying and hashing run in a thread). Returns how many items were queued."""
        n = status.completed_epochs
        if n <= self.last_epoch_seen:
            return 0
        self.last_epoch_seen = n
        extra = list(extra_files)
        async with self._files:
            weights = run_dir / "weights"
            queued = 0
            total = status.total_epochs
            if n % self.cfg.every_epochs == 0 or (total is not None and n >= total):
                outcome = await self._queue_file(weights / "last.pt", "weights/last.pt", n, "last")
                queued += outcome == "queued"
            best = status.best_epoch
            if best is not None and best != self._best_epoch_sent:
                outcome = await self._queue_file(
                    weights / "best.pt", "weights/best.pt", best, "best"
                )
                if outcome != "unavailable":
                    self._best_epoch_sent = best
                queued += outcome == "queued"
            queued += await self._queue_epoch_files(run_dir)
            queued += await self._queue_small(run_dir, n, extra)
        if queued:
            log.info("milestone epoch=%d: %d file(s) queued", n, queued)
        return queued

    async def final(
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
        extra = list(extra_files)
        queued = 0
        n = status.completed_epochs if status else None
        async with self._files:
            if run_dir is not None:
                # The trainer has exited: every epoch file on disk is final, seen or not (a
                # restarted agent, epochs that went by between two reads of status.json, or a
                # failed run whose status.json has no completed_epochs). Torn ones fail the
                # zip check.
                on_disk = epoch_snapshots(run_dir)
                self.last_epoch_seen = max(self.last_epoch_seen, n or 0, *on_disk, 0)
                weights = run_dir / "weights"
                for name in ("last.pt", "best.pt"):
                    kind = name.removesuffix(".pt")
                    epoch = status.best_epoch if (status and kind == "best") else n
                    remote = f"weights/{name}"
                    if not await self._differs(weights / name, remote):
                        continue
                    entry = self.ledger.entries.get(remote)
                    # The epoch's own checkpoint is verified, queued or being sent: an unsafe
                    # rewrite goes beside it, never over it.
                    has_good = (entry is not None and entry.status == "verified") or (
                        remote in self._pending or remote in self._in_flight
                    )
                    if not clean_exit and has_good:
                        remote = f"weights/{kind}.at-exit.pt"
                        log.warning(
                            "%s changed after the last verified epoch and the trainer did not "
                            "exit cleanly: uploading it as %s, keeping the verified one",
                            name,
                            remote,
                        )
                    outcome = await self._queue_file(weights / name, remote, epoch, kind)
                    queued += outcome == "queued"
                queued += await self._queue_epoch_files(run_dir)
            queued += await self._queue_small(run_dir, n, extra)
        log.info("final sync: %d file(s) queued", queued)
        return queued

    def _expected(self, remote_path: str) -> tuple[str, int] | None:
        """(sha256, size) of what the target holds or is about to: the queued version, else
        the one being sent, else the verified one."""
        pending = self._pending.get(remote_path)
        if pending is not None:
            return pending.sha256, pending.size
        flight = self._in_flight.get(remote_path)
        if flight is not None:
            return flight.item.sha256, flight.item.size
        entry = self.ledger.entries.get(remote_path)
        if entry is not None and entry.status == "verified":
            return entry.sha256, entry.size
        # Promised by the ledger (a previous agent queued it) but not delivered yet, or new.
        return None

    async def _differs(self, local: Path, remote_path: str) -> bool:
        expected = self._expected(remote_path)
        if expected is None:
            return True
        # Compared with what is queued and in flight too: a failing or slow target must not
        # make the final sync copy, upload and verify an unchanged checkpoint twice.
        return not await asyncio.to_thread(_has_content, local, *expected)

    async def _queue_epoch_files(self, run_dir: Path) -> int:
        queued = 0
        for epoch, path in sorted(epoch_snapshots(run_dir).items()):
            if epoch in self._epoch_files_sent or epoch > max(self.last_epoch_seen, 0):
                continue
            outcome = await self._queue_file(path, f"weights/{path.name}", epoch, "epoch")
            if outcome != "unavailable":
                self._epoch_files_sent.add(epoch)
            queued += outcome == "queued"
        return queued

    async def _queue_small(self, run_dir: Path | None, epoch: int | None, extra: list[Path]) -> int:
        files: list[tuple[Path, str, str]] = []
        if run_dir is not None:
            files += [(run_dir / name, name, "small") for name in SMALL_FILES]
        files += [(path, f"agent/{path.name}", "agent") for path in extra]
        queued = 0
        for src, remote, kind in files:
            outcome = await self._queue_file(src, remote, epoch, kind, checkpoint=False)
            queued += outcome == "queued"
        return queued

    async def _queue_file(
        self, src: Path, remote_path: str, epoch: int | None, kind: str, *, checkpoint: bool = True
    ) -> Queued:
        try:
            snap = await asyncio.to_thread(self.snapshots.take, src, checkpoint=checkpoint)
        except OSError as exc:  # take() catches its own; listing the folder can still fail
            self._warn(remote_path, describe(exc), "snapshot of %s failed: %s", src.name, exc)
            return "unavailable"
        if snap is None:
            return "unavailable"
        self._note_disk(snap, checkpoint=checkpoint)
        if self._expected(remote_path) == (snap.sha256, snap.size):
            if not snap.live:
                unlink_quietly(snap.path)
            return "unchanged"
        self.submit(
            Item(
                remote_path,
                snap.path,
                snap.sha256,
                snap.size,
                epoch,
                kind,
                snapshot=not snap.live,
                mtime_ns=snap.mtime_ns if snap.live else None,
            )
        )
        return "queued"

    def _note_disk(self, snap: Snapshot, *, checkpoint: bool) -> None:
        """Say once that snapshots cannot be written, and once that they can again."""
        err = snap.copy_error
        if err is None:
            # A small file still fits on a disk too full for a checkpoint: only a checkpoint
            # copy says there is room again (else the warning comes back every epoch).
            if self.disk_full is not None and checkpoint:
                log.info(
                    "snapshots work again (the disk had been full since %.0f)",
                    self.disk_full["since"],
                )
                self.disk_full = None
            return
        if err.errno in _DISK_FULL:
            if self.disk_full is None:
                self.disk_full = {"since": self._clock(), "message": describe(err)}
                self._warn(
                    "snapshots",
                    "disk full",
                    "disk full: cannot snapshot to %s (%s); uploading checkpoints straight "
                    "from the run directory until there is room",
                    self.snapshots.root,
                    describe(err),
                )
        else:
            self._warn(
                "snapshot",
                describe(err),
                "snapshot of %s failed (%s): uploading the live file",
                snap.path.name,
                describe(err),
            )

    # ---------------------------------------------------------------- start-up and the end

    async def recover(self, run_dir: Path | None) -> int:
        """At start-up, before the first milestone: re-queue what a previous agent promised
        but never verified, then delete the snapshot files nothing needs any more.

        Each unverified ledger entry is queued from its leftover snapshot when one still has the
        expected sha256, else from a fresh snapshot of its source (a newer version supersedes
        the promise). An entry whose snapshot and source are both gone stays pending, is
        logged and listed in ``status()["sources_gone"]``; verification reports it. Returns
        how many items were queued."""
        async with self._files:
            leftovers = await asyncio.to_thread(self.snapshots.files)
            used: set[Path] = set()
            queued = 0
            for entry in sorted_entries(list(self.ledger.entries.values())):
                path = entry.remote_path
                if entry.status == "verified" or path in self._pending or path in self._in_flight:
                    continue
                copy = await asyncio.to_thread(_find_copy, leftovers, used, entry)
                if copy is not None:
                    used.add(copy)
                    item = Item(path, copy, entry.sha256, entry.size, entry.epoch, entry.kind)
                    item.attempts = entry.attempts
                    self.submit(item)
                    queued += 1
                    continue
                src = self._source_of(path, run_dir)
                outcome: Queued = "unavailable"
                if src is not None:
                    outcome = await self._queue_file(
                        src, path, entry.epoch, entry.kind, checkpoint=path.endswith(".pt")
                    )
                queued += outcome == "queued"
                if outcome == "unavailable" and path not in self.sources_gone:
                    self.sources_gone.append(path)
                    log.warning(
                        "recover: %s (epoch %s) is owed to the target but neither its snapshot "
                        "nor its source is left; it stays pending and verification reports it",
                        path,
                        entry.epoch,
                    )
            files, size = await asyncio.to_thread(self.snapshots.remove_except, self._needed())
        if files:
            log.info("recover: removed %d stale snapshot file(s), %d bytes", files, size)
        if queued:
            log.info("recover: %d unverified file(s) queued again", queued)
        return queued

    def _source_of(self, remote_path: str, run_dir: Path | None) -> Path | None:
        """The local file a remote path is uploaded from, or None when it has none here."""
        head, _, name = remote_path.partition("/")
        if head == "agent" and name and "/" not in name:
            return self.state_dir / name
        if run_dir is None:
            return None
        if head == "weights" and name and "/" not in name:
            m = _AT_EXIT.fullmatch(name)
            return run_dir / "weights" / (f"{m.group(1)}.pt" if m else name)
        if remote_path in SMALL_FILES:
            return run_dir / remote_path
        return None

    def _needed(self) -> set[Path]:
        items = [*self._pending.values(), *(f.item for f in self._in_flight.values())]
        return {i.local for i in items if i.snapshot}

    async def cleanup(self) -> int:
        """At DONE: delete the snapshot files. Those of uploads still owed (queued or in
        flight) are kept for a restarted agent; once everything is verified the folder ends up
        empty. Returns how many files were removed."""
        async with self._files:
            files, size = await asyncio.to_thread(self.snapshots.remove_except, self._needed())
        if files:
            log.info("removed %d snapshot file(s), %d bytes", files, size)
        return files

    # ---------------------------------------------------------------- queue

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

    @property
    def queue(self) -> list[dict[str, Any]]:
        return [
            {"path": i.remote_path, "epoch": i.epoch, "attempts": i.attempts, "error": i.last_error}
            for i in self._pending.values()
        ]

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
        fut = _in_daemon_thread(self._upload_and_verify, item, name=f"upload:{item.remote_path}")
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
            self._failed(item, describe(exc))
        except Exception as exc:  # a sink bug must not kill the queue
            error = f"{type(exc).__name__}: {exc}"
            if self._throttle.allow(f"crash:{item.remote_path}", error) is not None:
                log.exception("upload of %s crashed", item.remote_path)
            self._failed(item, error)
        else:
            self._succeeded(item, sha256, size)
        finally:
            self._in_flight.pop(item.remote_path, None)
            self._wake.set()

    def _succeeded(self, item: Item, sha256: str, size: int) -> None:
        self.uploads_done += 1
        now = self._clock()
        self.last_success_at = now
        # A live file (no snapshot) may have been re-hashed before this attempt: the ledger
        # records what really went up.
        recorded = item.sha256
        item.sha256, item.size = sha256, size
        self.ledger.update(
            item.remote_path,
            recorded,
            sha256=sha256,
            size=size,
            status="verified",
            uploaded_at=now,
            verified_at=now,
            attempts=item.attempts,
            error=None,
        )
        if item.epoch is not None and item.kind in ("last", "epoch"):
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
        self._warn(
            item.remote_path,
            error,
            "upload of %s failed (attempt %d): %s; retry in %.1fs",
            item.remote_path,
            item.attempts,
            error,
            delay,
        )
        self.ledger.update(item.remote_path, item.sha256, attempts=item.attempts, error=error)

    def _discard(self, item: Item) -> None:
        """Drop ``item``'s snapshot file; a live checkpoint is never deleted."""
        if item.snapshot:
            unlink_quietly(item.local)

    def _warn(self, path: str, error: str, fmt: str, *args: Any) -> None:
        """A warning, at most once per path and distinct error per ``log_every_s``."""
        suppressed = self._throttle.allow(path, error)
        if suppressed is None:
            return
        if suppressed:
            fmt += " (%d more like this not logged)"
            args = (*args, suppressed)
        log.warning(fmt, *args)

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

    async def verify_all(
        self, run_dir: Path | None = None, *, completed_epochs: int | None = None
    ) -> VerifyResult:
        """Read back every path the ledger expects and compare size and sha256; with
        ``run_dir``, also require every checkpoint on disk to be on the target: ``last.pt``,
        ``best.pt`` (at their path or, after an unclean exit, as ``<name>.at-exit.pt``) and
        each ``epoch_N.pt`` with N <= ``completed_epochs`` (None: all of them - call it once
        the trainer has exited). A checkpoint that is not a valid zip is skipped, with a note."""
        entries = list(self.ledger.entries.values())
        read: dict[str, RemoteFile | None] = {}
        missing: list[dict[str, Any]] = []
        skipped: list[dict[str, Any]] = []

        async def read_back(path: str) -> RemoteFile | None:
            if path not in read:
                read[path] = await asyncio.wait_for(
                    asyncio.wrap_future(_in_daemon_thread(self.sink.stat, path, name="read-back")),
                    self.cfg.upload_timeout_s,
                )
            return read[path]

        for e in entries:
            try:
                remote = await read_back(e.remote_path)
            except (SinkError, OSError) as exc:  # TimeoutError is an OSError
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
        checked = len(entries)
        if run_dir is not None:
            on_disk = await asyncio.to_thread(_checkpoints_on_disk, run_dir, completed_epochs)
            for local, places in on_disk:
                ident = await asyncio.to_thread(_checkpoint_identity, local)
                if ident is None:
                    skipped.append(
                        {"path": places[0], "note": "not a valid zip archive (torn?): not checked"}
                    )
                    continue
                checked += places[0] not in self.ledger.entries
                problem = "on disk but not on the target"
                for place in places:
                    try:
                        remote = await read_back(place)
                    except (SinkError, OSError) as exc:  # TimeoutError is an OSError
                        problem = f"on disk, read-back failed: {exc}"
                        continue
                    if remote is not None and (remote.sha256, remote.size) == ident:
                        break
                else:
                    missing.append({"path": places[0], "problem": problem})
        result = VerifyResult(not missing and checked > 0, checked, missing, self._clock(), skipped)
        self.verify_result = result
        try:
            atomic_write_json(self.state_dir / "sync-result.json", result.to_dict(), mode=0o600)
        except OSError as exc:
            log.error("sync-result.json not written: %s", describe(exc))
        return result

    def status(self) -> dict[str, Any]:
        """The sync part of ``/status``: queue, uploads in flight (since when, which attempt),
        whether uploads are stalled and why, and the disk-full condition."""
        now = self._clock()
        last = self.ledger.last_verified_checkpoint()
        stalled_since: float | None = None
        if self._pending or self._in_flight:
            since = max(self._busy_since or now, self.last_success_at or 0.0)
            if now - since >= self.stalled_after_s:
                stalled_since = since
        return {
            "target": self.sink.description,
            "last_synced_epoch": self.last_synced_epoch,
            "last_verified_checkpoint": (
                {"path": last.remote_path, "epoch": last.epoch, "at": last.verified_at}
                if last
                else None
            ),
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
            "last_success_at": self.last_success_at,
            "stalled_since": stalled_since,
            "last_error": self.last_error,
            "failures": self.failures[-5:],
            "disk_full": self.disk_full,
            "ledger_error": self.ledger.save_error,
            "sources_gone": list(self.sources_gone),
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
        if self.ledger.dirty:
            self.ledger.persist()


def describe(exc: OSError) -> str:
    """``ENOSPC: No space left on device`` - short, greppable, no path."""
    name = errno.errorcode.get(exc.errno or 0)
    text = exc.strerror or str(exc)
    return f"{name}: {text}" if name else f"{type(exc).__name__}: {text}"


def unlink_quietly(path: Path) -> bool:
    """Delete a file of ours; a failure is logged, never raised. True when it was deleted."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("cannot delete %s: %s", path, describe(exc))
        return False
    return True


def _has_content(path: Path, sha256: str, size: int) -> bool:
    try:
        return path.stat().st_size == size and sha256_file(path) == sha256
    except OSError:
        return False


def _find_copy(leftovers: list[Path], used: set[Path], entry: LedgerEntry) -> Path | None:
    """A snapshot a killed agent left of ``entry``'s source with exactly its content, newest
    first. Snapshots are named ``NNNNNN-<source name>``: only those are hashed."""
    name = entry.remote_path.rpartition("/")[2]
    m = _AT_EXIT.fullmatch(name)
    name = f"{m.group(1)}.pt" if m else name
    for p in reversed(leftovers):
        seq = _SEQ.fullmatch(p.name)
        if p in used or seq is None or seq.group(2) != name:
            continue
        if _has_content(p, entry.sha256, entry.size):
            return p
    return None


def _checkpoints_on_disk(
    run_dir: Path, completed_epochs: int | None
) -> list[tuple[Path, list[str]]]:
    """Checkpoints of completed epochs in ``run_dir/weights`` and where each may be stored."""
    weights = run_dir / "weights"
    out: list[tuple[Path, list[str]]] = []
    for name in ("last.pt", "best.pt"):
        if (weights / name).is_file():
            kind = name.removesuffix(".pt")
            out.append((weights / name, [f"weights/{name}", f"weights/{kind}.at-exit.pt"]))
    for epoch, path in sorted(epoch_snapshots(run_dir).items()):
        if completed_epochs is None or epoch <= completed_epochs:
            out.append((path, [f"weights/{path.name}"]))
    return out


def _checkpoint_identity(path: Path) -> tuple[str, int] | None:
    """(sha256, size) of a valid checkpoint; None when it is torn or gone."""
    snap = live_snapshot(path, checkpoint=True)
    return None if snap is None else (snap.sha256, snap.size)


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
