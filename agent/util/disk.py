"""Free disk space where a path is, or will be created once it is.

A base module: it imports nothing of the agent (the preflight's disk checks and the archive
unpacker both ask it).
"""

from __future__ import annotations

import shutil
from pathlib import Path


def nearest_existing(path: Path) -> Path:
    """``path`` made absolute (``~`` expanded), or its nearest existing ancestor when it does not
    exist yet: where a new file or directory at ``path`` will be created. Symlinks are kept as
    they are (``.resolve()`` the result where they matter)."""
    probe = path.expanduser().absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return probe


def disk_free(path: Path) -> int:
    """Free bytes on the file system holding ``path`` (or its nearest existing ancestor)."""
    return shutil.disk_usage(nearest_existing(path)).free
