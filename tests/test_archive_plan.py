"""The plan (agent/data/archive/plan.py): hostile archives are refused before anything is written,
every unsafe member named - traversal, absolute paths, escaping links, devices, FIFOs,
duplicate and clashing members, names too long for the file system, decompression bombs.
Every archive goes through the real :func:`agent.data.archive.safe_unpack` on the real file system.
"""

from __future__ import annotations

import os
import stat
import tarfile
import warnings
import zipfile
from pathlib import Path

import pytest

from agent.data.archive import MAX_EXPANSION_RATIO, ArchiveError, UnsafeArchiveError, safe_unpack
from tests.test_archive import (
    MiB,
    reg,
    snapshot,
    special,
    tar_bytes,
    write,
    zeros_archive,
    zip_bytes,
    zip_symlink,
)

# --------------------------------------------------------------------------------------------
# Hostile archives are refused before anything is written


def _outside(tmp_path: Path) -> str:
    return str(tmp_path / "sentinel.txt")


HOSTILE_TARS = {
    "traversal": lambda t: [reg("ok.txt"), reg("../sentinel.txt")],
    "traversal_nested": lambda t: [reg("a/b/../../../sentinel.txt")],
    "absolute": lambda t: [reg(_outside(t))],
    "symlink_escape": lambda t: [special("link", tarfile.SYMTYPE, "../sentinel.txt")],
    "symlink_absolute": lambda t: [special("link", tarfile.SYMTYPE, _outside(t))],
    # Lexically "deep/er/up/../.." is "deep", but the kernel follows deep/er/up (-> dest) first.
    "symlink_chain_escape": lambda t: [
        special("deep/er", tarfile.DIRTYPE),
        special("deep/er/up", tarfile.SYMTYPE, "../.."),
        special("link", tarfile.SYMTYPE, "deep/er/up/../.."),
    ],
    "write_through_symlink": lambda t: [
        special("dir", tarfile.DIRTYPE),
        special("l", tarfile.SYMTYPE, "dir"),
        reg("l/file.txt"),
    ],
    "hardlink_escape": lambda t: [special("h", tarfile.LNKTYPE, "../sentinel.txt")],
    "hardlink_absolute": lambda t: [special("h", tarfile.LNKTYPE, _outside(t))],
    "hardlink_to_symlink": lambda t: [
        special("s", tarfile.SYMTYPE, "x"),
        special("h", tarfile.LNKTYPE, "s"),
    ],
    "char_device": lambda t: [special("dev/null", tarfile.CHRTYPE)],
    "block_device": lambda t: [special("dev/sda", tarfile.BLKTYPE)],
    "fifo": lambda t: [special("pipe", tarfile.FIFOTYPE)],
}


@pytest.mark.parametrize("case", sorted(HOSTILE_TARS))
def test_hostile_tar_is_refused_and_nothing_is_written(tmp_path: Path, case: str) -> None:
    members = HOSTILE_TARS[case](tmp_path)
    archive = write(tmp_path / "in" / "evil.tar", tar_bytes(*members))
    dest = tmp_path / "work" / "data"
    before = snapshot(tmp_path)

    with pytest.raises(UnsafeArchiveError) as info:
        safe_unpack(archive, dest)

    err = info.value
    assert "nothing was unpacked" in str(err)
    assert "\n" not in str(err)
    assert err.members, err
    for name in err.members:
        assert repr(name)[:40] in str(err)
    assert not (tmp_path / "sentinel.txt").exists()
    assert not os.path.lexists(dest)
    assert snapshot(tmp_path) == before  # no dest, no temporary sibling, nothing anywhere


def test_every_unsafe_member_is_named(tmp_path: Path) -> None:
    archive = write(
        tmp_path / "evil.tar",
        tar_bytes(
            reg("good.txt"),
            reg("../up.txt"),
            special("pipe", tarfile.FIFOTYPE),
            special("esc", tarfile.SYMTYPE, "../../x"),
            special("dev", tarfile.CHRTYPE),
        ),
    )
    with pytest.raises(UnsafeArchiveError) as info:
        safe_unpack(archive, tmp_path / "data")
    msg = str(info.value)
    assert info.value.members == ["../up.txt", "pipe", "esc", "dev"]
    assert "4 unsafe member(s)" in msg
    assert "'../up.txt': leaves the destination" in msg
    assert "'pipe': is a FIFO" in msg
    assert "'esc': is a symlink that points outside the destination" in msg
    assert "'dev': is a character device" in msg
    assert "good.txt" not in msg


