"""The hostile-archive unpacker: a tar (any compression) or zip archive into a new directory.

Unpacking never trusts the archive. Every member is checked before anything is written (path
traversal, absolute paths, links that leave the destination, device files, FIFOs, duplicate
names, a name that is both a file and a directory, names too long for the file system), the
declared size is compared with the free disk (keeping a headroom, the preflight's 30 % by
default) and with the archive's own size (a decompression bomb), and the bytes are counted again
as they are written, stopping at the first one over. The tree is built in a temporary sibling
directory that is renamed into place only when complete: a failed unpack leaves nothing
half-written in ``dest``. Where Python has it (3.11.4+), tar members also pass
``tarfile.data_filter`` (PEP 706) on top of our own checks, which do not rely on it; hardlinks are
written as independent copies, and modes are reduced to 0644/0755.

:func:`safe_unpack` does it all in one call. A caller that must look at what an archive holds
before making room for it (staging replaces an earlier tree only once the new archive passed)
calls :func:`plan_unpack`, then :func:`unpack`. Nothing here knows where the archive came from:
every failure is an :class:`ArchiveError` whose message is one line that says what to do.

The parts, lowest first (each imports only those above it; of the rest of the agent, only the
base modules :mod:`agent.util.text` and :mod:`agent.util.disk`, which import nothing of it):

* :mod:`~agent.data.archive.errors`: ``ArchiveError``, ``UnsafeArchiveError``, how messages name
members.
* :mod:`~agent.data.archive.formats`: the formats we unpack, by suffix, and what a bad one raises.
* :mod:`~agent.data.archive.plan`: every member listed and checked (names, kinds, duplicates, links,
  name lengths, the expansion cap), nothing written: :func:`plan_unpack`.
* :mod:`~agent.data.archive.write`: the byte budget and free disk, the tree written in a temporary
  sibling with sane modes, the rename into place: :func:`unpack`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from agent.data.archive.errors import ArchiveError, UnsafeArchiveError
from agent.data.archive.formats import (
    SUPPORTED_FORMATS,
    ArchiveFormat,
    archive_format,
    require_format,
)
from agent.data.archive.plan import (
    MAX_EXPANSION_RATIO,
    UnpackPlan,
    make_plan,
    plan_unpack,
    scratch_prefix,
)
from agent.data.archive.write import DEFAULT_HEADROOM, leftovers, unpack
from agent.util.disk import disk_free

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
    fmt = require_format(archive)
    if os.path.lexists(dest) and (dest.is_symlink() or not dest.is_dir() or any(dest.iterdir())):
        raise ArchiveError(f"cannot unpack into {dest}: it exists and is not an empty directory")
    plan = make_plan(archive, fmt, dest, max_ratio=max_ratio)
    return unpack(plan, free_space=free_space, headroom=headroom)
