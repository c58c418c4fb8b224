"""Staging: download the dataset archive from the Hugging Face Hub, unpack it safely, check it.

The daemon calls :func:`stage_dataset` in its STAGING phase (from a worker thread). It is
idempotent: a marker file inside ``dest`` records what was staged, and a restarted agent with the
same ``[dataset]`` settings finds it and neither contacts the Hub nor unpacks again, so an offline
restart works.

Unpacking never trusts the archive. Every member is checked before anything is written (path
traversal, absolute paths, links that leave the destination, device files, FIFOs, duplicate
names, a name that is both a file and a directory, names too long for the file system), the
declared size is compared with the free disk (keeping the 30 % headroom of the preflight) and
with the archive's own size (a decompression bomb), and the bytes are counted again as they are
written, stopping at the first one over. The tree is built in a temporary sibling directory that
is renamed into place only when complete: a failed unpack leaves nothing half-written in
``dest``. Tar members also pass ``tarfile.data_filter`` (PEP 706) on top of our own checks;
hardlinks are written as independent copies, and modes are reduced to 0644/0755.

:func:`check_data_yaml` is the check of every job's data YAML, staged or local: it is readable
YAML, the paths in a staged one stay inside the staged folder, and ``libreyolo doctor`` finds no
errors.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import logging
import lzma
import math
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Literal

import yaml  # type: ignore[import-untyped,unused-ignore]
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    FileMetadataError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from agent.config import DatasetSection, Env
from agent.preflight import DISK_HEADROOM

__all__ = [
    "MARKER_NAME",
    "MAX_EXPANSION_RATIO",
    "DataCheck",
    "DoctorError",
    "StageResult",
    "StagingError",
    "UnsafeArchiveError",
    "check_data_yaml",
    "disk_free",
    "find_data_yaml",
    "read_marker",
    "run_doctor",
    "safe_unpack",
    "stage_dataset",
]

#: File inside ``dest`` that records what was staged there (JSON, see :func:`read_marker`).
MARKER_NAME = ".libreyolo-agent-staged.json"
MARKER_FORMAT = 1
#: Archive suffixes we unpack, by kind.
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tbz", ".tar.xz", ".txz")
ZIP_SUFFIXES = (".zip",)
SUPPORTED_FORMATS = ".tar, .tar.gz/.tgz, .tar.bz2, .tar.xz or .zip"

#: Unsafe members named in one error message; the rest are counted.
_MAX_NAMED_PROBLEMS = 10
#: Symlinks followed while resolving one link target (the kernel's limit is 40 too).
_MAX_LINK_HOPS = 40
#: Disk-space estimate: files occupy whole blocks, and every entry costs at least one.
_BLOCK = 4096
#: Doctor findings keep at most this many example paths each (a broken dataset of 100k images
#: would otherwise produce a report of megabytes).
_MAX_FINDING_PATHS = 20
#: Environment variables that a child process never needs to see.
_SECRET_ENV = ("HF_TOKEN", "CONTAINER_API_KEY", "VAST_API_KEY", "RUNPOD_API_KEY", "LAMBDA_API_KEY")
#: Default cap on unpacked bytes per archive byte. Images and most label files barely compress
#: (a real dataset archive unpacks to 1-3x its size); a run of zeros gzips about 1000x.
MAX_EXPANSION_RATIO = 200
#: The expansion cap is never below this, so a tiny archive of text is not called a bomb.
_MIN_EXPANSION_CAP = 1 << 20
#: Bytes read and written at a time while unpacking; the budget is checked per chunk.
_CHUNK = 1 << 20
#: Used when the file system does not say (``pathconf``): Linux's NAME_MAX and PATH_MAX.
_NAME_MAX = 255
_PATH_MAX = 4096
#: A data YAML is a page of text; anything bigger is not one.
_MAX_YAML_BYTES = 16 << 20
#: Image list files (``train: train.txt``) read for the path check, at most.
_MAX_LIST_BYTES = 64 << 20
#: Where LibreYOLO 1.6.0 looks first for a relative ``path:`` (``libreyolo/data/utils.py``).
_LIBREYOLO_DATASETS_ENV = "LIBREYOLO_DATASETS_DIR"
#: Keys of a data YAML that hold paths (``annotations`` maps splits to COCO JSON files).
_SPLIT_KEYS = ("train", "val", "test")

_logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Errors and results


class StagingError(Exception):
    """Staging failed. The message is one readable line that says what to do about it.

    ``retryable`` is True for trouble that may go away by itself (network, Hub 5xx/429);
    ``findings`` holds ``libreyolo doctor`` findings when the doctor gate failed, else ``[]``.
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = False,
        findings: Iterable[Mapping[str, Any]] = (),
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.findings: list[dict[str, Any]] = [dict(f) for f in findings]


class UnsafeArchiveError(StagingError):
    """The archive has members that must not be unpacked; ``problems`` maps member -> why."""

    def __init__(self, archive: Path, problems: list[tuple[str, str]]) -> None:
        shown = "; ".join(f"{_show(name)}: {why}" for name, why in problems[:_MAX_NAMED_PROBLEMS])
        more = len(problems) - _MAX_NAMED_PROBLEMS
        if more > 0:
            shown += f"; and {more} more"
        super().__init__(
            f"archive {archive.name} has {len(problems)} unsafe member(s), nothing was unpacked: "
            f"{shown}; rebuild the archive from plain files and folders with relative paths "
            "(e.g. tar -C DIR -cf dataset.tar .)"
        )
        self.problems = problems
        self.members = [name for name, _ in problems]


class DoctorError(StagingError):
    """``libreyolo doctor`` found errors; ``report`` is its JSON, ``findings`` its findings."""

    def __init__(self, message: str, report: Mapping[str, Any]) -> None:
        super().__init__(message, retryable=False, findings=_trim_findings(report))
        self.report = dict(report)


@dataclass(frozen=True)
class StageResult:
    #: The directory holding the unpacked dataset.
    dest: Path
    #: The data YAML that was checked / that training can use, if one was set or found.
    data_yaml: Path | None
    #: The archive was downloaded (or taken from the HF cache) in this call.
    downloaded: bool
    #: The archive was unpacked in this call (False: an intact earlier staging was kept).
    unpacked: bool
    #: The Hub commit the archive came from, when the Hub told us.
    commit: str | None
    #: sha256 of the archive, hex.
    archive_sha256: str
    #: ``libreyolo doctor`` JSON report (each finding's ``paths`` cut to 20, the rest counted in
    #: ``paths_truncated``), or None when the doctor gate is off.
    doctor: dict[str, Any] | None = None
    #: Doctor warnings as ``"check_id: message"`` lines, to be shown to the user.
    warnings: list[str] = field(default_factory=list)
    #: Bytes of file content in the unpacked tree.
    unpacked_bytes: int = 0


