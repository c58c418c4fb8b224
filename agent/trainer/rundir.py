"""Reading LibreYOLO's run directory: ``status.json``, ``metrics.jsonl``, ``weights/``.

Facts this rests on (LibreYOLO 1.6.0): status.json is replaced atomically at train start, at each
epoch end, at train end and on an exception; checkpoints are written in place and *before* that
epoch's status.json, so ``completed_epochs = N`` means epoch N's weights are complete. SIGTERM
leaves ``state: running`` behind, so the state is never trusted without checking the pid.
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

STATUS = "status.json"
METRICS = "metrics.jsonl"
SMALL_FILES = ("status.json", "metrics.jsonl", "summary.json", "results.csv", "train.log")
_EPOCH_FILE = re.compile(r"epoch_(\d+)\.pt$")


@dataclass(frozen=True)
class RunStatus:
    """The parts of status.json the agent relies on, plus the raw document."""

    state: str
    pid: int | None
    save_dir: str | None
    completed_epochs: int
    total_epochs: int | None
    current_epoch: int | None
    eta_seconds: float | None
    best_epoch: int | None
    best_metric: float | None
    error_type: str | None
    error_message: str | None
    updated_at: str | None
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunStatus:
        err = d.get("error") if isinstance(d.get("error"), dict) else None

        def num(key: str) -> float | None:
            v = d.get(key)
            return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

        def integer(key: str) -> int | None:
            v = d.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        completed = integer("completed_epochs")
        current = integer("current_epoch")
        if completed is None and current is not None:
            # The failure write (SIGINT, exception) has only the epoch that was running.
            completed = max(current - 1, 0)
        start = integer("start_epoch")
        if d.get("state") == "completed" and completed is not None and start and start > 1:
            # LibreYOLO 1.6.0's train-end write counts this invocation's epochs only: a run
            # resumed at epoch 3 of 4 ends with completed_epochs = 2 (every other write, and
            # metrics.jsonl, count from epoch 1).
            completed += start - 1
        return cls(
            state=str(d.get("state", "unknown")),
            pid=integer("pid"),
            save_dir=d.get("save_dir") if isinstance(d.get("save_dir"), str) else None,
            completed_epochs=completed or 0,
            total_epochs=integer("total_epochs"),
            current_epoch=integer("current_epoch"),
            eta_seconds=num("eta_seconds"),
            best_epoch=integer("best_epoch"),
            best_metric=num("best_metric"),
            error_type=str(err.get("type")) if err and err.get("type") else None,
            error_message=str(err.get("message"))
            if err and err.get("message") is not None
            else None,
            updated_at=d.get("updated_at") if isinstance(d.get("updated_at"), str) else None,
            raw=d,
        )


def read_status(run_dir: Path) -> RunStatus | None:
    """status.json of ``run_dir``; None when it is missing or unreadable (never raises)."""
    try:
        data = json.loads((run_dir / STATUS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return RunStatus.from_dict(data)


def pid_alive(pid: int | None, create_time: float | None = None) -> bool:
    """True when ``pid`` runs and, if given, was created at ``create_time`` (pids are reused)."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(proc.create_time() - create_time) <= 0.01
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def effective_state(status: RunStatus, *, alive: bool) -> str:
    """``running`` only when the trainer is really alive: a SIGTERM/SIGKILL leaves ``running``."""
    if status.state == "running" and not alive:
        return "dead"
    return status.state


def find_run_dir(runs_dir: Path, pids: set[int], *, newer_than: float = 0.0) -> Path | None:
    """The run dir whose status.json names one of ``pids``: LibreYOLO may rename ``run1`` to
    ``run12``, so the real directory is read from status.json, never assumed."""
    try:
        candidates = [p for p in runs_dir.iterdir() if p.is_dir()]
    except OSError:
        return None
    best: tuple[float, Path] | None = None
    for d in candidates:
        try:
            mtime = (d / STATUS).stat().st_mtime
        except OSError:
            continue
        if mtime < newer_than:
            continue
        st = read_status(d)
        if st is None or st.pid not in pids:
            continue
        real = Path(st.save_dir) if st.save_dir else d
        if best is None or mtime > best[0]:
            best = (mtime, real)
    return best[1] if best else None


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows; a torn last line (written while we read) is skipped."""
    rows: list[dict[str, Any]] = []
    try:
        text = (run_dir / METRICS).read_text(encoding="utf-8")
    except OSError:
        return rows
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def epoch_snapshots(run_dir: Path) -> dict[int, Path]:
    """``weights/epoch_N.pt`` files by N (LibreYOLO's ``save_period``)."""
    out: dict[int, Path] = {}
    try:
        for p in (run_dir / "weights").iterdir():
            m = _EPOCH_FILE.fullmatch(p.name)
            if m:
                out[int(m.group(1))] = p
    except OSError:
        pass
    return out


def is_epoch_file(name: str) -> bool:
    """``epoch_N.pt``: a ``save_period`` checkpoint."""
    return _EPOCH_FILE.fullmatch(name) is not None


def is_valid_checkpoint(path: Path) -> bool:
    """A ``.pt`` is a zip archive: a torn or truncated copy fails this without importing torch."""
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return False


def run_dir_from_result(result: dict[str, Any] | None) -> Path | None:
    """``save_dir`` of the trainer's ``json=true`` result."""
    if result and isinstance(result.get("save_dir"), str):
        return Path(result["save_dir"])
    return None


def find_dead_run_dir(
    runs_dir: Path, pid: int, started_at: float, result: dict[str, Any] | None
) -> Path | None:
    """The run dir of a trainer that is gone: the one whose status.json names its pid (written
    after it started), else its json result's ``save_dir``."""
    return find_run_dir(runs_dir, {pid}, newer_than=started_at - 5) or run_dir_from_result(result)
