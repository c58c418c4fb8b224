"""The sync ledger: what the target is expected to hold, persisted in the state directory as
``sync-ledger.json`` so a restarted agent still knows what it promised.

One entry per remote path, the newest version only. An entry is ``pending`` from the moment its
upload is queued until that upload has been read back intact (``verified``); an upload that
keeps failing stays pending and is retried, never given up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from agent.state import atomic_write_json
from agent.util.text import os_error

# One logger for all of sync: its lines are grepped and asserted as ``agent.sync.engine``.
log = logging.getLogger(__name__)


class ItemKind(StrEnum):
    """What a stored file is; written as its value in the ledger."""

    LAST = "last"  #: ``weights/last.pt`` (or ``last.at-exit.pt``)
    BEST = "best"  #: ``weights/best.pt`` (or ``best.at-exit.pt``)
    EPOCH = "epoch"  #: ``weights/epoch_N.pt``, kept every ``save_period`` epochs
    SMALL = "small"  #: a small file of the run directory (status.json, metrics.jsonl)
    AGENT = "agent"  #: a file of the agent's state directory, stored under ``agent/``


class LedgerStatus(StrEnum):
    """Where one entry stands; written as its value in the ledger."""

    PENDING = "pending"  #: queued or being retried; not on the target as far as we know
    VERIFIED = "verified"  #: uploaded and read back with the expected size and sha256


class Promise(Protocol):
    """What :meth:`Ledger.expect` records: an upload about to be queued (``uploads.Item``)."""

    @property
    def remote_path(self) -> str: ...
    @property
    def sha256(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def epoch(self) -> int | None: ...
    @property
    def kind(self) -> ItemKind: ...
    @property
    def created_at(self) -> float: ...


@dataclass
class LedgerEntry:
    """One remote path the target must hold, with the content it must have."""

    remote_path: str
    sha256: str
    size: int
    epoch: int | None
    kind: ItemKind
    status: LedgerStatus
    queued_at: float
    uploaded_at: float | None = None
    verified_at: float | None = None
    attempts: int = 0
    error: str | None = None

    def __post_init__(self) -> None:
        # Loaded from JSON these are plain strings; an unknown one is a ValueError.
        self.kind = ItemKind(self.kind)
        self.status = LedgerStatus(self.status)


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
            message = os_error(exc)
            if message != self.save_error:
                log.error("sync ledger not saved (%s): kept in memory, saved again later", message)
            self.save_error = message
            return False
        if self.save_error is not None:
            log.info("sync ledger saved again (it had failed: %s)", self.save_error)
        self.dirty = False
        self.save_error = None
        return True

    def expect(self, item: Promise) -> None:
        """Record that ``item`` is queued: its path is owed with this content (pending)."""
        self.entries[item.remote_path] = LedgerEntry(
            remote_path=item.remote_path,
            sha256=item.sha256,
            size=item.size,
            epoch=item.epoch,
            kind=item.kind,
            status=LedgerStatus.PENDING,
            queued_at=item.created_at,
        )
        self.persist()

    def mark_verified(
        self,
        remote_path: str,
        expected_sha256: str,
        /,
        *,
        sha256: str,
        size: int,
        at: float,
        attempts: int,
    ) -> None:
        """The upload of ``remote_path`` was read back intact as (``sha256``, ``size``) at
        ``at``: its entry is verified, if it still expects ``expected_sha256``."""
        e = self._current(remote_path, expected_sha256)
        if e is None:
            return
        e.sha256, e.size = sha256, size
        e.status = LedgerStatus.VERIFIED
        e.uploaded_at = e.verified_at = at
        e.attempts, e.error = attempts, None
        self.persist()

    def note_attempt(
        self, remote_path: str, expected_sha256: str, /, *, attempts: int, error: str
    ) -> None:
        """An upload of ``remote_path`` failed: recorded if its entry still expects
        ``expected_sha256``; the entry stays pending."""
        e = self._current(remote_path, expected_sha256)
        if e is None:
            return
        e.attempts, e.error = attempts, error
        self.persist()

    def raise_epoch(self, remote_path: str, sha256: str, epoch: int) -> LedgerEntry | None:
        """The content ``sha256`` of ``remote_path`` is known to hold ``epoch`` (status.json
        said so while the file was this version): its entry's epoch goes up to it, never down.
        The entry when it changed; None otherwise."""
        e = self._current(remote_path, sha256)
        if e is None or (e.epoch is not None and e.epoch >= epoch):
            return None
        e.epoch = epoch
        self.persist()
        return e

    def _current(self, remote_path: str, sha256: str) -> LedgerEntry | None:
        """The entry of ``remote_path`` if it still expects ``sha256``."""
        e = self.entries.get(remote_path)
        # A result for an older snapshot must not overwrite the entry of a newer one.
        return e if e is not None and e.sha256 == sha256 else None

    def last_verified_checkpoint(self) -> LedgerEntry | None:
        done = [
            e
            for e in self.entries.values()
            if e.status == LedgerStatus.VERIFIED and e.remote_path.endswith(".pt") and e.verified_at
        ]
        return max(done, key=lambda e: e.verified_at or 0.0) if done else None


def sorted_entries(entries: Iterable[LedgerEntry]) -> list[LedgerEntry]:
    return sorted(entries, key=lambda e: e.remote_path)
