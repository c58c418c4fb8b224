"""Snapshots: stable, checked copies of the files LibreYOLO rewrites in place. A torn or
changing checkpoint is never copied; every snapshot gets a name of its own, never a leftover's."""

from __future__ import annotations

import os
import time
from pathlib import Path, PosixPath

from agent.sinks.digests import DIGESTS, copy_hashing, sha256_file
from agent.sinks.local import LocalSink
from agent.sync.snapshots import Snapshotter, has_content
from tests.fakes.scripted_trainer import write_checkpoint


def checkpoint(path: Path, epoch: int = 3) -> Path:
    write_checkpoint(path, epoch)
    return path


def test_snapshot_of_a_valid_checkpoint(tmp_path: Path) -> None:
    src = tmp_path / "weights" / "last.pt"
    write_checkpoint(src, 3)
    snaps = Snapshotter(tmp_path / "snapshots")
    taken = snaps.take(src, checkpoint=True)
    assert taken is not None
    dst, digest, size = taken.path, taken.sha256, taken.size
    assert not taken.live
    assert dst.parent == tmp_path / "snapshots"
    assert dst.read_bytes() == src.read_bytes()
    assert (digest, size) == (sha256_file(src), src.stat().st_size)
    again = snaps.take(src, checkpoint=True)
    assert again is not None and again.path != dst  # every snapshot has its own file


def test_snapshot_rejects_a_torn_checkpoint(tmp_path: Path) -> None:
    src = tmp_path / "last.pt"
    write_checkpoint(src, 3, payload_kb=32)
    data = src.read_bytes()
    src.write_bytes(data[: len(data) - 100])  # the trainer was still writing it
    snaps = Snapshotter(tmp_path / "snapshots")
    assert snaps.take(src, checkpoint=True) is None
    assert list((tmp_path / "snapshots").iterdir()) == []


def test_snapshot_does_not_zip_check_small_files(tmp_path: Path) -> None:
    src = tmp_path / "status.json"
    src.write_text('{"state": "running"}', encoding="utf-8")
    taken = Snapshotter(tmp_path / "snapshots").take(src, checkpoint=False)
    assert taken is not None and taken.path.read_bytes() == src.read_bytes()


def test_snapshot_of_a_missing_file_is_none(tmp_path: Path) -> None:
    assert Snapshotter(tmp_path / "snapshots").take(tmp_path / "nope.pt", checkpoint=True) is None


class TouchedDuringCopy(PosixPath):
    """A real file whose mtime moves between the snapshotter's before- and after-copy stat(),
    as when the trainer rewrites it in place while it is being copied."""

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        result = super().stat(follow_symlinks=follow_symlinks)
        if not getattr(self, "touched", False):
            self.touched = True
            os.utime(self, ns=(result.st_atime_ns, result.st_mtime_ns + 1_000_000_000))
        return result


def test_snapshot_rejects_a_file_modified_during_copy(tmp_path: Path) -> None:
    plain = tmp_path / "last.pt"
    write_checkpoint(plain, 3)
    src = TouchedDuringCopy(plain)
    assert Snapshotter(tmp_path / "snapshots").take(src, checkpoint=True) is None
    assert list((tmp_path / "snapshots").iterdir()) == []
    # The same file, left alone, is fine.
    assert Snapshotter(tmp_path / "snapshots").take(plain, checkpoint=True) is not None


def test_new_snapshots_never_overwrite_a_leftover_one(tmp_path: Path) -> None:
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    (snapshots / "000001-last.pt").write_bytes(b"a killed agent's pending snapshot")
    (snapshots / "000007-last.pt").write_bytes(b"another one")
    src = tmp_path / "last.pt"
    write_checkpoint(src, 3)
    taken = Snapshotter(snapshots).take(src, checkpoint=True)
    assert taken is not None and taken.path.name == "000008-last.pt"
    assert (snapshots / "000001-last.pt").read_bytes() == b"a killed agent's pending snapshot"


# ---- one read per checkpoint version (issue 15) --------------------------------------------


def test_copy_hashing_copies_and_hashes_in_one_pass(tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(3 * (1 << 20) + 123))  # not a multiple of the chunk
    dst = tmp_path / "copy.bin"
    assert copy_hashing(src, dst) == sha256_file(src)
    assert dst.read_bytes() == src.read_bytes()


def test_a_snapshotted_version_is_not_hashed_again(tmp_path: Path) -> None:
    src = checkpoint(tmp_path / "last.pt")
    snap = Snapshotter(tmp_path / "snaps").take(src, checkpoint=True)
    assert snap is not None and snap.sha256 == sha256_file(src)
    misses = DIGESTS.misses
    # The final sync's question "is the live file still what was uploaded?" needs no read.
    assert has_content(src, snap.sha256, snap.size)
    assert has_content(snap.path, snap.sha256, snap.size)
    assert DIGESTS.misses == misses


def test_a_rewrite_with_the_same_size_and_mtime_is_hashed_anew(tmp_path: Path) -> None:
    """The trainer rewrites last.pt in place; even a same-size rewrite whose mtime is set back
    changes the ctime, so the remembered digest is never taken for the new content."""
    src = checkpoint(tmp_path / "last.pt")
    snap = Snapshotter(tmp_path / "snaps").take(src, checkpoint=True)
    assert snap is not None
    st = src.stat()
    data = bytearray(src.read_bytes())
    data[-30] ^= 0xFF
    time.sleep(0.01)
    src.write_bytes(bytes(data))
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert src.stat().st_size == snap.size and src.stat().st_mtime_ns == snap.mtime_ns
    assert not has_content(src, snap.sha256, snap.size)
    assert has_content(src, sha256_file(src), snap.size)


def test_local_target_read_back_uses_the_digest_of_the_bytes_written(tmp_path: Path) -> None:
    src = checkpoint(tmp_path / "last.pt")
    sink = LocalSink(tmp_path / "target")
    sink.upload(src, "weights/last.pt")
    misses = DIGESTS.misses
    remote = sink.stat("weights/last.pt")
    assert remote is not None and remote.sha256 == sha256_file(src)
    assert DIGESTS.misses == misses
    # Something else changes the stored copy: the read-back reads it and sees it.
    stored = tmp_path / "target" / "weights" / "last.pt"
    time.sleep(0.01)
    stored.write_bytes(b"PK garbage" + b"\0" * (remote.size - 10))
    changed = sink.stat("weights/last.pt")
    assert changed is not None and changed.size == remote.size
    assert changed.sha256 == sha256_file(stored) != remote.sha256


def test_hub_upload_is_handed_the_snapshot_digest(tmp_path: Path) -> None:
    from huggingface_hub import CommitOperationAdd

    from agent.sinks.hf import _give_known_digest

    src = checkpoint(tmp_path / "last.pt")
    snap = Snapshotter(tmp_path / "snaps").take(src, checkpoint=True)
    assert snap is not None
    op = CommitOperationAdd(path_in_repo="weights/last.pt", path_or_fileobj=str(snap.path))
    assert not op.upload_info.is_hashed  # the client would read the whole file to hash it
    _give_known_digest(op, snap.path)
    assert op.upload_info.is_hashed and op.upload_info.sha256.hex() == snap.sha256
    # A file this process never hashed is left to the client.
    other = checkpoint(tmp_path / "other.pt")
    op2 = CommitOperationAdd(path_in_repo="weights/other.pt", path_or_fileobj=str(other))
    _give_known_digest(op2, other)
    assert not op2.upload_info.is_hashed
    assert op2.upload_info.sha256.hex() == sha256_file(other)
