"""Snapshots: stable, checked copies of the files LibreYOLO rewrites in place. A torn or
changing checkpoint is never copied; every snapshot gets a name of its own, never a leftover's."""

from __future__ import annotations

import os
from pathlib import Path, PosixPath

from agent.sinks import sha256_file
from agent.snapshots import Snapshotter
from tests.fakes.scripted_trainer import write_checkpoint


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
