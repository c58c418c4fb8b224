"""A dataset folder packed into one tar that the agent's own unpacker accepts.

The guide's first step is "one tar in a Hugging Face dataset repo"; a tar made by hand on a laptop
often carries what a box must refuse (agent/data/archive/): absolute names, ``..``, a symlink to
the user's home, a FIFO left by a tool. Here the folder is listed first (:func:`survey`), every
such thing named at once with the fix, and only then written (:func:`write_tar`):

* member names are relative, under one top folder (the folder's name, as ``tar -C PARENT -cf
  NAME.tar NAME`` writes them), in sorted order, so the same folder gives the same bytes;
* regular files, folders and symlinks that stay inside the folder (written relative); a symlink
  that leads out, a device, a FIFO or a socket is refused, never followed;
* owner and group are zeroed and modes reduced to 0644/0755, mtimes whole seconds (no PAX
  header for them): nothing of the laptop's accounts goes up, and a second pack of an unchanged
  folder gives the same sha256 (the Hub then has nothing to store);
* files are streamed, 1 MiB at a time, into a temporary sibling that is renamed into place when
  complete; the sha256 is computed as the bytes are written, so the upload need not read the
  archive again to hash it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal, cast

from agent.util.text import show

#: Image suffixes LibreYOLO trains on (``IMG_FORMATS`` of its data utilities), lower case.
IMAGE_SUFFIXES = frozenset(
    {".bmp", ".dng", ".jpeg", ".jpg", ".mpo", ".png", ".tif", ".tiff", ".webp", ".pfm"}
)
#: Bytes read from a file at a time while packing.
CHUNK = 1 << 20
#: Tar format: PAX (UTF-8 names of any length); no PAX header is needed for whole mtimes.
PAX = tarfile.PAX_FORMAT
#: Problems named in one message; the rest are counted.
_MAX_NAMED = 8

#: What a member of the archive is.
MemberKind = Literal["dir", "file", "symlink"]
#: ``(bytes done, bytes in all)`` as packing goes on.
PackProgress = Callable[[int, int], None]


class PackError(Exception):
    """The folder cannot be packed as it is; the message is one line that says what to do."""


@dataclass(frozen=True)
class Member:
    """One entry of the archive-to-be."""

    #: Where it is on disk.
    source: Path
    #: Its name in the archive (``top/rel/path``, ``/``-separated).
    name: str
    kind: MemberKind
    #: Bytes of content (files only).
    size: int = 0
    #: True: written 0755 (folders, and files with the owner's execute bit).
    executable: bool = False
    #: Seconds since the epoch, whole.
    mtime: int = 0
    #: A symlink's target, relative to the link's folder.
    target: str = ""


@dataclass(frozen=True)
class Survey:
    """What :func:`survey` found in a folder that can be packed."""

    #: The folder (absolute).
    root: Path
    #: The top folder's name in the archive.
    top: str
    members: list[Member]
    #: Files (symlinks not counted) and their bytes.
    files: int
    file_bytes: int
    #: Image files (by suffix, :data:`IMAGE_SUFFIXES`), symlinked ones included.
    images: int


@dataclass(frozen=True)
class Packed:
    """A tar :func:`write_tar` wrote."""

    path: Path
    #: The archive's size and sha256 (hex).
    size: int
    sha256: str


def survey(root: Path, *, skip: Path | None = None) -> Survey:
    """List ``root`` for packing, refusing what a box's unpacker would (:class:`PackError`
    naming each offending path). ``skip`` (the archive being written, when it lies inside) is
    left out."""
    root = Path(os.path.abspath(root))
    top = root.name
    if not top or top in (".", ".."):
        raise PackError(f"{root} has no folder name to put at the top of the archive")
    problems: list[str] = []
    members: list[Member] = [_member(root, top, os.stat(root))]
    for path, st in _walk(root, problems):
        if skip is not None and path == skip:
            continue
        rel = path.relative_to(root).as_posix()
        name = f"{top}/{rel}"
        why = _name_problem(rel)
        if why is None and stat.S_ISLNK(st.st_mode):
            why, target = _link_target(root, path)
            if why is None:
                members.append(Member(path, name, "symlink", target=target, mtime=int(st.st_mtime)))
            problems += [f"{show(rel, 80)} {why}"] if why else []
            continue
        if why is None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            why = f"is a {_kind_word(st.st_mode)}, which no dataset archive may hold"
        if why is None and stat.S_ISREG(st.st_mode) and not os.access(path, os.R_OK):
            why = "cannot be read (permission denied)"
        if why is not None:
            problems.append(f"{show(rel, 80)} {why}")
            continue
        members.append(_member(path, name, st))
    if problems:
        named = "; ".join(problems[:_MAX_NAMED])
        more = f"; and {len(problems) - _MAX_NAMED} more" if len(problems) > _MAX_NAMED else ""
        raise PackError(
            f"{root} holds {len(problems)} thing(s) the box's unpacker refuses: {named}{more}; "
            "remove them, or push a copy made of plain files (cp -rL DIR COPY)"
        )
    files = [m for m in members if m.kind == "file"]
    images = sum(
        1 for m in members if m.kind != "dir" and Path(m.name).suffix.lower() in IMAGE_SUFFIXES
    )
    return Survey(root, top, members, len(files), sum(m.size for m in files), images)


def write_tar(
    found: Survey, dest: Path, *, on_progress: PackProgress | None = None, chunk: int = CHUNK
) -> Packed:
    """Write the archive of ``found`` to ``dest`` (replaced only once complete); ``on_progress``
    gets ``(bytes done, bytes in all)`` of file content as packing goes on (a last call with
    both equal). :class:`PackError` when a file changed or vanished meanwhile, or on a write
    error (the partial file is removed)."""
    dest = Path(os.path.abspath(dest))
    partial = dest.with_name(f".{dest.name}.partial")
    total, done = found.file_bytes, 0
    try:
        with open(partial, "wb") as raw:
            out = _Hashing(raw)
            with tarfile.TarFile(
                fileobj=cast("BinaryIO", out), mode="w", format=PAX, copybufsize=chunk
            ) as tf:
                for m in found.members:
                    info = _tarinfo(m)
                    if m.kind != "file":
                        tf.addfile(info)
                        continue
                    with open(m.source, "rb") as f:
                        tf.addfile(info, cast("BinaryIO", _Counted(f, m, chunk)))
                    done += m.size
                    if on_progress is not None:
                        on_progress(done, total)
            out.flush()
            os.fsync(raw.fileno())
            size, digest = out.size, out.sha256.hexdigest()
        os.replace(partial, dest)
    except (OSError, tarfile.TarError) as exc:
        with contextlib.suppress(OSError):
            partial.unlink()
        if isinstance(exc, _ChangedError):
            raise PackError(str(exc)) from None
        where = getattr(exc, "filename", None) or dest
        raise PackError(
            f"cannot write the archive {dest} ({exc.strerror or exc} at {where}); pass --tar "
            "PATH somewhere writable with room"
            if isinstance(exc, OSError)
            else f"cannot write the archive {dest} ({exc})"
        ) from None
    if on_progress is not None and total == 0:
        on_progress(0, 0)
    return Packed(dest, size, digest)


# --------------------------------------------------------------------------------------------
# Listing


def _walk(root: Path, problems: list[str]) -> Iterator[tuple[Path, os.stat_result]]:
    """Every entry below ``root``, depth first in sorted order (by the name's bytes, so the
    order does not depend on the locale); symlinks are not followed."""
    try:
        with os.scandir(root) as it:
            entries = sorted(it, key=lambda e: os.fsencode(e.name))
    except OSError as exc:
        problems.append(f"{show(str(root), 80)} cannot be listed ({exc.strerror or exc})")
        return
    for entry in entries:
        path = Path(entry.path)
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError as exc:
            problems.append(f"{show(entry.name, 80)} cannot be read ({exc.strerror or exc})")
            continue
        yield path, st
        if stat.S_ISDIR(st.st_mode):
            yield from _walk(path, problems)


def _name_problem(rel: str) -> str | None:
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        return "has a name that is not UTF-8"
    if any(ch in rel for ch in "\n\r\0"):
        return "has a line break in its name"
    return None


def _link_target(root: Path, link: Path) -> tuple[str | None, str]:
    """``(why it is refused, None)`` or ``(None, the target relative to the link's folder)``."""
    real = os.path.realpath(link)
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, real]) != real_root:
        return f"is a symlink that leads out of the folder (to {show(real, 80)})", ""
    if not os.path.exists(real):
        return "is a broken symlink", ""
    return None, os.path.relpath(real, os.path.realpath(link.parent))


