"""The post-mortem of a run: ``report.json`` and ``report.md`` in the state directory (and on the
sync target), so the story of the run survives the box that ran it.

:func:`build` is a pure function of what the daemon knows when the job is DONE (its state, the
``/status`` document, the sync ledger, ``metrics.jsonl``, the warnings it published);
:func:`markdown` tells the same as one readable page; :func:`write` puts both in the state
directory the way every state file is written (atomic, 0600). The state holds no secret, and
every string still goes through the redaction the log gets (:mod:`agent.util.redact`).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from agent.config.jobvalues import format_duration
from agent.state import RunState, atomic_write_json, atomic_write_text
from agent.sync.ledger import LedgerEntry
from agent.util import redact as redaction

#: Bumped when a key changes meaning; readers (``libreyolo-agent status``) check it.
FORMAT = 1
JSON_NAME = "report.json"
MD_NAME = "report.md"

#: What each teardown action is called once it happened.
_DONE_WORD = {"destroy": "destroyed", "stop": "stopped", "keep": "kept"}


# ------------------------------------------------------------------------------------ build


def build(
    state: RunState,
    status_doc: Mapping[str, Any],
    ledger_entries: Iterable[LedgerEntry] | Iterable[Mapping[str, Any]],
    metrics_rows: list[dict[str, Any]],
    warnings: Iterable[str],
    *,
    now: float | None = None,
) -> dict[str, Any]:
    """The content of ``report.json``. ``now`` (default: the state's ``updated_at``) is when
    the report was made; the run's end is the teardown's ``finished_at``, else the change to
    DONE or FAILED, else ``now``."""
    generated_at = state.updated_at if now is None else now
    ended_at = _ended_at(state, generated_at)
    sync = status_doc.get("sync") or {}
    entries = [_entry(e) for e in ledger_entries]
    checkpoints = [e for e in entries if str(e["remote_path"]).endswith(".pt")]
    others = [e for e in entries if not str(e["remote_path"]).endswith(".pt")]
    verified = sync.get("verified") if isinstance(sync, Mapping) else None
    report: dict[str, Any] = {
        "format": FORMAT,
        "job": state.job_name,
        "job_source": state.job_source,
        "phase": state.phase.value,
        "reason": state.reason.value if state.reason else None,
        "cause": state.cause,
        "outcome": state.outcome,
        "started_at": state.started_at,
        "ended_at": ended_at,
        "duration_s": max(0.0, ended_at - state.started_at),
        "generated_at": generated_at,
        "timeline": timeline(state, ended_at),
        "resumes": list(state.resumes),
        "preempted": state.preempted,
        "crashes": list(state.crashes),
        "training": _training(status_doc, metrics_rows),
        "sync": {
            "target": sync.get("target") if isinstance(sync, Mapping) else None,
            "last_synced_epoch": status_doc.get("last_synced_epoch"),
            "verified": verified,
            "files": len(entries),
            "pending": sum(1 for e in entries if e["status"] != "verified"),
        },
        "checkpoints": checkpoints,
        "other_files": others,
        "money": dict(status_doc.get("money") or {}),
        "sizing": dict(status_doc.get("sizing") or {}),
        "teardown": state.teardown,
        # The final checkpoints fetched back and loaded (agent/sync/restore.py), and the
        # figures of on_success = "auto" (agent/policy/autoteardown.py): both gate or make
        # the teardown's decision, so both are kept with it.
        "restore_drill": (state.teardown or {}).get("restore_drill"),
        "auto_teardown": (state.teardown or {}).get("auto"),
        "steering": list(state.steering),
        "extended_s": state.extended_s,
        "hold": state.hold,
        "warnings": _unique(warnings),
    }
    report["headline"] = headline(report)
    clean: dict[str, Any] = redact(report)
    return clean


def _ended_at(state: RunState, default: float) -> float:
    td = state.teardown or {}
    if isinstance(td.get("finished_at"), int | float):
        return float(td["finished_at"])
    for entry in reversed(state.history):
        if entry.get("to") in ("DONE", "FAILED") and isinstance(entry.get("at"), int | float):
            return float(entry["at"])
    return default


def timeline(state: RunState, ended_at: float) -> list[dict[str, Any]]:
    """Every phase the run went through, in order: ``phase``, ``at``, ``duration_s`` (until the
    next phase change; None for a final DONE or FAILED), and what the history says of the change
    (``from``, ``reason``, ``note``). Other history entries (an agent restart, a reboot) come in
    their place as ``{"event", "at"}`` rows, without a duration."""
    rows: list[dict[str, Any]] = [{"phase": "BOOTING", "at": state.started_at}]
    for entry in state.history:
        at = entry.get("at")
        if not isinstance(at, int | float):
            continue
        if "to" in entry:
            row = {"phase": entry["to"], "at": float(at), "from": entry.get("from")}
            row.update({k: entry[k] for k in ("reason", "note") if entry.get(k)})
        else:
            row = {k: v for k, v in entry.items() if k != "at"}
            row["at"] = float(at)
        rows.append(row)
    phases = [r for r in rows if "phase" in r]
    for row, nxt in itertools.pairwise(phases):
        row["duration_s"] = max(0.0, nxt["at"] - row["at"])
    if phases:
        last = phases[-1]
        last["duration_s"] = (
            None if last["phase"] in ("DONE", "FAILED") else max(0.0, ended_at - last["at"])
        )
    return rows


def _training(status_doc: Mapping[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Epochs, the last metrics row and the best epoch (status.json's, else metrics.jsonl's)."""
    last = rows[-1] if rows else None
    best_epoch = status_doc.get("best_epoch")
    best_metric = status_doc.get("best_metric")
    if best_epoch is None:
        flagged = [r for r in rows if r.get("is_best")]
        if flagged:
            best_epoch, best_metric = flagged[-1].get("epoch"), flagged[-1].get("current_metric")
    best_row = next((r for r in rows if r.get("epoch") == best_epoch), None)
    name = next(
        (r["current_metric_name"] for r in reversed(rows) if r.get("current_metric_name")), None
    )
    epoch = status_doc.get("epoch")
    if epoch is None and last is not None and isinstance(last.get("epoch"), int):
        epoch = last["epoch"]
    return {
        "epochs": epoch,
        "total_epochs": status_doc.get("total_epochs"),
        "training_state": status_doc.get("training_state"),
        "run_dir": status_doc.get("run_dir"),
        "metric_name": name,
        "last": last,
        "best": {"epoch": best_epoch, "metric": best_metric, "row": best_row}
        if best_epoch is not None
        else None,
    }


def _entry(e: LedgerEntry | Mapping[str, Any]) -> dict[str, Any]:
    d = asdict(e) if is_dataclass(e) and not isinstance(e, type) else dict(e)  # type: ignore[arg-type]
    return {
        "remote_path": str(d.get("remote_path")),
        "epoch": d.get("epoch"),
        "kind": str(d.get("kind")) if d.get("kind") is not None else None,
        "size": d.get("size"),
        "sha256": d.get("sha256"),
        "status": str(d.get("status")),
        "verified_at": d.get("verified_at"),
        "attempts": d.get("attempts", 0),
        "error": d.get("error"),
    }


def _unique(items: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for item in items:
        seen.setdefault(str(item), None)
    return list(seen)


def redact(value: Any) -> Any:
    """``value`` without any secret, in every string (keys included), however deep
    (:func:`agent.util.redact.redact_value`: the redaction agent.log gets)."""
    return redaction.redact_value(value)


# ------------------------------------------------------------------------------------ text


def usd(amount: object) -> str:
    return f"${amount:.2f}" if isinstance(amount, int | float) else "cost unknown"


def teardown_words(td: Mapping[str, Any] | None) -> str:
    """``destroyed (confirmed)``, ``stopped (NOT confirmed)``, ``destroy: dry run (provider
    none)``, ``destroy pending`` (decided, not carried out yet: a report written just before
    the provider call), ``no teardown``."""
    if not td or not td.get("action"):
        return "no teardown"
    action = str(td["action"])
    if td.get("provider") == "none":
        return f"{action}: dry run (provider none)"
    if "confirmed" not in td:
        return f"{action} pending"
    if action == "keep":
        return "box kept (still billing)"
    done = _DONE_WORD.get(action, action)
    if not td.get("performed"):
        return f"{action} NOT performed"
    return f"{done} ({'confirmed' if td.get('confirmed') else 'NOT confirmed'})"


def headline(report: Mapping[str, Any]) -> str:
    """``run1: completed in 3h12m, $11.20, destroyed (confirmed)``."""
    how = report.get("reason") or str(report.get("phase", "?")).lower()
    cause = str(report.get("cause") or "")
    if how == "diverged" and cause.startswith("diverged at epoch "):
        how = cause.partition(":")[0]  # which epoch, in the first line a person reads
    if report.get("phase") == "FAILED":
        how = f"FAILED ({how})"
    money = report.get("money") or {}
    return (
        f"{report.get('job')}: {how} in {format_duration(float(report.get('duration_s') or 0))}, "
        f"{usd(money.get('spent_usd'))}, {teardown_words(report.get('teardown'))}"
    )


def utc(at: object) -> str:
    if not isinstance(at, int | float):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(at))


def _cell(value: object) -> str:
    text = "-" if value is None or value == "" else str(value)
    return " ".join(text.split()).replace("|", "\\|")


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows),
    ]


