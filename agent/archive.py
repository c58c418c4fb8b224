"""The hostile-archive unpacker: a tar (any compression) or zip archive into a new directory.

Unpacking never trusts the archive. Every member is checked before anything is written (path
traversal, absolute paths, links that leave the destination, device files, FIFOs, duplicate
names, a name that is both a file and a directory, names too long for the file system), the
declared size is compared with the free disk (keeping a headroom, the preflight's 30 % by
default) and with the archive's own size (a decompression bomb), and the bytes are counted again
as they are written, stopping at the first one over. The tree is built in a temporary sibling
directory that is renamed into place only when complete: a failed unpack leaves nothing
half-written in ``dest``. Tar members also pass ``tarfile.data_filter`` (PEP 706) on top of our
own checks; hardlinks are written as independent copies, and modes are reduced to 0644/0755.

:func:`safe_unpack` does it all in one call. A caller that must look at what an archive holds
before making room for it (staging replaces an earlier tree only once the new archive passed)
calls :func:`plan_unpack`, then :func:`unpack`. Nothing here knows where the archive came from:
every failure is an :class:`ArchiveError` whose message is one line that says what to do.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import lzma
import math
import os
import shutil
import stat
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO, Any

__all__ = [
    "DEFAULT_HEADROOM",
    "MAX_EXPANSION_RATIO",
    "SUPPORTED_FORMATS",
    "ArchiveError",
    "ArchiveFormat",
    "UnpackPlan",
    "UnsafeArchiveError",
    "archive_format",
    "disk_free",
    "leftovers",
    "plan_unpack",
    "safe_unpack",
    "scratch_prefix",
    "unpack",
]

#: Archive suffixes we unpack, by format.
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tbz", ".tar.xz", ".txz")
ZIP_SUFFIXES = (".zip",)
SUPPORTED_FORMATS = ".tar, .tar.gz/.tgz, .tar.bz2, .tar.xz or .zip"
#: Default cap on unpacked bytes per archive byte. Images and most label files barely compress
#: (a real dataset archive unpacks to 1-3x its size); a run of zeros gzips about 1000x.
MAX_EXPANSION_RATIO = 200
#: Default free-disk rule: an unpack needs what it writes times this, and stops when writing
#: would eat into the rest. The preflight's 30 % (``agent.preflight.DISK_HEADROOM``, which
#: staging passes explicitly).
DEFAULT_HEADROOM = 1.3

#: Unsafe members named in one error message; the rest are counted.
_MAX_NAMED_PROBLEMS = 10
#: Symlinks followed while resolving one link target (the kernel's limit is 40 too).
_MAX_LINK_HOPS = 40
#: Disk-space estimate: files occupy whole blocks, and every entry costs at least one.
_BLOCK = 4096
#: The expansion cap is never below this, so a tiny archive of text is not called a bomb.
_MIN_EXPANSION_CAP = 1 << 20
#: Bytes read and written at a time while unpacking; the budget is checked per chunk.
_CHUNK = 1 << 20
#: Used when the file system does not say (``pathconf``): Linux's NAME_MAX and PATH_MAX.
_NAME_MAX = 255
_PATH_MAX = 4096


class ArchiveFormat(str, Enum):
    TAR = "tar"  #: a tar archive, uncompressed or gzip, bzip2 or xz compressed
    ZIP = "zip"  #: a zip archive


class _Kind(str, Enum):
    FILE = "file"  #: a regular file
    DIR = "dir"  #: a directory
    SYMLINK = "symlink"  #: a symbolic link, created as such
    HARDLINK = "hardlink"  #: a hardlink to an earlier file, written as an independent copy

    @property
    def noun(self) -> str:
        """What a message calls it."""
        return "folder" if self is _Kind.DIR else self.value


# --------------------------------------------------------------------------------------------
# Errors


class ArchiveError(Exception):
    """The archive cannot be unpacked (unreadable, unsafe, too big for the disk...): nothing
    was unpacked. The message is one readable line that says what to do about it."""


class UnsafeArchiveError(ArchiveError):
    """The archive has members that must not be unpacked; ``problems`` maps member -> why."""

    def __init__(self, archive: Path, problems: list[tuple[str, str]]) -> None:
        super().__init__(
            f"archive {archive.name} has {len(problems)} unsafe member(s), nothing was unpacked: "
            f"{_name_problems(problems)}; rebuild the archive from plain files and folders with "
            "relative paths (e.g. tar -C DIR -cf dataset.tar .)"
        )
        self.problems = problems
        self.members = [name for name, _ in problems]


def _name_problems(problems: list[tuple[str, str]]) -> str:
    """``'member': why; ...`` for the first few, the rest counted."""
    shown = "; ".join(f"{_show(name)}: {why}" for name, why in problems[:_MAX_NAMED_PROBLEMS])
    more = len(problems) - _MAX_NAMED_PROBLEMS
    if more > 0:
        shown += f"; and {more} more"
    return shown


# --------------------------------------------------------------------------------------------
# The calls


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
    entries: list[_Entry]
    #: The archive's own member objects for ``entries`` (TarInfo or ZipInfo).
    members: list[Any]


def archive_format(filename: str) -> ArchiveFormat | None:
    """The format a file of this name holds, by its suffix; None when it is none we unpack."""
    lower = filename.lower()
    if lower.endswith(TAR_SUFFIXES):
        return ArchiveFormat.TAR
    if lower.endswith(ZIP_SUFFIXES):
        return ArchiveFormat.ZIP
    return None


def disk_free(path: Path) -> int:
    """Free bytes on the file system holding ``path`` (the default free-space reader)."""
    return shutil.disk_usage(path).free


def safe_unpack(
    archive: Path,
    dest: Path,
    *,
    max_ratio: float = MAX_EXPANSION_RATIO,
    free_space: Callable[[Path], int] = disk_free,
    headroom: float = DEFAULT_HEADROOM,
) -> int:
    """Unpack a tar (any compression) or zip ``archive`` into ``dest``; return the bytes written.

    ``dest`` must not exist or be an empty directory. Every member is checked first; an unsafe one
    raises :class:`UnsafeArchiveError` naming each offending member. Before anything is written,
    the declared size must fit the free disk with ``headroom`` (1.3: 30 % more than the tree
    needs) and stay within ``max_ratio`` times the archive's size (never below 1 MiB); while
    writing, the bytes are counted against that budget and free space is read again
    (``free_space(path)``, bytes free on the file system of an existing ``path``): the first byte
    over stops the unpack with an :class:`ArchiveError`. The tree is built in a temporary sibling
    of ``dest`` and renamed into place, so ``dest`` is never half-unpacked.
    """
    archive = Path(archive)
    dest = Path(os.path.abspath(dest))
    fmt = _require_format(archive)
    if os.path.lexists(dest) and (dest.is_symlink() or not dest.is_dir() or any(dest.iterdir())):
        raise ArchiveError(f"cannot unpack into {dest}: it exists and is not an empty directory")
    plan = _plan(archive, fmt, dest, max_ratio=max_ratio)
    return unpack(plan, free_space=free_space, headroom=headroom)


def plan_unpack(archive: Path, dest: Path, *, max_ratio: float = MAX_EXPANSION_RATIO) -> UnpackPlan:
    """List and check every member of ``archive`` for an unpack into ``dest``, writing nothing.

    Raises as :func:`safe_unpack` does for everything that can be known before writing (the
    free disk excepted: :func:`unpack` reads it). ``dest`` itself is not looked at: the caller
    makes sure it is absent or empty by the time it calls :func:`unpack`.
    """
    archive = Path(archive)
    return _plan(
        archive, _require_format(archive), Path(os.path.abspath(dest)), max_ratio=max_ratio
    )


def scratch_prefix(dest: Path) -> str:
    """Name prefix of the temporary siblings an unpack into ``dest`` builds its tree in."""
    return f".{dest.name}.unpacking-"


def leftovers(dest: Path) -> list[Path]:
    """Temporary siblings of ``dest`` that an interrupted unpack left behind (they only cost
    disk; nothing else uses them)."""
    if not dest.parent.is_dir():
        return []
    return [
        p
        for p in dest.parent.glob(f"{glob.escape(scratch_prefix(dest))}*")
        if p.is_dir() and not p.is_symlink()
    ]


def _require_format(archive: Path) -> ArchiveFormat:
    fmt = archive_format(archive.name)
    if fmt is None:
        raise ArchiveError(
            f"{archive.name!r} is not a supported archive; pack the dataset as {SUPPORTED_FORMATS}"
        )
    return fmt


def _unreadable(archive: Path, fmt: ArchiveFormat, exc: BaseException) -> ArchiveError:
    return ArchiveError(
        f"{archive.name} is not a readable {fmt.value} archive ({type(exc).__name__}: "
        f"{_one_line(str(exc), 120)}); check that the upload is complete and the name's suffix "
        "matches its format"
    )


# Exceptions that a corrupt or truncated archive raises while being read.
_READ_ERRORS: tuple[type[BaseException], ...] = (
    tarfile.TarError,
    zipfile.BadZipFile,
    EOFError,
    NotImplementedError,
    RuntimeError,
    ValueError,
    zlib.error,
    lzma.LZMAError,
)
#: Listing also reads the file: an I/O error there means the same.
_LIST_ERRORS: tuple[type[BaseException], ...] = (*_READ_ERRORS, OSError)


# --------------------------------------------------------------------------------------------
# The plan: every member listed and checked, nothing written yet


@dataclass
class _Entry:
    #: Normalized relative path ("a/b/c"), "" for the archive's root entry.
    path: str
    kind: _Kind
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


def _plan(archive: Path, fmt: ArchiveFormat, dest: Path, *, max_ratio: float) -> UnpackPlan:
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
    except _LIST_ERRORS as exc:
        raise _unreadable(archive, fmt, exc) from None

    # Archive index -> (member name, why); one reason per member, reported in archive order.
    bad: dict[int, tuple[str, str]] = {}
    entries: list[_Entry] = []
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
            if entry.kind is not _Kind.DIR:
                bad[index] = (name, "has an empty path")
            continue  # the archive's own root ("./"): dest itself
        entries.append(entry)
        members.append(member)
    for entry, why in (*_check_clashes(entries), *_check_links(entries)):
        bad.setdefault(entry.index, (entry.name, why))
    if bad:
        raise UnsafeArchiveError(archive, [bad[i] for i in sorted(bad)])
    _check_lengths(archive, entries, dest)

    sizes = {e.path: e.size for e in entries if e.kind is _Kind.FILE}
    for e in entries:
        if e.kind is _Kind.HARDLINK:
            e.size = sizes[_normalize(e.target)]
    content = [e for e in entries if e.kind in (_Kind.FILE, _Kind.HARDLINK)]
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
            f"declare {plan.file_bytes:,} bytes ({_fmt_bytes(plan.file_bytes)}) from "
            f"{archive_bytes:,} bytes ({_fmt_bytes(archive_bytes)}), more than the "
            f"{cap:,.0f}-byte cap; nothing was unpacked; this is how a decompression bomb looks: "
            "check the archive, and if the data really compresses this well upload it as an "
            "uncompressed .tar"
        )


def _tar_entry(m: tarfile.TarInfo) -> tuple[str, _Entry | None, str | None]:
    name = m.name
    path = _normalize(name)
    if m.isreg():
        return name, _Entry(path, _Kind.FILE, size=m.size, mode=m.mode, mtime=m.mtime), None
    if m.isdir():
        return name, _Entry(path, _Kind.DIR), None
    if m.issym():
        return name, _Entry(path, _Kind.SYMLINK, target=m.linkname), None
    if m.islnk():
        return (
            name,
            _Entry(path, _Kind.HARDLINK, target=m.linkname, mode=m.mode, mtime=m.mtime),
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


def _zip_entry(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[str, _Entry | None, str | None]:
    name = info.filename
    path = _normalize(name)
    if info.flag_bits & 0x1:
        return name, None, "is encrypted"
    mode = info.external_attr >> 16 if info.create_system == 3 else 0
    ftype = stat.S_IFMT(mode)
    if info.is_dir() or ftype == stat.S_IFDIR:
        return name, _Entry(path, _Kind.DIR), None
    if ftype == stat.S_IFLNK:
        if info.file_size > 4096:
            return name, None, "is a symlink with an oversized target"
        target = zf.read(info).decode("utf-8", "surrogateescape")
        return name, _Entry(path, _Kind.SYMLINK, target=target), None
    if ftype in (0, stat.S_IFREG):
        return name, _Entry(path, _Kind.FILE, size=info.file_size, mode=mode & 0o777), None
    kinds = {
        stat.S_IFCHR: "is a character device",
        stat.S_IFBLK: "is a block device",
        stat.S_IFIFO: "is a FIFO",
        stat.S_IFSOCK: "is a socket",
    }
    return name, None, kinds.get(ftype, f"is a special member (mode {mode:o})")


def _normalize(name: str) -> str:
    return "/".join(p for p in name.split("/") if p not in ("", "."))


def _check_name(path: str, name: str) -> str | None:
    if "\x00" in name:
        return "has a NUL byte in its name"
    if name.startswith("/"):
        return "is an absolute path"
    if ".." in path.split("/"):
        return "leaves the destination (path has '..')"
    return None


def _check_clashes(entries: list[_Entry]) -> list[tuple[_Entry, str]]:
    """Every path names one thing: no duplicates, nothing both a file and a directory.

    A second member of the same name would overwrite the first, or write through it when the
    first is a hardlink (a member written through a hardlink to ``data.yaml`` rewrites it).
    Repeated directory entries are harmless and allowed. Members below a symlink are refused
    by :func:`_check_links`.
    """
    problems: list[tuple[_Entry, str]] = []
    first: dict[str, _Entry] = {}
    for e in entries:
        prev = first.setdefault(e.path, e)
        if prev is e or prev.kind is e.kind is _Kind.DIR:
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
            if prefix is not None and prefix.kind in (_Kind.FILE, _Kind.HARDLINK):
                problems.append(
                    (
                        e,
                        f"lies below {_show(prefix.path)}, which is a {prefix.kind.noun}, "
                        "not a folder",
                    )
                )
                break
    return problems


def _check_lengths(archive: Path, entries: list[_Entry], dest: Path) -> None:
    """Refuse names the file system at ``dest`` cannot hold (ENAMETOOLONG), before writing."""
    probe = _existing_ancestor(dest.parent)
    name_max = _pathconf(probe, "PC_NAME_MAX", _NAME_MAX)
    path_max = _pathconf(probe, "PC_PATH_MAX", _PATH_MAX)
    # Members are written below ".<dest.name>.unpacking-XXXXXXXX/" next to dest.
    prefix = len(os.fsencode(dest.parent)) + len(os.fsencode(f"/{scratch_prefix(dest)}")) + 9
    problems: list[tuple[str, str]] = []
    for e in entries:
        try:
            parts = [len(os.fsencode(p)) for p in e.path.split("/")]
            target = len(os.fsencode(e.target)) if e.kind is _Kind.SYMLINK else 0
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
            f"the file system at {dest}, nothing was unpacked: {_name_problems(problems)}; "
            f"shorten those names (at most {name_max} bytes per file or folder name, "
            f"{path_max - 1} for a whole path) and rebuild the archive"
        )


def _pathconf(path: Path, name: str, fallback: int) -> int:
    try:
        value = os.pathconf(path, name)
    except (OSError, ValueError):
        return fallback
    return value if value > 0 else fallback


def _check_links(entries: list[_Entry]) -> list[tuple[_Entry, str]]:
    """Links must stay inside dest, and nothing may be written through a link.

    Forbidding members below a symlink (and a path that is both a symlink and something else)
    makes every member land exactly where its name says, so link targets can be resolved
    against the archive's own symlinks without touching the disk.
    """
    problems: list[tuple[_Entry, str]] = []
    links: dict[str, str] = {}
    seen: dict[str, _Kind] = {}
    for e in entries:
        if e.kind is _Kind.SYMLINK:
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
                problems.append((e, f"lies below the symlink {_show(prefix)}"))
                break
        if e.kind is _Kind.SYMLINK:
            if not e.target:
                problems.append((e, "is a symlink with an empty target"))
            elif e.target.startswith("/"):
                problems.append((e, f"is a symlink to the absolute path {_show(e.target)}"))
            elif _resolve(parts[:-1], e.target, links, [0]) is None:
                problems.append(
                    (
                        e,
                        f"is a symlink that points outside the destination ({_show(e.target)})",
                    )
                )
        elif e.kind is _Kind.HARDLINK:
            target = _normalize(e.target)
            if e.target.startswith("/") or ".." in target.split("/") or not target:
                problems.append(
                    (
                        e,
                        f"is a hardlink that points outside the destination ({_show(e.target)})",
                    )
                )
            elif target not in files_so_far:
                problems.append(
                    (
                        e,
                        f"is a hardlink to {_show(e.target)}, which is not an earlier file of "
                        "the archive",
                    )
                )
        if e.kind is _Kind.FILE:
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


# --------------------------------------------------------------------------------------------
# Writing: the budget, the temporary tree, the rename


def _existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (where a new directory will be created)."""
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return probe


