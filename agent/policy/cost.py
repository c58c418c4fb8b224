"""Stop or destroy: what a box costs once training is over, and which of the two is cheaper.

A stopped box pays for its disk only: ``allocated_GB x storage_usd_per_GB_month / hours per
month`` dollars an hour. A destroyed box costs nothing more, but coming back means rebuilding it
(setup time at the running price, the dataset's inbound transfer): ``rebuild_usd``. So for a gap
of ``G`` hours before the next run, stopping costs ``G x stopped rate`` and destroying costs
``rebuild_usd``; they break even at ``rebuild_usd / stopped rate`` hours.

The rebuild cost can be given, or derived as the guide measured it: ``setup minutes x running
price / 60 + GB transferred in x transfer price``: 15 minutes at $3.4828/h plus 43 GB at the
default :data:`TRANSFER_USD_PER_GB` ($0.003/GB, $3 per TB) is $0.87 + $0.13, about $1.00.

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

from agent.config.jobvalues import ConfigError, ConfigErrors

#: Hours in a month as providers bill storage: 30 days (see the module docstring).
HOURS_PER_MONTH = 720.0

#: Inbound transfer price, USD per GB, when ``--transfer-usd-per-gb`` is not given: $3 per TB,
#: what the guide's rebuild (15 minutes of setup plus 43 GB in, about $1.00 at $3.4828/h) implies.
TRANSFER_USD_PER_GB = 0.003

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
    #: Where ``rebuild_usd`` was derived (:func:`rebuild_usd`): the setup minutes, the GB
    #: transferred in and the transfer price, USD per GB; None when it was given.
    setup_minutes: float | None = None
    transfer_gb: float | None = None
    transfer_usd_per_gb: float | None = None


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


def rebuild_usd(
    setup_minutes: float,
    running_usd_per_hour: float,
    transfer_gb: float,
    transfer_usd_per_gb: float = TRANSFER_USD_PER_GB,
) -> float:
    """What destroying and coming back costs: the setup time at the running price plus the
    dataset's inbound transfer, USD."""
    return setup_minutes * running_usd_per_hour / 60.0 + transfer_gb * transfer_usd_per_gb


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
    "setup_minutes": (
        "--setup-minutes",
        "the minutes a new box takes to set up, 0 or more (e.g. 15)",
        True,
    ),
    "transfer_gb": (
        "--transfer-gb",
        "the GB transferred in on a rebuild, 0 or more (e.g. 43)",
        True,
    ),
    "transfer_usd_per_gb": (
        "--transfer-usd-per-gb",
        "the inbound transfer price in USD per GB, 0 or more (e.g. 0.003)",
        True,
    ),
    "hours_per_month": (
        "--hours-per-month",
        "the hours in a billing month, more than 0 (720 or 730)",
        False,
    ),
}
_REQUIRED = ("disk_gb", "storage_usd_per_gb_month")
#: What derives the rebuild cost when ``--rebuild-usd`` is not given.
_DERIVE = ("setup_minutes", "transfer_gb", "running_usd_per_hour")
#: The options of the per-job form; every other one belongs to the stop-or-destroy form.
PER_JOB_OPTIONS = ("--per-job", "--epochs", "--json")


def _number(name: str, raw: str) -> float:
    option, expected, zero_ok = _FIELDS[name]
    return _positive_number(option, raw, expected, zero=zero_ok)


