"""The hostile-archive unpacker (agent/data/archive/__init__.py): good archives of every format
unpack
whole through the real :func:`agent.data.archive.safe_unpack` on the real file system; what ``dest``
may be; an unsupported or unreadable archive is a clear error. The members' checks are tested in
tests/test_archive_plan.py, the writing (disk budget, modes, copies) in tests/test_archive_write.py;
the archive builders below serve all three (and the dataset tests).
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from agent.data.archive import ArchiveError, safe_unpack

MiB = 1 << 20

# --------------------------------------------------------------------------------------------
# Helpers


def snapshot(root: Path) -> set[str]:
    """Every path under ``root`` (links not followed), to prove nothing was written."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def tar_bytes(*members: tuple[tarfile.TarInfo, bytes | None], mode: str = "w") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode, format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            if data is None:
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def reg(name: str, data: bytes = b"data\n", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.mode = mode
    return info, data


def special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info, None


def zip_bytes(*entries: tuple[zipfile.ZipInfo | str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for info, data in entries:
            zf.writestr(info, data)
    return buf.getvalue()


def zip_symlink(name: str, target: str) -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(name)
    info.create_system = 3
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info, target.encode()


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def small_archive() -> bytes:
    return tar_bytes(
        special("ds", tarfile.DIRTYPE),
        reg("ds/a.txt", b"alpha\n"),
        reg("ds/sub/b.txt", b"beta\n"),
    )


def zeros_archive(suffix: str, size: int) -> bytes:
    """One member of ``size`` zero bytes: compresses about 1000 times."""
    if suffix == ".zip":
        return zip_bytes(("ds/zeros.bin", bytes(size)))
    return tar_bytes(reg("ds/zeros.bin", bytes(size)), mode="w:gz")


# --------------------------------------------------------------------------------------------
# Safe unpack: good archives


def good_tree_tar(mode: str) -> bytes:
    return tar_bytes(
        special("./", tarfile.DIRTYPE),
        special("ds", tarfile.DIRTYPE),
        reg("ds/images/a.txt", b"alpha\n"),
        reg("ds/run.sh", b"#!/bin/sh\n", mode=0o4755),  # setuid must not survive
        special("ds/labels", tarfile.SYMTYPE, "images"),
        special("ds/same.txt", tarfile.LNKTYPE, "ds/images/a.txt"),
        mode=mode,
    )


@pytest.mark.parametrize(
    ("suffix", "mode"),
    [
        (".tar", "w"),
        (".tar.gz", "w:gz"),
        (".tgz", "w:gz"),
        (".tar.bz2", "w:bz2"),
        (".tar.xz", "w:xz"),
    ],
)
def test_good_tar_unpacks(tmp_path: Path, suffix: str, mode: str) -> None:
    archive = write(tmp_path / f"good{suffix}", good_tree_tar(mode))
    dest = tmp_path / "data"
    written = safe_unpack(archive, dest)
    # The hardlink is written as a copy: its bytes count too.
    assert written == 2 * len(b"alpha\n") + len(b"#!/bin/sh\n")
    assert (dest / "ds/images/a.txt").read_bytes() == b"alpha\n"
    assert os.readlink(dest / "ds/labels") == "images"
    assert (dest / "ds/labels/a.txt").read_bytes() == b"alpha\n"
    assert (dest / "ds/same.txt").read_bytes() == b"alpha\n"
    assert (dest / "ds/same.txt").stat().st_ino != (dest / "ds/images/a.txt").stat().st_ino
    run_mode = (dest / "ds/run.sh").stat().st_mode
    assert run_mode & 0o100 and not run_mode & stat.S_ISUID  # filter="data" was applied
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([archive.name, "data"])


def test_good_zip_unpacks(tmp_path: Path) -> None:
    exe = zipfile.ZipInfo("ds/run.sh")
    exe.create_system = 3
    exe.external_attr = (stat.S_IFREG | 0o755) << 16
    archive = write(
        tmp_path / "good.zip",
        zip_bytes(
            ("ds/", b""),
            ("ds/images/a.txt", b"alpha\n" * 100),
            (exe, b"#!/bin/sh\n"),
            zip_symlink("ds/labels", "images"),
        ),
    )
    dest = tmp_path / "data"
    assert safe_unpack(archive, dest) == 600 + 10
    assert (dest / "ds/images/a.txt").read_bytes() == b"alpha\n" * 100
    assert (dest / "ds/run.sh").stat().st_mode & 0o100
    assert os.readlink(dest / "ds/labels") == "images"


def test_unpack_fills_an_existing_empty_dest(tmp_path: Path) -> None:
    archive = write(tmp_path / "a.tar", small_archive())
    (tmp_path / "data").mkdir()
    assert safe_unpack(archive, tmp_path / "data") == 11
    assert (tmp_path / "data" / "ds" / "a.txt").read_bytes() == b"alpha\n"


def test_unpack_refuses_a_non_empty_dest(tmp_path: Path) -> None:
    archive = write(tmp_path / "a.tar", small_archive())
    write(tmp_path / "data" / "mine.txt", b"keep me")
    with pytest.raises(ArchiveError, match="not an empty directory"):
        safe_unpack(archive, tmp_path / "data")
    assert (tmp_path / "data" / "mine.txt").read_bytes() == b"keep me"


def test_unsupported_format_is_refused(tmp_path: Path) -> None:
    archive = write(tmp_path / "a.rar", b"Rar!")
    with pytest.raises(ArchiveError, match=r"not a supported archive; pack the dataset as \.tar"):
        safe_unpack(archive, tmp_path / "data")


def test_truncated_archive_is_a_clear_error(tmp_path: Path) -> None:
    data = tar_bytes(reg("a.txt", os.urandom(50_000)), mode="w:gz")
    archive = write(tmp_path / "a.tar.gz", data[: len(data) // 2])
    before = snapshot(tmp_path)
    with pytest.raises(ArchiveError, match=r"a\.tar\.gz is not a readable tar archive"):
        safe_unpack(archive, tmp_path / "data")
    assert snapshot(tmp_path) == before