class _Budget:
    """Bytes an unpack may still write; raises at the first byte over.

    The limit is what the members declare (checked beforehand against the free disk with
    headroom and the expansion cap), so a member that yields more than its header says stops
    here. Free space is read again before each MiB written (not per file: on a network volume
    every read is a round trip): when someone else fills the disk while we write, the unpack
    stops before the headroom kept for training is gone (``reserve`` bytes of what was free).
    """

    def __init__(
        self,
        archive: Path,
        limit: int,
        *,
        free_space: Callable[[Path], int],
        probe: Path,
        reserve: int,
        headroom: float,
    ) -> None:
        self.archive = archive
        self.limit = limit
        self.written = 0
        self.unchecked = 0
        self.free_space = free_space
        self.probe = probe
        self.reserve = reserve
        self.headroom = headroom

    def take(self, n: int, entry: _Entry, member_left: int) -> None:
        if n > member_left or self.written + n > self.limit:
            raise ArchiveError(
                f"archive {self.archive.name} expands past the {self.limit:,} bytes its members "
                f"declare: member {_show(entry.name)} gave more than its header says; nothing "
                "was unpacked; the archive is corrupt or hostile, rebuild it"
            )
        self.unchecked += n
        if self.unchecked < _CHUNK:
            self.written += n
            return
        self.unchecked = 0
        free = self.free_space(self.probe)
        if free - n < self.reserve:
            raise ArchiveError(
                f"the disk filled up while unpacking {self.archive.name} ({self.written:,} of "
                f"{self.limit:,} bytes written): {free:,} bytes ({_fmt_bytes(free)}) are free on "
                f"{self.probe}, less than the {_percent(self.headroom)} headroom kept for "
                "training; nothing was unpacked; find what else writes there, free some space "
                "or rent a bigger disk"
            )
        self.written += n


