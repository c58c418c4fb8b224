"""Checkpoints copied while the trainer writes them (agent/sync/follow.py, agent/data/zipstream.py;
issue 15, P2): real torch.save archives, real inotify, real writer threads. The rule under attack: a
followed copy is used only when it is byte for byte the live file's current version; anything
else falls back to the epoch-end copy, never to a wrong snapshot."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.data.zipstream import ZipStream
from agent.sinks.digests import copy_hashing, sha256_file
from agent.sync.follow import CheckpointFollower
from agent.sync.snapshots import Snapshotter
from agent.trainer.rundir import is_valid_checkpoint

#: Every (epoch, floats) checkpoint the tests use: written by one torch process (torch is never
#: imported into the test runner itself: its deprecation shims warn when other tests scan
#: every live object).
SPECS = [
    *((1, n) for n in (1, 1000, 10_000, 50_000, 100_000, 200_000, 300_000)),
    *((2, n) for n in (20_000, 50_000, 100_000, 200_000, 250_000)),
    *((e, 120_000) for e in range(6)),
    (3, 100_000),
    (3, 300_000),
    (3, 400_000),
    (4, 10_000),
    (4, 100_000),
]
_WRITE = """
import io, json, sys, torch
out = sys.argv[1]
for epoch, floats in json.loads(sys.argv[2]):
    g = torch.Generator().manual_seed(epoch)
    state = {"epoch": epoch, "w": torch.randn(floats, generator=g), "b": torch.ones(3)}
    torch.save(state, f"{out}/{epoch}-{floats}.pt")
"""
_CACHE: dict[tuple[int, int], bytes] = {}


def torch_bytes(epoch: int, floats: int = 50_000) -> bytes:
    """A real checkpoint's bytes: torch.save of a dict with tensors, as LibreYOLO writes."""
    if not _CACHE:
        with tempfile.TemporaryDirectory() as out:
            subprocess.run(
                [sys.executable, "-c", _WRITE, out, json.dumps(SPECS)], check=True, timeout=300
            )
            for e, n in SPECS:
                _CACHE[(e, n)] = Path(out, f"{e}-{n}.pt").read_bytes()
    return _CACHE[(epoch, floats)]


def stream(data: bytes, rng: random.Random) -> ZipStream:
    z = ZipStream()
    at = 0
    while at < len(data):
        n = rng.choice([1, 2, 3, 15, 16, 17, 27, 28, 29, 4096, 1 << 20])
        z.feed(data[at : at + n])
        at += n
    return z


# ------------------------------------------------------------------------------ ZipStream


@pytest.mark.parametrize("floats", [1, 1000, 300_000])
def test_a_real_torch_checkpoint_streams_whole_in_any_chunking(tmp_path: Path, floats: int) -> None:
    data = torch_bytes(1, floats)
    path = tmp_path / "last.pt"
    path.write_bytes(data)
    names = [i.filename for i in zipfile.ZipFile(path).infolist()]
    for seed in range(8):
        z = stream(data, random.Random(seed))
        assert z.broken is None
        assert [m.name for m in z.members] == names
        assert z.matches(path)


def test_a_flipped_byte_or_a_torn_end_does_not_match(tmp_path: Path) -> None:
    data = bytearray(torch_bytes(2, 20_000))
    flipped = tmp_path / "flipped.pt"
    at = data.find(b"data/0") + 200  # inside the tensor's bytes
    data[at] ^= 0x40
    flipped.write_bytes(data)
    assert not stream(bytes(data), random.Random(0)).matches(flipped)
    torn = tmp_path / "torn.pt"
    good = torch_bytes(2, 20_000)
    torn.write_bytes(good[:-30])
    assert not stream(good[:-30], random.Random(0)).matches(torn)


