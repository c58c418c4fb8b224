"""The plan: every member of an archive listed and checked, nothing written yet.

Checked, in archive order: names (NUL bytes, absolute paths, ``..``), kinds (no devices, FIFOs,
sockets or encrypted zip members), duplicates and names that are both a file and a folder,
links (symlinks and hardlinks stay inside the destination, nothing is written through a
symlink), name lengths against the file system at the destination, and the expansion cap.
"""

from __future__ import annotations

import os
import stat
import tarfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from agent.data.archive.errors import ArchiveError, UnsafeArchiveError, name_problems
from agent.data.archive.formats import LIST_ERRORS, ArchiveFormat, require_format, unreadable
from agent.util.disk import nearest_existing
from agent.util.text import format_bytes, show

#: Default cap on unpacked bytes per archive byte. Images and most label files barely compress
#: (a real dataset archive unpacks to 1-3x its size); a run of zeros gzips about 1000x.
MAX_EXPANSION_RATIO = 200

#: Symlinks followed while resolving one link target (the kernel's limit is 40 too).
_MAX_LINK_HOPS = 40
#: Disk-space estimate: files occupy whole blocks, and every entry costs at least one.
_BLOCK = 4096
#: The expansion cap is never below this, so a tiny archive of text is not called a bomb.
_MIN_EXPANSION_CAP = 1 << 20
#: Used when the file system does not say (``pathconf``): Linux's NAME_MAX and PATH_MAX.
_NAME_MAX = 255
_PATH_MAX = 4096


class Kind(StrEnum):
    """What a member is, once it passed the checks."""

    FILE = "file"  #: a regular file
    DIR = "dir"  #: a directory
    SYMLINK = "symlink"  #: a symbolic link, created as such
    HARDLINK = "hardlink"  #: a hardlink to an earlier file, written as an independent copy

    @property
    def noun(self) -> str:
        """What a message calls it."""
        return "folder" if self is Kind.DIR else self.value


@dataclass
class Entry:
    """One member to write, as the plan sees it."""

    #: Normalized relative path ("a/b/c"), "" for the archive's root entry.
    path: str
    kind: Kind
    #: Bytes of content; for a hardlink, its target's (it is written as a copy).
    size: int = 0
    target: str = ""
    #: Permission bits the archive gives (only the owner's execute bit is kept).
    mode: int = 0o644
    #: Modification time the archive gives, if any.
    mtime: float | None = None
    #: Position in the archive and the member's name as the archive spells it.
    index: int = 0
    name: str = ""


@dataclass(frozen=True)
class UnpackPlan:
    """What :func:`plan_unpack` found in an archive that passed every check."""

    #: The archive, and its format (from the name's suffix).
    archive: Path
    format: ArchiveFormat
    #: Where it is to be unpacked (absolute).
    dest: Path
    #: Bytes of file content the members declare (hardlinks count: they become copies).
    file_bytes: int
    #: Files it will write (hardlinks count: they become copies).
    files: int
    #: Estimated bytes the tree occupies on disk (whole blocks).
    disk_bytes: int
    #: Names at the top of the tree, in archive order.
    top_level: list[str]
    #: The members to write, in archive order.
    entries: list[Entry]
    #: The archive's own member objects for ``entries`` (TarInfo or ZipInfo).
    members: list[Any]


def plan_unpack(archive: Path, dest: Path, *, max_ratio: float = MAX_EXPANSION_RATIO) -> UnpackPlan:
    """List and check every member of ``archive`` for an unpack into ``dest``, writing nothing.

    Raises as :func:`~agent.data.archive.safe_unpack` does for everything that can be known before
    writing (the free disk excepted: :func:`~agent.data.archive.unpack` reads it). ``dest`` itself
    is not looked at: the caller makes sure it is absent or empty by the time it calls ``unpack``.
    """
    archive = Path(archive)
    return make_plan(
        archive, require_format(archive), Path(os.path.abspath(dest)), max_ratio=max_ratio
    )


