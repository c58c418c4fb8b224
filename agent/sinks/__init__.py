"""Where checkpoints go: one module per kind of target behind one small, blocking interface.

This package's ``__init__`` holds the nouns every sink shares (the interface, what a target
reads back, the error); the sinks are ``local.py`` and ``hf.py``, ``target.py`` picks one for a
job, ``digests.py`` remembers what was hashed.

Sinks are deliberately synchronous: the upload queue (``agent/sync/uploads.py``) runs every call
in its own worker thread, keeps the thread's future, and treats a path as "in flight" until that
thread has really finished, even after a timeout gave up waiting for it. So a sink never has to
be cancellation-safe, and two uploads of the same path can never overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.sinks.digests import sha256_file


@dataclass(frozen=True)
class RemoteFile:
    """What a sink reads back about a stored file: the content's size and sha256."""

    path: str
    size: int
    sha256: str


class SinkError(Exception):
    """An upload or read-back failed. ``retryable`` is False only when retrying cannot help
    until a person acts (bad token, no permission); the message says what to do."""

    def __init__(
        self, message: str, *, retryable: bool = True, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        #: The target's own word on when to come back (HTTP ``Retry-After``), seconds.
        self.retry_after_s = retry_after_s


class Sink(Protocol):
    #: Human-readable target, without secrets (``file:///backup/run1``, ``hf://org/repo``).
    description: str
    #: How many files one :meth:`upload_many` call may carry: 1 where a file costs nothing on
    #: its own (a folder: each file goes alone, several at once), more where each call is a
    #: commit the target counts (the Hub: one milestone, one commit).
    max_files_per_upload: int
    #: Commits the target accepts per hour (the Hub's per-repo limit), None where uploads are
    #: not commits: the sync spaces its milestones out near it (:mod:`agent.sync.commits`).
    commits_per_hour: int | None

    def prepare(self) -> None:
        """Make the target exist (create the folder / the repo). Safe to repeat."""

    def upload(self, local: Path, remote_path: str) -> None:
        """Store ``local`` at ``remote_path`` (a relative POSIX path). Blocking."""

    def upload_many(self, files: Sequence[tuple[Path, str]]) -> None:
        """Store each ``(local, remote_path)`` at once: one commit on a target that has commits
        (all of them land or none does). Blocking. Nothing is read back: the caller checks each
        file with :meth:`stat`."""

    def stat(self, remote_path: str) -> RemoteFile | None:
        """Read back the stored file's size and sha256; None when it is not there. Blocking."""

    def download(self, remote_path: str, local: Path) -> RemoteFile | None:
        """Fetch ``remote_path`` into ``local`` (written to a temp file beside it, checked
        against the target's size and sha256, then renamed): a box that lost its disk, or a new
        box, resumes from it. None when it is not there; SinkError when it cannot be read or
        does not match. Blocking."""

    def delete(self, remote_path: str) -> None:
        """Remove ``remote_path`` from the target (nothing when it is not there): preflight's
        canary (``agent/.canary``) leaves nothing behind. Blocking."""


def check_download(tmp: Path, local: Path, expected: RemoteFile, action: str) -> RemoteFile:
    """Compare the downloaded ``tmp`` with what the target says, then move it into place."""
    size = tmp.stat().st_size
    digest = sha256_file(tmp)
    if size != expected.size or digest != expected.sha256:
        tmp.unlink(missing_ok=True)
        raise SinkError(
            f"{action}: got {size} bytes with sha256 {digest[:12]}, the target lists "
            f"{expected.size} bytes with sha256 {expected.sha256[:12]}; not used"
        )
    tmp.replace(local)
    return expected
