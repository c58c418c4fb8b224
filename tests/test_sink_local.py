"""LocalSink's download (what a box that lost its disk, or a new box, resumes from), and its
upload's one hash per checkpoint version."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from agent.sinks import SinkError, digests
from agent.sinks.digests import DIGESTS, sha256_file
from agent.sinks.local import LocalSink


def test_download_copies_and_checks(tmp_path: Path) -> None:
    s = LocalSink(tmp_path / "target")
    s.prepare()
    src = tmp_path / "last.pt"
    src.write_bytes(b"PK\x03\x04" + b"x" * 5000)
    s.upload(src, "weights/last.pt")
    dest = tmp_path / "box" / "runs" / "r1" / "weights" / "last.pt"
    got = s.download("weights/last.pt", dest)
    assert got is not None and got.sha256 == sha256_file(src) == sha256_file(dest)
    assert s.download("weights/nope.pt", tmp_path / "nope.pt") is None


def test_download_refuses_a_path_outside_the_target(tmp_path: Path) -> None:
    s = LocalSink(tmp_path / "target")
    s.prepare()
    with pytest.raises(SinkError):
        s.download("../secret", tmp_path / "x")


def test_a_snapshot_hashed_as_it_was_made_is_not_hashed_again(tmp_path: Path) -> None:
    """Hash once per checkpoint version: the upload takes the snapshot's digest from memory.
    Proved by remembering a digest that is not the file's: the read-back reports it."""
    s = LocalSink(tmp_path / "target")
    s.prepare()
    snap = tmp_path / "snap-last.pt"
    snap.write_bytes(b"PK\x03\x04" + os.urandom(3 << 20))
    remembered = "f" * 64
    DIGESTS.remember(snap.stat(), remembered)
    s.upload(snap, "weights/last.pt")
    target = tmp_path / "target" / "weights" / "last.pt"
    assert target.read_bytes() == snap.read_bytes()
    got = s.stat("weights/last.pt")
    assert got is not None and got.sha256 == remembered  # from memory: no second hash
    # A file the memory does not know is hashed as it is copied.
    other = tmp_path / "other.pt"
    other.write_bytes(b"PK\x03\x04" + os.urandom(1 << 20))
    s.upload(other, "weights/best.pt")
    best = s.stat("weights/best.pt")
    assert best is not None and best.sha256 == hashlib.sha256(other.read_bytes()).hexdigest()


def test_a_source_that_changes_during_the_copy_is_copied_again_hashing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = LocalSink(tmp_path / "target")
    s.prepare()
    src = tmp_path / "last.pt"
    src.write_bytes(b"PK\x03\x04" + os.urandom(3 << 20))
    DIGESTS.remember(src.stat(), "e" * 64)  # the version before the writer came back
    real_blocks = digests._blocks
    written: list[bool] = []

    def blocks_then_a_writer(f: Any, chunk: int) -> Any:
        for i, block in enumerate(real_blocks(f, chunk)):
            yield block
            if i == 0 and not written:  # a writer appends while the first copy runs
                written.append(True)
                with open(src, "ab") as w:
                    w.write(b"more")

    monkeypatch.setattr(digests, "_blocks", blocks_then_a_writer)
    s.upload(src, "weights/last.pt")
    got = s.stat("weights/last.pt")
    final = src.read_bytes()
    assert (tmp_path / "target" / "weights" / "last.pt").read_bytes() == final
    assert got is not None and got.sha256 == hashlib.sha256(final).hexdigest()


def test_delete_removes_a_file_and_a_missing_one_is_fine(tmp_path: Path) -> None:
    root = tmp_path / "target"
    s = LocalSink(root)
    s.prepare()
    src = tmp_path / "canary"
    src.write_bytes(b"canary\n")
    s.upload(src, "agent/.canary")
    assert (root / "agent" / ".canary").is_file()
    s.delete("agent/.canary")
    assert not (root / "agent" / ".canary").exists() and s.stat("agent/.canary") is None
    s.delete("agent/.canary")  # already gone: nothing to do
    with pytest.raises(SinkError):
        s.delete("../outside")
