"""The archive formats we unpack, told apart by the name's suffix; what reading a bad one raises."""

from __future__ import annotations

import lzma
import tarfile
import zipfile
import zlib
from enum import StrEnum
from pathlib import Path

from agent.data.archive.errors import ArchiveError
from agent.util.text import one_line

#: Archive suffixes we unpack, by format.
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tbz", ".tar.xz", ".txz")
ZIP_SUFFIXES = (".zip",)
SUPPORTED_FORMATS = ".tar, .tar.gz/.tgz, .tar.bz2, .tar.xz or .zip"


class ArchiveFormat(StrEnum):
    TAR = "tar"  #: a tar archive, uncompressed or gzip, bzip2 or xz compressed
    ZIP = "zip"  #: a zip archive


def archive_format(filename: str) -> ArchiveFormat | None:
    """The format a file of this name holds, by its suffix; None when it is none we unpack."""
    lower = filename.lower()
    if lower.endswith(TAR_SUFFIXES):
        return ArchiveFormat.TAR
    if lower.endswith(ZIP_SUFFIXES):
        return ArchiveFormat.ZIP
    return None


def require_format(archive: Path) -> ArchiveFormat:
    """The format of ``archive`` by its name; :class:`ArchiveError` when it is none we unpack."""
    fmt = archive_format(archive.name)
    if fmt is None:
        raise ArchiveError(
            f"{archive.name!r} is not a supported archive; pack the dataset as {SUPPORTED_FORMATS}"
        )
    return fmt


def unreadable(archive: Path, fmt: ArchiveFormat, exc: BaseException) -> ArchiveError:
    """The error for an archive that ``exc`` shows to be corrupt, truncated or misnamed."""
    return ArchiveError(
        f"{archive.name} is not a readable {fmt.value} archive ({type(exc).__name__}: "
        f"{one_line(str(exc), 120)}); check that the upload is complete and the name's suffix "
        "matches its format"
    )


#: Exceptions that a corrupt or truncated archive raises while being read.
READ_ERRORS: tuple[type[BaseException], ...] = (
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
LIST_ERRORS: tuple[type[BaseException], ...] = (*READ_ERRORS, OSError)
