"""``teardown.on_success = "auto"``: stop or destroy, from this box's own figures.

The guide's rule (:mod:`agent.policy.cost`): a stopped box costs its disk, ``GB x storage
$/GB-month / 720`` an hour; a destroyed one costs a rebuild when the next run comes; so for an
expected gap ``G`` (``teardown.expected_gap``) stop when ``G x stopped rate`` is at most the
rebuild cost, i.e. when ``G`` is under break-even = rebuild / stopped rate, else destroy.

Every figure is this run's own:

- the rebuild: what getting back to the first epoch cost on this box, the minutes from the
  agent's first start for this job to the trainer's start (preflight, staging, launch: the
  ``TRAINING`` phase's first entry in state.json's history) at the box's price
  (``limits.price_usd_per_hour``, or the provider's with ``"auto"``), plus the dataset archive
  it staged (``staging.json``'s ``archive_bytes``) at :data:`agent.policy.cost.TRANSFER_USD_PER_GB`.
  What ran before the agent (the image pull, ``install.sh``) is not seen, so the rebuild is a
  floor: the rule leans to stop, the reversible side;
- the disk and its price: the provider's (Vast's ``disk_space`` and ``storage_cost``, read at
  the decision), else ``limits.storage_usd_per_gb_month`` for the price.

Where a figure is missing (no price, a provider that does not say its disk) the rule cannot be
applied, and the answer is **stop**: it costs cents an hour and can be undone; a destroy cannot.
A provider that cannot stop (Lambda, ``command`` without ``stop_command``) gets destroy: the
only way to end its bill. Either answer still passes the teardown's gates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent.config.jobvalues import format_duration
from agent.data.dataset import read_marker
from agent.policy.cost import (
    GPU_WARNING,
    HOURS_PER_MONTH,
    TRANSFER_USD_PER_GB,
    CostInputs,
    Verdict,
    compute,
    rebuild_usd,
)
from agent.state import RunState


@dataclass(frozen=True)
class AutoInputs:
    """What the rule is fed; None where this run does not know it."""

    gap_s: float
    #: From the agent's first start to the trainer's, seconds.
    setup_s: float | None
    price_usd_per_hour: float | None
    #: The dataset archive staged from the Hub, GB (0 with nothing staged).
    data_gb: float | None
    disk_gb: float | None
    storage_usd_per_gb_month: float | None
    #: Where the disk and the storage price came from (``provider``, ``job``), for the words.
    disk_source: str | None = None
    storage_source: str | None = None
    can_stop: bool = True
    transfer_usd_per_gb: float = TRANSFER_USD_PER_GB


@dataclass(frozen=True)
class AutoDecision:
    action: Verdict
    #: One line with the arithmetic: the log, the teardown's why, /status, the post-mortem.
    why: str
    inputs: AutoInputs
    rebuild_usd: float | None = None
    stopped_usd_per_hour: float | None = None
    break_even_hours: float | None = None
    stop_usd: float | None = None
    warning: str = GPU_WARNING

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _h(hours: float) -> str:
    return f"{hours:.1f}h"


def decide_auto(i: AutoInputs) -> AutoDecision:
    """Stop or destroy for the gap ``i.gap_s`` (see the module docstring)."""
    gap = f"expected gap {format_duration(i.gap_s)}"
    if not i.can_stop:
        why = f"auto: destroy (this provider cannot stop; {gap})"
        return AutoDecision("destroy", why, i)
    unknown = [
        name
        for name, value in (
            ("the price (limits.price_usd_per_hour)", i.price_usd_per_hour),
            ("the setup time (no TRAINING in the history)", i.setup_s),
            ("the disk size (the provider does not say it)", i.disk_gb),
            (
                "the storage price (the provider does not say it: limits.storage_usd_per_gb_month)",
                i.storage_usd_per_gb_month,
            ),
        )
        if value is None
    ]
    if unknown:
        why = f"auto: stop (unknown: {', '.join(unknown)}; unknown -> stop)"
        return AutoDecision("stop", why, i)
    assert i.price_usd_per_hour is not None and i.setup_s is not None  # for mypy: checked above
    assert i.disk_gb is not None and i.storage_usd_per_gb_month is not None
    data_gb = i.data_gb or 0.0
    minutes = i.setup_s / 60.0
    rebuild = rebuild_usd(minutes, i.price_usd_per_hour, data_gb, i.transfer_usd_per_gb)
    report = compute(
        CostInputs(
            disk_gb=i.disk_gb,
            storage_usd_per_gb_month=i.storage_usd_per_gb_month,
            rebuild_usd=rebuild,
            running_usd_per_hour=i.price_usd_per_hour,
            gap_hours=i.gap_s / 3600.0,
        )
    )
    assert report.gap is not None  # a gap was given
    even = report.break_even_hours
    action = report.gap.verdict
    compare = (
        "stopping is free"
        if even is None
        else f"{gap} {'<=' if action == 'stop' else '>'} break-even {_h(even)}"
    )
    why = (
        f"auto: {action} ({compare}; rebuild ${rebuild:.2f} = {minutes:.1f} min setup x "
        f"${i.price_usd_per_hour:.4f}/h + {data_gb:.1f} GB staged x ${i.transfer_usd_per_gb}/GB; "
        f"stopped ${report.stopped_usd_per_hour:.4f}/h = {i.disk_gb:.0f} GB "
        f"({i.disk_source or '?'}) x ${i.storage_usd_per_gb_month}/GB-month "
        f"({i.storage_source or '?'}) / {HOURS_PER_MONTH:.0f})"
    )
    return AutoDecision(
        action,
        why,
        i,
        rebuild_usd=rebuild,
        stopped_usd_per_hour=report.stopped_usd_per_hour,
        break_even_hours=even,
        stop_usd=report.gap.stop_usd,
    )


def setup_seconds(state: RunState) -> float | None:
    """From the agent's first start for this job to the trainer's first start (the first
    change to TRAINING in the history), seconds; None when training never started."""
    for entry in state.history:
        at = entry.get("at")
        if entry.get("to") == "TRAINING" and isinstance(at, int | float):
            return max(0.0, float(at) - state.started_at)
    return None


def staged_gb(staging: Mapping[str, Any] | None) -> float:
    """The dataset archive this box fetched, GB: the staging marker's ``archive_bytes`` (in the
    staged folder, ``staging.json``'s ``dest``), else the unpacked bytes; 0 when nothing was
    staged (a dataset already on the box is not counted: the agent never moved it)."""
    staging = staging or {}
    size = staging.get("archive_bytes")
    if not _bytes(size) and isinstance(staging.get("dest"), str):
        size = (read_marker(Path(staging["dest"])) or {}).get("archive_bytes")
    if not _bytes(size):
        size = staging.get("unpacked_bytes")
    return float(size) / 1e9 if isinstance(size, int | float) and _bytes(size) else 0.0


def _bytes(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
