"""The hostile-archive unpacker (agent/archive.py): hostile archives are refused before anything
is written, good ones unpack whole; decompression bombs, a disk that fills while unpacking,
duplicate and clashing members, hardlinks written through, modes, names too long for the file
system. Every archive is built here with tarfile/zipfile and goes through the real
:func:`agent.archive.safe_unpack` on the real file system.
"""

from __future__ import annotations

import io
import math
import os
import stat
import tarfile
import warnings
import zipfile
from pathlib import Path

import pytest

from agent.archive import MAX_EXPANSION_RATIO, ArchiveError, UnsafeArchiveError, safe_unpack

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
# Safe unpack: hostile archives are refused before anything is written


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


def test_failed_unpack_leaves_nothing_half_written(tmp_path: Path) -> None:
    # The listing is fine; the second member's data is corrupt, found only while extracting.
    raw = bytearray(zip_bytes(("ds/a.txt", b"a" * 1000), ("ds/b.txt", b"payload-" * 500)))
    i = raw.rfind(b"ds/b.txt", 0, raw.find(b"PK\x01\x02")) + len("ds/b.txt") + 5
    raw[i] ^= 0xFF
    archive = write(tmp_path / "bad.zip", bytes(raw))
    before = snapshot(tmp_path)
    with pytest.raises(ArchiveError, match=r"bad\.zip is not a readable zip archive"):
        safe_unpack(archive, tmp_path / "data")
    assert snapshot(tmp_path) == before  # ds/a.txt was written to the temp dir, then removed


def test_disk_check_refuses_before_writing(tmp_path: Path) -> None:
    # A GNU sparse member (PAX 0.1) claims 1 PB of content in a 10 KiB tar: a real disk check
    # on the real file system, no monkeypatching. (With the default expansion cap it is refused
    # as a decompression bomb first: see test_decompression_bomb_is_refused_before_writing.)
    big = tarfile.TarInfo("ds/big.bin")
    big.pax_headers = {
        "GNU.sparse.map": "0,0",
        "GNU.sparse.size": str(10**15),
        "GNU.sparse.name": "ds/big.bin",
    }
    archive = write(tmp_path / "huge.tar", tar_bytes(reg("ds/a.txt"), (big, b"")))
    dest = tmp_path / "work" / "data"
    before = snapshot(tmp_path)
    with pytest.raises(ArchiveError) as info:
        safe_unpack(archive, dest, max_ratio=math.inf)
    msg = str(info.value)
    assert msg.startswith(f"not enough disk space to unpack huge.tar into {dest}: needs ")
    assert "1,000,000,000,00" in msg  # needed bytes, in full
    free = int(msg.split("but only ")[1].split(" bytes")[0].replace(",", ""))
    assert 0 < free < 10**15
    assert "free some space or rent a bigger disk" in msg
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------------------------
# Decompression bombs and the disk budget


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


def random_files_tar(count: int, size: int) -> bytes:
    return tar_bytes(*(reg(f"ds/f{i}.bin", os.urandom(size)) for i in range(count)))


def test_unpack_keeps_the_preflights_disk_headroom(tmp_path: Path) -> None:
    # 3 x 256 KiB fit in 900,000 bytes, but not with the preflight's 30 % headroom.
    archive = write(tmp_path / "a.tar", random_files_tar(3, 256 * 1024))
    asked: list[Path] = []

    def small_disk(path: Path) -> int:
        asked.append(path)
        return 900_000

    before = snapshot(tmp_path)
    with pytest.raises(ArchiveError) as info:
        safe_unpack(archive, tmp_path / "work" / "data", free_space=small_disk)
    msg = str(info.value)
    assert msg.startswith(f"not enough disk space to unpack a.tar into {tmp_path / 'work'}/data")
    needed = math.ceil(3 * 256 * 1024 * 1.3)
    assert f"plus 30 % headroom ({needed:,} bytes) but only 900,000 bytes" in msg
    assert f"are free on {tmp_path};" in msg  # the nearest folder that exists
    assert asked == [tmp_path]
    assert snapshot(tmp_path) == before

    assert safe_unpack(archive, tmp_path / "data", free_space=lambda p: needed) == 3 * 256 * 1024


