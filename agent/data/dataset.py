"""Staging: download the dataset archive from the Hugging Face Hub, unpack it, check its data YAML.

The daemon calls :func:`stage_dataset` in its STAGING phase (from a worker thread). It is
idempotent: a marker file inside ``dest`` records what was staged, and a restarted agent with the
same ``[dataset]`` settings finds it and neither contacts the Hub nor unpacks again, so an offline
restart works.

The archive is never trusted: :mod:`agent.data.archive` checks every member before anything is
written and builds the tree beside ``dest``, renaming it into place only when complete (with
the marker inside). A new archive replaces an earlier staging only once it passed those checks.

The data YAML is then found (:func:`find_data_yaml`) and checked by :mod:`agent.data.datacheck`
(paths inside the staged folder, ``libreyolo doctor``); :class:`StagingError`,
:class:`DoctorError` and :func:`check_data_yaml` are re-exported from there for the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agent import hub
from agent.config.model import DatasetSection, Env
from agent.data.archive import (
    MAX_EXPANSION_RATIO,
    SUPPORTED_FORMATS,
    ArchiveError,
    archive_format,
    disk_free,
    leftovers,
    plan_unpack,
    scratch_prefix,
    unpack,
)
from agent.data.datacheck import DoctorError, StagingError, check_data_yaml
from agent.preflight import DISK_HEADROOM
from agent.sinks.digests import sha256_file
from agent.util.text import format_bytes

__all__ = [
    "MARKER_NAME",
    "DoctorError",
    "StageResult",
    "StagingError",
    "check_data_yaml",
    "find_data_yaml",
    "read_marker",
    "stage_dataset",
]

#: File inside ``dest`` that records what was staged there (JSON, see :func:`read_marker`).
MARKER_NAME = ".libreyolo-agent-staged.json"
MARKER_FORMAT = 1

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Results


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


# --------------------------------------------------------------------------------------------
# Staging


def stage_dataset(
    ds: DatasetSection,
    env: Env,
    *,
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
    ``max_ratio`` and ``free_space`` are those of :func:`agent.data.archive.safe_unpack`.
    Raises :class:`StagingError` (``DoctorError`` for doctor errors; for an archive that cannot
    be unpacked, its :class:`agent.data.archive.ArchiveError` - ``UnsafeArchiveError`` for a hostile
    one - is the ``__cause__``).
    """
    dest = Path(os.path.abspath(ds.dest))
    if archive_format(ds.file) is None:
        raise StagingError(
            f"dataset.file {ds.file!r} is not a supported archive; pack the dataset as "
            f"{SUPPORTED_FORMATS}"
        )
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
        return _finish(result, ds, data_yaml, checks)

    # The marker's name is ours: whatever it says, the directory was staged by an agent.
    ours = os.path.lexists(dest / MARKER_NAME)
    _check_dest_usable(dest, ours=ours)
    _remove_leftovers(dest)

    log.info(
        "staging: downloading %s/%s@%s from %s", ds.repo, ds.file, ds.revision, env.hf_endpoint
    )
    started = time.monotonic()
    archive = _download(ds, env)
    commit = _commit_from_cache_path(archive, ds.file)
    size = archive.stat().st_size
    sha256 = sha256_file(archive)
    log.info(
        "staging: downloaded %s (%s, commit %s, sha256 %s) in %.1fs",
        ds.file,
        format_bytes(size),
        commit or "unknown",
        sha256[:12],
        time.monotonic() - started,
    )

    with _archive_errors():
        plan = plan_unpack(archive, dest, max_ratio=max_ratio)
    if ours:
        # Another dataset (or a broken staging) of ours is in the way. Renaming it aside is
        # atomic, so a crash during the slow removal leaves only a leftover for the next start.
        log.info("staging: removing the previous staging in %s", dest)
        old = dest.parent / f"{scratch_prefix(dest)}old-{os.getpid()}-{time.monotonic_ns()}"
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
    with _archive_errors():
        written = unpack(
            plan,
            free_space=free_space or disk_free,
            headroom=DISK_HEADROOM,
            on_ready=lambda tmp: _write_marker(tmp, record),
        )
    log.info(
        "staging: unpacked %d files (%s) into %s in %.1fs",
        plan.files,
        format_bytes(written),
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
    return _finish(result, ds, data_yaml, checks)


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


def _remove_leftovers(dest: Path) -> None:
    """Remove temporary siblings a crashed earlier unpack left behind (they only cost disk)."""
    for p in leftovers(dest):
        log.info("staging: removing the leftover %s of an interrupted unpack", p)
        shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def _archive_errors() -> Iterator[None]:
    """The unpacker's errors, as staging's: same line, never retried (the same bytes fail the
    same way); the original stays the ``__cause__``."""
    try:
        yield
    except ArchiveError as exc:
        raise StagingError(str(exc)) from exc


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
        path = hub.api(env).hf_hub_download(
            ds.repo, ds.file, repo_type="dataset", revision=ds.revision, cache_dir=cache_dir
        )
    except Exception as exc:
        raise _hub_error(exc, ds, env, cache_dir) from None
    return Path(str(path))


def _hub_error(
    exc: BaseException, ds: DatasetSection, env: Env, cache_dir: Path | None
) -> StagingError:
    """Turn what the download raised into one line that says what to do (retryable as
    :func:`agent.hub.classify` decides)."""
    token = env.hf_token
    failure = hub.classify(exc, token=token)
    repo = f"dataset repo {ds.repo!r}"
    where = env.hf_endpoint
    tokens_url = f"{where}/settings/tokens"
    match failure.kind:
        case "gated" if token is None:
            msg = (
                f"{repo} on {where} is gated; set HF_TOKEN to a read token of an account that "
                "was granted access"
            )
        case "gated":
            msg = (
                f"{repo} on {where} is gated and HF_TOKEN's account has no access; request "
                f"access at {where}/datasets/{ds.repo}"
            )
        case "missing_repo" if token is None:
            msg = (
                f"{repo} was not found on {where}, or it is private and HF_TOKEN is not set; "
                "check dataset.repo, or set HF_TOKEN to a read token that can see it"
            )
        case "missing_repo":
            msg = (
                f"{repo} was not found on {where}, or HF_TOKEN has no access to it; "
                "check dataset.repo and the token's permissions"
            )
        case "missing_revision":
            msg = (
                f"revision {ds.revision!r} was not found in {repo}; check dataset.revision "
                "(a branch, tag or commit)"
            )
        case "missing_file":
            msg = (
                f"file {ds.file!r} was not found in {repo} at revision {ds.revision!r}; check "
                "dataset.file (the archive's path inside the repo)"
            )
        case "unauthorized" if token is None:
            msg = (
                f"{where} asks for authentication to read {repo}; set HF_TOKEN to a read token "
                f"({tokens_url})"
            )
        case "unauthorized":
            msg = (
                f"HF_TOKEN was rejected by {where} (401); create a read token at {tokens_url} "
                "and set HF_TOKEN to it"
            )
        case "forbidden" if token is None:
            msg = (
                f"{where} refused access to {repo} (403); set HF_TOKEN to a read token with access"
            )
        case "forbidden":
            msg = f"HF_TOKEN may not read {repo} (403); use a token with read access ({tokens_url})"
        case "rate_limited" | "transient":
            wait = failure.retry_after_s
            hint = f", it asks to wait {wait:g} s" if wait is not None else ""
            msg = (
                f"the Hugging Face Hub at {where} answered {failure.status} for {repo}; it is "
                f"busy or down{hint} (retryable)"
            )
        case "rejected":
            msg = (
                f"the Hugging Face Hub at {where} rejected the download of {ds.file!r} of "
                f"{repo}: {failure.detail}"
            )
        case "offline":
            msg = (
                f"HF_HUB_OFFLINE is set and {ds.file!r} of {repo} is not in the download cache; "
                "unset HF_HUB_OFFLINE"
            )
        case "not_a_hub":
            msg = (
                f"{where} did not answer like a Hugging Face Hub ({failure.detail}); check "
                "HF_ENDPOINT and any proxy"
            )
        case "invalid" if isinstance(failure.cause, ValueError):
            msg = f"invalid dataset settings: {failure.detail}; check dataset.repo and dataset.file"
        case "invalid":
            msg = (
                f"the Hub client refused to send the request ({failure.detail}); check HF_TOKEN "
                "and HF_ENDPOINT"
            )
        case "unreachable":
            msg = (
                f"cannot reach the Hugging Face Hub at {where} while downloading {ds.file!r} "
                f"({failure.detail}); check the box's network (retryable)"
            )
        case "local":
            msg = _local_error(failure, ds, cache_dir)
        case _:
            msg = f"download of {ds.file!r} from {repo} failed: {failure.detail} (retryable)"
    return StagingError(hub.redact(msg, token), retryable=failure.retryable)


def _local_error(failure: hub.HubFailure, ds: DatasetSection, cache_dir: Path | None) -> str:
    """This machine failed the download (disk, permissions of the download cache)."""
    cache = str(cache_dir) if cache_dir is not None else "the Hugging Face cache"
    code = failure.cause.errno if isinstance(failure.cause, OSError) else None
    if code in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"no space left while downloading {ds.file!r} into {cache}; free disk space or set "
            "HF_HOME to a bigger volume"
        )
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write the download cache {cache} ({failure.detail}); check HF_HOME"
    return f"download of {ds.file!r} failed ({failure.detail}) (retryable)"


def _commit_from_cache_path(path: Path, filename: str) -> str | None:
    """The cache keeps files at ``.../snapshots/<commit>/<filename>``: read the commit there."""
    depth = len([p for p in filename.split("/") if p])
    parts = path.parts
    if len(parts) < depth + 2 or parts[-depth - 2] != "snapshots":
        return None
    commit = parts[-depth - 1]
    return commit if re.fullmatch(r"[0-9a-f]{40}", commit) else None


# --------------------------------------------------------------------------------------------
# Finding the data YAML

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


# --------------------------------------------------------------------------------------------
# Small helpers


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _int_or_zero(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
