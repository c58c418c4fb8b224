"""Is this the right box? A verdict on what limits the training speed, and what the job costs.

During the first epochs of the real run the daemon feeds a :class:`SizingWatch` each loop turn
with the GPU samples (:meth:`agent.gpu.health.GpuMonitor.samples`), the CPU seconds used so far
by the trainer's process tree (:class:`agent.watch.sampling.TreeCpu`), the box's CPU count and
the run's status.json (epoch times). From the samples of the last :data:`WINDOW_S` it gives a
:class:`Verdict` in the vocabulary of LibreYOLO's profiler (``libreyolo profile``):

- ``gpu``: the mean utilisation of the job's GPUs is at least :data:`GPU_BOUND_UTIL_PCT`: the
  card is the limit (a faster card would shorten the run).
- ``idle gpu``: the GPUs are below :data:`IDLE_UTIL_PCT`: nothing runs on the card (training
  on the CPU by mistake, a hang, a wait on I/O).
- ``dataloader``: low GPU use while the trainer's processes are saturated: at least
  :data:`SATURATED_FRACTION` of what they can use (one core per process of the tree, at most
  the box's CPUs). The GPU waits for input: more workers (while CPUs are free), ``cache``, or a
  cheaper GPU.
- ``host / launch``: low GPU use with CPU to spare: small kernels and per-step host overhead.
  A bigger batch helps, a faster GPU does not.
- ``unknown``: no GPU reading (no NVML) or fewer than :data:`MIN_SAMPLES` samples yet.

Utilisation is NVML's: the fraction of time some kernel ran. It overstates the use of a card
that runs tiny kernels; the power draw (shown beside it) tells those apart.

:func:`project` turns seconds per epoch into the job's time and cost on this box;
:func:`advice` and :func:`summary_line` word them for the log, ``/status``, the page and the
post-mortem. Everything here is arithmetic on what it was given: tests feed recorded samples.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import psutil

from agent.config.model import Job, ProfileSection, format_duration
from agent.gpu.health import GpuSample
from agent.trainer.rundir import RunStatus
from agent.watch.sampling import Sampler

#: What limits the training speed (LibreYOLO's profiler says ``compute`` for ``gpu``).
Bound = Literal["gpu", "dataloader", "host / launch", "idle gpu", "unknown"]

#: The card is the limit from this mean utilisation, percent (LibreYOLO's profiler: 80 %).
GPU_BOUND_UTIL_PCT = 80.0
#: Below this mean utilisation, percent, the card counts as idle.
IDLE_UTIL_PCT = 5.0
#: The trainer's processes count as saturated from this fraction of what they can use.
SATURATED_FRACTION = 0.8
#: Fewer samples than this in the window: no verdict yet.
MIN_SAMPLES = 5
#: The verdict is taken over the samples of this many seconds (the recent speed is what counts).
WINDOW_S = 600.0
#: Below this fraction of its power limit a "busy" GPU runs small kernels (gpuhealth measured
#: 12 % idle and 17 % for a spinning kernel on an H200).
LOW_POWER_FRACTION = 0.3
#: The bounds that say the box is the wrong size: a faster (dearer) GPU would not help.
WRONG_BOX: frozenset[Bound] = frozenset({"dataloader", "host / launch", "idle gpu"})
#: LibreYOLO profiler words -> ours (``memory-pressure`` and ``mixed`` readings are unreliable).
PROFILER_BOUNDS: Mapping[str, Bound] = {
    "compute": "gpu",
    "dataloader": "dataloader",
    "host / launch": "host / launch",
}


@dataclass(frozen=True)
class Verdict:
    """What limits the run, with the figures it rests on."""

    bound: Bound
    #: One line: the figures and why (``GPU 38 % at 210 W of 700 W, 16/16 CPUs busy``).
    detail: str
    #: Mean utilisation of the job's GPUs over the window, percent; None without a reading.
    gpu_util: float | None
    #: CPU cores the trainer's tree kept busy on average over the window; None before two turns.
    cpu_busy: float | None
    #: Measured seconds per epoch (steady epochs; the first only while it is the only one).
    seconds_per_epoch: float | None
    #: Where it comes from: ``samples`` (the live run) or ``profiler`` (``libreyolo profile``).
    source: str = "samples"
    #: The box's CPU count, for the ``16/16 CPUs busy`` wording.
    cpu_count: int | None = None

    @property
    def wrong_box(self) -> bool:
        """The verdict says a faster GPU would not help: the box is the wrong size."""
        return self.bound in WRONG_BOX

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "wrong_box": self.wrong_box}


@dataclass(frozen=True)
class Projection:
    """The job's time and cost on this box."""

    #: Training time of all epochs at the measured speed, seconds.
    total_s: float
    #: Training time of the epochs still to run, seconds.
    remaining_s: float
    #: ``spent_usd`` + the remaining time at the price, USD; None without a price.
    total_usd: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def project(
    total_epochs: int,
    done_epochs: int,
    seconds_per_epoch: float,
    price_usd_per_hour: float | None,
    spent_usd: float = 0.0,
) -> Projection:
    """``total_s = total_epochs x seconds_per_epoch``, ``remaining_s = (total - done) x
    seconds_per_epoch``, ``total_usd = spent_usd + remaining_s / 3600 x price`` (None without a
    price). ``spent_usd`` is what the box cost so far, preflight and staging included."""
    remaining_epochs = max(0, total_epochs - max(0, done_epochs))
    total_s = max(0, total_epochs) * seconds_per_epoch
    remaining_s = remaining_epochs * seconds_per_epoch
    total_usd = (
        None
        if price_usd_per_hour is None
        else spent_usd + remaining_s / 3600.0 * price_usd_per_hour
    )
    return Projection(total_s, remaining_s, total_usd)