def unpack(
    plan: UnpackPlan,
    *,
    free_space: Callable[[Path], int] = disk_free,
    headroom: float = DEFAULT_HEADROOM,
    on_ready: Callable[[Path], None] | None = None,
) -> int:
    """Write what :func:`plan_unpack` planned into ``plan.dest``; return the bytes written.

    ``plan.dest`` must be absent or an empty directory by now. ``free_space`` and ``headroom``
    are those of :func:`safe_unpack`. ``on_ready(tmp)``, when given, is called once the tree is
    complete in its temporary sibling ``tmp`` and before it is renamed into place: what it adds
    there (a record of what was unpacked) appears together with the tree, or not at all.
    """
    archive, dest = plan.archive, plan.dest
    probe = _existing_ancestor(dest.parent)
    free = free_space(probe)
    needed = math.ceil(plan.disk_bytes * headroom)
    if needed > free:
        raise ArchiveError(
            f"not enough disk space to unpack {archive.name} into {dest}: needs "
            f"{plan.disk_bytes:,} bytes ({_fmt_bytes(plan.disk_bytes)}) plus "
            f"{_percent(headroom)} headroom ({needed:,} bytes) but only {free:,} bytes "
            f"({_fmt_bytes(free)}) are free on {probe}; free some space or rent a bigger disk"
        )
    budget = _Budget(
        archive,
        plan.file_bytes,
        free_space=free_space,
        probe=probe,
        reserve=free - int(free / headroom),
        headroom=headroom,
    )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=scratch_prefix(dest), dir=dest.parent))
    try:
        if plan.format is ArchiveFormat.TAR:
            _extract_tar(archive, tmp, plan, budget)
        else:
            _extract_zip(archive, tmp, plan, budget)
        if on_ready is not None:
            on_ready(tmp)
        os.chmod(tmp, 0o755)
        # Make the tree durable before it becomes visible under its real name.
        os.sync()
        if dest.is_dir():
            dest.rmdir()  # empty (checked by the caller); rename cannot replace it otherwise
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(dest.parent)
    return budget.written


