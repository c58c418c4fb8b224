"""The report: :class:`Check`, its status, :class:`PreflightReport` and the table for humans.

Every check is named like ``gpu0.matmul`` or ``disk.runs`` and carries a :class:`CheckStatus`,
the measured value and, when it did not pass, a one-line fix. The small text helpers every side
uses to write those values live here too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

GiB = 1024**3
MiB = 1024**2


class CheckStatus(StrEnum):
    """A check's verdict; ``preflight.json`` carries the value."""

    PASS = "pass"  #: fine as it is
    WARN = "warn"  #: works, but costs time or money, or could not be verified; does not stop a job
    FAIL = "fail"  #: the job cannot train like this; preflight fails


# Short aliases, so that a verdict reads ``make_check(name, PASS, ...)``.
PASS = CheckStatus.PASS
WARN = CheckStatus.WARN
FAIL = CheckStatus.FAIL


@dataclass(frozen=True)
class Check:
    """One named check: its status, what was measured, and a one-line fix when not ``pass``."""

    #: e.g. ``gpu0.matmul``, ``disk.runs``, ``shm``, ``torch.version``.
    name: str
    #: ``pass``, ``warn`` or ``fail``.
    status: CheckStatus
    #: The measured value, human readable, one line.
    value: str
    #: What to do about it when the status is not ``pass``.
    fix: str | None = None
    #: Machine-readable measurements (JSON types only).
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The check as JSON-able data."""
        return {
            "name": self.name,
            "status": self.status.value,
            "value": self.value,
            "fix": self.fix,
            "details": self.details,
        }


@dataclass(frozen=True)
class PreflightReport:
    """All checks of one preflight run, in a stable order, and how long the run took."""

    checks: tuple[Check, ...]
    wall_s: float

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings do not stop a job)."""
        return not self.failures()

    def failures(self) -> list[Check]:
        """The failed checks, in report order."""
        return [c for c in self.checks if c.status == FAIL]

    def warnings(self) -> list[Check]:
        """The checks that passed with a warning."""
        return [c for c in self.checks if c.status == WARN]

    def get(self, name: str) -> Check | None:
        """The check called ``name``, or None when it was not run."""
        return next((c for c in self.checks if c.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """``{"ok": ..., "wall_s": ..., "checks": [...]}``, ready for ``json.dumps``."""
        return {
            "ok": self.ok,
            "wall_s": round(self.wall_s, 3),
            "checks": [c.to_dict() for c in self.checks],
        }


def format_table(report: PreflightReport) -> str:
    """The report as a table for humans: one row per check, fixes under the rows that need one."""
    labels = {PASS: "pass", WARN: "WARN", FAIL: "FAIL"}
    width = max((len(c.name) for c in report.checks), default=0)
    lines = []
    for c in report.checks:
        lines.append(f"{labels[c.status]:4}  {c.name:<{width}}  {c.value}")
        if c.fix and c.status != PASS:
            lines.append(f"{'':4}  {'':<{width}}  fix: {c.fix}")
    failed = report.failures()
    n_warn = len(report.warnings())
    warn_text = f"{n_warn} warning{'s' if n_warn != 1 else ''}"
    if failed:
        names = ", ".join(c.name for c in failed)
        lines.append(
            f"preflight FAILED: {len(failed)} of {len(report.checks)} checks failed ({names}), "
            f"{warn_text}, {report.wall_s:.1f} s"
        )
    else:
        lines.append(
            f"preflight passed: {len(report.checks)} checks, {warn_text}, {report.wall_s:.1f} s"
        )
    return "\n".join(lines)


def make_check(
    name: str, status: CheckStatus, value: str, fix: str | None = None, /, **details: Any
) -> Check:
    """A :class:`Check` with ``details`` as keywords; a passed check keeps no fix."""
    return Check(name, status, value, fix if status != PASS else None, details)


# --------------------------------------------------------------------------------------------
# Small formatting helpers


def first_line(text: str) -> str:
    """The first non-blank line of ``text``, stripped."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return text.strip()


def strip_exc_type(text: str) -> str:
    """``"AcceleratorError: CUDA error: ..."`` -> ``"CUDA error: ..."``."""
    head, sep, rest = text.partition(": ")
    return rest if sep and re.fullmatch(r"[A-Za-z_][\w.]*", head) else text