def test_unpack_stops_when_the_disk_fills_while_writing(tmp_path: Path) -> None:
    # A fake 20 MiB disk, on the real tree: after the check before writing, another writer
    # takes 12 MiB. The unpack must stop before eating into the headroom (20 - 20/1.3 MiB).
    archive = write(tmp_path / "a.tar", random_files_tar(4, MiB))
    seen: list[int] = []

    def filling_disk(path: Path) -> int:
        unpacked = sum(p.stat().st_size for p in tmp_path.glob(".data.unpacking-*/**/*.bin"))
        seen.append(unpacked)
        other = 12 * MiB if len(seen) > 1 else 0
        return 20 * MiB - other - unpacked

    before = snapshot(tmp_path)
    with pytest.raises(ArchiveError) as info:
        safe_unpack(archive, tmp_path / "data", free_space=filling_disk)

    msg = str(info.value)
    assert msg.startswith("the disk filled up while unpacking a.tar (3,145,728 of 4,194,304 ")
    assert "less than the 30 % headroom kept for training; nothing was unpacked" in msg
    assert max(seen) == 3 * MiB  # it stopped before the chunk that would go over
    assert snapshot(tmp_path) == before  # the temporary tree is gone


# --------------------------------------------------------------------------------------------
# One name, one thing: duplicates, file/folder clashes, hardlinks


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


def test_hardlinks_become_independent_copies(tmp_path: Path) -> None:
    archive = write(
        tmp_path / "links.tar",
        tar_bytes(
            reg("ds/data.yaml", b"train: images/train\n"),
            special("ds/copy.yaml", tarfile.LNKTYPE, "ds/data.yaml"),
        ),
    )
    dest = tmp_path / "data"
    assert safe_unpack(archive, dest) == 2 * len(b"train: images/train\n")
    original, copy = dest / "ds" / "data.yaml", dest / "ds" / "copy.yaml"
    assert copy.read_bytes() == original.read_bytes()
    assert copy.stat().st_ino != original.stat().st_ino and original.stat().st_nlink == 1
    copy.write_bytes(b"path: /etc\n")  # what training, or a later tool, might do
    assert original.read_bytes() == b"train: images/train\n"


# --------------------------------------------------------------------------------------------
# Modes


MODES = {
    # name: (mode in the archive, mode after unpacking)
    "setuid": (0o4755, 0o755),
    "setgid": (0o2755, 0o755),
    "sticky": (0o1755, 0o755),
    "all_bits": (0o7777, 0o755),
    "world_writable": (0o666, 0o644),
    "world_writable_exec": (0o777, 0o755),
    "owner_only": (0o600, 0o644),
    "exec_by_others_only": (0o611, 0o644),
}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_tar_modes_are_made_sane(tmp_path: Path) -> None:
    members = [reg(f"ds/{name}", b"x", mode=mode) for name, (mode, _) in MODES.items()]
    for name, mode in (("sgid_dir", 0o2775), ("sticky_dir", 0o1777), ("private_dir", 0o700)):
        info, data = special(f"ds/{name}", tarfile.DIRTYPE)
        info.mode = mode
        members.append((info, data))
    archive = write(tmp_path / "modes.tar", tar_bytes(*members))
    dest = tmp_path / "data"
    old_umask = os.umask(0o077)  # the result must not depend on the box's umask
    try:
        safe_unpack(archive, dest)
    finally:
        os.umask(old_umask)
    got = {name: _mode(dest / "ds" / name) for name in MODES}
    assert got == {name: after for name, (_, after) in MODES.items()}
    for name in ("sgid_dir", "sticky_dir", "private_dir"):
        assert _mode(dest / "ds" / name) == 0o755, name
    assert _mode(dest / "ds") == 0o755 and _mode(dest) == 0o755


def test_zip_modes_are_made_sane(tmp_path: Path) -> None:
    entries: list[tuple[zipfile.ZipInfo | str, bytes]] = []
    for name, (mode, _) in MODES.items():
        info = zipfile.ZipInfo(f"ds/{name}")
        info.create_system = 3
        info.external_attr = (stat.S_IFREG | mode) << 16
        entries.append((info, b"x"))
    archive = write(tmp_path / "modes.zip", zip_bytes(*entries))
    dest = tmp_path / "data"
    safe_unpack(archive, dest)
    got = {name: _mode(dest / "ds" / name) for name in MODES}
    assert got == {name: after for name, (_, after) in MODES.items()}


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
