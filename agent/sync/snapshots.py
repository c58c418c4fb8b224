"""Snapshots: stable copies of the files LibreYOLO rewrites in place, taken at the safe moment.

LibreYOLO writes checkpoints in place, before that epoch's status.json (DESIGN.md). When
status.json says ``completed_epochs = N`` the weights of epoch N are whole, so the sync engine
copies them here then, checks the copy is a valid zip of an unchanged source, and uploads the
copy - never the live file. On a disk too full to copy to, the live file is checked the same way
in place instead (:func:`live_snapshot`).

Snapshots are named ``NNNNNN-<source name>`` in one folder of the state directory; the sequence
number never repeats, even across a killed agent, so a leftover snapshot is never overwritten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agent.sinks.digests import DIGESTS, copy_hashing, sha256_file
from agent.trainer.rundir import is_valid_checkpoint
from agent.util.text import os_error

# One logger for all of sync: its lines are grepped and asserted as ``agent.sync.engine``.
log = logging.getLogger(__name__)

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

_SEQ = re.compile(r"(\d+)-(.+)")


class Claimer(Protocol):
    """What :meth:`Snapshotter.take` asks first for a checkpoint: a copy already made while
    the file was written (:class:`agent.sync.follow.CheckpointFollower`), or None."""

    def claim(self, src: Path) -> Snapshot | None: ...


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
    writes to the snapshot folder (tests inject a full disk there); when it returns the copied
    bytes' sha256 (the default does, in the same pass) the snapshot is not read again to hash.
    With a ``follower`` (``follow.py``), a checkpoint copied while it was written is used when
    it is still the live file's version; no copy is made then."""

    def __init__(self, root: Path, *, copy: Callable[[Path, Path], object] = copy_hashing) -> None:
        self.root = root
        self.copy = copy
        self._seq: int | None = None
        self._lock = threading.Lock()
        self.follower: Claimer | None = None

    def files(self) -> list[Path]:
        """Every file in the snapshot folder (partial ``.tmp`` copies included)."""
        try:
            return sorted(p for p in self.root.iterdir() if p.is_file())
        except FileNotFoundError:
            return []

    def next_path(self, name: str) -> Path:
        """The next snapshot's name for a source called ``name``."""
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
        if checkpoint and self.follower is not None:
            followed = self.follower.claim(src)
            if followed is not None:
                return followed
        try:
            before = src.stat()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("snapshot of %s skipped: %s", src.name, os_error(exc))
            return None
        dst = self.next_path(src.name)
        tmp = dst.with_name(dst.name + ".tmp")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            copied = self.copy(src, tmp)
            after = src.stat()
        except OSError as exc:
            unlink_quietly(tmp)
            if not src.exists():
                return None
            live = live_snapshot(src, checkpoint=checkpoint)
            if live is None:
                log.warning(
                    "snapshot of %s failed (%s), the live file too", src.name, os_error(exc)
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
            digest = copied if isinstance(copied, str) else sha256_file(tmp)
            tmp.replace(dst)
            st = dst.stat()
            # This version of the source is hashed now: the final sync's "did it change?" and
            # the pruner's "is it verified?" need not read it again.
            DIGESTS.remember(after, digest)
            DIGESTS.remember(st, digest)
            return Snapshot(dst, digest, st.st_size, after.st_mtime_ns)
        except OSError as exc:
            log.warning("snapshot of %s skipped: %s", src.name, os_error(exc))
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
        digest = DIGESTS.lookup(before) or sha256_file(src)
        after = src.stat()
    except OSError as exc:
        log.warning("%s not used: %s", src.name, os_error(exc))
        return None
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
        log.warning("%s not used: it changed while being hashed", src.name)
        return None
    DIGESTS.remember(after, digest)
    return Snapshot(src, digest, after.st_size, after.st_mtime_ns, live=True)


def find_leftover(
    leftovers: list[Path], used: set[Path], source_name: str, sha256: str, size: int
) -> Path | None:
    """A snapshot of ``source_name`` among ``leftovers`` (a killed agent's), not in ``used``,
    with exactly this content; newest first. Only snapshots of that source are hashed."""
    for p in reversed(leftovers):
        seq = _SEQ.fullmatch(p.name)
        if p in used or seq is None or seq.group(2) != source_name:
            continue
        if has_content(p, sha256, size):
            return p
    return None


def has_content(path: Path, sha256: str, size: int) -> bool:
    """True when ``path`` holds exactly this content (size first: no hashing on a mismatch)."""
    try:
        return path.stat().st_size == size and DIGESTS.sha256(path) == sha256
    except OSError:
        return False


def unlink_quietly(path: Path) -> bool:
    """Delete a file of ours; a failure is logged, never raised. True when it was deleted."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("cannot delete %s: %s", path, os_error(exc))
        return False
    return True


def note_disk(
    disk_full: dict[str, Any] | None,
    snap: Snapshot,
    *,
    checkpoint: bool,
    now: Callable[[], float],
    root: Path,
    warn: Callable[..., None],
) -> dict[str, Any] | None:
    """Say once that snapshots cannot be written, and once that they can again. Returns the
    disk-full condition after ``snap`` (``{"since", "message"}``, or None); ``warn`` is the
    engine's throttled warning (key, error, format, args)."""
    err = snap.copy_error
    if err is None:
        # A small file still fits on a disk too full for a checkpoint: only a checkpoint copy
        # says there is room again (else the warning comes back every epoch).
        if disk_full is not None and checkpoint:
            log.info("snapshots work again (the disk had been full since %.0f)", disk_full["since"])
            return None
        return disk_full
    if err.errno in _DISK_FULL:
        if disk_full is None:
            disk_full = {"since": now(), "message": os_error(err)}
            warn(
                "snapshots",
                "disk full",
                "disk full: cannot snapshot to %s (%s); uploading checkpoints straight from the "
                "run directory until there is room",
                root,
                os_error(err),
            )
        return disk_full
    warn(
        "snapshot",
        os_error(err),
        "snapshot of %s failed (%s): uploading the live file",
        snap.path.name,
        os_error(err),
    )
    return disk_full
