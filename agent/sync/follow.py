"""Following checkpoints while the trainer writes them, so the snapshot is ready when the epoch is.

Without this, the sync engine starts copying and hashing ``last.pt`` when status.json says the
epoch is done: for a 200 MB checkpoint that is most of a second between "written" and "upload
started", on top of the write itself (issue 15, P2). torch.save writes a checkpoint front to
back in many chunks over about as long. The :class:`CheckpointFollower` reads each wanted
``weights/*.pt`` as it grows (inotify IN_MODIFY on ``weights/``, a raw inotify descriptor of
its own: :mod:`agent.util.watch` says why watchdog does not serve here), copying the new bytes
into the snapshot folder, hashing them (sha256 on a thread of its own, beside the copy) and checking
the zip's CRC-32s on the way (:mod:`agent.data.zipstream`). When the file is closed the copy is
finished; the snapshot the engine asks for at the epoch's end (:meth:`Snapshotter.take`) is
then already there.

The consistency rule does not change: a followed copy is used only when

- the zip streamed past whole: every member's CRC-32 and size equal to the central directory's,
  at the same offsets (anything torn or rewritten in place fails that), and the bytes no CRC-32
  covers (headers, descriptors, the directory: a few kB) equal to the file's at the close;
- and the live file's identity (device, inode, size, mtime, ctime) at the epoch's end is the one
  it had when the copy finished: any later write changes its ctime.

Otherwise the copy is thrown away and :meth:`Snapshotter.take` copies the file as before. A
follow that cannot be trusted (a truncation, an unexpected zip, an error) costs a copy, never a
wrong snapshot. Files the sync policy will not send at the next epoch are not followed, and
nothing is followed while the disk is short of room for the trainer's own writes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import queue
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.data.zipstream import ZipStream
from agent.sinks.digests import DIGESTS, Digests
from agent.sync.snapshots import Snapshot, Snapshotter, unlink_quietly
from agent.util.disk import disk_free
from agent.util.text import os_error
from agent.util.watch import (
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_ISDIR,
    IN_MODIFY,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_Q_OVERFLOW,
    Inotify,
)
from agent.watch.disk import NEED_FLOOR_BYTES

log = logging.getLogger(__name__)

_WEIGHTS_MASK = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE
_RUN_MASK = IN_CREATE | IN_MOVED_TO

#: Bytes read per step while following (small enough that the hash, CRC and write passes over
#: it stay in the CPU cache).
CHUNK = 256 * 1024
#: After a batch of events, wait this long before reading the next: a write() is not an event
#: to act on alone, and the trainer's writes of the next moments are read in one go, seconds.
SETTLE_S = 0.01
#: Chunks that may wait for the hashing thread (``CHUNK`` bytes each).
HASH_QUEUE = 16


class _Hasher:
    """sha256 on a thread of its own, in the order given: hashlib lets go of the GIL, so the
    follower's copy and CRC-32 pass (which let go of it too) run beside it, on another core.
    At most ``HASH_QUEUE`` chunks wait: a slow hash slows the copy, never grows memory.

    A chunk is put under the same lock as :meth:`close`'s stop mark, and a thread started
    after a close first waits for the one before it to reach that mark: a chunk given while
    the follower closes (its thread may outlive close's 5 s wait) is hashed in order by
    exactly one thread, never left behind the mark where no thread takes it and :meth:`wait`
    would wait for ever."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Any, bytes] | None] = queue.Queue(maxsize=HASH_QUEUE)
        self._thread: threading.Thread | None = None
        self._closed: threading.Thread | None = None  # the thread a close() told to stop
        self._guard = threading.Lock()

    def update(self, sha: Any, data: bytes) -> None:
        with self._guard:
            if self._thread is None:
                if self._closed is not None:
                    # It hashes what came before its stop mark (HASH_QUEUE chunks at most)
                    # and takes no lock: one reader of the queue at a time keeps the order.
                    self._closed.join()
                    self._closed = None
                self._thread = threading.Thread(target=self._run, name="follow-hash", daemon=True)
                self._thread.start()
            # Blocks while HASH_QUEUE chunks wait; the thread takes them without the lock.
            self._queue.put((sha, data))

    def wait(self) -> None:
        """Until every chunk given so far is hashed."""
        self._queue.join()

    def close(self) -> None:
        with self._guard:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._closed = thread
                self._queue.put(None)
        if thread is not None:
            thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                item[0].update(item[1])
            finally:
                self._queue.task_done()


@dataclass
class _Follow:
    """One version of one file being copied as it is written."""

    src: Path
    fd: int
    ino: int
    dst: Path
    out: Any  # the snapshot's .tmp, unbuffered
    sha: Any = field(default_factory=hashlib.sha256)
    zip: ZipStream = field(default_factory=ZipStream)
    offset: int = 0

    @property
    def tmp(self) -> Path:
        return self.dst.with_name(self.dst.name + ".tmp")


@dataclass
class _Track:
    """One ``weights/*.pt`` path: its events not acted on yet (in order), the version being
    copied, the finished copy. ``lock`` is held by whoever acts on it (the thread, or a claim),
    so a claim of last.pt never waits for best.pt's copy."""

    path: Path
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: list[int] = field(default_factory=list)  # guarded by the follower's _lock
    follow: _Follow | None = None
    #: (the file's identity when the copy finished, the snapshot)
    ready: tuple[tuple[int, ...], Snapshot] | None = None
    #: A follow of this version gave up: not followed again until the file is closed.
    skip: bool = False
    #: The file's size when a copy of it last finished.
    size: int = 0


class CheckpointFollower:
    """Copies wanted checkpoints into the snapshot folder as the trainer writes them; the
    :class:`Snapshotter` asks it first (:meth:`claim`). ``wanted(name)`` says whether the sync
    policy will send ``weights/<name>`` at the next epoch's end."""

    def __init__(
        self,
        snapshots: Snapshotter,
        wanted: Callable[[str], bool],
        *,
        free: Callable[[Path], int] = disk_free,
        floor_bytes: int = NEED_FLOOR_BYTES,
        settle_s: float = SETTLE_S,
    ) -> None:
        self.snapshots = snapshots
        self.wanted = wanted
        self._free = free
        self.floor_bytes = floor_bytes
        self.settle_s = settle_s
        self._lock = threading.Lock()  # the tracks and their pending events
        self._events_lock = threading.Lock()  # reading the inotify descriptor
        self._tracks: dict[Path, _Track] = {}
        self._dirs: dict[int, Path] = {}  # watch -> folder
        self._runs: set[Path] = set()
        self._inotify: Inotify | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        self._stopping = threading.Event()
        self._hasher = _Hasher()
        #: Followed copies handed to the engine, and copies thrown away (tests, debugging).
        self.claimed = 0
        self.discarded = 0

    # ------------------------------------------------------------ public

    def watch(self, run_dir: Path) -> None:
        """Follow ``run_dir/weights`` (watched for its creation when it is not there yet)."""
        if run_dir in self._runs or self._stopping.is_set():
            return
        try:
            if self._inotify is None:
                self._inotify = Inotify()
                self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self._runs.add(run_dir)
            weights = run_dir / "weights"
            self._dirs[self._inotify.add(run_dir, _RUN_MASK)] = run_dir
            if weights.is_dir():
                self._dirs[self._inotify.add(weights, _WEIGHTS_MASK)] = weights
        except OSError as exc:
            # Out of inotify watches or instances: snapshots are copied at the epoch's end.
            log.warning("checkpoints not followed while written (%s)", os_error(exc))
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="follow", daemon=True)
            self._thread.start()

    def claim(self, src: Path) -> Snapshot | None:
        """The followed snapshot of ``src`` as it is now, finishing the copy if the close was
        not acted on yet; None when there is none to trust (the caller copies the file then)."""
        self._drain()  # every write up to now is known: a copy of an older version is dropped
        with self._lock:
            track = self._tracks.get(src)
        if track is None:
            return None
        with track.lock:
            self._act(track)
            if track.follow is not None:
                self._finish(track)
            ready, track.ready = track.ready, None
        if ready is None:
            return None
        identity, snap = ready
        try:
            current = Digests.identity(os.stat(src))
        except OSError:
            current = None
        if identity != current:
            self._discarded(snap.path)  # written again since: the copy is of an older version
            return None
        self.claimed += 1
        return snap

    def close(self) -> None:
        """Stop following; unfinished copies and unclaimed snapshots are deleted."""
        self._stopping.set()
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            tracks = list(self._tracks.values())
            self._tracks.clear()
        for track in tracks:
            with track.lock:
                self._forget(track)
        with self._events_lock:
            if self._inotify is not None:
                self._inotify.close()
                self._inotify = None
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1
        self._hasher.close()

    # ------------------------------------------------------------ events

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                inotify = self._inotify
                if inotify is None:
                    return
                readable, _, _ = select.select([inotify.fd, self._wake_r], [], [])
                if self._wake_r in readable:
                    return
                for track in self._drain():
                    if self._stopping.is_set():
                        return
                    with track.lock:
                        self._act(track)
                self._stopping.wait(self.settle_s)
        except Exception:  # a bug here must not take the agent down: copies fall back
            log.exception("following checkpoints stopped; snapshots are copied at epoch ends")

    def _drain(self) -> list[_Track]:
        """Read every event queued so far (the kernel queues them within the write itself)
        onto its file's track, in order; the tracks that got some. Cheap: no file is read."""
        touched: list[_Track] = []
        with self._events_lock:
            while self._inotify is not None and not self._stopping.is_set():
                events = self._inotify.read()
                if not events:
                    break
                for wd, mask, name in events:
                    track = self._note(wd, mask, name)
                    if mask & IN_Q_OVERFLOW:
                        with self._lock:
                            touched = list(self._tracks.values())
                    elif track is not None and track not in touched:
                        touched.append(track)
        return touched

    def _note(self, wd: int, mask: int, name: str) -> _Track | None:
        if mask & IN_Q_OVERFLOW:
            # Events were lost: a write after a finished copy may be among them. Every copy
            # is dropped (as if each file had been replaced); the epoch's end copies anew.
            with self._lock:
                for track in self._tracks.values():
                    track.pending.append(IN_MOVED_FROM)
            return None
        folder = self._dirs.get(wd)
        if folder is None or not name:
            return None
        if folder in self._runs:
            if name == "weights" and mask & IN_ISDIR and self._inotify is not None:
                with contextlib.suppress(OSError):
                    self._dirs[self._inotify.add(folder / name, _WEIGHTS_MASK)] = folder / name
            return None
        if not name.endswith(".pt"):
            return None
        path = folder / name
        with self._lock:
            track = self._tracks.setdefault(path, _Track(path))
            track.pending.append(mask)
        return track

    def _act(self, track: _Track) -> None:
        """Act on the track's pending events, in order. Holds ``track.lock``."""
        with self._lock:
            masks, track.pending = track.pending, []
        grown = False
        for mask in masks:
            if mask & (IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO):
                self._forget(track)  # deleted or replaced: nothing copied of it is of use
                grown = False
                continue
            # Written after a copy finished: that copy is of an older version, whatever the
            # file's timestamps say (they move in clock ticks of several ms).
            self._drop_ready(track)
            if mask & IN_CLOSE_WRITE:
                self._closed(track)
                grown = False
            elif mask & IN_MODIFY:
                grown = True
        if grown and self._following(track):
            assert track.follow is not None
            self._pump(track)

    def _closed(self, track: _Track) -> None:
        """A version is complete: finish its copy (or copy it now when it was not followed
        and the engine did not copy it already)."""
        skipped, track.skip = track.skip, False  # the next version is followed afresh
        if track.follow is None and (skipped or self._hashed(track.path)):
            return
        if self._following(track):
            self._finish(track)

    def _following(self, track: _Track) -> bool:
        """Whether a follow of this version is under way, starting one when it should be."""
        if track.follow is None and not track.skip and self.wanted(track.path.name):
            track.follow = self._start(track.path)
        return track.follow is not None

    @staticmethod
    def _hashed(path: Path) -> bool:
        """The engine copied and hashed this version already (it asked before we looked)."""
        try:
            return DIGESTS.peek(os.stat(path)) is not None
        except OSError:
            return True

    # ------------------------------------------------------------ one follow

    def _start(self, path: Path) -> _Follow | None:
        fd = -1
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            ino = os.fstat(fd).st_ino
            self.snapshots.root.mkdir(parents=True, exist_ok=True)
            dst = self.snapshots.next_path(path.name)
            out = open(dst.with_name(dst.name + ".tmp"), "wb", buffering=0)  # noqa: SIM115
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            if exc.errno != errno.ENOENT:
                log.info("%s not followed: %s", path.name, os_error(exc))
            return None
        return _Follow(path, fd, ino, dst, out)

    def _pump(self, track: _Track) -> bool:
        """Copy what was appended since the last step; False (and the follow given up) when
        the file was replaced or cannot be followed. Holds ``track.lock``."""
        f = track.follow
        assert f is not None
        try:
            if os.stat(f.src).st_ino != f.ino:  # a new file under the name: followed anew
                return self._give_up(track, "replaced", skip=False)
            size = os.fstat(f.fd).st_size
            if size < f.offset:  # truncated: the next version is being written; start over
                f.out.seek(0)
                f.out.truncate()
                f.sha, f.zip, f.offset = hashlib.sha256(), ZipStream(), 0
            # Room for the rest of our copy and of the trainer's write (as large as the
            # previous version), and the floor: else the trainer's write could fail.
            expect = max(size, track.size)
            need = self.floor_bytes + (expect - f.offset) + (expect - size)
            if size > f.offset and self._free(self.snapshots.root) < need:
                return self._give_up(track, "disk nearly full")
            while f.offset < size:
                chunk = os.pread(f.fd, min(CHUNK, size - f.offset), f.offset)
                if not chunk:
                    break
                self._hasher.update(f.sha, chunk)  # on its own thread, meanwhile:
                f.zip.feed(chunk)
                block = memoryview(chunk)
                while block:
                    block = block[f.out.write(block) :]
                f.offset += len(chunk)
            if f.zip.broken is not None:
                return self._give_up(track, f.zip.broken)
        except OSError as exc:
            return self._give_up(track, os_error(exc))
        return True

    def _finish(self, track: _Track) -> None:
        """The file is complete (closed, or the epoch's end says so): check the copy and keep
        it as the snapshot of the file's current identity. Holds ``track.lock``."""
        f = track.follow
        assert f is not None
        try:
            before = os.stat(f.src)
        except OSError as exc:
            self._give_up(track, os_error(exc))
            return
        if not self._pump(track):
            return
        try:
            after = os.stat(f.src)
            same = Digests.identity(before) == Digests.identity(after)
            if not same or after.st_size != f.offset or after.st_ino != f.ino:
                self._give_up(track, "changed while finished")
                return
            f.out.close()
            if not f.zip.matches(f.tmp):
                self._give_up(track, "not a whole zip archive as it streamed past")
                return
            if not self._same_bytes(f):
                self._give_up(track, "bytes already copied were written again")
                return
            if Digests.identity(os.stat(f.src)) != Digests.identity(after):
                self._give_up(track, "changed while compared")
                return
            f.tmp.replace(f.dst)
            st = f.dst.stat()
        except OSError as exc:
            self._give_up(track, os_error(exc))
            return
        self._hasher.wait()
        digest = f.sha.hexdigest()
        DIGESTS.remember(after, digest)
        DIGESTS.remember(st, digest)
        os.close(f.fd)
        track.follow = None
        track.ready = (
            Digests.identity(after),
            Snapshot(f.dst, digest, st.st_size, after.st_mtime_ns),
        )
        track.size = after.st_size
        log.debug("%s followed: snapshot %s ready", f.src.name, f.dst.name)

    @staticmethod
    def _same_bytes(f: _Follow) -> bool:
        """The copy holds the file's bytes now: a writer that went back over bytes already
        copied (not torch's, which only appends) is caught here, not trusted. Only the bytes
        no CRC-32 covers are compared (headers, descriptors, the directory: a few kB): each
        member's data in the copy has the CRC-32 that the file's directory, compared here,
        gives it (:meth:`ZipStream.matches`), so data written again after its copy fails
        that."""
        with open(f.tmp, "rb", buffering=0) as copy:
            for start, stop in f.zip.unchecked(f.offset):
                at = start
                while at < stop:
                    n = min(CHUNK, stop - at)
                    copy.seek(at)
                    if os.pread(f.fd, n, at) != copy.read(n):
                        return False
                    at += n
        return True

    def _give_up(self, track: _Track, why: str, *, skip: bool = True) -> bool:
        """Stop following this version of the file (``skip``: until it is closed); its copy
        is deleted."""
        log.debug("%s not followed: %s", track.path.name, why)
        self._drop_follow(track)
        track.skip = skip
        return False

    def _drop_follow(self, track: _Track) -> None:
        f, track.follow = track.follow, None
        if f is None:
            return
        for close in (f.out.close, lambda: os.close(f.fd)):
            with contextlib.suppress(OSError):
                close()
        self._discarded(f.tmp)

    def _drop_ready(self, track: _Track) -> None:
        ready, track.ready = track.ready, None
        if ready is not None:
            self._discarded(ready[1].path)

    def _forget(self, track: _Track) -> None:
        self._drop_follow(track)
        self._drop_ready(track)
        track.skip = False

    def _discarded(self, path: Path) -> None:
        self.discarded += 1
        unlink_quietly(path)
