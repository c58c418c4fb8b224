"""Stop or destroy: what a box costs once training is over, and which of the two is cheaper.

A stopped box pays for its disk only: ``allocated_GB x storage_usd_per_GB_month / hours per
month`` dollars an hour. A destroyed box costs nothing more, but coming back means rebuilding it
(setup time at the running price, the dataset's inbound transfer): ``rebuild_usd``. So for a gap
of ``G`` hours before the next run, stopping costs ``G x stopped rate`` and destroying costs
``rebuild_usd``; they break even at ``rebuild_usd / stopped rate`` hours.

Hours per month: 720 (a 30-day month) by default, because that is what reproduces the rate
measured on a rented box (250 GB at $0.20/GB-month billed $0.0694/h stopped; 730, the average
month, would give $0.0685/h). ``--hours-per-month 730`` is there for providers that bill that way.

What the money does not show: a stopped box releases its GPUs and nothing reserves them.
The disk is safe; the GPUs may be rented by someone else by the time you start it again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from .jobvalues import ConfigError

#: Hours in a month as providers bill storage: 30 days (see the module docstring).
HOURS_PER_MONTH = 720.0

#: The verdict for a gap: the cheaper of the two ways to leave the box.
Verdict = Literal["stop", "destroy"]

GPU_WARNING = (
    "a stopped box releases its GPUs and nothing reserves them: the disk is safe, the GPUs are "
    "not; the box may not start again until the same GPUs are free on that host"
)


@dataclass(frozen=True)
class CostInputs:
    """What the calculator needs; every amount in US dollars."""

    #: The box's allocated disk (billed as allocated, not as used), GB.
    disk_gb: float
    #: The provider's storage price, USD per GB per month.
    storage_usd_per_gb_month: float
    #: What destroying and coming back costs: setup time at the running price plus inbound
    #: transfer of the dataset, USD.
    rebuild_usd: float
    #: The box's price while running, USD per hour (optional: shown for comparison).
    running_usd_per_hour: float | None = None
    #: The expected gap before the next run, hours (optional: without it, no verdict).
    gap_hours: float | None = None
    #: Hours in a billing month (default 720, a 30-day month).
    hours_per_month: float = HOURS_PER_MONTH


@dataclass(frozen=True)
class GapVerdict:
    hours: float
    verdict: Verdict
    #: Staying stopped for the whole gap, USD.
    stop_usd: float
    #: Destroying now and rebuilding after the gap, USD.
    destroy_usd: float
    #: Leaving the box running (idle) for the gap, USD; None without a running price.
    running_usd: float | None


@dataclass(frozen=True)
class CostReport:
    inputs: CostInputs
    stopped_usd_per_hour: float
    #: The gap at which stopping costs as much as rebuilding, hours; None when stopping costs
    #: nothing (storage price 0): stopping is then never the dearer.
    break_even_hours: float | None
    gap: GapVerdict | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "inputs": asdict(self.inputs),
            "running_usd_per_hour": self.inputs.running_usd_per_hour,
            "stopped_usd_per_hour": self.stopped_usd_per_hour,
            "destroyed_usd_per_hour": 0.0,
            "rebuild_usd": self.inputs.rebuild_usd,
            "break_even_hours": self.break_even_hours,
            "gap": asdict(self.gap) if self.gap else None,
            "warning": GPU_WARNING,
        }


def stopped_usd_per_hour(
    disk_gb: float, storage_usd_per_gb_month: float, hours_per_month: float = HOURS_PER_MONTH
) -> float:
    """What a stopped box costs per hour: its disk, ``GB x $/GB-month / hours per month``."""
    return disk_gb * storage_usd_per_gb_month / hours_per_month


def break_even_hours(rebuild_usd: float, stopped_rate: float) -> float | None:
    """The gap (hours) at which staying stopped costs as much as a rebuild; None when
    stopping is free."""
    return None if stopped_rate <= 0 else rebuild_usd / stopped_rate


def compute(inputs: CostInputs) -> CostReport:
    rate = stopped_usd_per_hour(
        inputs.disk_gb, inputs.storage_usd_per_gb_month, inputs.hours_per_month
    )
    even = break_even_hours(inputs.rebuild_usd, rate)
    gap = None
    if inputs.gap_hours is not None:
        hours = inputs.gap_hours
        stop_usd = hours * rate
        # A tie goes to stop: the same money, and no rebuild to wait for.
        verdict: Verdict = "stop" if stop_usd <= inputs.rebuild_usd else "destroy"
        running = inputs.running_usd_per_hour
        gap = GapVerdict(
            hours=hours,
            verdict=verdict,
            stop_usd=stop_usd,
            destroy_usd=inputs.rebuild_usd,
            running_usd=None if running is None else hours * running,
        )
    return CostReport(inputs, rate, even, gap)


# ------------------------------------------------------------------------------------ input

#: Each input: its command-line option, what it must be, and whether zero is allowed.
_FIELDS: dict[str, tuple[str, str, bool]] = {
    "disk_gb": ("--disk-gb", "the allocated disk in GB, more than 0 (e.g. 250)", False),
    "storage_usd_per_gb_month": (
        "--storage-usd-per-gb-month",
        "the storage price in USD per GB-month, 0 or more (e.g. 0.20)",
        True,
    ),
    "rebuild_usd": ("--rebuild-usd", "the rebuild cost in USD, 0 or more (e.g. 1.00)", True),
    "running_usd_per_hour": (
        "--running-usd-per-hour",
        "the running price in USD per hour, 0 or more (e.g. 3.4828)",
        True,
    ),
    "gap_hours": ("--gap-hours", "the expected gap in hours, 0 or more (e.g. 8)", True),
    "hours_per_month": (
        "--hours-per-month",
        "the hours in a billing month, more than 0 (720 or 730)",
        False,
    ),
}
_REQUIRED = ("disk_gb", "storage_usd_per_gb_month", "rebuild_usd")


def _number(name: str, raw: str) -> float:
    option, expected, zero_ok = _FIELDS[name]
    text = raw.strip().removeprefix("$")
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(option, f"{raw!r} is not a number; expected {expected}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(option, f"{raw!r} is out of range; expected {expected}")
    return value


def parse_inputs(raw: Mapping[str, str | None]) -> CostInputs:
    """Check the calculator's inputs as typed (strings, by field name; None: not given).
    Raises :class:`ConfigError` naming the option, the value and what was expected; the
    missing required options are named together, in one error."""
    missing = [_FIELDS[name][0] for name in _REQUIRED if raw.get(name) is None]
    if missing:
        raise ConfigError("cost", f"needs {', '.join(missing)} (see libreyolo-agent cost --help)")
    values = {name: _number(name, text) for name, text in raw.items() if text is not None}
    return CostInputs(**values)


# ----------------------------------------------------------------------------------- output


def _usd(amount: float) -> str:
    return f"${amount:.2f}"


def _price(amount: float) -> str:
    """``0.2 -> "$0.20"``, ``0.015 -> "$0.015"``: cents at least, more digits when given."""
    return f"${amount:.2f}" if round(amount, 2) == amount else f"${amount:g}"


def _hours(hours: float) -> str:
    return f"{hours:.1f} h" if hours < 48 else f"{hours:.1f} h ({hours / 24:.1f} days)"


def format_report(report: CostReport) -> str:
    """The report for a person: rates, break-even, the verdict for the gap, the GPU warning."""
    i = report.inputs
    rows: list[tuple[str, str]] = []
    if i.running_usd_per_hour is not None:
        rows.append(("running", f"${i.running_usd_per_hour:.4f}/h"))
    rows.append(
        (
            "stopped",
            f"${report.stopped_usd_per_hour:.4f}/h (disk only: {i.disk_gb:g} GB x "
            f"{_price(i.storage_usd_per_gb_month)}/GB-month / {i.hours_per_month:g} h)",
        )
    )
    rows.append(("destroyed", f"$0/h; coming back costs a rebuild, {_usd(i.rebuild_usd)}"))
    if report.break_even_hours is None:
        rows.append(("break-even", "none: a stopped box costs nothing here, stop for any gap"))
    else:
        rows.append(
            (
                "break-even",
                f"{_hours(report.break_even_hours)}: back sooner, stop; later, destroy and rebuild",
            )
        )
    g = report.gap
    if g is not None:
        line = (
            f"{g.verdict} (stopped {_usd(g.stop_usd)} vs destroy and rebuild {_usd(g.destroy_usd)}"
        )
        if g.running_usd is not None:
            line += f"; left running {_usd(g.running_usd)}"
        rows.append((f"gap {g.hours:g} h", line + ")"))
    width = max(len(label) for label, _ in rows) + 1
    lines = [f"{label + ':':<{width}} {text}" for label, text in rows]
    lines.append(f"warning: {GPU_WARNING}")
    return "\n".join(lines)