def _member(path: Path, name: str, st: os.stat_result) -> Member:
    if stat.S_ISDIR(st.st_mode):
        return Member(path, name, "dir", executable=True, mtime=int(st.st_mtime))
    return Member(
        path,
        name,
        "file",
        size=st.st_size,
        executable=bool(st.st_mode & stat.S_IXUSR),
        mtime=int(st.st_mtime),
    )


def _kind_word(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device file" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "special file"


# --------------------------------------------------------------------------------------------
# Writing


def _tarinfo(m: Member) -> tarfile.TarInfo:
    info = tarfile.TarInfo(m.name)
    info.type = {"dir": tarfile.DIRTYPE, "file": tarfile.REGTYPE, "symlink": tarfile.SYMTYPE}[
        m.kind
    ]
    info.size = m.size if m.kind == "file" else 0
    info.linkname = m.target
    info.mode = 0o755 if m.executable else 0o644
    info.mtime = m.mtime
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


class _ChangedError(OSError):
    """A file's size changed between the listing and its packing."""


class _Counted:
    """A file read for the tar that must hold exactly the size the listing saw."""

    def __init__(self, f: BinaryIO, m: Member, chunk: int) -> None:
        self._f, self._m, self._left, self._chunk = f, m, m.size, chunk

    def read(self, n: int = -1) -> bytes:
        want = self._left if n < 0 else min(n, self._left)
        data = self._f.read(min(want, self._chunk) if want else 0)
        self._left -= len(data)
        if want and not data:
            self._changed()
        if self._left == 0 and self._f.read(1):
            self._changed()
        return data

    def readinto(self, buf: bytearray | memoryview) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def _changed(self) -> None:
        raise _ChangedError(
            f"{self._m.source} changed while it was packed (the listing saw {self._m.size} "
            "bytes); push again once nothing writes into the folder"
        )


class _Hashing:
    """A write-only file that hashes and counts what goes through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self._raw.write(data)

    def flush(self) -> None:
        self._raw.flush()

    def tell(self) -> int:
        return self.size
