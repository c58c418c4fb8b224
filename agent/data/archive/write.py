"""Writing a plan: the byte budget, the tree built in a temporary sibling, modes, the rename."""

from __future__ import annotations

import contextlib
import errno
import glob
import math
import os
import shutil
import stat
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from agent.data.archive.errors import ArchiveError, UnsafeArchiveError, percent
from agent.data.archive.formats import READ_ERRORS, ArchiveFormat, unreadable
from agent.data.archive.plan import Entry, Kind, UnpackPlan, normalize, scratch_prefix
from agent.util.disk import disk_free, nearest_existing
from agent.util.text import format_bytes, show

#: Default free-disk rule: an unpack needs what it writes times this, and stops when writing
#: would eat into the rest. The preflight's 30 % (``agent.preflight.DISK_HEADROOM``, which
#: staging passes explicitly).
DEFAULT_HEADROOM = 1.3
#: Bytes read and written at a time while unpacking; the budget is checked per chunk.
_CHUNK = 1 << 20


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

    def take(self, n: int, entry: Entry, member_left: int) -> None:
        if n > member_left or self.written + n > self.limit:
            raise ArchiveError(
                f"archive {self.archive.name} expands past the {self.limit:,} bytes its members "
                f"declare: member {show(entry.name, 80)} gave more than its header says; nothing "
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
                f"{self.limit:,} bytes written): {free:,} bytes ({format_bytes(free)}) are free on "
                f"{self.probe}, less than the {percent(self.headroom)} headroom kept for "
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
    probe = nearest_existing(dest.parent)
    free = free_space(probe)
    needed = math.ceil(plan.disk_bytes * headroom)
    if needed > free:
        raise ArchiveError(
            f"not enough disk space to unpack {archive.name} into {dest}: needs "
            f"{plan.disk_bytes:,} bytes ({format_bytes(plan.disk_bytes)}) plus "
            f"{percent(headroom)} headroom ({needed:,} bytes) but only {free:,} bytes "
            f"({format_bytes(free)}) are free on {probe}; free some space or rent a bigger disk"
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


class _NoFilterError(Exception):
    """Stands in for ``tarfile.FilterError`` where there is none: nothing raises it."""


def _pep706() -> tuple[Callable[[tarfile.TarInfo, str], object] | None, type[Exception]]:
    """``tarfile.data_filter`` and ``tarfile.FilterError`` where this Python has them (PEP 706:
    3.11.4 and later; Debian 12's 3.11.2 has neither), else ``(None, a class nothing raises)``.

    The filter is only a second opinion: :func:`~agent.data.archive.plan.make_plan` has already
    refused everything it refuses (absolute paths, ``..``, links leaving the destination,
    devices and FIFOs) and the writer sets every mode itself (0644/0755 files, 0755 folders,
    never setuid, setgid, sticky or group/world write), so the unpack is as safe without it.
    Looked up per call, not at import: a test hides it to stand for such a Python.
    """
    data_filter = getattr(tarfile, "data_filter", None)
    filter_error = getattr(tarfile, "FilterError", None)
    if data_filter is None or filter_error is None:
        return None, _NoFilterError
    return data_filter, filter_error


def _extract_tar(archive: Path, tmp: Path, plan: UnpackPlan, budget: _Budget) -> None:
    made: set[Path] = {tmp}
    data_filter, filter_error = _pep706()
    try:
        with tarfile.open(archive, "r:*") as tf:
            for entry, member in zip(plan.entries, plan.members, strict=True):
                # A second opinion on our own checks (PEP 706); we write the result ourselves.
                if data_filter is not None:
                    data_filter(member, str(tmp))
                if entry.kind is Kind.FILE:
                    src = tf.extractfile(member)
                    if src is None:
                        raise tarfile.ReadError(f"no data for {member.name!r}")
                    with src:
                        _write_file(tmp, entry, src, budget, made)
                elif entry.kind is Kind.HARDLINK:
                    # An independent copy: a later write to one name can never change another.
                    origin = tmp.joinpath(*normalize(entry.target).split("/"))
                    fd = os.open(origin, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    with os.fdopen(fd, "rb") as src:
                        _write_file(tmp, entry, src, budget, made)
                else:
                    _write_other(tmp, entry, made)
    except filter_error as exc:
        member = getattr(exc, "tarinfo", None)
        name = member.name if isinstance(member, tarfile.TarInfo) else "?"
        raise UnsafeArchiveError(
            archive, [(name, f"refused by tarfile's data filter ({exc})")]
        ) from None
    except OSError as exc:
        raise _write_error(archive, tmp, ArchiveFormat.TAR, exc) from None
    except READ_ERRORS as exc:
        raise unreadable(archive, ArchiveFormat.TAR, exc) from None


def _extract_zip(archive: Path, tmp: Path, plan: UnpackPlan, budget: _Budget) -> None:
    made: set[Path] = {tmp}
    try:
        with zipfile.ZipFile(archive) as zf:
            for entry, info in zip(plan.entries, plan.members, strict=True):
                if entry.kind is Kind.FILE:
                    with zf.open(info) as src:
                        _write_file(tmp, entry, src, budget, made)
                else:
                    _write_other(tmp, entry, made)
    except OSError as exc:
        raise _write_error(archive, tmp, ArchiveFormat.ZIP, exc) from None
    except READ_ERRORS as exc:
        raise unreadable(archive, ArchiveFormat.ZIP, exc) from None


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


def _write_file(tmp: Path, entry: Entry, src: IO[bytes], budget: _Budget, made: set[Path]) -> None:
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


def _write_other(tmp: Path, entry: Entry, made: set[Path]) -> None:
    parts = entry.path.split("/")
    if entry.kind is Kind.DIR:
        _make_dirs(tmp, parts, made)
    elif entry.kind is Kind.SYMLINK:
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
        where = show(os.path.relpath(exc.filename, tmp), 80) if exc.filename else "a member"
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
    return unreadable(archive, fmt, exc)


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