def make_plan(archive: Path, fmt: ArchiveFormat, dest: Path, *, max_ratio: float) -> UnpackPlan:
    """:func:`plan_unpack` for an archive of known format and an absolute ``dest``."""
    raw: list[Any]
    try:
        if fmt is ArchiveFormat.TAR:
            with tarfile.open(archive, "r:*") as tf:
                raw = tf.getmembers()
            listed = [_tar_entry(m) for m in raw]
        else:
            with zipfile.ZipFile(archive) as zf:
                raw = zf.infolist()
                listed = [_zip_entry(zf, info) for info in raw]
    except LIST_ERRORS as exc:
        raise unreadable(archive, fmt, exc) from None

    # Archive index -> (member name, why); one reason per member, reported in archive order.
    bad: dict[int, tuple[str, str]] = {}
    entries: list[Entry] = []
    members: list[Any] = []
    for index, (member, (name, entry, problem)) in enumerate(zip(raw, listed, strict=True)):
        if problem is None and entry is not None:
            problem = _check_name(entry.path, name)
        if problem is not None:
            bad[index] = (name, problem)
            continue
        assert entry is not None
        entry.index, entry.name = index, name
        if entry.path == "":
            if entry.kind is not Kind.DIR:
                bad[index] = (name, "has an empty path")
            continue  # the archive's own root ("./"): dest itself
        entries.append(entry)
        members.append(member)
    for entry, why in (*_check_clashes(entries), *_check_links(entries)):
        bad.setdefault(entry.index, (entry.name, why))
    if bad:
        raise UnsafeArchiveError(archive, [bad[i] for i in sorted(bad)])
    _check_lengths(archive, entries, dest)

    sizes = {e.path: e.size for e in entries if e.kind is Kind.FILE}
    for e in entries:
        if e.kind is Kind.HARDLINK:
            e.size = sizes[normalize(e.target)]
    content = [e for e in entries if e.kind in (Kind.FILE, Kind.HARDLINK)]
    file_bytes = sum(e.size for e in content)
    disk_bytes = sum(-(-e.size // _BLOCK) * _BLOCK for e in content)
    disk_bytes += _BLOCK * (len(entries) - len(content))
    top: list[str] = []
    for e in entries:
        head = e.path.split("/", 1)[0]
        if head not in top:
            top.append(head)
    plan = UnpackPlan(
        archive=archive,
        format=fmt,
        dest=dest,
        file_bytes=file_bytes,
        files=len(content),
        disk_bytes=disk_bytes,
        top_level=top,
        entries=entries,
        members=members,
    )
    _check_expansion(archive, plan, max_ratio)
    return plan


def _check_expansion(archive: Path, plan: UnpackPlan, max_ratio: float) -> None:
    """Refuse an archive whose members declare far more than it could hold (a bomb)."""
    archive_bytes = archive.stat().st_size
    cap = max(archive_bytes * max_ratio, _MIN_EXPANSION_CAP)  # float: max_ratio may be inf
    if plan.file_bytes > cap:
        raise ArchiveError(
            f"archive {archive.name} expands past {max_ratio:g} times its size: its members "
            f"declare {plan.file_bytes:,} bytes ({format_bytes(plan.file_bytes)}) from "
            f"{archive_bytes:,} bytes ({format_bytes(archive_bytes)}), more than the "
            f"{cap:,.0f}-byte cap; nothing was unpacked; this is how a decompression bomb looks: "
            "check the archive, and if the data really compresses this well upload it as an "
            "uncompressed .tar"
        )


def _tar_entry(m: tarfile.TarInfo) -> tuple[str, Entry | None, str | None]:
    name = m.name
    path = normalize(name)
    if m.isreg():
        return name, Entry(path, Kind.FILE, size=m.size, mode=m.mode, mtime=m.mtime), None
    if m.isdir():
        return name, Entry(path, Kind.DIR), None
    if m.issym():
        return name, Entry(path, Kind.SYMLINK, target=m.linkname), None
    if m.islnk():
        return (
            name,
            Entry(path, Kind.HARDLINK, target=m.linkname, mode=m.mode, mtime=m.mtime),
            None,
        )
    if m.ischr():
        what = "is a character device"
    elif m.isblk():
        what = "is a block device"
    elif m.isfifo():
        what = "is a FIFO"
    else:
        what = f"is a special member (tar type {m.type!r})"
    return name, None, what


def _zip_entry(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[str, Entry | None, str | None]:
    name = info.filename
    path = normalize(name)
    if info.flag_bits & 0x1:
        return name, None, "is encrypted"
    mode = info.external_attr >> 16 if info.create_system == 3 else 0
    ftype = stat.S_IFMT(mode)
    if info.is_dir() or ftype == stat.S_IFDIR:
        return name, Entry(path, Kind.DIR), None
    if ftype == stat.S_IFLNK:
        if info.file_size > 4096:
            return name, None, "is a symlink with an oversized target"
        target = zf.read(info).decode("utf-8", "surrogateescape")
        return name, Entry(path, Kind.SYMLINK, target=target), None
    if ftype in (0, stat.S_IFREG):
        return name, Entry(path, Kind.FILE, size=info.file_size, mode=mode & 0o777), None
    kinds = {
        stat.S_IFCHR: "is a character device",
        stat.S_IFBLK: "is a block device",
        stat.S_IFIFO: "is a FIFO",
        stat.S_IFSOCK: "is a socket",
    }
    return name, None, kinds.get(ftype, f"is a special member (mode {mode:o})")


def normalize(name: str) -> str:
    """A member name as a relative path: ``"./a//b/"`` -> ``"a/b"``."""
    return "/".join(p for p in name.split("/") if p not in ("", "."))


def _check_name(path: str, name: str) -> str | None:
    if "\x00" in name:
        return "has a NUL byte in its name"
    if name.startswith("/"):
        return "is an absolute path"
    if ".." in path.split("/"):
        return "leaves the destination (path has '..')"
    return None


def _check_clashes(entries: list[Entry]) -> list[tuple[Entry, str]]:
    """Every path names one thing: no duplicates, nothing both a file and a directory.

    A second member of the same name would overwrite the first, or write through it when the
    first is a hardlink (a member written through a hardlink to ``data.yaml`` rewrites it).
    Repeated directory entries are harmless and allowed. Members below a symlink are refused
    by :func:`_check_links`.
    """
    problems: list[tuple[Entry, str]] = []
    first: dict[str, Entry] = {}
    for e in entries:
        prev = first.setdefault(e.path, e)
        if prev is e or prev.kind is e.kind is Kind.DIR:
            continue
        if prev.kind == e.kind:
            kinds = f"{e.kind.noun}s"
            problems.append((e, f"appears twice in the archive (two {kinds} of that name)"))
        else:
            both = f"{prev.kind.noun} and a {e.kind.noun}"
            problems.append((e, f"is both a {both} in the archive"))
    for e in entries:
        parts = e.path.split("/")
        for i in range(1, len(parts)):
            prefix = first.get("/".join(parts[:i]))
            if prefix is not None and prefix.kind in (Kind.FILE, Kind.HARDLINK):
                problems.append(
                    (
                        e,
                        f"lies below {show(prefix.path, 80)}, which is a {prefix.kind.noun}, "
                        "not a folder",
                    )
                )
                break
    return problems


# --------------------------------------------------------------------------------------------
# Where the tree is built (agent.data.archive.write builds it; name lengths count its prefix)


def scratch_prefix(dest: Path) -> str:
    """Name prefix of the temporary siblings an unpack into ``dest`` builds its tree in."""
    return f".{dest.name}.unpacking-"


def _check_lengths(archive: Path, entries: list[Entry], dest: Path) -> None:
    """Refuse names the file system at ``dest`` cannot hold (ENAMETOOLONG), before writing."""
    probe = nearest_existing(dest.parent)
    name_max = _pathconf(probe, "PC_NAME_MAX", _NAME_MAX)
    path_max = _pathconf(probe, "PC_PATH_MAX", _PATH_MAX)
    # Members are written below ".<dest.name>.unpacking-XXXXXXXX/" next to dest.
    prefix = len(os.fsencode(dest.parent)) + len(os.fsencode(f"/{scratch_prefix(dest)}")) + 9
    problems: list[tuple[str, str]] = []
    for e in entries:
        try:
            parts = [len(os.fsencode(p)) for p in e.path.split("/")]
            target = len(os.fsencode(e.target)) if e.kind is Kind.SYMLINK else 0
        except UnicodeError:
            problems.append((e.name, "has a name the file system cannot store"))
            continue
        longest = max(parts)
        total = prefix + sum(parts) + len(parts) - 1
        if longest > name_max:
            problems.append(
                (
                    e.name,
                    f"has a name part of {longest} bytes, more than the {name_max} the file "
                    "system allows (ENAMETOOLONG)",
                )
            )
        elif total >= path_max:
            problems.append(
                (
                    e.name,
                    f"would have a path of {total} bytes, more than the {path_max - 1} the file "
                    "system allows (ENAMETOOLONG)",
                )
            )
        elif target >= path_max:
            problems.append(
                (e.name, f"is a symlink with a target of {target} bytes (ENAMETOOLONG)")
            )
    if problems:
        raise ArchiveError(
            f"archive {archive.name} has {len(problems)} member(s) whose names are too long for "
            f"the file system at {dest}, nothing was unpacked: {name_problems(problems)}; "
            f"shorten those names (at most {name_max} bytes per file or folder name, "
            f"{path_max - 1} for a whole path) and rebuild the archive"
        )


def _pathconf(path: Path, name: str, fallback: int) -> int:
    try:
        value = os.pathconf(path, name)
    except (OSError, ValueError):
        return fallback
    return value if value > 0 else fallback


def _check_links(entries: list[Entry]) -> list[tuple[Entry, str]]:
    """Links must stay inside dest, and nothing may be written through a link.

    Forbidding members below a symlink (and a path that is both a symlink and something else)
    makes every member land exactly where its name says, so link targets can be resolved
    against the archive's own symlinks without touching the disk.
    """
    problems: list[tuple[Entry, str]] = []
    links: dict[str, str] = {}
    seen: dict[str, Kind] = {}
    for e in entries:
        if e.kind is Kind.SYMLINK:
            if e.path in seen:
                problems.append((e, "is a symlink and also another entry of the archive"))
            links[e.path] = e.target
        elif e.path in links:
            problems.append((e, "is a symlink and also another entry of the archive"))
        seen.setdefault(e.path, e.kind)

    files_so_far: set[str] = set()
    for e in entries:
        parts = e.path.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in links:
                problems.append((e, f"lies below the symlink {show(prefix, 80)}"))
                break
        if e.kind is Kind.SYMLINK:
            if not e.target:
                problems.append((e, "is a symlink with an empty target"))
            elif e.target.startswith("/"):
                problems.append((e, f"is a symlink to the absolute path {show(e.target, 80)}"))
            elif _resolve(parts[:-1], e.target, links, [0]) is None:
                problems.append(
                    (
                        e,
                        f"is a symlink that points outside the destination ({show(e.target, 80)})",
                    )
                )
        elif e.kind is Kind.HARDLINK:
            target = normalize(e.target)
            if e.target.startswith("/") or ".." in target.split("/") or not target:
                problems.append(
                    (
                        e,
                        f"is a hardlink that points outside the destination ({show(e.target, 80)})",
                    )
                )
            elif target not in files_so_far:
                problems.append(
                    (
                        e,
                        f"is a hardlink to {show(e.target, 80)}, which is not an earlier file of "
                        "the archive",
                    )
                )
        if e.kind is Kind.FILE:
            files_so_far.add(e.path)
    return problems


def _resolve(
    start: list[str], target: str, links: Mapping[str, str], hops: list[int]
) -> list[str] | None:
    """Where ``target``, relative to directory ``start``, lands; None when it leaves dest."""
    stack = list(start)
    for comp in target.split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            if not stack:
                return None
            stack.pop()
            continue
        stack.append(comp)
        link = links.get("/".join(stack))
        if link is not None:
            hops[0] += 1
            if hops[0] > _MAX_LINK_HOPS or link.startswith("/"):
                return None
            resolved = _resolve(stack[:-1], link, links, hops)
            if resolved is None:
                return None
            stack = resolved
    return stack
