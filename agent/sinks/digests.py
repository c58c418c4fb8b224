"""The digest memory: sha256 of files by identity, so each version of a checkpoint is read and
hashed once (by the snapshot's copy) and every later check finds the digest here.

Its own module, not the sinks package's: snapshots, the follower, the pruner and each sink share
the one :data:`DIGESTS` of the process, and none of them needs a sink to ask it.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path


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