def test_python_zipfile_archives_stream_with_and_without_descriptors(tmp_path: Path) -> None:
    plain = tmp_path / "plain.pt"
    with zipfile.ZipFile(plain, "w") as zf:  # sizes in the local headers
        zf.writestr("a/data.pkl", b"PK\x07\x08" * 300)
        zf.writestr("a/data/0", os.urandom(5000))
    assert stream(plain.read_bytes(), random.Random(1)).matches(plain)

    class Unseekable(io.RawIOBase):  # zipfile then writes data descriptors, like torch
        def __init__(self) -> None:
            self.data = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, b: bytes) -> int:  # type: ignore[override]
            self.data += b
            return len(b)

    out = Unseekable()
    with zipfile.ZipFile(out, "w") as zf:
        # Data that opens with a descriptor-shaped run (CRC 0, sizes 0): not the member's end.
        with zf.open("x", "w") as f:
            f.write(b"PK\x07\x08" + bytes(12) + b"abc" * 1000)
        with zf.open("empty", "w") as f:
            f.write(b"")
    described = tmp_path / "described.pt"
    described.write_bytes(bytes(out.data))
    for seed in range(5):
        z = stream(bytes(out.data), random.Random(seed))
        assert z.matches(described), z.broken
        assert [m.size for m in z.members] == [3016, 0]


def test_a_compressed_member_gives_up_and_never_matches(tmp_path: Path) -> None:
    path = tmp_path / "deflated.pt"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("a/data/0", b"0" * 10_000)
    z = stream(path.read_bytes(), random.Random(2))
    assert z.broken is not None and "compressed" in z.broken
    assert not z.matches(path)
    assert is_valid_checkpoint(path)  # a valid zip all the same: the slow check takes it


# ------------------------------------------------------------------------------ the follower


class Copies:
    """The Snapshotter's own copy function, counted."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, src: Path, dst: Path) -> str:
        self.n += 1
        return copy_hashing(src, dst)


@pytest.fixture
def follower(tmp_path: Path) -> Iterator[tuple[CheckpointFollower, Snapshotter, Copies, Path]]:
    copies = Copies()
    snaps = Snapshotter(tmp_path / "snapshots", copy=copies)
    f = CheckpointFollower(snaps, lambda name: name != "skip.pt")
    snaps.follower = f
    run = tmp_path / "run"
    (run / "weights").mkdir(parents=True)
    f.watch(run)
    try:
        yield f, snaps, copies, run / "weights"
    finally:
        f.close()


def write_slowly(
    path: Path, data: bytes, *, chunk: int = 64 * 1024, pause: Callable[[int], None] | None = None
) -> None:
    """Write ``data`` in place, front to back in chunks, as torch.save does (O_TRUNC)."""
    with open(path, "wb", buffering=0) as f:
        for i, at in enumerate(range(0, len(data), chunk)):
            f.write(data[at : at + chunk])
            if pause is not None:
                pause(i)


def wait_for(cond: Callable[[], bool], timeout: float = 60.0) -> bool:
    """True once ``cond`` holds; False after ``timeout`` seconds (a hang: under load an inotify
    event comes late, never lost)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def tmp_copies(snaps: Snapshotter) -> list[Path]:
    return [p for p in snaps.files() if p.name.endswith(".tmp")]


def test_a_checkpoint_is_copied_while_written_and_used_without_a_copy(
    follower: tuple[CheckpointFollower, Snapshotter, Copies, Path],
) -> None:
    f, snaps, copies, weights = follower
    data = torch_bytes(3, 400_000)  # 1.6 MB
    src = weights / "last.pt"
    seen_mid_write: list[int] = []

    def pause(i: int) -> None:
        if i == 12:  # halfway: the copy is already under way (real inotify, real thread)
            wait_for(lambda: any(p.stat().st_size > 0 for p in tmp_copies(snaps)))
            seen_mid_write.append(sum(p.stat().st_size for p in tmp_copies(snaps)))

    write_slowly(src, data, pause=pause)
    assert seen_mid_write and seen_mid_write[0] > 0
    snap = snaps.take(src, checkpoint=True)
    assert snap is not None and not snap.live
    assert copies.n == 0  # the followed copy was used
    assert snap.path.read_bytes() == data
    assert snap.sha256 == sha256_file(src) and snap.size == len(data)
    assert f.claimed == 1 and not tmp_copies(snaps)


def test_every_version_written_in_turn_is_the_one_claimed(
    follower: tuple[CheckpointFollower, Snapshotter, Copies, Path],
) -> None:
    f, snaps, copies, weights = follower
    src = weights / "last.pt"
    for epoch in range(1, 5):
        data = torch_bytes(epoch, 100_000)
        write_slowly(src, data)
        snap = snaps.take(src, checkpoint=True)
        assert snap is not None and snap.path.read_bytes() == data
        snap.path.unlink()
    assert f.claimed + copies.n == 4 and f.claimed >= 1