def parse_inputs(raw: Mapping[str, str | None]) -> CostInputs:
    """Check the calculator's inputs as typed (strings, by field name; None: not given).
    Raises :class:`ConfigError` naming the option, the value and what was expected; the
    missing required options are named together, in one error."""
    missing = [_FIELDS[name][0] for name in _REQUIRED if raw.get(name) is None]
    derive = [
        name
        for name in ("setup_minutes", "transfer_gb", "transfer_usd_per_gb")
        if raw.get(name) is not None
    ]
    if raw.get("rebuild_usd") is not None and derive:
        raise ConfigError(
            "--rebuild-usd",
            f"give it, or {', '.join(_FIELDS[n][0] for n in derive)} to derive it, not both",
        )
    if raw.get("rebuild_usd") is None:
        lacking = [_FIELDS[n][0] for n in _DERIVE if raw.get(n) is None]
        if not derive:
            missing.append("--rebuild-usd (or --setup-minutes and --transfer-gb to derive it)")
        elif lacking:
            missing.append(f"{', '.join(lacking)} (to derive the rebuild cost)")
    if missing:
        raise ConfigError("cost", f"needs {', '.join(missing)} (see libreyolo-agent cost --help)")
    values = {name: _number(name, text) for name, text in raw.items() if text is not None}
    if "rebuild_usd" not in values:
        values.setdefault("transfer_usd_per_gb", TRANSFER_USD_PER_GB)
        values["rebuild_usd"] = rebuild_usd(
            values["setup_minutes"],
            values["running_usd_per_hour"],
            values["transfer_gb"],
            values["transfer_usd_per_gb"],
        )
    return CostInputs(**values)


def refuse_other_form(given: list[str], *, per_job: bool) -> None:
    """Options given (as typed, ``--disk-gb``) that do not belong to the chosen form: the
    per-job comparison (``--per-job``) takes only :data:`PER_JOB_OPTIONS`, the stop-or-destroy
    calculator takes no ``--epochs``. Raises one :class:`ConfigError` per option, together:
    ignored silently, they would make the user believe they counted."""
    if per_job:
        wrong = [o for o in given if o not in PER_JOB_OPTIONS]
        why = "belongs to the stop-or-destroy form; --per-job compares boxes per job"
    else:
        wrong = [o for o in given if o == "--epochs"]
        why = "applies to --per-job only (the per-job comparison)"
    errors = [ConfigError(option, f"{why}: leave it out") for option in wrong]
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


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
    rebuild = f"$0/h; coming back costs a rebuild, {_usd(i.rebuild_usd)}"
    if i.setup_minutes is not None and i.running_usd_per_hour is not None:
        rebuild += (
            f" ({i.setup_minutes:g} min of setup at ${i.running_usd_per_hour:g}/h + "
            f"{i.transfer_gb or 0:g} GB in at {_price(i.transfer_usd_per_gb or 0)}/GB)"
        )
    rows.append(("destroyed", rebuild))
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


# ---------------------------------------------------------------------------------- per job
#
# Size by cost per job, not by $/h: a small model leaves a big card half idle, so the dearer
# box per hour can be the cheaper one per job, or the other way round. Given the seconds per
# epoch measured on each box (the agent logs them after epoch 1) and each box's price, a job
# of E epochs costs ``E x seconds_per_epoch / 3600 x price`` there.


@dataclass(frozen=True)
class BoxRun:
    """One box for the per-job comparison."""

    #: Seconds per epoch measured (or profiled) on the box.
    seconds_per_epoch: float
    #: The box's running price, USD per hour.
    usd_per_hour: float
    #: ``box 1``, ``box 2``... in the order given.
    label: str = ""

    @property
    def usd_per_epoch(self) -> float:
        return self.seconds_per_epoch / 3600.0 * self.usd_per_hour


@dataclass(frozen=True)
class PerJobReport:
    boxes: tuple[BoxRun, ...]
    #: The job's epochs; None: figures per epoch only (the verdict is the same).
    epochs: int | None
    #: Index in ``boxes`` of the cheapest per job (a tie goes to the faster box).
    cheapest: int

    def job_usd(self, box: BoxRun) -> float:
        return box.usd_per_epoch * (self.epochs or 1)

    def job_hours(self, box: BoxRun) -> float:
        return box.seconds_per_epoch * (self.epochs or 1) / 3600.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "epochs": self.epochs,
            "boxes": [
                {
                    **asdict(b),
                    "usd_per_epoch": b.usd_per_epoch,
                    "job_usd": self.job_usd(b) if self.epochs else None,
                    "job_hours": self.job_hours(b) if self.epochs else None,
                }
                for b in self.boxes
            ],
            "cheapest": self.boxes[self.cheapest].label,
        }


