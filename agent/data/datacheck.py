"""The check of every job's data YAML, staged or local, before the trainer starts.

:func:`check_data_yaml`: the YAML is readable, the paths in a staged one stay inside the staged
folder (resolved as LibreYOLO 1.6.0 resolves them, symlinks followed), and ``libreyolo doctor``
finds no errors (:func:`run_doctor`).

:class:`StagingError` lives here, below ``agent.data.dataset``, because the STAGING phase reports
this check's failures and staging's own with one type: both modules raise it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml  # type: ignore[import-untyped,unused-ignore]

from agent.install.libreyolo import find_libreyolo
from agent.util.text import format_bytes, one_line, show

__all__ = [
    "DataCheck",
    "DoctorError",
    "DoctorStatus",
    "StagingError",
    "check_data_yaml",
    "run_doctor",
]

#: Doctor findings keep at most this many example paths each (a broken dataset of 100k images
#: would otherwise produce a report of megabytes).
_MAX_FINDING_PATHS = 20
#: Environment variables that a child process never needs to see.
_SECRET_ENV = ("HF_TOKEN", "CONTAINER_API_KEY", "VAST_API_KEY", "RUNPOD_API_KEY", "LAMBDA_API_KEY")
#: A data YAML is a page of text; anything bigger is not one.
_MAX_YAML_BYTES = 16 << 20
#: Image list files (``train: train.txt``) read for the path check, at most.
_MAX_LIST_BYTES = 64 << 20
#: Where LibreYOLO 1.6.0 looks first for a relative ``path:`` (``libreyolo/data/utils.py``).
_LIBREYOLO_DATASETS_ENV = "LIBREYOLO_DATASETS_DIR"
#: Keys of a data YAML that hold paths (``annotations`` maps splits to COCO JSON files).
_SPLIT_KEYS = ("train", "val", "test")

# These lines were agent.data.dataset's before the check had a module of its own; they still are,
# so a log read or filtered by logger name finds them where it always did.
log = logging.getLogger(__name__)


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


class DoctorError(StagingError):
    """``libreyolo doctor`` found errors; ``report`` is its JSON, ``findings`` its findings."""

    def __init__(self, message: str, report: Mapping[str, Any]) -> None:
        super().__init__(message, retryable=False, findings=_trim_findings(report))
        self.report = dict(report)


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
    #: ``libreyolo doctor`` JSON report (each finding's ``paths`` cut to 20, the rest counted in
    #: ``paths_truncated``), or None when the doctor did not run.
    doctor: dict[str, Any] | None = None
    #: Lines to show the user: doctor warnings as ``"check_id: message"``, and the agent's own
    #: (doctor skipped, ``path:`` taken from LIBREYOLO_DATASETS_DIR...).
    warnings: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# The doctor and the check


def run_doctor(
    data_yaml: Path,
    *,
    timeout_s: float = 600,
    exe: str | None = None,
    started: Callable[[subprocess.Popen[str]], object] | None = None,
) -> dict[str, Any]:
    """Run ``libreyolo doctor DATA json=true`` and return its JSON report.

    The report has ``summary`` (``errors``, ``warnings``, ``infos``), ``findings`` (each with
    ``check_id``, ``severity``, ``message``...) and ``exit_code`` (0 healthy, 1 errors). Raises
    :class:`StagingError` when the doctor cannot be run or gives no report (e.g. exit 3, data
    not found); judging the report is the caller's business (:func:`check_data_yaml` does).
    ``exe`` is the libreyolo command; by default the one next to this Python, else on PATH.
    ``started`` gets the doctor's process as soon as it runs: killing it ends this call (with a
    :class:`StagingError`), which is how a doctor beside the trainer is cancelled.
    """
    exe = exe or find_libreyolo()
    if exe is None:
        raise StagingError(
            f"the libreyolo command was not found next to {sys.executable} or on PATH; install the "
            "training stack (pip install libreyolo==1.6.0) or set dataset.doctor = false"
        )
    env = {k: v for k, v in os.environ.items() if k not in _SECRET_ENV}
    # data=PATH rather than a positional: a path holding '=' would read as key=value.
    cmd = [exe, "doctor", f"data={data_yaml}", "json=true"]
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=env,
            cwd=data_yaml.parent if data_yaml.parent.is_dir() else None,
            start_new_session=True,  # killed as a group (a doctor beside the trainer)
        )
    except OSError as exc:
        raise StagingError(
            f"cannot run {exe} ({exc.strerror or exc}); check the libreyolo install"
        ) from None
    with proc:
        if started is not None:
            started(proc)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise StagingError(
                f"libreyolo doctor did not finish within {timeout_s:g}s on {data_yaml}; set "
                "dataset.doctor = false to skip it"
            ) from None
    report = _parse_json_object(stdout)
    if report is None:
        tail = one_line(stderr.strip().splitlines()[-1] if stderr.strip() else "no output", 200)
        raise StagingError(
            f"libreyolo doctor exited {proc.returncode} without a JSON report on {data_yaml} "
            f"({tail}); run it by hand to see why, or set dataset.doctor = false"
        )
    report.setdefault("exit_code", proc.returncode)
    if not isinstance(report.get("summary"), dict):
        message = one_line(str(report.get("message") or report.get("error") or "no summary"), 200)
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
    find_libreyolo: Callable[[], str | None] = find_libreyolo,
    started: Callable[[subprocess.Popen[str]], object] | None = None,
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
            f"path {show(str(config['path']), 80)} in {path} resolves to {root}, not to {beside}: "
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
    began = time.monotonic()
    report = run_doctor(path, timeout_s=timeout_s, exe=exe, started=started)
    # Keep the report small enough for state files and /status (see _MAX_FINDING_PATHS).
    report["findings"] = _trim_findings(report)
    summary = report.get("summary")
    errors = _int_or_zero(summary.get("errors")) if isinstance(summary, dict) else 0
    findings = [f for f in report.get("findings") or [] if isinstance(f, dict)]
    if errors or report.get("exit_code") not in (0, None):
        bad = [f for f in findings if f.get("severity") == "error"]
        text = " | ".join(
            f"{f.get('check_id', '?')}: {one_line(str(f.get('message', '')))}" for f in bad[:5]
        )
        if len(bad) > 5:
            text += f" | and {len(bad) - 5} more"
        # Not logged here: the error says it, and its caller logs it (staging.check_data).
        fix = "fix the dataset and upload a new archive" if staged else "fix the dataset"
        raise DoctorError(
            f"libreyolo doctor found {errors or len(bad)} error(s) in {path}: "
            f"{text or 'see findings'}; {fix}, or set dataset.doctor = false to train anyway",
            report,
        )
    found = [
        f"{f.get('check_id', '?')}: {one_line(str(f.get('message', '')))}"
        for f in findings
        if f.get("severity") == "warning"
    ]
    log.info(
        "dataset: doctor passed %s (%d warnings) in %.1fs",
        path,
        len(found),
        time.monotonic() - began,
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


# --------------------------------------------------------------------------------------------
# Reading the YAML, and where its paths lead


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
            f"the data YAML {path} is larger than {format_bytes(_MAX_YAML_BYTES)}, which no data "
            "YAML is; check train.data"
        )
    try:
        config = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or exc
        raise StagingError(
            f"the data YAML {path} is not valid YAML ({one_line(str(problem), 120)}{where}); "
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
            f"path in the data YAML {yaml_path} is {show(str(raw), 80)}, not a folder; fix the file"
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
            outside.append(f"{key} {show(value, 80)} resolves to {os.path.realpath(target)}{why}")
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
                f"{key} list {listing.name} line {number} {show(line, 80)} resolves to "
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


# --------------------------------------------------------------------------------------------
# The doctor's report


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


def _int_or_zero(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