def _scalar(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def markdown(report: Mapping[str, Any]) -> str:
    """``report.md``: the run's story on one page, the headline first."""
    out = [f"# {report.get('headline') or headline(report)}", ""]
    out += [
        f"- job: {report.get('job')} ({report.get('job_source')})",
        f"- phase: {report.get('phase')}, reason: {report.get('reason') or '-'}",
        f"- cause: {report.get('cause') or '-'}",
        f"- started {utc(report.get('started_at'))}, ended {utc(report.get('ended_at'))} "
        f"({format_duration(float(report.get('duration_s') or 0))})",
    ]
    outcome = report.get("outcome")
    if isinstance(outcome, Mapping):
        out.append(
            f"- trainer: {outcome.get('kind')} (exit {outcome.get('exit_code')})"
            + (f": {outcome.get('message')}" if outcome.get("message") else "")
        )
    out += ["", "## Timeline", ""]
    rows: list[list[object]] = []
    for r in report.get("timeline") or []:
        d = r.get("duration_s")
        dur = format_duration(d) if isinstance(d, int | float) else "-"
        what = r.get("phase") or f"({r.get('event')})"
        note = ", ".join(str(r[k]) for k in ("reason", "note", "was") if r.get(k))
        rows.append([utc(r.get("at")), what, dur, note])
    out += _table(["at", "phase", "lasted", "note"], rows)
    out += ["", "## Training", ""]
    out += _training_md(report.get("training") or {}, report.get("resumes") or [])
    out += ["", "## Checkpoints", ""]
    out += _checkpoints_md(report)
    out += ["", "## Money", ""]
    out += _money_md(report.get("money") or {})
    out += ["", "## Was it the right box?", ""]
    out += _sizing_md(report.get("sizing") or {})
    out += ["", "## Teardown", ""]
    out += _teardown_md(report.get("teardown"))
    steering = report.get("steering") or []
    if steering:
        out += ["", "## Steering", ""]
        out += _table(
            ["at", "action", "detail"],
            [
                [utc(s.get("at")), s.get("action"), _rest(s, ("at", "action"))]
                for s in steering
                if isinstance(s, Mapping)
            ],
        )
    out += ["", "## Warnings", ""]
    warnings = report.get("warnings") or []
    out += [f"- {w}" for w in warnings] if warnings else ["none"]
    text: str = redact("\n".join(out) + "\n")
    return text


def _rest(d: Mapping[str, Any], skip: tuple[str, ...]) -> str:
    return ", ".join(f"{k} {_scalar(v)}" for k, v in d.items() if k not in skip and v is not None)


def _training_md(t: Mapping[str, Any], resumes: list[Any]) -> list[str]:
    lines = [f"- epochs: {t.get('epochs', '-')}/{t.get('total_epochs') or '?'}"]
    if t.get("run_dir"):
        lines.append(f"- run dir: {t['run_dir']}")
    best = t.get("best")
    if isinstance(best, Mapping):
        metric = best.get("metric")
        lines.append(
            f"- best: epoch {best.get('epoch')}, {t.get('metric_name') or 'metric'} "
            f"{_scalar(metric) if metric is not None else '-'}"
        )
    last = t.get("last")
    if isinstance(last, Mapping):
        shown = [f"{k} {_scalar(v)}" for k, v in last.items() if isinstance(v, int | float | str)]
        lines.append(f"- last epoch's metrics: {', '.join(shown)}")
    if resumes:
        lines.append(f"- resumed {len(resumes)} time(s):")
        lines += [
            f"  - {utc(r.get('at'))} at epoch {r.get('epoch')}: {r.get('kind')} "
            f"{r.get('message') or ''}".rstrip()
            for r in resumes
            if isinstance(r, Mapping)
        ]
    return lines


def _checkpoints_md(report: Mapping[str, Any]) -> list[str]:
    sync = report.get("sync") or {}
    if not sync.get("target"):
        return ["no sync target: nothing left the box"]
    verified = sync.get("verified")
    state = "not verified"
    if isinstance(verified, Mapping):
        state = (
            f"verified ({verified.get('checked')} files checked)"
            if verified.get("sync_verified")
            else f"NOT verified ({len(verified.get('missing') or [])} problem(s))"
        )
    lines = [
        f"target: {sync['target']}; final check: {state}; {sync.get('files', 0)} file(s), "
        f"{sync.get('pending', 0)} pending",
        "",
    ]
    rows = [
        [
            c["remote_path"],
            c.get("epoch"),
            c.get("size"),
            c.get("sha256"),
            utc(c.get("verified_at")),
        ]
        for c in report.get("checkpoints") or []
    ]
    return lines + (
        _table(["path", "epoch", "bytes", "sha256", "verified"], rows) if rows else ["none"]
    )


def _money_md(m: Mapping[str, Any]) -> list[str]:
    if not m:
        return ["unknown"]
    price = m.get("price_usd_per_hour")
    lines = [
        f"- spent: {usd(m.get('spent_usd'))}"
        + (f" at {usd(price)}/h" if price is not None else " (no price_usd_per_hour)")
        + (" (price read from the provider)" if m.get("price_from_provider") else ""),
    ]
    if m.get("budget_usd") is not None:
        lines.append(f"- budget: {usd(m['budget_usd'])}")
    if m.get("stopped_usd_per_hour") is not None:
        lines.append(f"- a stopped box costs {usd(m['stopped_usd_per_hour'])}/h (its disk)")
    return lines


def _sizing_md(sz: Mapping[str, Any]) -> list[str]:
    """The bottleneck verdict and the projection (agent/watch/sizing.py), as measured."""
    verdict, projection, profile = sz.get("verdict"), sz.get("projection"), sz.get("profile")
    lines: list[str] = []
    if isinstance(verdict, Mapping):
        lines.append(f"- verdict: {verdict.get('bound')} ({verdict.get('detail') or '-'})")
    if isinstance(projection, Mapping) and projection.get("total_s") is not None:
        lines.append(
            f"- projected: {format_duration(float(projection['total_s']))} of training, "
            f"{usd(projection.get('total_usd'))} in all"
        )
    if isinstance(profile, Mapping):
        lines.append(f"- profiler: {profile.get('message') or '-'}")
    return lines or ["not measured"]


def _teardown_md(td: Any) -> list[str]:
    if not isinstance(td, Mapping) or not td:
        return ["none recorded"]
    lines = [f"- {teardown_words(td)}: {td.get('detail') or '-'}"]
    lines.append(f"- decision: {td.get('action')} ({td.get('why') or '-'})")
    lines.append(f"- provider: {td.get('provider')}, instance {td.get('instance_id') or '-'}")
    lines.append(
        f"- decided {utc(td.get('started_at'))}, sent {utc(td.get('sent_at'))}, "
        f"finished {utc(td.get('finished_at'))}"
    )
    if td.get("box_fault"):
        lines.append(f"- box fault: {td['box_fault']}")
    drill = td.get("restore_drill")
    if isinstance(drill, Mapping):
        lines.append(f"- {drill.get('why') or drill.get('status')}")
        for f in drill.get("files") or ():
            if isinstance(f, Mapping):
                lines.append(f"  - {f.get('path')}: {f.get('status')} ({f.get('detail') or '-'})")
    auto = td.get("auto")
    if isinstance(auto, Mapping):
        lines.append(f"- {auto.get('why')}")
        lines.append(f"- warning: {auto.get('warning')}")
    return lines


# ------------------------------------------------------------------------------------ files


def write(state_dir: Path, report: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.md`` into ``state_dir`` (atomic, 0600); returns their
    paths. Raises OSError (the caller logs it: a report is not worth crashing for)."""
    json_path, md_path = state_dir / JSON_NAME, state_dir / MD_NAME
    atomic_write_json(json_path, report)
    atomic_write_text(md_path, markdown(report))
    return json_path, md_path


def load(state_dir: Path) -> dict[str, Any] | None:
    """``report.json`` of ``state_dir``; None when there is none or it cannot be read."""
    try:
        data = json.loads((state_dir / JSON_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("job"), str) else None
