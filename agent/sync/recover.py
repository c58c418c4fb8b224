"""Start-up recovery: what a killed agent promised the target and never verified, queued again.

The ledger (``ledger.py``) is written before an upload starts, so a restarted agent knows every
promise its predecessor made. :func:`requeue_owed` walks the unverified ones, oldest first: each
goes up again from its leftover snapshot when one still has the promised sha256, else from a
fresh snapshot of its source (a newer version supersedes the promise). A promise whose snapshot
and source are both gone stays pending; verification at the end reports it. The engine
(:meth:`agent.sync.engine.SyncEngine.recover`) runs it before the first milestone, under its
snapshot lock, and then deletes the snapshot files nothing needs any more.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from agent.sync.ledger import ItemKind, Ledger, LedgerStatus, sorted_entries
from agent.sync.snapshots import Snapshotter, find_leftover
from agent.sync.uploads import Item, Queued, UploadQueue
from agent.trainer.rundir import SMALL_FILES

log = logging.getLogger(__name__)

_AT_EXIT = re.compile(r"(last|best)\.at-exit\.pt")


class QueueFile(Protocol):
    """The engine's snapshot-and-queue of one source file, and what became of it."""

    def __call__(
        self,
        src: Path,
        remote_path: str,
        epoch: int | None,
        kind: ItemKind,
        *,
        checkpoint: bool = True,
    ) -> Awaitable[Queued]: ...


@dataclass
class Recovered:
    """What :func:`requeue_owed` did: items queued, and the entries still owed (remote path,
    epoch) whose snapshot and source are both gone."""

    queued: int = 0
    sources_gone: list[tuple[str, int | None]] = field(default_factory=list)


async def requeue_owed(
    ledger: Ledger,
    uploads: UploadQueue,
    snapshots: Snapshotter,
    *,
    source_of: Callable[[str], Path | None],
    queue_file: QueueFile,
) -> Recovered:
    """Queue again every ledger entry that is neither verified nor queued or in flight, from
    its leftover snapshot or else its source (``source_of``, snapshotted by ``queue_file``)."""
    result = Recovered()
    leftovers = await asyncio.to_thread(snapshots.files)
    used: set[Path] = set()
    for entry in sorted_entries(list(ledger.entries.values())):
        path = entry.remote_path
        if entry.status == LedgerStatus.VERIFIED or uploads.queued_or_in_flight(path):
            continue
        copy = await asyncio.to_thread(
            find_leftover,
            leftovers,
            used,
            source_name(path.rpartition("/")[2]),
            entry.sha256,
            entry.size,
        )
        if copy is not None:
            used.add(copy)
            item = Item(path, copy, entry.sha256, entry.size, entry.epoch, entry.kind)
            item.attempts = entry.attempts
            # Its commit may have landed after the agent died: read back before sending.
            item.check_first = True
            uploads.submit(item)
            result.queued += 1
            continue
        src = source_of(path)
        outcome: Queued = "unavailable"
        if src is not None:
            outcome = await queue_file(
                src, path, entry.epoch, entry.kind, checkpoint=path.endswith(".pt")
            )
            if outcome == "queued":
                uploads.check_first(path)
        result.queued += outcome == "queued"
        if outcome == "unavailable":
            result.sources_gone.append((path, entry.epoch))
    return result


def source_of(remote_path: str, state_dir: Path, run_dir: Path | None) -> Path | None:
    """The local file a remote path is uploaded from, or None when it has none here."""
    head, _, name = remote_path.partition("/")
    if head == "agent" and name and "/" not in name:
        return state_dir / name
    if run_dir is None:
        return None
    if head == "weights" and name and "/" not in name:
        return run_dir / "weights" / source_name(name)
    if remote_path in SMALL_FILES:
        return run_dir / remote_path
    return None


def source_name(name: str) -> str:
    """The run-directory file a stored name comes from: ``last.at-exit.pt`` is ``last.pt``."""
    m = _AT_EXIT.fullmatch(name)
    return f"{m.group(1)}.pt" if m else name
