"""Where checkpoints go: one module per kind of target behind one small, blocking interface.

Sinks are deliberately synchronous: ``sync.py`` runs every call in its own worker thread, keeps
the thread's future, and treats a path as "in flight" until that thread has really finished,
even after a timeout gave up waiting for it. So a sink never has to be cancellation-safe, and two
uploads of the same path can never overlap.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.config.model import Env, SyncSection


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

    def prepare(self) -> None:
        """Make the target exist (create the folder / the repo). Safe to repeat."""

    def upload(self, local: Path, remote_path: str) -> None:
        """Store ``local`` at ``remote_path`` (a relative POSIX path). Blocking."""

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


def _blocks(f: io.RawIOBase, chunk: int) -> Iterator[memoryview]:
    """The file's bytes, ``chunk`` at a time, read into one reused buffer (no copy per read)."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    while n := f.readinto(buf):
        yield view[:n]


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of the file at ``path``, hex (read ``chunk`` bytes at a time)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        for block in _blocks(f, chunk):
            h.update(block)
    return h.hexdigest()


class Digests:
    """sha256 of files by identity (device, inode, size, mtime_ns, ctime_ns): each version of a
    checkpoint is read and hashed once - by the snapshot's copy - and its later checks (the
    final sync's "did it change?", the local target's read-back, the disk pruner's "is this one
    verified?") find the digest here instead of reading hundreds of MB again. Any write to a
    file changes its ctime, which the writer cannot set back: a changed file is hashed anew.
    Thread-safe; the oldest of ``limit`` entries is forgotten first."""

    def __init__(self, limit: int = 256) -> None:
        self._known: OrderedDict[tuple[int, ...], str] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()
        #: Lookups that found nothing (each one a file read in full by the caller).
        self.misses = 0

    @staticmethod
    def identity(st: os.stat_result) -> tuple[int, ...]:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def remember(self, st: os.stat_result, digest: str) -> None:
        key = self.identity(st)
        with self._lock:
            self._known[key] = digest
            self._known.move_to_end(key)
            while len(self._known) > self._limit:
                self._known.popitem(last=False)

    def lookup(self, st: os.stat_result) -> str | None:
        with self._lock:
            digest = self._known.get(self.identity(st))
            self.misses += digest is None
            return digest

    def peek(self, st: os.stat_result) -> str | None:
        """Like :meth:`lookup`, for a caller that reads nothing when it finds nothing."""
        with self._lock:
            return self._known.get(self.identity(st))

    def sha256(self, path: Path) -> str:
        """The file's sha256, from memory when this version of it was hashed before. Raises
        OSError like :func:`sha256_file`."""
        before = os.stat(path)
        known = self.lookup(before)
        if known is not None:
            return known
        digest = sha256_file(path)
        if self.identity(os.stat(path)) == self.identity(before):
            self.remember(before, digest)
        return digest


#: The process's one digest memory (snapshots, sinks and the pruner share it).
DIGESTS = Digests()


def copy_hashing(src: Path, dst: Path, chunk: int = 1 << 20, *, known_ok: bool = False) -> str:
    """Copy ``src`` to ``dst`` and return the sha256 of the bytes copied: one read of the
    source instead of a copy and a second read to hash (a checkpoint is hundreds of MB).

    ``known_ok``: when :data:`DIGESTS` knows this very version of ``src`` (a snapshot, hashed
    as it was made) the copy is not hashed again and that digest is returned, provided ``src``
    kept the identity through the copy; a source that changed meanwhile is copied again,
    hashing what is copied."""
    with open(src, "rb", buffering=0) as f, open(dst, "wb", buffering=0) as out:
        before = os.fstat(f.fileno())
        known = DIGESTS.peek(before) if known_ok else None
        h = hashlib.sha256() if known is None else None
        for block in _blocks(f, chunk):
            if h is not None:
                h.update(block)
            while block:
                block = block[out.write(block) :]
        if h is not None:
            return h.hexdigest()
        unchanged = Digests.identity(os.fstat(f.fileno())) == Digests.identity(before)
    if unchanged and known is not None:
        return known
    return copy_hashing(src, dst, chunk)


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


def make_sink(sync: SyncSection, env: Env) -> Sink:
    """Build the sink for ``sync.target``."""
    if sync.scheme == "file":
        from agent.sinks.local import LocalSink

        return LocalSink(Path(sync.location))
    if sync.scheme == "hf":
        from agent.sinks.hf import HubSink

        return HubSink(sync.location, env=env, private=sync.private)
    raise ValueError(f"unsupported sync target scheme {sync.scheme!r}")
