"""What the guard (agent/guard/run.py) saves before its teardown, and the notices it sends.

Imported by the guard only when it acts, never while it waits: it pulls in the trainer's process
handling (psutil), the job file's parser, the sinks (the Hub client for ``hf://``) and the
webhook notifier, which a guard that only watches a heartbeat must not carry in memory.

:func:`rescue`, within a bounded time (the job's ``train.stop_grace`` + ``kill_grace`` for the
trainer, then ``LIBREYOLO_AGENT_GUARD_SAVE_TIMEOUT``, default 10 min, for the upload):

1. stops the trainer recorded in state.json - only once its pid AND create time match (a pid
   reused by another process is never signalled) - with SIGINT (LibreYOLO's clean stop, which
   writes ``last.pt``), then SIGTERM, then SIGKILL to its whole tree, as the agent does;
2. uploads the newest ``weights/last.pt`` to the job's ``[sync]`` target with the agent's own sink
   code (agent/sinks/), and reads it back (size and sha256 must match the file on disk); a
   version the agent's ledger already holds verified is not sent again;
3. returns what it did and what it could not save (the other checkpoints the ledger does not
   hold verified), for guard.json, state.json, the log and a notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from agent.config.jobvalues import ConfigError, parse_duration
from agent.config.model import Env, Job
from agent.guard.plan import SAVE_TIMEOUT_ENV
from agent.state import RunState

log = logging.getLogger(__name__)

#: Seconds the guard's upload of ``last.pt`` (with its read-back) may take before the teardown
#: goes ahead without it.
DEFAULT_SAVE_TIMEOUT_S = 600.0
LAST = "weights/last.pt"
BEST = "weights/best.pt"
_LEDGER_FILE = "sync-ledger.json"


def save_timeout_s(environ: dict[str, str] | None = None) -> float:
    """``LIBREYOLO_AGENT_GUARD_SAVE_TIMEOUT`` (a duration), else the default; a bad value is
    said and the default used (the guard must not fail on it)."""
    raw = (os.environ if environ is None else environ).get(SAVE_TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_SAVE_TIMEOUT_S
    try:
        return parse_duration(SAVE_TIMEOUT_ENV, raw)
    except ConfigError as exc:
        log.error("guard: %s; using %.0fs", exc, DEFAULT_SAVE_TIMEOUT_S)
        return DEFAULT_SAVE_TIMEOUT_S


def read_job(job_file: str | None) -> tuple[Job | None, str | None]:
    """The job the agent ran (its ``[sync]``, ``[train]`` graces and ``[notify]``), re-read from
    its file; ``(None, why)`` when it cannot be read."""
    if not job_file:
        return None, "the plan names no job file"
    from agent.config.jobfile import parse_job

    path = Path(job_file)
    try:
        text = path.read_text(encoding="utf-8-sig")
        return parse_job(text, source=str(path), base_dir=path.parent), None
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"cannot read the job file {path}: {exc}"
    except ConfigError as exc:
        return None, f"the job file {path} no longer parses: {exc}"


# --------------------------------------------------------------------------- the trainer


async def stop_trainer(state: RunState | None, job: Job | None) -> dict[str, Any]:
    """Stop the trainer state.json records, once its identity is checked."""
    record = state.trainer if state is not None else None
    if record is None:
        return {"stopped": False, "why": "state.json records no trainer"}
    from agent.trainer.process import Trainer
    from agent.trainer.rundir import pid_alive

    if not pid_alive(record.pid, record.create_time):
        return {
            "pid": record.pid,
            "stopped": False,
            "why": f"trainer pid {record.pid} (created {record.create_time:.2f}) is not running",
        }
    trainer = Trainer.attach(record)
    if trainer is None:
        return {"pid": record.pid, "stopped": False, "why": "the trainer ended meanwhile"}
    stop_grace = job.train.stop_grace_s if job is not None else 60.0
    kill_grace = job.train.kill_grace_s if job is not None else 10.0
    log.warning(
        "guard: stopping trainer pid %d (identity checked: create time %.2f): SIGINT, then "
        "SIGTERM after %.0fs, SIGKILL after %.0fs more",
        record.pid,
        record.create_time,
        stop_grace,
        kill_grace,
    )
    signal_used = await trainer.stop(stop_grace_s=stop_grace, kill_grace_s=kill_grace)
    log.warning("guard: trainer pid %d stopped (%s)", record.pid, signal_used)
    return {"pid": record.pid, "stopped": True, "signal": signal_used}


# --------------------------------------------------------------------------- last.pt


def newest_last(state: RunState | None, job: Job | None) -> Path | None:
    """The trainer's run's ``weights/last.pt``, else the newest of the job's runs."""
    candidates: list[Path] = []
    if state is not None and state.trainer is not None and state.trainer.run_dir:
        candidates.append(Path(state.trainer.run_dir) / LAST)
    if job is not None:
        with contextlib.suppress(OSError):
            from glob import escape

            candidates += job.job.runs_dir.glob(f"{escape(job.job.name)}*/{LAST}")
    found = []
    for path in candidates:
        with contextlib.suppress(OSError):
            found.append((path.stat().st_mtime, path))
    return max(found)[1] if found else None


