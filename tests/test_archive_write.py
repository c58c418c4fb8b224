"""Writing (agent/data/archive/write.py): the free disk is checked with its headroom before writing
and read again while writing; a failure leaves nothing half-written; hardlinks become
independent copies; modes are made sane. Every archive goes through the real
:func:`agent.data.archive.safe_unpack` on the real file system.
"""

from __future__ import annotations

import math
import os
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from agent.data.archive import ArchiveError, UnsafeArchiveError, safe_unpack
from tests.test_archive import (
    MiB,
    reg,
    snapshot,
    special,
    tar_bytes,
    write,
    zip_bytes,
)

# --------------------------------------------------------------------------------------------
# The disk budget


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
# Nothing half-written, hardlinks as copies


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
# tarfile's own data filter (PEP 706): a second opinion where Python has it, never relied on


def test_tarfiles_data_filter_is_a_second_opinion_where_python_has_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = getattr(tarfile, "data_filter", None)
    if real is None:
        pytest.skip(
            "this Python's tarfile has no data_filter (PEP 706 came in 3.11.4): the unpack relies "
            "on its own checks alone (tests/test_archive_no_pep706.py)"
        )
    seen: list[str] = []

    def stricter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        # Our plan refuses all the real filter refuses, so only a stand-in can refuse what it
        # passed: the one fault this test injects.
        seen.append(member.name)
        if member.name == "ds/b.txt":
            raise tarfile.OutsideDestinationError(member, dest)
        return real(member, dest)

    monkeypatch.setattr(tarfile, "data_filter", stricter)
    archive = write(tmp_path / "ds.tar", tar_bytes(reg("ds/a.txt"), reg("ds/b.txt")))
    before = snapshot(tmp_path)
    with pytest.raises(UnsafeArchiveError, match=r"'ds/b\.txt': refused by tarfile's data filter"):
        safe_unpack(archive, tmp_path / "data")
    assert seen == ["ds/a.txt", "ds/b.txt"]
    assert snapshot(tmp_path) == before  # ds/a.txt was written to the temp dir, then removed


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