def compare_per_job(boxes: list[BoxRun], epochs: int | None = None) -> PerJobReport:
    """Which box is cheaper per job: the lowest ``seconds_per_epoch x price`` (a tie goes to
    the faster box: the same money, done sooner)."""
    if len(boxes) < 2:
        raise ConfigError("--per-job", "compares two boxes or more: give --per-job twice")
    labelled = tuple(
        b if b.label else BoxRun(b.seconds_per_epoch, b.usd_per_hour, f"box {i + 1}")
        for i, b in enumerate(boxes)
    )
    cheapest = min(
        range(len(labelled)),
        key=lambda i: (labelled[i].usd_per_epoch, labelled[i].seconds_per_epoch),
    )
    return PerJobReport(labelled, epochs, cheapest)


def parse_per_job(pairs: list[list[str]], epochs: str | None) -> tuple[list[BoxRun], int | None]:
    """``--per-job SECONDS_PER_EPOCH USD_PER_HOUR`` (given once per box) and ``--epochs``, as
    typed; :class:`ConfigError` names the option, the value and what was expected."""
    boxes = []
    for i, pair in enumerate(pairs):
        spe_text, price_text = pair
        spe = _positive_number("--per-job", spe_text, "seconds per epoch, more than 0 (e.g. 259)")
        price = _positive_number(
            "--per-job", price_text, "the price in USD per hour, 0 or more (e.g. 3.48)", zero=True
        )
        boxes.append(BoxRun(spe, price, f"box {i + 1}"))
    n: int | None = None
    if epochs is not None:
        try:
            n = int(epochs.strip())
        except ValueError:
            raise ConfigError("--epochs", f"{epochs!r} is not a whole number of epochs") from None
        if n < 1:
            raise ConfigError("--epochs", f"{epochs!r} must be 1 or more")
    return boxes, n


def _positive_number(option: str, raw: str, expected: str, *, zero: bool = False) -> float:
    text = raw.strip().removeprefix("$")
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(option, f"{raw!r} is not a number; expected {expected}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise ConfigError(option, f"{raw!r} is out of range; expected {expected}")
    return value


def format_per_job(report: PerJobReport) -> str:
    """The comparison for a person: per box its cost per epoch (and per job), then which is
    cheaper per job and by how much."""
    lines = []
    for b in report.boxes:
        line = (
            f"{b.label}: {b.seconds_per_epoch:g} s/epoch at ${b.usd_per_hour:g}/h = "
            f"${b.usd_per_epoch:.4f}/epoch"
        )
        if report.epochs:
            line += (
                f"; {report.epochs} epochs: {_hours(report.job_hours(b))}, "
                f"{_usd(report.job_usd(b))}"
            )
        lines.append(line)
    best = report.boxes[report.cheapest]
    others = [b for i, b in enumerate(report.boxes) if i != report.cheapest]
    dearest = max(others, key=lambda b: b.usd_per_epoch)
    saving = report.job_usd(dearest) - report.job_usd(best)
    per = f"per job of {report.epochs} epochs" if report.epochs else "per epoch"
    verdict = f"cheaper per job: {best.label} (saves {_usd(saving)} {per} over {dearest.label}"
    slower = [b for b in others if b.seconds_per_epoch < best.seconds_per_epoch]
    if slower:
        fastest = min(slower, key=lambda b: b.seconds_per_epoch)
        ratio = best.seconds_per_epoch / fastest.seconds_per_epoch
        verdict += f"; {ratio:.1f}x slower than {fastest.label}"
    lines.append(verdict + ")")
    return "\n".join(lines)
