"""One attempt at a batch of uploads, in the upload thread (part of the upload queue,
``uploads.py``): the files that must go up go in one ``upload_many`` (one commit on the Hub),
then each is read back on its own, size and sha256, so one file of a commit can fail while the
others are verified.

A file marked ``check_first`` (an earlier attempt failed, or a restarted agent found it owed) is
read back first: a commit that landed while its answer was lost, or while the agent was dead, is
verified as it is and not made again (the Hub counts commits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.sinks import Sink, SinkError
from agent.sync.commits import CommitWindow
from agent.sync.snapshots import live_snapshot
from agent.util.crashpoints import crashpoint
from agent.util.text import os_error


class Sendable(Protocol):
    """What the queue sends (``uploads.Item``)."""

    @property
    def remote_path(self) -> str: ...
    @property
    def local(self) -> Path: ...
    @property
    def sha256(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def snapshot(self) -> bool: ...
    @property
    def mtime_ns(self) -> int | None: ...
    @property
    def attempts(self) -> int: ...
    @property
    def check_first(self) -> bool: ...


@dataclass(frozen=True)
class Sent:
    """One file of a batch, verified on the target: what went up, and whether it was sent now
    (False: found there already by ``check_first``)."""

    sha256: str
    size: int
    sent: bool


#: What became of one file of a batch: verified, or the error that failed it.
Outcome = Sent | BaseException


def send_batch(
    sink: Sink, items: Sequence[Sendable], *, commits: CommitWindow | None
) -> list[Outcome]:
    """Send ``items`` in one ``sink.upload_many`` (a commit, counted in ``commits``), then read
    each back. Returns each item's outcome, in order; one error object fails every file it
    touched (a refused commit fails all its files)."""
    outcomes: list[Outcome | None] = [None] * len(items)
    wanted: dict[int, tuple[str, int]] = {}
    for n, item in enumerate(items):
        try:
            sha256, size = _content(item)
        except Exception as exc:
            outcomes[n] = exc
            continue
        if item.check_first and _found(sink, item.remote_path, sha256, size):
            outcomes[n] = Sent(sha256, size, sent=False)
        else:
            wanted[n] = (sha256, size)
    if wanted:
        try:
            sink.upload_many([(items[n].local, items[n].remote_path) for n in wanted])
        except Exception as exc:
            for n in wanted:
                outcomes[n] = exc
            wanted = {}
        else:
            if commits is not None:
                commits.record()
            crashpoint("upload-sent")
    for n, (sha256, size) in wanted.items():
        try:
            outcomes[n] = _read_back(sink, items[n].remote_path, sha256, size)
        except Exception as exc:
            outcomes[n] = exc
    return [o if o is not None else RuntimeError("no outcome") for o in outcomes]


def failure_of(error: str | BaseException) -> tuple[str, bool, float | None]:
    """What a failed attempt says: its one-line error, whether to retry it, and the target's
    ``Retry-After`` (seconds). A sink that lets EMFILE/ENOSPC through, or a bug, is retried."""
    if isinstance(error, SinkError):
        return str(error), error.retryable, error.retry_after_s
    if isinstance(error, OSError):
        return os_error(error), True, None
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}", True, None
    return error, True, None


def _content(item: Sendable) -> tuple[str, int]:
    """(sha256, size) of what goes up: the snapshot's, or a live file's hashed anew."""
    sha256, size = item.sha256, item.size
    if not item.snapshot:
        # No snapshot: the live file may have moved on since it was hashed (a retry after a
        # read-back mismatch): hash what is there now.
        st = item.local.stat()
        if item.attempts > 1 or (st.st_size, st.st_mtime_ns) != (item.size, item.mtime_ns):
            fresh = live_snapshot(item.local, checkpoint=item.remote_path.endswith(".pt"))
            if fresh is None:
                raise SinkError(f"{item.local} is being rewritten; trying again later")
            sha256, size = fresh.sha256, fresh.size
    return sha256, size


def _found(sink: Sink, remote_path: str, sha256: str, size: int) -> bool:
    """Whether the target holds this content at ``remote_path`` already; a read-back that fails
    says nothing, and the file is sent."""
    try:
        remote = sink.stat(remote_path)
    except Exception:
        return False
    return remote is not None and (remote.sha256, remote.size) == (sha256, size)


def _read_back(sink: Sink, remote_path: str, sha256: str, size: int) -> Sent:
    remote = sink.stat(remote_path)
    if remote is None:
        raise SinkError(f"{remote_path} was accepted but is not on the target")
    if remote.sha256 != sha256 or remote.size != size:
        raise SinkError(
            f"{remote_path} read back as size={remote.size} sha256={remote.sha256[:12]}, "
            f"expected size={size} sha256={sha256[:12]}"
        )
    return Sent(sha256, size, sent=True)