@pytest.mark.parametrize(
    "entry",
    [
        ("../sentinel.txt", b"x"),
        ("a/../../sentinel.txt", b"x"),
        ("/abs/sentinel.txt", b"x"),
        zip_symlink("link", "../sentinel.txt"),
    ],
    ids=["traversal", "traversal_nested", "absolute", "symlink_escape"],
)
def test_hostile_zip_is_refused(tmp_path: Path, entry: tuple[zipfile.ZipInfo | str, bytes]) -> None:
    archive = write(tmp_path / "evil.zip", zip_bytes(("ok.txt", b"fine"), entry))
    dest = tmp_path / "work" / "data"
    before = snapshot(tmp_path)
    with pytest.raises(UnsafeArchiveError, match="unsafe member"):
        safe_unpack(archive, dest)
    assert snapshot(tmp_path) == before


def test_zip_fifo_member_is_refused(tmp_path: Path) -> None:
    info = zipfile.ZipInfo("pipe")
    info.create_system = 3
    info.external_attr = (stat.S_IFIFO | 0o644) << 16
    archive = write(tmp_path / "evil.zip", zip_bytes((info, b"")))
    with pytest.raises(UnsafeArchiveError, match="'pipe': is a FIFO"):
        safe_unpack(archive, tmp_path / "data")


# --------------------------------------------------------------------------------------------
# One name, one thing: duplicates, file/folder clashes


CLASHING_TARS = {
    "duplicate_file": (
        [reg("ds/a.txt", b"first"), reg("ds/b.txt"), reg("ds/a.txt", b"second")],
        "ds/a.txt",
        "appears twice in the archive (two files of that name)",
    ),
    "file_then_dir": (
        [reg("ds/a", b"file"), special("ds/a", tarfile.DIRTYPE)],
        "ds/a",
        "is both a file and a folder in the archive",
    ),
    "dir_then_file": (
        [special("ds/a", tarfile.DIRTYPE), reg("ds/a", b"file")],
        "ds/a",
        "is both a folder and a file in the archive",
    ),
    "file_then_child": (
        [reg("ds/a", b"file"), reg("ds/a/b.txt")],
        "ds/a/b.txt",
        "lies below 'ds/a', which is a file, not a folder",
    ),
    "child_then_file": (
        [reg("ds/a/b.txt"), reg("ds/a", b"file")],
        "ds/a/b.txt",
        "lies below 'ds/a', which is a file, not a folder",
    ),
    # The attack: a hardlink to data.yaml, then a member of the link's name written
    # through it, rewrote data.yaml.
    "hardlink_then_write": (
        [
            reg("ds/data.yaml", b"train: images/train\nval: images/val\n"),
            special("ds/h", tarfile.LNKTYPE, "ds/data.yaml"),
            reg("ds/h", b"path: /etc\n"),
        ],
        "ds/h",
        "is both a hardlink and a file in the archive",
    ),
}


@pytest.mark.parametrize("case", sorted(CLASHING_TARS))
def test_clashing_members_are_refused_and_named(tmp_path: Path, case: str) -> None:
    members, member, why = CLASHING_TARS[case]
    archive = write(tmp_path / "clash.tar", tar_bytes(*members))
    dest = tmp_path / "data"
    before = snapshot(tmp_path)

    with pytest.raises(UnsafeArchiveError) as info:
        safe_unpack(archive, dest)

    assert info.value.members == [member]
    assert f"{member!r}: {why}" in str(info.value)
    assert "1 unsafe member(s), nothing was unpacked" in str(info.value)
    assert snapshot(tmp_path) == before


