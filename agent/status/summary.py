"""``libreyolo-agent status`` for people: the compact summary of a ``/status`` document, the
one-line form ``--watch`` prints on a pipe or a dumb terminal, the progress bar, and the summary
of an ended job's ``report.json``. Pure functions of the documents (and ``now``); the CLI prints.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent.config.jobvalues import format_duration
from agent.policy.teardown import open_words
from agent.state import RunState, teardown_open
from agent.status.report import headline, teardown_words, usd

#: Width of the progress bar, characters between the brackets.
BAR_WIDTH = 24
#: Width of the row names in the summary (``phase              TRAINING``).
KEY_WIDTH = 18


def bar(done: object, total: object, width: int = BAR_WIDTH) -> str:
    """``[#########---------------]  37%``; ASCII, so any terminal (and a log) shows it."""
    if not isinstance(done, int | float) or not isinstance(total, int | float) or total <= 0:
        return "[" + "?" * width + "]"
    frac = min(max(float(done) / float(total), 0.0), 1.0)
    filled = int(frac * width)
    return f"[{'#' * filled}{'-' * (width - filled)}] {frac * 100:.0f}%"


def _in(at: object, now: float) -> str:
    if not isinstance(at, int | float):
        return "-"
    left = at - now
    return f"in {format_duration(left)}" if left > 0 else f"passed {format_duration(-left)} ago"


def _clock(at: float) -> str:
    return time.strftime("%H:%M", time.localtime(at))


def epoch_text(s: Mapping[str, Any]) -> str:
    epoch, total = s.get("epoch"), s.get("total_epochs")
    if epoch is None:
        return "-"
    return f"{epoch}/{total if total else '?'} {bar(epoch, total)}"


def eta_text(s: Mapping[str, Any]) -> str:
    eta = s.get("eta_seconds")
    if not isinstance(eta, int | float):
        return "-"
    at = s.get("eta_at")
    return format_duration(eta) + (f" (at {_clock(at)})" if isinstance(at, int | float) else "")


def sync_text(s: Mapping[str, Any]) -> str:
    sync = s.get("sync")
    if not isinstance(sync, Mapping):
        return "no sync target"
    last = s.get("last_synced_epoch")
    parts = [f"epoch {last}" if last is not None else "nothing yet"]
    queue = sync.get("queue")
    if isinstance(queue, list) and queue:
        parts.append(f"{len(queue)} queued")
    if sync.get("stalled"):
        parts.append("STALLED")
    verified = sync.get("verified")
    if isinstance(verified, Mapping):
        parts.append("verified" if verified.get("sync_verified") else "NOT verified")
    return ", ".join(parts) + f" -> {sync.get('target')}"


def money_text(s: Mapping[str, Any]) -> str:
    m = s.get("money")
    if not isinstance(m, Mapping) or m.get("spent_usd") is None:
        return "- (no price_usd_per_hour)"
    text = f"{usd(m['spent_usd'])} at {usd(m.get('price_usd_per_hour'))}/h"
    if m.get("projected_usd") is not None:
        text += f", projected {usd(m['projected_usd'])}"
    if m.get("budget_usd") is not None:
        text += f", budget {usd(m['budget_usd'])}"
    return text


def deadline_text(s: Mapping[str, Any], now: float) -> str:
    lim = s.get("limits")
    if not isinstance(lim, Mapping) or lim.get("stop_training_at") is None:
        return "none"
    text = f"training stops {_in(lim['stop_training_at'], now)}"
    if lim.get("max_runtime_at") is not None:
        text += f" (max_runtime ends {_in(lim['max_runtime_at'], now)})"
    return text


def teardown_text(s: Mapping[str, Any], now: float) -> str:
    steering = s.get("steering")
    hold = steering.get("hold") if isinstance(steering, Mapping) else None
    if isinstance(hold, Mapping) and hold.get("active"):
        until = hold.get("until")
        held = "HELD: the box stays up" if s.get("phase") == "HELD" else "hold set"
        return f"{held} until release or {_in(until, now).removeprefix('in ')} from now"
    td = s.get("teardown")
    if isinstance(td, Mapping) and td and teardown_open(td) and "confirmed" in td:
        return f"{open_words(td)}: {td.get('detail') or td.get('why') or '-'}"
    if isinstance(td, Mapping) and td:
        return f"{teardown_words(td)}: {td.get('detail') or td.get('why') or '-'}"
    plan = s.get("teardown_plan")
    return plan_text(plan) if isinstance(plan, Mapping) and plan else "-"


#: Providers that have no stop: the verified-sync gate keeps their box instead
#: (agent/providers/lambdalabs.py ``can_stop = False``; agent/policy/teardown.py ``decide``).
NO_STOP_PROVIDERS = ("lambda",)


def plan_text(plan: Mapping[str, Any]) -> str:
    """What the teardown will do, before it is decided, from ``/status``'s ``teardown_plan``
    (the rules of agent/policy/teardown.py ``decide``): "when training ends: destroy (vast)
    if every checkpoint is verified, else stop; after a failure: stop"."""
    provider = str(plan.get("provider") or "none")
    if provider == "none":
        return "none: nothing is torn down (teardown.provider = none)"
    fallback = "keep (it has no stop)" if provider in NO_STOP_PROVIDERS else "stop"

    def gated(action: object) -> str:
        if action == "destroy" and plan.get("require_verified_sync"):
            return f"destroy ({provider}) if every checkpoint is verified, else {fallback}"
        if action == "stop" and provider in NO_STOP_PROVIDERS:
            return f"keep ({provider} has no stop)"
        return f"{action} ({provider})"

    text = f"when training ends: {gated(plan.get('on_success'))}"
    if plan.get("on_failure") != plan.get("on_success"):
        text += f"; after a failure: {gated(plan.get('on_failure'))}"
    return text


def summary(s: Mapping[str, Any], now: float) -> str:
    """The compact human summary of a ``/status`` document."""
    phase = str(s.get("phase"))
    reason = s.get("reason")
    rows = [
        ("job", s.get("job")),
        ("phase", phase + (f" (reason {reason})" if reason else "")),
        ("epoch", epoch_text(s)),
        ("eta", eta_text(s)),
        ("last synced", sync_text(s)),
        ("money", money_text(s)),
        ("deadline", deadline_text(s, now)),
        ("teardown", teardown_text(s, now)),
    ]
    if s.get("cause"):
        rows.insert(2, ("cause", s["cause"]))
    if s.get("state_write_error"):
        rows.append(("state file", f"NOT WRITTEN: {s['state_write_error']}"))
    return "\n".join(f"{k:<{KEY_WIDTH}} {v}" for k, v in rows)


def change_key(s: Mapping[str, Any]) -> tuple[Any, ...]:
    """What ``--watch`` on a pipe prints a new line for: not the ETA or the money, which move
    on every read."""
    td = s.get("teardown")
    steering = s.get("steering")
    hold = steering.get("hold") if isinstance(steering, Mapping) else None
    return (
        s.get("phase"),
        s.get("reason"),
        s.get("epoch"),
        s.get("total_epochs"),
        s.get("last_synced_epoch"),
        td.get("action") if isinstance(td, Mapping) else None,
        td.get("confirmed") if isinstance(td, Mapping) else None,
        bool(isinstance(hold, Mapping) and hold.get("active")),
    )


def plain_line(s: Mapping[str, Any], now: float) -> str:
    """One line for a log or a pipe: time, phase, epoch and bar, ETA, synced epoch, money."""
    parts = [_clock(now), str(s.get("phase"))]
    if s.get("reason"):
        parts.append(f"({s['reason']})")
    if s.get("epoch") is not None:
        parts.append(f"epoch {epoch_text(s)}")
    if isinstance(s.get("eta_seconds"), int | float):
        parts.append(f"eta {format_duration(s['eta_seconds'])}")
    if s.get("last_synced_epoch") is not None:
        parts.append(f"synced {s['last_synced_epoch']}")
    m = s.get("money")
    if isinstance(m, Mapping) and m.get("spent_usd") is not None:
        parts.append(usd(m["spent_usd"]))
    td = s.get("teardown")
    if isinstance(td, Mapping) and td and teardown_open(td) and "confirmed" in td:
        parts.append(f"teardown: {open_words(td)}")
    elif isinstance(td, Mapping) and td:
        parts.append(f"teardown: {teardown_words(td)}")
    return "  ".join(parts)


def _report_teardown(td: Mapping[str, Any] | None) -> str:
    if not td:
        return "-"
    words = open_words(td) if teardown_open(td) and "confirmed" in td else teardown_words(td)
    return f"{words}: {td.get('detail') or '-'}"


def report_summary(report: Mapping[str, Any], source: str) -> str:
    """An ended job's post-mortem (``report.json``) in a few rows, its headline first."""
    t = report.get("training") or {}
    best = t.get("best") if isinstance(t, Mapping) else None
    epochs = f"{t.get('epochs', '-')}/{t.get('total_epochs') or '?'}"
    if isinstance(best, Mapping) and best.get("metric") is not None:
        epochs += f", best {t.get('metric_name') or 'metric'} {best['metric']:.4g} at epoch "
        epochs += str(best.get("epoch"))
    sync = report.get("sync") or {}
    checkpoints = report.get("checkpoints") or []
    synced = "no sync target"
    if sync.get("target"):
        verified = sync.get("verified")
        ok = isinstance(verified, Mapping) and verified.get("sync_verified")
        synced = (
            f"{len(checkpoints)} checkpoint(s) on {sync['target']}, "
            f"{'verified' if ok else 'NOT verified'}"
        )
    td = report.get("teardown")
    warnings = report.get("warnings") or []
    rows = [
        ("job", report.get("job")),
        ("phase", f"{report.get('phase')} (reason {report.get('reason') or '-'})"),
        ("cause", report.get("cause") or "-"),
        ("epochs", epochs),
        ("checkpoints", synced),
        ("money", usd((report.get("money") or {}).get("spent_usd"))),
        ("teardown", _report_teardown(td)),
        ("warnings", f"{len(warnings)} (in report.md)" if warnings else "none"),
    ]
    head = f"no agent is running; this is the record of an ended job, from {source}:"
    body = "\n".join(f"{k:<{KEY_WIDTH}} {v}" for k, v in rows)
    return f"{head}\n{report.get('headline') or headline(report)}\n{body}"


def teardown_line(teardown: Mapping[str, Any] | None) -> str:
    if not teardown:
        return "-"
    line = str(teardown.get("detail") or teardown.get("action") or "-")
    return f"{open_words(teardown)}: {line}" if teardown_open(teardown) else line


def ended_record(record: RunState, path: Path) -> dict[str, Any]:
    """What ``status`` says of an ended job when no agent runs: its state file's verdict."""
    return {
        "source": "state_file",
        "state_file": str(path),
        "agent_running": False,
        "ended": True,
        "job": record.job_name,
        "phase": record.phase.value,
        "reason": record.reason.value if record.reason else None,
        "cause": record.cause,
        "teardown": record.teardown,
        "updated_at": record.updated_at,
    }


def format_ended(d: dict[str, Any]) -> str:
    ended = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(d["updated_at"]))
    rows = [
        ("job", d["job"]),
        ("phase", d["phase"]),
        ("reason", d["reason"] or "-"),
        ("cause", d["cause"] or "-"),
        ("teardown", teardown_line(d["teardown"])),
        ("last written", ended),
    ]
    head = f"no agent is running; this is the record of an ended job, from {d['state_file']}:"
    return "\n".join([head, *(f"{k:<18} {v}" for k, v in rows)])


class WatchView:
    """What ``status --watch`` writes for each ``/status`` read. On a terminal (``fancy``) the
    summary is redrawn over the previous one (cursor up, clear to the end of the screen), each
    line cut to ``width`` so wrapping cannot break the count; else one plain line, only when
    something a person waits for changed (:func:`change_key`)."""

    def __init__(self, *, fancy: bool, width: int = 80) -> None:
        self.fancy = fancy
        self.width = max(20, width)
        self._drawn = 0
        self._key: tuple[Any, ...] | None = None

    def frame(self, s: Mapping[str, Any], now: float) -> str:
        if self.fancy:
            lines = [line[: self.width] for line in summary(s, now).splitlines()]
            text = self.erase() + "\n".join(lines) + "\n"
            self._drawn = len(lines)
            return text
        key = change_key(s)
        if key == self._key:
            return ""
        self._key = key
        return plain_line(s, now) + "\n"

    def erase(self) -> str:
        """Escapes that remove the block drawn last ("" when none, or not on a terminal)."""
        return f"\x1b[{self._drawn}F\x1b[J" if self.fancy and self._drawn else ""