def _extract_tar(archive: Path, tmp: Path, plan: UnpackPlan, budget: _Budget) -> None:
    made: set[Path] = {tmp}
    try:
        with tarfile.open(archive, "r:*") as tf:
            for entry, member in zip(plan.entries, plan.members, strict=True):
                # A second opinion on our own checks (PEP 706); we write the result ourselves.
                tarfile.data_filter(member, str(tmp))
                if entry.kind is _Kind.FILE:
                    src = tf.extractfile(member)
                    if src is None:
                        raise tarfile.ReadError(f"no data for {member.name!r}")
                    with src:
                        _write_file(tmp, entry, src, budget, made)
                elif entry.kind is _Kind.HARDLINK:
                    # An independent copy: a later write to one name can never change another.
                    origin = tmp.joinpath(*_normalize(entry.target).split("/"))
                    fd = os.open(origin, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    with os.fdopen(fd, "rb") as src:
                        _write_file(tmp, entry, src, budget, made)
                else:
                    _write_other(tmp, entry, made)
    except tarfile.FilterError as exc:
        member = getattr(exc, "tarinfo", None)
        name = member.name if isinstance(member, tarfile.TarInfo) else "?"
        raise UnsafeArchiveError(
            archive, [(name, f"refused by tarfile's data filter ({exc})")]
        ) from None
    except OSError as exc:
        raise _write_error(archive, tmp, ArchiveFormat.TAR, exc) from None
    except _READ_ERRORS as exc:
        raise _unreadable(archive, ArchiveFormat.TAR, exc) from None


def _extract_zip(archive: Path, tmp: Path, plan: UnpackPlan, budget: _Budget) -> None:
    made: set[Path] = {tmp}
    try:
        with zipfile.ZipFile(archive) as zf:
            for entry, info in zip(plan.entries, plan.members, strict=True):
                if entry.kind is _Kind.FILE:
                    with zf.open(info) as src:
                        _write_file(tmp, entry, src, budget, made)
                else:
                    _write_other(tmp, entry, made)
    except OSError as exc:
        raise _write_error(archive, tmp, ArchiveFormat.ZIP, exc) from None
    except _READ_ERRORS as exc:
        raise _unreadable(archive, ArchiveFormat.ZIP, exc) from None


def _make_dirs(tmp: Path, rel: list[str], made: set[Path]) -> Path:
    """Create ``tmp/rel`` and its parents as 0755 directories; return it."""
    path = tmp
    for part in rel:
        path = path / part
        if path not in made:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path)
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
            os.chmod(path, 0o755)  # the same on every box: not the umask's, nor the archive's
            made.add(path)
    return path


