"""LocalSink's download: what a box that lost its disk (or a new box) resumes from."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.sinks import SinkError, sha256_file
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