def _ledger(state_dir: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads((state_dir / _LEDGER_FILE).read_text(encoding="utf-8"))
        return {str(e["remote_path"]): e for e in data.get("entries", [])}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def _verified(entry: dict[str, Any] | None, sha256: str | None, size: int) -> bool:
    return bool(
        entry
        and entry.get("status") == "verified"
        and entry.get("size") == size
        and (sha256 is None or entry.get("sha256") == sha256)
    )


def _upload_and_verify(job: Job, env: Env, local: Path, remote_path: str) -> dict[str, Any]:
    """Blocking: upload ``local`` as ``remote_path`` and read it back."""
    from agent.sinks.digests import sha256_file
    from agent.sinks.target import make_sink

    assert job.sync is not None
    if job.sync.scheme == "hf":
        from agent import hub

        hub.configure(env)  # the agent's timeouts for the Hub client, as at its own start
    size = local.stat().st_size
    digest = sha256_file(local)
    sink = make_sink(job.sync, env)
    sink.prepare()
    sink.upload(local, remote_path)
    remote = sink.stat(remote_path)
    if remote is None or remote.size != size or remote.sha256 != digest:
        got = "nothing" if remote is None else f"{remote.size} bytes sha256 {remote.sha256[:12]}"
        raise RuntimeError(
            f"read-back of {remote_path} found {got}, expected {size} bytes {digest[:12]}"
        )
    return {"sha256": digest, "size": size, "target": sink.description, "verified_at": time.time()}


def _others_unsaved(run_dir: Path, ledger: dict[str, dict[str, Any]]) -> list[str]:
    """Checkpoints of the run other than last.pt that the target does not hold verified (by the
    agent's ledger: same size; ``best.pt``, rewritten in place, same sha256 too)."""
    from agent.sinks.digests import sha256_file

    out = []
    with contextlib.suppress(OSError):
        for path in sorted((run_dir / "weights").glob("*.pt")):
            if path.name == "last.pt":
                continue
            remote = f"weights/{path.name}"
            entry = ledger.get(remote)
            with contextlib.suppress(OSError):
                size = path.stat().st_size
                digest = sha256_file(path) if path.name == "best.pt" and entry else None
                if not _verified(entry, digest, size):
                    out.append(remote)
    return out


async def rescue(
    state: RunState | None,
    job: Job | None,
    job_problem: str | None,
    env: Env,
    state_dir: Path,
    *,
    timeout_s: float,
    clock: Callable[[], float] = time.time,
) -> dict[str, Any]:
    """Stop the trainer, then upload the newest ``last.pt`` with read-back, then ``best.pt``
    (unless the agent's ledger holds that very version verified) with what is left of
    ``timeout_s``; what was saved and what was not. Never raises: a failure is recorded in the
    result."""
    report: dict[str, Any] = {"started_at": clock(), "unsaved": []}
    try:
        report["trainer"] = await stop_trainer(state, job)
    except Exception as exc:  # the teardown must not wait on a bug here
        report["trainer"] = {"stopped": False, "why": f"{type(exc).__name__}: {exc}"}
        log.exception("guard: stopping the trainer failed")
    report["trainer_done_at"] = clock()
    last = newest_last(state, job)
    ledger = _ledger(state_dir)
    if last is None:
        report["last_pt"] = {"saved": False, "why": "no last.pt on this box"}
    elif job is None or job.sync is None:
        why = job_problem or "the job has no [sync] target"
        report["last_pt"] = {"path": str(last), "saved": False, "why": why}
        report["unsaved"].append(LAST)
    else:
        report["last_pt"] = await _save(job, env, last, ledger, timeout_s, LAST)
        if not report["last_pt"].get("saved"):
            report["unsaved"].append(LAST)
        best = last.parent / "best.pt"
        left = timeout_s - (clock() - report["trainer_done_at"])
        if best.is_file() and left > 1:
            report["best_pt"] = await _save(job, env, best, ledger, left, BEST)
    if last is not None:
        saved_best = (report.get("best_pt") or {}).get("saved")
        report["unsaved"] += [
            p for p in _others_unsaved(last.parent.parent, ledger) if not (p == BEST and saved_best)
        ]
    report["finished_at"] = clock()
    return report


async def _save(
    job: Job,
    env: Env,
    last: Path,
    ledger: dict[str, dict[str, Any]],
    timeout_s: float,
    remote_path: str,
) -> dict[str, Any]:
    """Upload ``last`` as ``remote_path`` and read it back, unless the agent's ledger already
    holds this very version verified there."""
    entry = ledger.get(remote_path)
    try:
        size = last.stat().st_size
        from agent.trainer.rundir import is_valid_checkpoint

        if not await asyncio.to_thread(is_valid_checkpoint, last):
            # Seen on an H200: the guard's SIGINT landed while LibreYOLO rewrote last.pt in
            # place, which left 665 bytes of a zip. Uploaded, it would have replaced the copy
            # the agent verified on the target: a torn file is never sent.
            why = (
                f"{last} is not a complete checkpoint ({size} bytes, not a whole zip: torn while "
                "the trainer wrote it?); not uploaded, so the target keeps the copy it holds"
            )
            log.error("guard: %s", why)
            return {"path": str(last), "saved": False, "torn": True, "why": why}
        if entry is not None and entry.get("size") == size:
            from agent.sinks.digests import sha256_file

            digest = await asyncio.to_thread(sha256_file, last)
            if _verified(entry, digest, size):
                log.info("guard: %s is already verified on the target (the agent's ledger)", last)
                return {
                    "path": str(last),
                    "saved": True,
                    "verified": True,
                    "already": True,
                    "verified_at": time.time(),
                }
        log.warning(
            "guard: uploading %s (%d bytes) to %s", last, size, job.sync and job.sync.target
        )
        done = await asyncio.wait_for(
            asyncio.to_thread(_upload_and_verify, job, env, last, remote_path), timeout_s
        )
    except TimeoutError:
        why = f"the upload of {last} took longer than {timeout_s:.0f}s ({SAVE_TIMEOUT_ENV})"
        log.error("guard: %s; tearing down without it", why)
        return {"path": str(last), "saved": False, "why": why}
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
        log.error("guard: %s NOT saved: %s", last, why)
        return {"path": str(last), "saved": False, "why": why[:400]}
    return {"path": str(last), "saved": True, "verified": True, **done}


def rescue_words(report: dict[str, Any]) -> str:
    """One line: what the guard saved and what it could not."""
    last = report.get("last_pt") or {}
    trainer = report.get("trainer") or {}
    parts = [
        f"trainer stopped ({trainer.get('signal')})"
        if trainer.get("stopped")
        else f"trainer not stopped: {trainer.get('why')}",
        "last.pt verified on the target"
        if last.get("saved")
        else f"last.pt NOT saved: {last.get('why')}",
    ]
    best = report.get("best_pt")
    if best:
        parts.append(
            "best.pt verified on the target"
            if best.get("saved")
            else f"best.pt NOT saved: {best.get('why')}"
        )
    unsaved = list(report.get("unsaved") or [])
    if unsaved:
        shown = ", ".join(unsaved[:5]) + (
            f" and {len(unsaved) - 5} more" if len(unsaved) > 5 else ""
        )
        parts.append(f"{len(unsaved)} file(s) NOT off the box: {shown}")
    return "; ".join(parts)


# --------------------------------------------------------------------------- notices


async def notify(
    job: Job | None,
    env: Env,
    notices: Iterable[tuple[str, dict[str, Any]]],
    timeout_s: float = 10.0,
) -> None:
    """Send ``notices`` (event kind, data) to the job's ``[notify]`` webhook, as the agent
    would, waiting at most ``timeout_s``. Nothing without ``[notify]``. Never raises."""
    if job is None or job.notify is None:
        return
    from agent.events import EventBus
    from agent.status.notify import Notifier

    try:
        bus = EventBus()
        notifier = Notifier(
            job.notify, bus, secrets=[v for _, v in env.secrets()], job=env.run_name(job.job.name)
        )
        task = asyncio.create_task(notifier.run())
        for kind, data in notices:
            bus.publish(kind, **data, by="guard")
        await notifier.flush(timeout_s)
        await notifier.close()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await task
    except Exception:
        log.exception("guard: sending the notices failed")