#: What became of the doctor in :func:`check_data_yaml`: it ran and found no errors, it is
#: turned off (``dataset.doctor = false``), or it could not run (libreyolo is not installed).
DoctorStatus = Literal["passed", "off", "skipped"]


@dataclass(frozen=True)
class DataCheck:
    """What :func:`check_data_yaml` found in a data YAML the trainer may use."""

    #: The data YAML that was checked (absolute).
    data_yaml: Path
    #: The dataset root LibreYOLO 1.6.0 will use (the YAML's ``path:`` resolved its way).
    root: Path
    #: See :data:`DoctorStatus`.
    doctor_status: DoctorStatus
    #: ``libreyolo doctor`` JSON report (findings trimmed as in :class:`StageResult`), or None
    #: when the doctor did not run.
    doctor: dict[str, Any] | None = None
    #: Lines to show the user: doctor warnings as ``"check_id: message"``, and the agent's own
    #: (doctor skipped, ``path:`` taken from LIBREYOLO_DATASETS_DIR...).
    warnings: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Staging


def stage_dataset(
    ds: DatasetSection,
    env: Env,
    *,
    log: logging.Logger | None = None,
    data_yaml: str | os.PathLike[str] | None = None,
    check: bool = True,
    allow_outside_paths: bool = False,
    doctor_timeout_s: float = 600.0,
    max_ratio: float = MAX_EXPANSION_RATIO,
    free_space: Callable[[Path], int] | None = None,
) -> StageResult:
    """Download ``ds.file`` from the dataset repo, unpack it into ``ds.dest``, check the data YAML.

    Skips download and unpack (and never contacts the Hub) when ``ds.dest`` holds an intact marker
    for the same repo, file and revision. ``data_yaml`` (e.g. the job's ``train.data``; absolute,
    or relative to dest) is the YAML to check; otherwise ``ds.data_yaml`` or the single data YAML
    found at the top of dest or one level down.

    ``check`` runs :func:`check_data_yaml` on it (the doctor when ``ds.doctor``, and the paths
    unless ``allow_outside_paths``); a caller that checks every job's YAML itself passes False.
    ``max_ratio`` and ``free_space`` are those of :func:`safe_unpack`.
    Raises :class:`StagingError` (``DoctorError`` for doctor errors, ``UnsafeArchiveError`` for a
    hostile archive).
    """
    log = log or _logger
    dest = Path(os.path.abspath(ds.dest))
    kind = _archive_kind(ds.file)
    checks = _Checks(check, allow_outside_paths, doctor_timeout_s)
    marker = read_marker(dest)

    if marker is not None and _marker_matches(marker, ds) and _marker_intact(marker, dest):
        log.info(
            "staging: %s/%s@%s already staged in %s (commit %s), skipping download",
            ds.repo,
            ds.file,
            ds.revision,
            dest,
            marker.get("commit") or "unknown",
        )
        result = StageResult(
            dest=dest,
            data_yaml=None,
            downloaded=False,
            unpacked=False,
            commit=_str_or_none(marker.get("commit")),
            archive_sha256=str(marker.get("archive_sha256", "")),
            unpacked_bytes=_int_or_zero(marker.get("unpacked_bytes")),
        )
        return _finish(result, ds, data_yaml, log, checks)

    # The marker's name is ours: whatever it says, the directory was staged by an agent.
    ours = os.path.lexists(dest / MARKER_NAME)
    _check_dest_usable(dest, ours=ours)
    _remove_leftovers(dest, log)

    log.info(
        "staging: downloading %s/%s@%s from %s", ds.repo, ds.file, ds.revision, env.hf_endpoint
    )
    started = time.monotonic()
    archive = _download(ds, env)
    commit = _commit_from_cache_path(archive, ds.file)
    size = archive.stat().st_size
    sha256 = _sha256(archive)
    log.info(
        "staging: downloaded %s (%s, commit %s, sha256 %s) in %.1fs",
        ds.file,
        _fmt_bytes(size),
        commit or "unknown",
        sha256[:12],
        time.monotonic() - started,
    )

    plan = _plan(archive, kind, dest, max_ratio=max_ratio)
    if ours:
        # Another dataset (or a broken staging) of ours is in the way. Renaming it aside is
        # atomic, so a crash during the slow removal leaves only a leftover for the next start.
        log.info("staging: removing the previous staging in %s", dest)
        old = dest.parent / f".{dest.name}.unpacking-old-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(dest, old)
        shutil.rmtree(old)

    record: dict[str, Any] = {
        "format": MARKER_FORMAT,
        "repo": ds.repo,
        "file": ds.file,
        "revision": ds.revision,
        "commit": commit,
        "archive_sha256": sha256,
        "archive_bytes": size,
        "unpacked_bytes": plan.file_bytes,
        "files": plan.files,
        "entries": plan.top_level[:100],
        "staged_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    started = time.monotonic()
    written = _unpack(
        archive,
        kind,
        dest,
        plan,
        on_ready=lambda tmp: _write_marker(tmp, record),
        free_space=free_space or disk_free,
    )
    log.info(
        "staging: unpacked %d files (%s) into %s in %.1fs",
        plan.files,
        _fmt_bytes(written),
        dest,
        time.monotonic() - started,
    )
    result = StageResult(
        dest=dest,
        data_yaml=None,
        downloaded=True,
        unpacked=True,
        commit=commit,
        archive_sha256=sha256,
        unpacked_bytes=written,
    )
    return _finish(result, ds, data_yaml, log, checks)


@dataclass(frozen=True)
class _Checks:
    """What :func:`stage_dataset` checks in the data YAML once the data is in place."""

    enabled: bool
    allow_outside_paths: bool
    doctor_timeout_s: float


def _finish(
    result: StageResult,
    ds: DatasetSection,
    override: str | os.PathLike[str] | None,
    log: logging.Logger,
    checks: _Checks,
) -> StageResult:
    """Resolve the data YAML and check it (paths, doctor) when asked."""
    if override is not None:
        given = Path(override)
        yaml_path: Path | None = given if given.is_absolute() else result.dest / given
        if yaml_path is None or not yaml_path.is_file():
            raise StagingError(
                f"the data YAML {yaml_path} does not exist after staging; check train.data"
            )
    else:
        yaml_path = find_data_yaml(result.dest, ds.data_yaml, required=checks.enabled and ds.doctor)
    if yaml_path is None or not checks.enabled:
        return replace(result, data_yaml=yaml_path)
    found = check_data_yaml(
        yaml_path,
        doctor=ds.doctor,
        allow_outside_paths=checks.allow_outside_paths,
        staged_root=result.dest,
        timeout_s=checks.doctor_timeout_s,
        log=log,
    )
    return replace(result, data_yaml=yaml_path, doctor=found.doctor, warnings=found.warnings)


def _check_dest_usable(dest: Path, *, ours: bool) -> None:
    if dest.is_symlink():
        # Renaming the new tree into place would replace the link, not fill its target.
        raise StagingError(
            f"dataset.dest {dest} is a symlink; set dataset.dest to the real path "
            f"({os.path.realpath(dest)})"
        )
    if os.path.lexists(dest) and not dest.is_dir():
        raise StagingError(
            f"dataset.dest {dest} exists and is not a directory; point it at a directory"
        )
    if dest.is_dir() and os.path.ismount(dest):
        # The unpack renames a sibling directory into place, which cannot replace a mount point.
        raise StagingError(
            f"dataset.dest {dest} is a mount point; set dataset.dest to a directory inside it "
            f"(e.g. {dest / 'data'})"
        )
    if dest.is_dir() and not ours and any(dest.iterdir()):
        raise StagingError(
            f"dataset.dest {dest} is not empty and was not staged by libreyolo-agent; point "
            "dataset.dest at a new or empty directory (the agent replaces its content)"
        )


def _remove_leftovers(dest: Path, log: logging.Logger) -> None:
    """Remove temporary siblings a crashed earlier unpack left behind (they only cost disk)."""
    parent = dest.parent
    if not parent.is_dir():
        return
    for p in parent.glob(f".{glob.escape(dest.name)}.unpacking-*"):
        if p.is_dir() and not p.is_symlink():
            log.info("staging: removing the leftover %s of an interrupted unpack", p)
            shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# The marker


def read_marker(dest: Path) -> dict[str, Any] | None:
    """The staging record in ``dest``, or None when there is none or it is unreadable.

    Format (JSON object): ``format`` (1), ``repo``, ``file``, ``revision``, ``commit`` (40 hex or
    null), ``archive_sha256``, ``archive_bytes``, ``unpacked_bytes``, ``files`` (count),
    ``entries`` (top-level names, at most 100), ``staged_at`` (UTC, ISO 8601).
    """
    try:
        data = json.loads((dest / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _marker_matches(marker: Mapping[str, Any], ds: DatasetSection) -> bool:
    return (
        marker.get("format") == MARKER_FORMAT
        and marker.get("repo") == ds.repo
        and marker.get("file") == ds.file
        and marker.get("revision") == ds.revision
        and isinstance(marker.get("archive_sha256"), str)
    )


def _marker_intact(marker: Mapping[str, Any], dest: Path) -> bool:
    entries = marker.get("entries")
    if not isinstance(entries, list):
        return False
    return all(isinstance(e, str) and os.path.lexists(dest / e) for e in entries)


def _write_marker(directory: Path, record: Mapping[str, Any]) -> None:
    path = directory / MARKER_NAME
    if os.path.lexists(path):
        path.unlink()  # the archive brought one (perhaps a symlink): ours replaces it
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------------------------
# Download


def _download(ds: DatasetSection, env: Env) -> Path:
    cache_dir = env.hf_home / "hub" if env.hf_home is not None else None
    try:
        path = hf_hub_download(
            ds.repo,
            ds.file,
            repo_type="dataset",
            revision=ds.revision,
            # False, not None: secrets come from the environment only, never from a token file
            # that happens to lie on the box.
            token=env.hf_token or False,
            endpoint=env.hf_endpoint,
            cache_dir=cache_dir,
        )
    except Exception as exc:
        raise _hub_error(exc, ds, env, cache_dir) from None
    return Path(path)


def _hub_error(
    exc: BaseException, ds: DatasetSection, env: Env, cache_dir: Path | None
) -> StagingError:
    """Turn what ``hf_hub_download`` raised into one line that says what to do."""
    token = env.hf_token
    repo = f"dataset repo {ds.repo!r}"
    where = env.hf_endpoint

    def err(message: str, retryable: bool = False) -> StagingError:
        return StagingError(_redact(message, token), retryable=retryable)

    if isinstance(exc, GatedRepoError):
        if token is None:
            return err(
                f"{repo} on {where} is gated; set HF_TOKEN to a read token of an account that "
                "was granted access"
            )
        return err(
            f"{repo} on {where} is gated and HF_TOKEN's account has no access; request access at "
            f"{env.hf_endpoint}/datasets/{ds.repo}"
        )
    if isinstance(exc, RepositoryNotFoundError):
        if token is None:
            return err(
                f"{repo} was not found on {where}, or it is private and HF_TOKEN is not set; "
                "check dataset.repo, or set HF_TOKEN to a read token that can see it"
            )
        return err(
            f"{repo} was not found on {where}, or HF_TOKEN has no access to it; "
            "check dataset.repo and the token's permissions"
        )
    if isinstance(exc, RevisionNotFoundError):
        return err(
            f"revision {ds.revision!r} was not found in {repo}; check dataset.revision "
            "(a branch, tag or commit)"
        )
    if isinstance(exc, EntryNotFoundError) and not isinstance(exc, LocalEntryNotFoundError):
        return err(
            f"file {ds.file!r} was not found in {repo} at revision {ds.revision!r}; check "
            "dataset.file (the archive's path inside the repo)"
        )
    if isinstance(exc, HfHubHTTPError):
        return _http_error(exc, ds, env)
    if isinstance(exc, LocalEntryNotFoundError):
        cause = exc.__cause__
        if isinstance(cause, OfflineModeIsEnabled):
            return err(
                f"HF_HUB_OFFLINE is set and {ds.file!r} of {repo} is not in the download cache; "
                "unset HF_HUB_OFFLINE"
            )
        if isinstance(cause, FileMetadataError):
            return err(
                f"{where} did not answer like a Hugging Face Hub ({_one_line(str(cause), 120)}); "
                "check HF_ENDPOINT and any proxy"
            )
        if isinstance(cause, HfHubHTTPError):
            return _http_error(cause, ds, env)
        detail = f"{type(cause).__name__}: {_one_line(str(cause), 120)}" if cause else "no answer"
        return err(
            f"cannot reach the Hugging Face Hub at {where} ({detail}); check the box's network "
            "(retryable)",
            retryable=True,
        )
    if isinstance(exc, HFValidationError):
        return err(
            f"invalid dataset settings: {_one_line(str(exc))}; check dataset.repo and dataset.file"
        )
    if _is_transport_error(exc):
        return err(
            f"network error while downloading {ds.file!r} from {where} ({type(exc).__name__}: "
            f"{_one_line(str(exc), 120)}); check the box's network (retryable)",
            retryable=True,
        )
    if isinstance(exc, OSError):
        cache = str(cache_dir) if cache_dir is not None else "the Hugging Face cache"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return err(
                f"no space left while downloading {ds.file!r} into {cache}; free disk space or set "
                "HF_HOME to a bigger volume"
            )
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return err(
                f"cannot write the download cache {cache} ({_one_line(str(exc))}); check HF_HOME"
            )
        return err(
            f"download of {ds.file!r} failed ({_one_line(str(exc))}) (retryable)", retryable=True
        )
    return err(
        f"download of {ds.file!r} from {repo} failed: {type(exc).__name__}: {_one_line(str(exc))}"
    )


def _http_error(exc: HfHubHTTPError, ds: DatasetSection, env: Env) -> StagingError:
    token = env.hf_token
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    repo = f"dataset repo {ds.repo!r}"
    tokens_url = f"{env.hf_endpoint}/settings/tokens"
    if status == 401:
        if token is None:
            msg = (
                f"{env.hf_endpoint} asks for authentication to read {repo}; set HF_TOKEN to a "
                f"read token ({tokens_url})"
            )
        else:
            msg = (
                f"HF_TOKEN was rejected by {env.hf_endpoint} (401); create a read token at "
                f"{tokens_url} and set HF_TOKEN to it"
            )
        return StagingError(msg)
    if status == 403:
        if token is None:
            msg = (
                f"{env.hf_endpoint} refused access to {repo} (403); set HF_TOKEN to a read "
                "token with access"
            )
        else:
            msg = f"HF_TOKEN may not read {repo} (403); use a token with read access ({tokens_url})"
        return StagingError(msg)
    if status in (408, 429) or (isinstance(status, int) and status >= 500):
        return StagingError(
            f"the Hugging Face Hub at {env.hf_endpoint} answered {status} for {repo}; it is busy "
            "or down (retryable)",
            retryable=True,
        )
    detail = _redact(_one_line(str(exc), 160), token)
    return StagingError(
        f"the Hugging Face Hub answered {status} for {ds.file!r} of {repo}: {detail}"
    )


def _is_transport_error(exc: BaseException) -> bool:
    """A connection or timeout error from any HTTP stack the Hub client may use."""
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    for cls in type(exc).__mro__:
        module = cls.__module__.split(".")[0]
        if module in ("httpx", "httpx2", "httpcore", "requests", "urllib3") and cls.__name__ in (
            "TransportError",
            "TimeoutException",
            "NetworkError",
            "ConnectionError",
            "Timeout",
            "ProtocolError",
        ):
            return True
    return False


def _commit_from_cache_path(path: Path, filename: str) -> str | None:
    """The cache keeps files at ``.../snapshots/<commit>/<filename>``: read the commit there."""
    depth = len([p for p in filename.split("/") if p])
    parts = path.parts
    if len(parts) < depth + 2 or parts[-depth - 2] != "snapshots":
        return None
    commit = parts[-depth - 1]
    return commit if re.fullmatch(r"[0-9a-f]{40}", commit) else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Unpack


@dataclass
class _Entry:
    #: Normalized relative path ("a/b/c"), "" for the archive's root entry.
    path: str
    #: "file", "dir", "symlink" or "hardlink".
    kind: str
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


@dataclass
class _Plan:
    entries: list[_Entry]
    #: Bytes of file content the members declare (hardlinks count: they become copies).
    file_bytes: int
    files: int
    #: Estimated bytes the tree occupies on disk (whole blocks).
    disk_bytes: int
    top_level: list[str]
    #: The archive's own member objects to extract, in order (TarInfo or ZipInfo).
    members: list[Any]


def disk_free(path: Path) -> int:
    """Free bytes on the file system holding ``path`` (the default free-space reader)."""
    return shutil.disk_usage(path).free


def safe_unpack(
    archive: Path,
    dest: Path,
    *,
    max_ratio: float = MAX_EXPANSION_RATIO,
    free_space: Callable[[Path], int] = disk_free,
) -> int:
    """Unpack a tar (any compression) or zip ``archive`` into ``dest``; return the bytes written.

    ``dest`` must not exist or be an empty directory. Every member is checked first; an unsafe one
    raises :class:`UnsafeArchiveError` naming each offending member. Before anything is written,
    the declared size must fit the free disk with the preflight's 30 % headroom and stay within
    ``max_ratio`` times the archive's size (never below 1 MiB); while writing, the bytes are
    counted against that budget and free space is read again (``free_space(path)``, bytes free
    on the file system of an existing ``path``): the first byte over stops the unpack with a
    :class:`StagingError`. The tree is built in a temporary sibling of ``dest`` and renamed into
    place, so ``dest`` is never half-unpacked.
    """
    archive = Path(archive)
    dest = Path(os.path.abspath(dest))
    kind = _archive_kind(archive.name)
    if os.path.lexists(dest) and (dest.is_symlink() or not dest.is_dir() or any(dest.iterdir())):
        raise StagingError(f"cannot unpack into {dest}: it exists and is not an empty directory")
    plan = _plan(archive, kind, dest, max_ratio=max_ratio)
    return _unpack(archive, kind, dest, plan, free_space=free_space)


def _archive_kind(filename: str) -> str:
    lower = filename.lower()
    if lower.endswith(TAR_SUFFIXES):
        return "tar"
    if lower.endswith(ZIP_SUFFIXES):
        return "zip"
    raise StagingError(
        f"dataset.file {filename!r} is not a supported archive; pack the dataset as "
        f"{SUPPORTED_FORMATS}"
    )


def _unreadable(archive: Path, kind: str, exc: BaseException) -> StagingError:
    return StagingError(
        f"{archive.name} is not a readable {kind} archive ({type(exc).__name__}: "
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


def _plan(archive: Path, kind: str, dest: Path, *, max_ratio: float) -> _Plan:
    """List and check every member for an unpack into ``dest``; raise before anything is
    written (``max_ratio``: see :func:`safe_unpack`)."""
    raw: list[Any]
    try:
        if kind == "tar":
            with tarfile.open(archive, "r:*") as tf:
                raw = tf.getmembers()
            listed = [_tar_entry(m) for m in raw]
        else:
            with zipfile.ZipFile(archive) as zf:
                raw = zf.infolist()
                listed = [_zip_entry(zf, info) for info in raw]
    except StagingError:
        raise
    except _LIST_ERRORS as exc:
        raise _unreadable(archive, kind, exc) from None

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
            if entry.kind != "dir":
                bad[index] = (name, "has an empty path")
            continue  # the archive's own root ("./"): dest itself
        entries.append(entry)
        members.append(member)
    for entry, why in (*_check_clashes(entries), *_check_links(entries)):
        bad.setdefault(entry.index, (entry.name, why))
    if bad:
        raise UnsafeArchiveError(archive, [bad[i] for i in sorted(bad)])
    _check_lengths(archive, entries, dest)

    sizes = {e.path: e.size for e in entries if e.kind == "file"}
    for e in entries:
        if e.kind == "hardlink":
            e.size = sizes[_normalize(e.target)]
    content = [e for e in entries if e.kind in ("file", "hardlink")]
    file_bytes = sum(e.size for e in content)
    disk_bytes = sum(-(-e.size // _BLOCK) * _BLOCK for e in content)
    disk_bytes += _BLOCK * (len(entries) - len(content))
    top: list[str] = []
    for e in entries:
        head = e.path.split("/", 1)[0]
        if head not in top:
            top.append(head)
    plan = _Plan(
        entries=entries,
        file_bytes=file_bytes,
        files=len(content),
        disk_bytes=disk_bytes,
        top_level=top,
        members=members,
    )
    _check_expansion(archive, plan, max_ratio)
    return plan


def _check_expansion(archive: Path, plan: _Plan, max_ratio: float) -> None:
    """Refuse an archive whose members declare far more than it could hold (a bomb)."""
    archive_bytes = archive.stat().st_size
    cap = max(archive_bytes * max_ratio, _MIN_EXPANSION_CAP)  # float: max_ratio may be inf
    if plan.file_bytes > cap:
        raise StagingError(
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
        return name, _Entry(path, "file", size=m.size, mode=m.mode, mtime=m.mtime), None
    if m.isdir():
        return name, _Entry(path, "dir"), None
    if m.issym():
        return name, _Entry(path, "symlink", target=m.linkname), None
    if m.islnk():
        return name, _Entry(path, "hardlink", target=m.linkname, mode=m.mode, mtime=m.mtime), None
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
        return name, _Entry(path, "dir"), None
    if ftype == stat.S_IFLNK:
        if info.file_size > 4096:
            return name, None, "is a symlink with an oversized target"
        target = zf.read(info).decode("utf-8", "surrogateescape")
        return name, _Entry(path, "symlink", target=target), None
    if ftype in (0, stat.S_IFREG):
        return name, _Entry(path, "file", size=info.file_size, mode=mode & 0o777), None
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


_KIND_WORDS = {"file": "file", "dir": "folder", "symlink": "symlink", "hardlink": "hardlink"}


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
        if prev is e or prev.kind == e.kind == "dir":
            continue
        if prev.kind == e.kind:
            kinds = f"{_KIND_WORDS[e.kind]}s"
            problems.append((e, f"appears twice in the archive (two {kinds} of that name)"))
        else:
            both = f"{_KIND_WORDS[prev.kind]} and a {_KIND_WORDS[e.kind]}"
            problems.append((e, f"is both a {both} in the archive"))
    for e in entries:
        parts = e.path.split("/")
        for i in range(1, len(parts)):
            prefix = first.get("/".join(parts[:i]))
            if prefix is not None and prefix.kind in ("file", "hardlink"):
                problems.append(
                    (e, f"lies below {_show(prefix.path)}, which is a {prefix.kind}, not a folder")
                )
                break
    return problems


def _check_lengths(archive: Path, entries: list[_Entry], dest: Path) -> None:
    """Refuse names the file system at ``dest`` cannot hold (ENAMETOOLONG), before writing."""
    probe = _existing_ancestor(dest.parent)
    name_max = _pathconf(probe, "PC_NAME_MAX", _NAME_MAX)
    path_max = _pathconf(probe, "PC_PATH_MAX", _PATH_MAX)
    # Members are written below ".<dest.name>.unpacking-XXXXXXXX/" next to dest.
    prefix = len(os.fsencode(dest.parent)) + len(os.fsencode(f"/.{dest.name}.unpacking-")) + 9
    problems: list[tuple[str, str]] = []
    for e in entries:
        try:
            parts = [len(os.fsencode(p)) for p in e.path.split("/")]
            target = len(os.fsencode(e.target)) if e.kind == "symlink" else 0
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
        shown = "; ".join(f"{_show(n)}: {why}" for n, why in problems[:_MAX_NAMED_PROBLEMS])
        more = len(problems) - _MAX_NAMED_PROBLEMS
        if more > 0:
            shown += f"; and {more} more"
        raise StagingError(
            f"archive {archive.name} has {len(problems)} member(s) whose names are too long for "
            f"the file system at {dest}, nothing was unpacked: {shown}; shorten those names (at "
            f"most {name_max} bytes per file or folder name, {path_max - 1} for a whole path) "
            "and rebuild the archive"
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
    seen: dict[str, str] = {}
    for e in entries:
        if e.kind == "symlink":
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
        if e.kind == "symlink":
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
        elif e.kind == "hardlink":
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
        if e.kind == "file":
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
    stops before the headroom kept for training is gone.
    """

    def __init__(
        self,
        archive: Path,
        limit: int,
        *,
        free_space: Callable[[Path], int],
        probe: Path,
        reserve: int,
    ) -> None:
        self.archive = archive
        self.limit = limit
        self.written = 0
        self.unchecked = 0
        self.free_space = free_space
        self.probe = probe
        self.reserve = reserve

    def take(self, n: int, entry: _Entry, member_left: int) -> None:
        if n > member_left or self.written + n > self.limit:
            raise StagingError(
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
            raise StagingError(
                f"the disk filled up while unpacking {self.archive.name} ({self.written:,} of "
                f"{self.limit:,} bytes written): {free:,} bytes ({_fmt_bytes(free)}) are free on "
                f"{self.probe}, less than the 30 % headroom kept for training; nothing was "
                "unpacked; find what else writes there, free some space or rent a bigger disk"
            )
        self.written += n


def _unpack(
    archive: Path,
    kind: str,
    dest: Path,
    plan: _Plan,
    *,
    on_ready: Callable[[Path], None] | None = None,
    free_space: Callable[[Path], int] = disk_free,
) -> int:
    probe = _existing_ancestor(dest.parent)
    free = free_space(probe)
    needed = math.ceil(plan.disk_bytes * DISK_HEADROOM)
    if needed > free:
        raise StagingError(
            f"not enough disk space to unpack {archive.name} into {dest}: needs "
            f"{plan.disk_bytes:,} bytes ({_fmt_bytes(plan.disk_bytes)}) plus 30 % headroom "
            f"({needed:,} bytes) but only {free:,} bytes ({_fmt_bytes(free)}) are free on "
            f"{probe}; free some space or rent a bigger disk"
        )
    budget = _Budget(
        archive,
        plan.file_bytes,
        free_space=free_space,
        probe=probe,
        reserve=free - int(free / DISK_HEADROOM),
    )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.unpacking-", dir=dest.parent))
    try:
        if kind == "tar":
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


def _extract_tar(archive: Path, tmp: Path, plan: _Plan, budget: _Budget) -> None:
    made: set[Path] = {tmp}
    try:
        with tarfile.open(archive, "r:*") as tf:
            for entry, member in zip(plan.entries, plan.members, strict=True):
                # A second opinion on our own checks (PEP 706); we write the result ourselves.
                tarfile.data_filter(member, str(tmp))
                if entry.kind == "file":
                    src = tf.extractfile(member)
                    if src is None:
                        raise tarfile.ReadError(f"no data for {member.name!r}")
                    with src:
                        _write_file(tmp, entry, src, budget, made)
                elif entry.kind == "hardlink":
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
        raise _write_error(archive, tmp, "tar", exc) from None
    except _READ_ERRORS as exc:
        raise _unreadable(archive, "tar", exc) from None


def _extract_zip(archive: Path, tmp: Path, plan: _Plan, budget: _Budget) -> None:
    made: set[Path] = {tmp}
    try:
        with zipfile.ZipFile(archive) as zf:
            for entry, info in zip(plan.entries, plan.members, strict=True):
                if entry.kind == "file":
                    with zf.open(info) as src:
                        _write_file(tmp, entry, src, budget, made)
                else:
                    _write_other(tmp, entry, made)
    except OSError as exc:
        raise _write_error(archive, tmp, "zip", exc) from None
    except _READ_ERRORS as exc:
        raise _unreadable(archive, "zip", exc) from None


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
    if entry.kind == "dir":
        _make_dirs(tmp, parts, made)
    elif entry.kind == "symlink":
        os.symlink(entry.target, _make_dirs(tmp, parts[:-1], made) / parts[-1])
    else:
        raise AssertionError(f"unplanned member kind {entry.kind!r}")


def _write_error(archive: Path, tmp: Path, fmt: str, exc: OSError) -> StagingError:
    """A full disk or a refused write says so; anything else is an unreadable archive."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StagingError(
            f"disk full while unpacking {archive.name} into {tmp.parent}; free some space or "
            "rent a bigger disk"
        )
    if exc.errno == errno.ENAMETOOLONG:
        where = _show(os.path.relpath(exc.filename, tmp)) if exc.filename else "a member"
        return StagingError(
            f"a member name of {archive.name} is too long for the file system at {tmp.parent} "
            f"({where}, ENAMETOOLONG); nothing was unpacked; shorten the names and rebuild the "
            "archive"
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StagingError(
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
# The data YAML and the doctor gate

_KEY_LINE = re.compile(r"^(train|val)\s*:", re.MULTILINE)


def find_data_yaml(
    dest: Path, data_yaml: str | None = None, *, required: bool = False
) -> Path | None:
    """The dataset YAML in ``dest``: ``dest / data_yaml`` when given, else the single YAML with
    ``train`` and ``val`` keys at the top of ``dest`` or one level down.

    Raises :class:`StagingError` when ``data_yaml`` is missing, when several candidates are found,
    and (``required``) when none is.
    """
    if data_yaml is not None:
        path = dest / data_yaml
        if not path.is_file():
            raise StagingError(
                f"dataset.data_yaml {data_yaml!r} is not a file in {dest} (top level: "
                f"{_listing(dest)}); set it to the YAML's path inside dest"
            )
        return path
    candidates = []
    for pattern in ("*.yaml", "*.yml", "*/*.yaml", "*/*.yml"):
        for p in sorted(dest.glob(pattern)):
            if p.name.startswith(".") or not p.is_file():
                continue
            try:
                with open(p, encoding="utf-8", errors="replace") as f:
                    text = f.read(1 << 20)
            except OSError:
                continue
            if {m.group(1) for m in _KEY_LINE.finditer(text)} == {"train", "val"}:
                candidates.append(p)
    if len(candidates) == 1:
        return candidates[0]
    if len(candidates) > 1:
        names = ", ".join(str(p.relative_to(dest)) for p in candidates[:10])
        raise StagingError(
            f"several data YAMLs found in {dest} ({names}); set dataset.data_yaml to the one to "
            "train on"
        )
    if required:
        raise StagingError(
            f"no data YAML with train and val keys found in {dest} or one level down (top level: "
            f"{_listing(dest)}); set dataset.data_yaml"
        )
    return None


def _listing(dest: Path) -> str:
    try:
        names = sorted(p.name for p in dest.iterdir() if p.name != MARKER_NAME)
    except OSError:
        return "unreadable"
    if not names:
        return "empty"
    shown = ", ".join(names[:10])
    return shown + (f", and {len(names) - 10} more" if len(names) > 10 else "")


def _libreyolo_exe() -> str | None:
    beside = Path(sys.executable).parent / "libreyolo"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("libreyolo")


def run_doctor(
    data_yaml: Path, *, timeout_s: float = 600, exe: str | None = None
) -> dict[str, Any]:
    """Run ``libreyolo doctor DATA json=true`` and return its JSON report.

    The report has ``summary`` (``errors``, ``warnings``, ``infos``), ``findings`` (each with
    ``check_id``, ``severity``, ``message``...) and ``exit_code`` (0 healthy, 1 errors). Raises
    :class:`StagingError` when the doctor cannot be run or gives no report (e.g. exit 3, data
    not found); judging the report is the caller's business (:func:`check_data_yaml` does).
    ``exe`` is the libreyolo command; by default the one next to this Python, else on PATH.
    """
    exe = exe or _libreyolo_exe()
    if exe is None:
        raise StagingError(
            f"the libreyolo command was not found next to {sys.executable} or on PATH; install the "
            "training stack (pip install libreyolo==1.6.0) or set dataset.doctor = false"
        )
    env = {k: v for k, v in os.environ.items() if k not in _SECRET_ENV}
    # data=PATH rather than a positional: a path holding '=' would read as key=value.
    cmd = [exe, "doctor", f"data={data_yaml}", "json=true"]
    try:
        proc = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            env=env,
            cwd=data_yaml.parent if data_yaml.parent.is_dir() else None,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise StagingError(
            f"libreyolo doctor did not finish within {timeout_s:g}s on {data_yaml}; set "
            "dataset.doctor = false to skip it"
        ) from None
    except OSError as exc:
        raise StagingError(
            f"cannot run {exe} ({exc.strerror or exc}); check the libreyolo install"
        ) from None
    report = _parse_json_object(proc.stdout)
    if report is None:
        tail = _one_line(
            proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output", 200
        )
        raise StagingError(
            f"libreyolo doctor exited {proc.returncode} without a JSON report on {data_yaml} "
            f"({tail}); run it by hand to see why, or set dataset.doctor = false"
        )
    report.setdefault("exit_code", proc.returncode)
    if not isinstance(report.get("summary"), dict):
        message = _one_line(str(report.get("message") or report.get("error") or "no summary"), 200)
        raise StagingError(
            f"libreyolo doctor could not check {data_yaml} (exit {proc.returncode}): {message}; "
            "check dataset.data_yaml / train.data"
        )
    return report


def check_data_yaml(
    data_yaml: str | os.PathLike[str],
    *,
    doctor: bool,
    allow_outside_paths: bool,
    staged_root: Path | None,
    timeout_s: float = 600.0,
    log: logging.Logger | None = None,
    find_libreyolo: Callable[[], str | None] = _libreyolo_exe,
) -> DataCheck:
    """Check the data YAML a job trains on, staged or local, before the trainer starts.

    1. It must be a readable YAML mapping (LibreYOLO reads it with ``yaml.safe_load`` too).
    2. When it lies in ``staged_root`` (the folder a dataset archive was unpacked into; None for
       a local dataset), every path it names must resolve, symlinks followed, inside
       ``staged_root``, unless ``allow_outside_paths``: ``path``, ``train``/``val``/``test`` (each
       entry of a list, and each line of a ``.txt`` image list) and ``annotations``. Paths are
       resolved as LibreYOLO 1.6.0 resolves them: a relative ``path:`` is looked up in
       ``$LIBREYOLO_DATASETS_DIR`` (default ``~/datasets``) first, then next to the YAML.
    3. With ``doctor``, ``libreyolo doctor`` (at most ``timeout_s`` seconds) must find no errors;
       its warnings are returned. When libreyolo is not installed (``find_libreyolo()`` gives
       None) the doctor is skipped and a warning says so.

    Raises :class:`DoctorError` when the doctor finds errors, :class:`StagingError` when the YAML
    is missing, unreadable or points outside the staged folder, or the doctor cannot check it.
    """
    log = log or _logger
    path = Path(os.path.abspath(data_yaml))
    if not path.is_file():
        what = "is not a file" if os.path.lexists(path) else "does not exist"
        raise StagingError(
            f"the data YAML {path} {what}; check train.data (and dataset.data_yaml for a staged "
            "dataset)"
        )
    config = _read_data_yaml(path)
    root, via = _dataset_root(config, path)
    warnings: list[str] = []
    staged = staged_root is not None and _inside(path, staged_root)
    if staged and not allow_outside_paths:
        assert staged_root is not None
        _check_inside(path, config, root, via, staged_root)
    elif via is not None:
        beside = path.parent / str(config["path"])
        note = (
            f"path {_show(str(config['path']))} in {path} resolves to {root}, not to {beside}: "
            f"{via}; make path absolute, or remove it to use the YAML's folder"
        )
        warnings.append(note)
        log.warning("dataset: %s", note)

    if not doctor:
        return DataCheck(data_yaml=path, root=root, doctor_status="off", warnings=warnings)
    exe = find_libreyolo()
    if exe is None:
        skipped = (
            f"libreyolo doctor skipped, {path} was not checked: the libreyolo command was not "
            f"found next to {sys.executable} or on PATH; install the training stack (pip install "
            "libreyolo==1.6.0)"
        )
        log.warning("dataset: %s", skipped)
        return DataCheck(
            data_yaml=path, root=root, doctor_status="skipped", warnings=[*warnings, skipped]
        )
    started = time.monotonic()
    report = run_doctor(path, timeout_s=timeout_s, exe=exe)
    # Keep the report small enough for state files and /status (see _MAX_FINDING_PATHS).
    report["findings"] = _trim_findings(report)
    summary = report.get("summary")
    errors = _int_or_zero(summary.get("errors")) if isinstance(summary, dict) else 0
    findings = [f for f in report.get("findings") or [] if isinstance(f, dict)]
    if errors or report.get("exit_code") not in (0, None):
        bad = [f for f in findings if f.get("severity") == "error"]
        text = " | ".join(
            f"{f.get('check_id', '?')}: {_one_line(str(f.get('message', '')))}" for f in bad[:5]
        )
        if len(bad) > 5:
            text += f" | and {len(bad) - 5} more"
        log.warning("dataset: doctor found %d error(s) in %s: %s", errors or len(bad), path, text)
        fix = "fix the dataset and upload a new archive" if staged else "fix the dataset"
        raise DoctorError(
            f"libreyolo doctor found {errors or len(bad)} error(s) in {path}: "
            f"{text or 'see findings'}; {fix}, or set dataset.doctor = false to train anyway",
            report,
        )
    found = [
        f"{f.get('check_id', '?')}: {_one_line(str(f.get('message', '')))}"
        for f in findings
        if f.get("severity") == "warning"
    ]
    log.info(
        "dataset: doctor passed %s (%d warnings) in %.1fs",
        path,
        len(found),
        time.monotonic() - started,
    )
    for w in found:
        log.warning("dataset: doctor warning: %s", w)
    return DataCheck(
        data_yaml=path,
        root=root,
        doctor_status="passed",
        doctor=report,
        warnings=[*warnings, *found],
    )


def _read_data_yaml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise StagingError(
            f"cannot read the data YAML {path} ({exc.strerror or exc}); check train.data and "
            "the file's permissions"
        ) from None
    if len(raw) > _MAX_YAML_BYTES:
        raise StagingError(
            f"the data YAML {path} is larger than {_fmt_bytes(_MAX_YAML_BYTES)}, which no data "
            "YAML is; check train.data"
        )
    try:
        config = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or exc
        raise StagingError(
            f"the data YAML {path} is not valid YAML ({_one_line(str(problem), 120)}{where}); "
            "fix the file"
        ) from None
    except (RecursionError, ValueError) as exc:
        raise StagingError(
            f"the data YAML {path} cannot be read ({type(exc).__name__}); fix the file"
        ) from None
    if not isinstance(config, dict):
        raise StagingError(
            f"the data YAML {path} holds a {type(config).__name__}, not keys like path, train, "
            "val and names; fix the file"
        )
    return config


def _dataset_root(config: Mapping[str, Any], yaml_path: Path) -> tuple[Path, str | None]:
    """The dataset root as LibreYOLO 1.6.0 resolves it, and why when that is not next to the
    YAML although the YAML's folder has it (or neither has it).

    Mirrors ``_resolve_dataset_path`` in ``libreyolo/data/utils.py``: no ``path`` means the
    YAML's folder; an absolute one is used as is; a relative one is taken from
    ``$LIBREYOLO_DATASETS_DIR`` (default ``~/datasets``) when it exists there, even ``path: .``
    (the whole datasets folder), then next to the YAML, else from the datasets folder again.
    """
    if "path" not in config:
        return yaml_path.parent, None
    raw = config["path"]
    if not isinstance(raw, str):
        raise StagingError(
            f"path in the data YAML {yaml_path} is {_show(str(raw))}, not a folder; fix the file"
        )
    given = Path(raw)
    if given.is_absolute():
        return given, None
    datasets = Path(os.environ.get(_LIBREYOLO_DATASETS_ENV, os.path.expanduser("~/datasets")))
    candidate = datasets / given
    beside = yaml_path.parent / given
    if not candidate.exists() and beside.exists():
        return beside.resolve(), None
    if candidate.exists() and (
        not beside.exists() or os.path.realpath(candidate) == os.path.realpath(beside)
    ):
        return candidate, None
    return candidate, (
        f"LibreYOLO takes a relative path from {_LIBREYOLO_DATASETS_ENV} ({datasets}) first"
    )


def _yaml_paths(
    config: Mapping[str, Any], root: Path, yaml_path: Path
) -> list[tuple[str, str, Path]]:
    """(key, value as written, where it points) for every path the data YAML names."""
    out: list[tuple[str, str, Path]] = []
    if "path" in config:
        out.append(("path", str(config["path"]), root))

    def add(key: str, value: object) -> None:
        if isinstance(value, str) and value:
            given = Path(value)
            out.append((key, value, given if given.is_absolute() else root / given))

    for key in _SPLIT_KEYS:
        value = config.get(key)
        if isinstance(value, list):
            for i, item in enumerate(value):
                add(f"{key}[{i}]", item)
        else:
            add(key, value)
    annotations = config.get("annotations")
    if isinstance(annotations, dict):
        for split in _SPLIT_KEYS:
            add(f"annotations.{split}", annotations.get(split))
    return out


def _check_inside(
    yaml_path: Path,
    config: Mapping[str, Any],
    root: Path,
    via: str | None,
    staged_root: Path,
) -> None:
    """Raise unless every path of a staged data YAML stays inside ``staged_root``."""
    outside: list[str] = []
    root_inside = _inside(root, staged_root)
    for key, value, target in _yaml_paths(config, root, yaml_path):
        if key != "path" and not root_inside and not Path(value).is_absolute():
            continue  # relative to an outside path:, which is named already
        if not _inside(target, staged_root):
            why = f" ({via})" if key == "path" and via else ""
            outside.append(f"{key} {_show(value)} resolves to {os.path.realpath(target)}{why}")
        elif key != "path" and target.suffix.lower() == ".txt" and target.is_file():
            outside.extend(_list_outside(key, target, staged_root))
    if outside:
        shown = "; ".join(outside[:5])
        if len(outside) > 5:
            shown += f"; and {len(outside) - 5} more"
        raise StagingError(
            f"the data YAML {yaml_path} points outside the staged dataset {staged_root}: "
            f"{shown}; fix the YAML so its paths stay inside {staged_root} (relative ones, or "
            "no path: key to use the YAML's folder), or set dataset.allow_outside_paths = true "
            "to allow it"
        )


def _list_outside(key: str, listing: Path, staged_root: Path) -> list[str]:
    """Lines of an image list file (``train: train.txt``) that point outside ``staged_root``.

    LibreYOLO reads one image path per line, relative to the list's folder. A list of 100k
    images names a few folders: each folder is resolved once.
    """
    out: list[str] = []
    try:
        with open(listing, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read(_MAX_LIST_BYTES)
    except OSError:
        return out  # the doctor, or the trainer, says what is wrong with it
    folders: dict[str, bool] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        target = os.path.join(listing.parent, line)
        folder, name = os.path.split(target)
        if name in ("", ".", "..") or os.path.islink(target):
            inside = _inside(Path(target), staged_root)
        else:
            if folder not in folders:
                folders[folder] = _inside(Path(folder), staged_root)
            inside = folders[folder]
        if not inside:
            out.append(
                f"{key} list {listing.name} line {number} {_show(line)} resolves to "
                f"{os.path.realpath(target)}"
            )
            if len(out) > 5:
                break  # enough to show; the message counts no further
    return out


def _inside(path: Path, root: Path) -> bool:
    """``path`` is ``root`` or below it once every symlink is followed."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return os.path.commonpath([real_root, real]) == real_root


def _parse_json_object(text: str) -> dict[str, Any] | None:
    text = text.strip()
    candidates = [text] + [
        line for line in reversed(text.splitlines()) if line.lstrip().startswith("{")
    ]
    for c in candidates:
        try:
            value = json.loads(c)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _trim_findings(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    for f in report.get("findings") or []:
        if not isinstance(f, dict):
            continue
        f = dict(f)
        paths = f.get("paths")
        if isinstance(paths, list) and len(paths) > _MAX_FINDING_PATHS:
            f["paths"] = paths[:_MAX_FINDING_PATHS]
            f["paths_truncated"] = len(paths) - _MAX_FINDING_PATHS
        out.append(f)
    return out


# --------------------------------------------------------------------------------------------
# Small helpers


def _show(name: str) -> str:
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _redact(text: str, token: str | None) -> str:
    return text.replace(token, "***") if token else text


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _int_or_zero(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