def _write_file(tmp: Path, entry: _Entry, src: IO[bytes], budget: _Budget, made: set[Path]) -> None:
    parts = entry.path.split("/")
    target = _make_dirs(tmp, parts[:-1], made) / parts[-1]
    # O_EXCL: the plan refused duplicates; nothing is ever written through an existing name.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(target, flags, 0o600), "wb") as out:
        left = entry.size
        while chunk := src.read(_CHUNK):
            budget.take(len(chunk), entry, left)
            left -= len(chunk)
            out.write(chunk)
        # No setuid/setgid/sticky, no group or world write: 0755 when the owner may execute.
        os.fchmod(out.fileno(), 0o755 if entry.mode & 0o100 else 0o644)
        out.flush()
        if entry.mtime is not None:
            # As tarfile does; an mtime the OS cannot store is not worth failing for.
            with contextlib.suppress(OverflowError, ValueError, OSError):
                os.utime(out.fileno(), (entry.mtime, entry.mtime))


def _write_other(tmp: Path, entry: _Entry, made: set[Path]) -> None:
    parts = entry.path.split("/")
    if entry.kind is _Kind.DIR:
        _make_dirs(tmp, parts, made)
    elif entry.kind is _Kind.SYMLINK:
        os.symlink(entry.target, _make_dirs(tmp, parts[:-1], made) / parts[-1])
    else:
        raise AssertionError(f"unplanned member kind {entry.kind!r}")


def _write_error(archive: Path, tmp: Path, fmt: ArchiveFormat, exc: OSError) -> ArchiveError:
    """A full disk or a refused write says so; anything else is an unreadable archive."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ArchiveError(
            f"disk full while unpacking {archive.name} into {tmp.parent}; free some space or "
            "rent a bigger disk"
        )
    if exc.errno == errno.ENAMETOOLONG:
        where = _show(os.path.relpath(exc.filename, tmp)) if exc.filename else "a member"
        return ArchiveError(
            f"a member name of {archive.name} is too long for the file system at {tmp.parent} "
            f"({where}, ENAMETOOLONG); nothing was unpacked; shorten the names and rebuild the "
            "archive"
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ArchiveError(
            f"cannot write into {tmp.parent} while unpacking {archive.name} "
            f"({exc.strerror or exc}); check the permissions of dataset.dest's parent folder"
        )
    return _unreadable(archive, fmt, exc)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a directory; the rename is still done
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# Small helpers


def _show(name: str) -> str:
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _percent(headroom: float) -> str:
    """``1.3`` -> ``"30 %"``."""
    return f"{(headroom - 1) * 100:.0f} %"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