def test_duplicate_zip_members_are_refused(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile warns "Duplicate name"
        data = zip_bytes(("ds/data.yaml", b"train: a\nval: b\n"), ("ds/data.yaml", b"path: /\n"))
    archive = write(tmp_path / "dup.zip", data)
    before = snapshot(tmp_path)
    with pytest.raises(UnsafeArchiveError, match=r"'ds/data.yaml': appears twice in the archive"):
        safe_unpack(archive, tmp_path / "data")
    assert snapshot(tmp_path) == before


def test_repeated_folder_entries_are_harmless(tmp_path: Path) -> None:
    # `tar -cf x.tar ds ds/images` lists folders twice; that must still unpack.
    archive = write(
        tmp_path / "ok.tar",
        tar_bytes(
            special("ds", tarfile.DIRTYPE),
            special("ds/images", tarfile.DIRTYPE),
            special("ds/", tarfile.DIRTYPE),
            reg("ds/images/a.txt", b"alpha\n"),
        ),
    )
    assert safe_unpack(archive, tmp_path / "data") == 6
    assert (tmp_path / "data" / "ds" / "images" / "a.txt").read_bytes() == b"alpha\n"


# --------------------------------------------------------------------------------------------
# Decompression bombs: the expansion cap


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip"])
def test_decompression_bomb_is_refused_before_writing(tmp_path: Path, suffix: str) -> None:
    # The case in small: a 1.6 MB .tar.gz wrote 1.5 GB. Here 32 KiB would write 32 MiB.
    archive = write(tmp_path / f"bomb{suffix}", zeros_archive(suffix, 32 * MiB))
    assert archive.stat().st_size * MAX_EXPANSION_RATIO < 32 * MiB
    dest = tmp_path / "work" / "data"
    before = snapshot(tmp_path)

    with pytest.raises(ArchiveError) as info:
        safe_unpack(archive, dest)

    msg = str(info.value)
    assert msg.startswith(f"archive bomb{suffix} expands past 200 times its size: ")
    assert f"declare {32 * MiB:,} bytes (32.0 MiB) from {archive.stat().st_size:,} bytes" in msg
    assert "decompression bomb" in msg and "uncompressed .tar" in msg
    assert snapshot(tmp_path) == before  # refused before anything was written


def test_expansion_cap_is_a_parameter(tmp_path: Path) -> None:
    archive = write(tmp_path / "zeros.tar.gz", zeros_archive(".tar.gz", 32 * MiB))
    written = safe_unpack(archive, tmp_path / "data", max_ratio=5000)
    assert written == 32 * MiB
    assert (tmp_path / "data" / "ds" / "zeros.bin").stat().st_size == 32 * MiB


def test_hardlink_copies_count_against_the_expansion_cap(tmp_path: Path) -> None:
    # Hardlinks are written as copies, so 300 links to 1 MiB write 301 MiB from a ~1.2 MiB tar.
    members = [reg("ds/a.bin", os.urandom(MiB))]
    members += [special(f"ds/l{i}", tarfile.LNKTYPE, "ds/a.bin") for i in range(300)]
    archive = write(tmp_path / "links.tar", tar_bytes(*members))
    before = snapshot(tmp_path)
    with pytest.raises(ArchiveError, match=r"expands past 200 times its size: .* \(301\.0 MiB\)"):
        safe_unpack(archive, tmp_path / "data")
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------------------------
# Names too long for the file system


def test_a_300_character_name_is_named_as_too_long(tmp_path: Path) -> None:
    name = "ds/" + "n" * 300 + ".png"
    archive = write(tmp_path / "long.tar", tar_bytes(reg("ds/ok.txt"), reg(name)))
    dest = tmp_path / "data"
    before = snapshot(tmp_path)

    with pytest.raises(ArchiveError) as info:
        safe_unpack(archive, dest)

    msg = str(info.value)
    assert "not a readable" not in msg and "upload is complete" not in msg
    assert msg.startswith(
        f"archive long.tar has 1 member(s) whose names are too long for the file system at "
        f"{dest}, nothing was unpacked: 'ds/nnnn"
    )
    assert "...: has a name part of 304 bytes, more than the 255 the file system allows " in msg
    assert "(ENAMETOOLONG); shorten those names" in msg
    assert "n" * 100 not in msg  # the member is named, cut short
    assert snapshot(tmp_path) == before

    longest = "ds/" + "n" * 251 + ".png"  # 255 bytes: the most a name may have
    archive = write(tmp_path / "ok.tar", tar_bytes(reg(longest)))
    assert safe_unpack(archive, dest) == 5
    assert (dest / longest).read_bytes() == b"data\n"


def test_a_path_too_long_for_the_file_system_is_named(tmp_path: Path) -> None:
    deep = "/".join(["d" * 200] * 21) + "/a.txt"  # every part fits, the whole does not
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        data = zip_bytes(("ok.txt", b"fine"), (deep, b"x"))
    archive = write(tmp_path / "deep.zip", data)
    before = snapshot(tmp_path)
    with pytest.raises(ArchiveError, match=r"'dddd.*\.\.\.: would have a path of \d{4} bytes, "):
        safe_unpack(archive, tmp_path / "data")
    assert snapshot(tmp_path) == before