def test_a_file_written_again_after_its_copy_finished_is_not_served_stale(
    follower: tuple[CheckpointFollower, Snapshotter, Copies, Path],
) -> None:
    f, snaps, copies, weights = follower  # noqa: RUF059
    src = weights / "last.pt"
    write_slowly(src, torch_bytes(1, 50_000))
    assert wait_for(lambda: any(not p.name.endswith(".tmp") for p in snaps.files()))
    # The same size, rewritten in place without truncation (no event the follower acts on
    # before the take): its identity moved, so the finished copy is not used.
    newer = torch_bytes(2, 50_000)
    with open(src, "r+b") as out:
        out.write(newer)
    snap = snaps.take(src, checkpoint=True)
    assert snap is not None and snap.path.read_bytes() == newer
    assert sha256_file(snap.path) == sha256_file(src)


def test_a_version_overwritten_mid_copy_never_yields_a_mixed_snapshot(
    follower: tuple[CheckpointFollower, Snapshotter, Copies, Path],
) -> None:
    f, snaps, copies, weights = follower  # noqa: RUF059
    src = weights / "last.pt"
    old, new = torch_bytes(1, 200_000), torch_bytes(2, 200_000)
    assert len(old) == len(new)

    def pause(i: int) -> None:
        if i == 5:  # the follower has a prefix of ``old``; then ``new`` lands over it in place
            wait_for(lambda: any(p.stat().st_size > 0 for p in tmp_copies(snaps)))
            with open(src, "r+b") as out:
                out.write(new)

    with open(src, "wb", buffering=0) as w:
        for i, at in enumerate(range(0, len(old), 64 * 1024)):
            w.write(old[at : at + 64 * 1024])
            pause(i)
    # What is on disk now: ``new``'s first bytes, then ``old``'s tail from where the writer
    # went on: whatever the follower kept, the snapshot is exactly the file.
    snap = snaps.take(src, checkpoint=True)
    current = src.read_bytes()
    if snap is not None:
        assert snap.path.read_bytes() == current
        assert snap.sha256 == sha256_file(src)
    assert f.claimed == 0  # the followed copy was not a whole archive of one version


def test_header_bytes_written_again_behind_the_copy_are_caught(
    follower: tuple[CheckpointFollower, Snapshotter, Copies, Path],
) -> None:
    """No CRC-32 covers a local header: a writer that goes back over one after its copy (its
    time field here) is caught by comparing those bytes, and the epoch's end copies the file."""
    f, snaps, copies, weights = follower
    src = weights / "last.pt"
    data = torch_bytes(1, 200_000)
    assert data[:4] == b"PK\x03\x04"

    with open(src, "wb", buffering=0) as w:
        for i, at in enumerate(range(0, len(data), 64 * 1024)):
            w.write(data[at : at + 64 * 1024])
            if i == 5:  # the first header is copied; then the writer goes back over it
                assert wait_for(lambda: any(p.stat().st_size > 64 for p in tmp_copies(snaps)))
                os.pwrite(w.fileno(), b"\x21\x43", 10)
    final = src.read_bytes()
    assert final != data and final[:10] == data[:10]
    snap = snaps.take(src, checkpoint=True)
    assert snap is not None and snap.path.read_bytes() == final
    assert f.claimed == 0 and copies.n == 1