def profile_seconds_per_epoch(img_per_s: float, train_images: int) -> float | None:
    """Seconds per epoch from the profiler's training speed and the train split's image count
    (``libreyolo doctor``'s ``stats.splits.train.images``): training steps only, validation
    not included, so an under-estimate. None when either is unknown or zero."""
    if img_per_s <= 0 or train_images <= 0:
        return None
    return train_images / img_per_s


def train_images(doctor_report: Mapping[str, Any] | None) -> int | None:
    """The train split's image count from a ``libreyolo doctor --json`` report, if it has one."""
    try:
        n = (doctor_report or {})["stats"]["splits"]["train"]["images"]
    except (KeyError, TypeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


@dataclass(frozen=True)
class _Turn:
    at: float
    util: float | None
    power_frac: float | None
    power_w: float | None
    power_limit_w: float | None
    cpu_s: float | None
    processes: int | None


class SizingWatch:
    """Collects the samples of the live run and judges them (see the module docstring).

    ``gpu_indices``: the job's GPUs (:func:`job_gpu_indices`); None: every GPU of the box.
    ``workers``: the job's ``train.workers`` when set, a cap on what the tree can use."""

    def __init__(
        self,
        *,
        gpu_indices: Collection[int] | None = None,
        workers: int | None = None,
        window_s: float = WINDOW_S,
        min_samples: int = MIN_SAMPLES,
    ) -> None:
        self._gpu_indices = None if gpu_indices is None else frozenset(gpu_indices)
        self._workers = workers
        self._window_s = window_s
        self._min_samples = min_samples
        self._turns: deque[_Turn] = deque()
        self._cpu_count: int | None = None
        self._epoch_s: dict[int, float] = {}
        self._mean_epoch_s: float | None = None
        self.completed_epochs = 0
        self.total_epochs: int | None = None

    def observe(
        self,
        now: float,
        gpus: Sequence[GpuSample],
        tree_cpu_s: float | None,
        cpu_count: int | None,
        status: RunStatus | None = None,
        *,
        processes: int | None = None,
    ) -> None:
        """One loop turn: the GPU samples, the tree's CPU seconds so far (:class:`TreeCpu`),
        the box's CPU count, status.json (its ``epoch_seconds`` per completed epoch) and the
        number of processes in the tree."""
        mine = [g for g in gpus if self._gpu_indices is None or g.index in self._gpu_indices]
        utils = [g.util_pct for g in mine if g.util_pct is not None]
        fracs = [
            g.power_w / g.power_limit_w for g in mine if g.power_w is not None and g.power_limit_w
        ]
        watts = [g.power_w for g in mine if g.power_w is not None]
        limits = [g.power_limit_w for g in mine if g.power_limit_w]
        self._turns.append(
            _Turn(
                now,
                _mean(utils),
                _mean(fracs),
                _mean(watts),
                _mean(limits),
                tree_cpu_s,
                processes,
            )
        )
        while self._turns and now - self._turns[0].at > self._window_s:
            self._turns.popleft()
        if cpu_count:
            self._cpu_count = cpu_count
        if status is not None:
            self._observe_status(status)

    def sample(self, sampler: Sampler, now: float, status: RunStatus | None = None) -> None:
        """:meth:`observe` with the readings of ``sampler`` (blocking: call it in a thread)."""
        self.observe(
            now,
            sampler.gpus(),
            sampler.tree_cpu_s(),
            psutil.cpu_count() or None,
            status,
            processes=sampler.processes(),
        )

    def _observe_status(self, status: RunStatus) -> None:
        self.completed_epochs = status.completed_epochs
        self.total_epochs = status.total_epochs
        raw = status.raw
        last = _positive(raw.get("epoch_seconds"))
        if last is not None and status.completed_epochs > 0:
            self._epoch_s.setdefault(status.completed_epochs, last)
        mean = _positive(raw.get("mean_epoch_seconds"))
        if mean is not None:
            self._mean_epoch_s = mean

    def seconds_per_epoch(self) -> float | None:
        """Steady seconds per epoch: the mean of the epochs timed after the first of this run
        (the first pays for warm-up), the first alone while it is the only one, else
        status.json's ``mean_epoch_seconds``."""
        times = dict(self._epoch_s)
        if len(times) > 1:
            times.pop(min(times))
        if times:
            return sum(times.values()) / len(times)
        return self._mean_epoch_s

    def _cpu_busy(self) -> float | None:
        """Mean cores busy over the window: CPU seconds between the first and last turn that
        had a reading, over the time between them."""
        with_cpu = [t for t in self._turns if t.cpu_s is not None]
        if len(with_cpu) < 2:
            return None
        first, last = with_cpu[0], with_cpu[-1]
        elapsed = last.at - first.at
        if elapsed <= 0:
            return None
        assert first.cpu_s is not None and last.cpu_s is not None
        return max(0.0, last.cpu_s - first.cpu_s) / elapsed

    def _capacity(self) -> float | None:
        """Cores the trainer's tree can keep busy: one per process (or ``workers + 1``), at
        most the box's CPUs."""
        caps: list[float] = []
        procs = [t.processes for t in self._turns if t.processes]
        if procs:
            caps.append(float(max(procs)))
        if self._workers is not None:
            caps.append(float(self._workers + 1))
        if self._cpu_count:
            caps.append(float(self._cpu_count))
        return min(caps) if caps else None

    def verdict(self) -> Verdict:
        """The verdict over the samples in the window (``unknown`` until there are enough)."""
        spe = self.seconds_per_epoch()
        cpu_busy = self._cpu_busy()
        n = self._cpu_count
        utils = [t.util for t in self._turns if t.util is not None]
        if len(self._turns) < self._min_samples:
            return Verdict(
                "unknown",
                f"not enough samples yet ({len(self._turns)} of {self._min_samples})",
                _mean(utils),
                cpu_busy,
                spe,
                cpu_count=n,
            )
        if not utils:
            return Verdict(
                "unknown",
                "no GPU reading (NVML unavailable, or the job's GPUs are not seen)"
                + (f"; trainer CPU {_cores(cpu_busy, n)}" if cpu_busy is not None else ""),
                None,
                cpu_busy,
                spe,
                cpu_count=n,
            )
        util = sum(utils) / len(utils)
        fracs = [t.power_frac for t in self._turns if t.power_frac is not None]
        frac = _mean(fracs)
        gpu_words = _gpu_words(util, self._turns)
        cap = self._capacity()
        saturated = (
            cpu_busy is not None and cap is not None and cpu_busy >= SATURATED_FRACTION * cap
        )
        cpu_words = "CPU not measured" if cpu_busy is None else _cores(cpu_busy, n)
        bound: Bound
        if util >= GPU_BOUND_UTIL_PCT:
            bound = "gpu"
            why = "the card is the limit"
            if frac is not None and frac < LOW_POWER_FRACTION:
                why += f" (but at {frac * 100:.0f} % of its power: small kernels)"
        elif util < IDLE_UTIL_PCT:
            bound = "idle gpu"
            why = (
                "the trainer keeps the CPU busy while the card idles: is it training on the CPU?"
                if cpu_busy is not None and cpu_busy >= 1.0
                else "nothing runs on the card"
            )
        elif saturated:
            bound = "dataloader"
            why = "the trainer's CPU workers are saturated: the card waits for input"
        else:
            bound = "host / launch"
            why = "the card is underused with CPU to spare: small kernels and host overhead"
        detail = f"{gpu_words}, {cpu_words}: {why}"
        return Verdict(bound, detail, util, cpu_busy, spe, cpu_count=n)

    def snapshot(self) -> dict[str, Any]:
        """For ``/status``: the verdict and the epoch timing it rests on."""
        return {
            "verdict": self.verdict().to_dict(),
            "samples": len(self._turns),
            "completed_epochs": self.completed_epochs,
            "total_epochs": self.total_epochs,
        }


def profiler_verdict(doc: Mapping[str, Any], cpu_count: int | None = None) -> Verdict:
    """A :class:`Verdict` from LibreYOLO's own profiler JSON (``profile run --json`` or
    ``profile summary --json``): its ``bound`` in our words, ``gpu_util`` (a fraction there)
    as percent; ``memory-pressure`` and ``mixed`` become ``unknown`` (LibreYOLO says its
    figures are unreliable then)."""
    raw = str(doc.get("bound") or "")
    bound: Bound = PROFILER_BOUNDS.get(raw, "unknown")
    util = doc.get("gpu_util")
    util_pct = float(util) * 100.0 if isinstance(util, int | float) else None
    ips = doc.get("img_per_s")
    parts = [f"LibreYOLO profiler: {raw or 'no verdict'}"]
    if isinstance(ips, int | float):
        parts.append(f"{ips:g} img/s")
    if util_pct is not None:
        parts.append(f"GPU {util_pct:.0f} %")
    why = doc.get("bound_why")
    detail = ", ".join(parts) + (f" ({why})" if why else "")
    return Verdict(bound, detail, util_pct, None, None, source="profiler", cpu_count=cpu_count)


# ------------------------------------------------------------------------------- words


def job_gpu_indices(job: Job) -> tuple[int, ...] | None:
    """The GPUs ``train.device`` names (``0``, ``0,1``, ``cuda:1``); ``()`` for ``cpu``
    (and ``mps``); None when it names none (LibreYOLO picks: watch every GPU)."""
    device = job.train.get("device")
    if device is None or isinstance(device, bool):
        return None
    if isinstance(device, int):
        return (device,)
    text = str(device).strip().lower()
    if text in ("cpu", "mps"):
        return ()
    found = tuple(int(n) for n in re.findall(r"\d+", text))
    return found or None


def job_workers(job: Job) -> int | None:
    """``train.workers`` when the job sets it as an integer."""
    w = job.train.get("workers")
    return w if isinstance(w, int) and not isinstance(w, bool) and w >= 0 else None


def advice(verdict: Verdict, job: Job) -> str:
    """What to try, for the log line and the page ("" when there is nothing to say)."""
    n = verdict.cpu_count
    workers = job_workers(job)
    batch = job.train.get("batch")
    if verdict.bound == "dataloader":
        if n and verdict.cpu_busy is not None and verdict.cpu_busy >= SATURATED_FRACTION * n:
            return (
                "every CPU is busy: more workers cannot help; try cache=ram, lighter "
                "augmentation, a box with more CPUs per GPU, or a cheaper GPU"
            )
        suggest = _more_workers(workers, n)
        more = f"workers={suggest}" if suggest else "more workers"
        return f"try {more} or cache=ram, or a cheaper GPU"
    if verdict.bound == "host / launch":
        bigger = (
            f"batch={2 * batch}"
            if isinstance(batch, int) and not isinstance(batch, bool) and batch > 0
            else "a bigger batch"
        )
        return f"try {bigger} or a cheaper GPU: a faster one would not help"
    if verdict.bound == "idle gpu":
        device = job.train.get("device")
        shown = f" (it is {device!r})" if device is not None else ""
        return f"check train.device{shown} and the train log: the card does no work"
    if verdict.bound == "gpu":
        return "the box fits the job: only a faster GPU would shorten it"
    return ""


def _more_workers(workers: int | None, cpu_count: int | None) -> int | None:
    """A worker count to try: double the job's (8 when unset), leaving a CPU for the trainer."""
    if not cpu_count or cpu_count < 2:
        return None
    suggest = min(cpu_count - 1, 2 * workers if workers else 8)
    return suggest if workers is None or suggest > workers else None


def summary_line(
    verdict: Verdict, projection: Projection | None, job: Job, *, price_known: bool = True
) -> str:
    """The log line after epoch 1: ``this job: ~7.2 h, ~$25 on this box; verdict: dataloader
    bound (GPU 38 %, 16/16 CPUs busy): try workers=12 or a cheaper GPU``."""
    parts: list[str] = []
    if projection is not None:
        cost = ""
        if projection.total_usd is not None:
            cost = (
                f", ~${projection.total_usd:.0f}"
                if projection.total_usd >= 10
                else (f", ~${projection.total_usd:.2f}")
            )
        elif not price_known:
            cost = " (no price: cost unknown)"
        parts.append(f"this job: ~{_hours(projection.total_s)}{cost} on this box")
    figures = _figures(verdict)
    words = verdict.bound if verdict.bound in ("unknown", "idle gpu") else f"{verdict.bound} bound"
    text = f"verdict: {words}" + (f" ({figures})" if figures else "")
    hint = advice(verdict, job)
    parts.append(text + (f": {hint}" if hint else ""))
    return "; ".join(parts)


def sizing_status(
    verdict: Verdict | None,
    projection: Projection | None,
    profile: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The ``/status`` key ``sizing``: ``{verdict, projection, profile}`` (None where unknown)."""
    return {
        "verdict": None if verdict is None else verdict.to_dict(),
        "projection": None if projection is None else projection.to_dict(),
        "profile": None if profile is None else dict(profile),
    }


def stop_reason(
    verdict: Verdict | None,
    projection: Projection | None,
    cfg: ProfileSection,
    budget_usd: float | None,
) -> str | None:
    """Why the job stops before the long run under ``on_verdict = "stop"``: a wrong-size
    verdict, or a projected cost over ``limits.budget_usd``; None to go on (always with
    ``warn``, and never on an ``unknown`` verdict: no reading is no reason)."""
    if cfg.on_verdict != "stop":
        return None
    if (
        projection is not None
        and projection.total_usd is not None
        and budget_usd is not None
        and projection.total_usd > budget_usd
    ):
        return (
            f"this job is projected to cost ${projection.total_usd:.2f} on this box "
            f"(~{_hours(projection.total_s)} of training), over limits.budget_usd "
            f'${budget_usd:.2f} ([profile] on_verdict = "stop")'
        )
    if verdict is not None and verdict.wrong_box:
        figures = _figures(verdict)
        return (
            f"wrong box: {verdict.bound} bound"
            + (f" ({figures})" if figures else "")
            + f', a faster GPU would not help ({verdict.source}; [profile] on_verdict = "stop")'
        )
    return None


def _figures(v: Verdict) -> str:
    parts = []
    if v.gpu_util is not None:
        parts.append(f"GPU {v.gpu_util:.0f} %")
    if v.cpu_busy is not None:
        parts.append(_cores(v.cpu_busy, v.cpu_count))
    return ", ".join(parts)


def _cores(busy: float | None, cpu_count: int | None) -> str:
    if busy is None:
        return "CPU not measured"
    if cpu_count:
        return f"{min(cpu_count, round(busy))}/{cpu_count} CPUs busy"
    return f"{busy:.1f} CPUs busy"


def _gpu_words(util: float, turns: Sequence[_Turn]) -> str:
    watts = _mean([t.power_w for t in turns if t.power_w is not None])
    limit = _mean([t.power_limit_w for t in turns if t.power_limit_w is not None])
    text = f"GPU {util:.0f} %"
    if watts is not None:
        text += f" at {watts:.0f} W" + (f" of {limit:.0f} W" if limit else "")
    return text


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else format_duration(seconds)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _positive(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) and v > 0 else None