def test_truncated_and_rewritten_while_followed_the_final_version_is_claimed(
    follower: tuple[CheckpointFollower, Snapshotter, Copies, Path],
) -> None:
    f, snaps, copies, weights = follower  # noqa: RUF059
    src = weights / "best.pt"
    first, final = torch_bytes(1, 300_000), torch_bytes(2, 250_000)
    with open(src, "wb", buffering=0) as w:
        w.write(first[: len(first) // 2])
        wait_for(lambda: any(p.stat().st_size > 0 for p in tmp_copies(snaps)))
    write_slowly(src, final)
    snap = snaps.take(src, checkpoint=True)
    assert snap is not None and snap.path.read_bytes() == final
    assert wait_for(lambda: not tmp_copies(snaps))


def test_files_the_policy_will_not_send_and_a_short_disk_are_not_followed(
    tmp_path: Path, follower: tuple[CheckpointFollower, Snapshotter, Copies, Path]
) -> None:
    f, snaps, copies, weights = follower
    write_slowly(weights / "skip.pt", torch_bytes(1, 100_000))
    f.floor_bytes = 1 << 62  # no disk has this much free
    write_slowly(weights / "last.pt", torch_bytes(2, 100_000))
    assert not snaps.files()  # nothing copied, nothing left behind
    snap = snaps.take(weights / "last.pt", checkpoint=True)
    assert snap is not None and copies.n == 1  # the epoch-end copy, as before
    assert snap.path.read_bytes() == (weights / "last.pt").read_bytes()


def test_a_checkpoint_deleted_while_followed_leaves_nothing_and_close_cleans_up(
    follower: tuple[CheckpointFollower, Snapshotter, Copies, Path],
) -> None:
    f, snaps, copies, weights = follower  # noqa: RUF059
    doomed = weights / "epoch_3.pt"
    data = torch_bytes(3, 300_000)
    with open(doomed, "wb", buffering=0) as w:
        w.write(data[: len(data) // 2])
        assert wait_for(lambda: bool(tmp_copies(snaps)))
        doomed.unlink()  # the disk pruner, mid-write
        assert wait_for(lambda: not tmp_copies(snaps))
    write_slowly(weights / "last.pt", torch_bytes(4, 10_000))
    assert wait_for(lambda: bool(snaps.files()))  # a finished, unclaimed copy
    f.close()
    assert not snaps.files()
    assert f._thread is not None and not f._thread.is_alive()


def test_a_follower_thread_never_stops_the_take_when_inotify_is_unavailable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run dir that cannot be watched (gone): a warning, and takes copy as before."""
    snaps = Snapshotter(tmp_path / "snapshots")
    f = CheckpointFollower(snaps, lambda name: True)
    snaps.follower = f
    with caplog.at_level("WARNING", logger="agent.sync"):
        f.watch(tmp_path / "missing-run")
    assert "checkpoints not followed while written" in caplog.text
    assert f._thread is None  # nothing to follow: no thread
    src = tmp_path / "last.pt"
    src.write_bytes(torch_bytes(1, 1000))
    snap = snaps.take(src, checkpoint=True)
    assert snap is not None and snap.path.read_bytes() == src.read_bytes()
    f.close()


def test_concurrent_claims_and_writes_only_ever_yield_exact_copies(
    follower: tuple[CheckpointFollower, Snapshotter, Copies, Path],
) -> None:
    """A writer rewriting last.pt as fast as it can while takes land at random moments: every
    snapshot handed out is a whole version that was written, byte for byte."""
    f, snaps, copies, weights = follower  # noqa: RUF059
    src = weights / "last.pt"
    datas = [torch_bytes(e, 120_000) for e in range(6)]
    versions = {hashlib.sha256(d).hexdigest(): d for d in datas}
    stop = threading.Event()

    def writer() -> None:
        rng = random.Random(7)
        while not stop.is_set():
            write_slowly(src, rng.choice(datas), chunk=rng.choice([4096, 65536, 1 << 20]))
            time.sleep(rng.uniform(0, 0.01))

    t = threading.Thread(target=writer)
    t.start()
    got = 0
    try:
        for _ in range(40):
            time.sleep(random.uniform(0, 0.02))
            snap = snaps.take(src, checkpoint=True)
            if snap is None:
                continue  # caught mid-write: torn, as before
            assert versions.get(snap.sha256) == snap.path.read_bytes()
            snap.path.unlink()
            got += 1
    finally:
        stop.set()
        t.join()
    assert got > 0


def test_a_read_error_mid_follow_leaves_no_copy_and_the_epoch_end_copies(
    follower: tuple[CheckpointFollower, Snapshotter, Copies, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A disk error while following (EIO on the read, which nothing else here can produce):
    the follow gives up and deletes its partial copy; the epoch's end copies the file."""
    f, snaps, copies, weights = follower
    real = os.pread
    failed: list[int] = []

    def flaky(fd: int, n: int, offset: int) -> bytes:
        if offset > 0 and not failed:
            failed.append(offset)
            raise OSError(5, "Input/output error")
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", flaky)
    data = torch_bytes(3, 300_000)
    src = weights / "last.pt"

    def pause(i: int) -> None:
        if i == 6:
            assert wait_for(lambda: bool(failed))

    write_slowly(src, data, pause=pause)
    assert wait_for(lambda: not tmp_copies(snaps))
    snap = snaps.take(src, checkpoint=True)
    assert snap is not None and snap.path.read_bytes() == data
    assert copies.n == 1 and f.claimed == 0


def test_lost_inotify_events_drop_every_finished_copy(
    follower: tuple[CheckpointFollower, Snapshotter, Copies, Path],
) -> None:
    """The kernel's queue overflowed (IN_Q_OVERFLOW, which this test cannot make the kernel
    send: it hands the follower the event): a write may have gone unseen, so no finished copy
    is trusted and the epoch's end copies the file."""
    from agent.util.watch import IN_Q_OVERFLOW

    f, snaps, copies, weights = follower
    src = weights / "last.pt"
    write_slowly(src, torch_bytes(1, 50_000))
    assert wait_for(lambda: any(not p.name.endswith(".tmp") for p in snaps.files()))
    with f._events_lock:
        f._note(-1, IN_Q_OVERFLOW, "")
    snap = snaps.take(src, checkpoint=True)
    assert snap is not None and snap.path.read_bytes() == src.read_bytes()
    assert copies.n == 1 and f.claimed == 0
    assert snaps.files() == [snap.path]  # the dropped copy is gone


def test_a_chunk_given_as_the_hasher_closes_is_hashed_not_left_behind_the_stop_mark(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The interleaving that hung a claim: update() has decided its thread is alive, close()
    then puts the stop mark and the thread ends, and only then the chunk goes in. The pause
    between the decision and the put is injected (a scheduler does it rarely, nothing else
    does it on demand); close() is let go on when it returns or after 0.5 s, whichever is
    first (it may rightly wait for the chunk's put)."""
    import queue as queue_mod

    from agent.sync import follow

    paused = threading.Event()
    go_on = threading.Event()

    class PausingQueue(queue_mod.Queue):  # type: ignore[type-arg]
        hold = False

        def put(self, item: object, block: bool = True, timeout: float | None = None) -> None:
            if item is not None and PausingQueue.hold:
                PausingQueue.hold = False
                paused.set()
                go_on.wait(10)
            super().put(item, block, timeout)

    monkeypatch.setattr(follow.queue, "Queue", PausingQueue)
    hasher = follow._Hasher()
    sha = hashlib.sha256()
    hasher.update(sha, b"first")  # the thread runs
    PausingQueue.hold = True
    giver = threading.Thread(target=hasher.update, args=(sha, b"second"), daemon=True)
    giver.start()
    assert paused.wait(10)
    closer = threading.Thread(target=hasher.close, daemon=True)
    closer.start()
    closer.join(timeout=0.5)
    go_on.set()
    giver.join(timeout=10)
    closer.join(timeout=10)
    waiter = threading.Thread(target=hasher.wait, daemon=True)
    waiter.start()
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "wait() blocks: the chunk sits behind the stop mark, unread"
    assert sha.hexdigest() == hashlib.sha256(b"firstsecond").hexdigest()
    hasher.close()


def test_chunks_given_while_the_hasher_closes_are_all_hashed() -> None:
    """The follower's thread may still hash after close() gave up waiting for it (5 s): a chunk
    given beside close()'s stop mark must be hashed by some thread, never left behind the
    mark, where wait() would block the agent's claim for ever."""
    from agent.sync.follow import _Hasher

    hasher = _Hasher()
    shas = [hashlib.sha256() for _ in range(6)]
    chunks = [os.urandom(64) for _ in range(300)]
    stop = threading.Event()

    def give(sha: object) -> None:
        for chunk in chunks:
            hasher.update(sha, chunk)

    givers = [threading.Thread(target=give, args=(sha,)) for sha in shas]
    for t in givers:
        t.start()
    closer = threading.Thread(target=lambda: [hasher.close() for _ in iter(stop.is_set, True)])
    closer.start()
    for t in givers:
        t.join(timeout=30)
    stop.set()
    closer.join(timeout=30)
    assert not any(t.is_alive() for t in givers), "a giver blocked on a queue no thread reads"
    waiter = threading.Thread(target=hasher.wait, daemon=True)
    waiter.start()
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "wait() blocks: a chunk was left where no thread takes it"
    whole = hashlib.sha256(b"".join(chunks)).hexdigest()
    assert [sha.hexdigest() for sha in shas] == [whole] * len(shas)
    hasher.close()
