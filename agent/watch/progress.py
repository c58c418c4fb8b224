"""Is the training run still making progress? Stall detection from more than status.json.

status.json moves only once per epoch, so a stall timeout read from it alone is either too short
for slow epochs or far too long for fast ones. :class:`ProgressTracker` watches several signals,
adapts its threshold to the epoch time it observes, and says in one line what was quiet.

Progress signals (any one moving restarts the quiet time):

- ``status``: status.json changed (completed epochs, state or ``updated_at``), or appeared;
- ``checkpoint``: a ``weights/*.pt`` file changed (mtime or size), or appeared;
- ``log``: a train log changed size or mtime, or appeared (the progress bar grows it during an
  epoch).

Alive signals (they never restart the quiet time; they can only postpone the verdict):

- ``cpu``: the trainer's process tree (the given pids and all their descendants) used at least
  :data:`CPU_BUSY_FRACTION` of one core since the previous observation;
- ``gpu``: some GPU is busy (:attr:`agent.gpu.health.GpuSample.busy`): utilisation high AND power
  well above idle. A hung NCCL collective spins at 100 % utilisation at low power: not busy. A
  dead kernel shows 0 %: not busy.

The rule, with ``now`` from the injected clock:

- ``quiet = now - (the last time a progress signal moved, or start() when none has)``.
- ``steady = max(stall_timeout, stall_epoch_factor x mean epoch time)``, once an epoch time is
  known. ``first = max(stall_timeout, first_epoch_timeout (default 3 x stall_timeout), steady)``.
- ``threshold = first`` until an epoch completes after :meth:`~ProgressTracker.start` and an epoch
  time is known (data loading, compilation and start-up belong to the first epoch; a resumed
  trainer starts up again), ``steady`` after.
- Stalled when ``quiet >= threshold``, unless an alive signal moved within the alive window
  (``min(threshold, alive_window_s)``) and ``quiet < 2 x threshold``: then the verdict is
  deferred. At ``2 x threshold`` it is a stall whatever the alive signals say (a deadlock can spin
  too). A slow run is never stalled: its log or checkpoints keep moving.

Mean epoch time: the time between consecutive observed changes of ``completed_epochs``, divided
by the epochs they advanced, over the last :data:`EPOCH_WINDOW` of them. Until two changes were
seen, a run that started from epoch 0 under this supervision uses its first epoch (start-up
included: an over-estimate, so a generous threshold); a trainer found mid-run (agent restart,
resume) is not timed until its second epoch change, because its first interval may be a fraction
of an epoch.

Everything is a function of what :meth:`~ProgressTracker.observe` saw and the clock, so the
timing logic is tested with an injected clock; ``observe`` is cheap but blocking (stat, psutil,
NVML): the daemon calls it from a worker thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from agent.config.model import LimitsSection, format_duration
from agent.gpu.health import GpuMonitor, GpuSample
from agent.trainer.process import tree_cpu_seconds
from agent.trainer.rundir import RunStatus

#: Signals that show the run moving forward.
ProgressSignal = Literal["status", "checkpoint", "log"]
#: Signals that show the trainer doing something (not necessarily progress).
AliveSignal = Literal["cpu", "gpu"]
Signal = ProgressSignal | AliveSignal

PROGRESS_SIGNALS: tuple[ProgressSignal, ...] = ("status", "checkpoint", "log")
ALIVE_SIGNALS: tuple[AliveSignal, ...] = ("cpu", "gpu")
_WORDS: dict[Signal, str] = {
    "status": "status.json",
    "checkpoint": "checkpoints",
    "log": "train log",
    "cpu": "process-tree CPU",
    "gpu": "GPU",
}

#: The process tree counts as busy from this fraction of one core between two observations
#: (idle helper threads stay far below it; a spinning deadlock uses a whole core).
CPU_BUSY_FRACTION = 0.05
#: ...and at least this much CPU time, seconds (below the kernel's tick it is noise).
CPU_MIN_BUSY_S = 0.02
#: Epoch intervals the mean epoch time is taken over (the recent speed is what counts).
EPOCH_WINDOW = 20
#: Default alive window, seconds: an alive signal older than this no longer defers a verdict.
ALIVE_WINDOW_S = 120.0
#: The verdict is deferred by alive signals up to this multiple of the threshold, never beyond.
DEFER_CAP = 2.0


@dataclass(frozen=True)
class Stall:
    """Why the run counts as stalled."""

    #: One line: what was quiet for how long, the threshold, the evidence.
    message: str
    quiet_s: float
    threshold_s: float
    evidence: dict[str, Any]


class ProgressTracker:
    """Watches the progress and alive signals of one training run (see the module docstring).

    ``clock`` is the one time source (monotonic seconds in the daemon, a fake in tests); ``gpu``
    the GPU monitor whose samples are the GPU alive signal (None or unavailable: no GPU signal).
    """

    def __init__(
        self,
        cfg: LimitsSection,
        *,
        clock: Callable[[], float],
        gpu: GpuMonitor | None = None,
        alive_window_s: float = ALIVE_WINDOW_S,
    ) -> None:
        self._cfg = cfg
        self._clock = clock
        self._gpu = gpu
        self._alive_window_s = alive_window_s
        #: Epoch intervals seen in this run: (seconds, epochs advanced); kept across start().
        self._intervals: list[tuple[float, int]] = []
        #: Start-up-inclusive first epoch of a run that began at epoch 0 under supervision.
        self._first_epoch_s: float | None = None
        self._started_at: float | None = None
        self._reset_observations()

    def _reset_observations(self) -> None:
        self._moved: dict[Signal, float | None] = dict.fromkeys(
            (*PROGRESS_SIGNALS, *ALIVE_SIGNALS), None
        )
        self._observed = False
        self._observed_at: float | None = None
        self._status_key: tuple[int, str, str | None] | None = None
        self._epochs: int | None = None
        #: Where epoch timing counts from: (time, completed epochs, includes start-up).
        self._mark: tuple[float, int, bool] | None = None
        self._epoch_since_start = False
        self._files: dict[Path, tuple[int, int] | None] = {}
        self._cpu: dict[tuple[int, float], float] = {}
        self._cpu_busy = False
        self._gpu_samples: list[GpuSample] = []

    # ----------------------------------------------------------------------------------------
    # Observing

    def start(self, now: float | None = None) -> None:
        """Supervision (re)starts, e.g. a trainer launched, resumed or re-attached: the quiet
        time counts from ``now`` and the first-epoch allowance applies again. The epoch times
        measured so far are kept (same run, same box)."""
        self._started_at = self._clock() if now is None else now
        self._reset_observations()

    def observe(
        self,
        *,
        status: RunStatus | None,
        log_paths: Sequence[Path],
        run_dir: Path | None,
        pids: Collection[int],
    ) -> None:
        """Record which signals moved since the previous call. The first call after
        :meth:`start` only takes the baselines. Blocking but cheap: stat calls, psutil CPU
        times of ``pids`` and their descendants, and the GPU monitor's samples."""
        if self._started_at is None:
            self.start()
        now = self._clock()
        self._observe_status(status, now)
        files: dict[Path, tuple[ProgressSignal, tuple[int, int] | None]] = {
            Path(p): ("log", _stat(Path(p))) for p in log_paths
        }
        if run_dir is not None:
            for path in _checkpoints(run_dir):
                files[path] = ("checkpoint", _stat(path))
        self._observe_files(files, now)
        self._observe_cpu(pids, now)
        self._observe_gpu(now)
        self._observed = True
        self._observed_at = now

    def _moved_now(self, signal: Signal, now: float) -> None:
        if self._observed:
            self._moved[signal] = now

    def _observe_status(self, status: RunStatus | None, now: float) -> None:
        if status is None:
            # Not written yet, or unreadable for a moment: no signal either way.
            return
        key = (status.completed_epochs, status.state, status.updated_at)
        if key != self._status_key:
            self._moved_now("status", now)
        self._status_key = key
        done, before = status.completed_epochs, self._epochs
        self._epochs = done
        if before is None:
            # The first status this supervision sees: a run at epoch 0 is timed from start()
            # (start-up included); one found mid-run from its next epoch change.
            if done == 0 and self._started_at is not None:
                self._mark = (self._started_at, 0, True)
            return
        if done < before:
            # A new run in the same place: its timing starts over.
            self._mark = None
            return
        if done == before:
            return
        self._epoch_since_start = True
        if self._mark is not None:
            t0, e0, startup = self._mark
            seconds, epochs = now - t0, done - e0
            if startup:
                self._first_epoch_s = seconds / epochs
            else:
                self._intervals.append((seconds, epochs))
                del self._intervals[:-EPOCH_WINDOW]
        self._mark = (now, done, False)

    def _observe_files(
        self, files: dict[Path, tuple[ProgressSignal, tuple[int, int] | None]], now: float
    ) -> None:
        seen: dict[Path, tuple[int, int] | None] = {}
        for path, (signal, stat) in files.items():
            seen[path] = stat
            # A path seen for the first time is a baseline; a file that appears later (its
            # path was watched while missing) is progress.
            if path in self._files and self._files[path] != stat:
                self._moved_now(signal, now)
            elif path not in self._files and self._observed and signal == "checkpoint":
                self._moved_now(signal, now)  # a new weights file (best.pt, epoch_N.pt)
        self._files = seen

    def _observe_cpu(self, pids: Collection[int], now: float) -> None:
        current = tree_cpu_seconds(pids)
        # Per process, so that one exiting (and its CPU time vanishing from the sum) is no
        # negative; a process new since the previous observation counts all its CPU time.
        used = sum(cpu - self._cpu.get(key, 0.0) for key, cpu in current.items())
        elapsed = now - self._observed_at if self._observed_at is not None else 0.0
        self._cpu_busy = self._observed and used >= max(CPU_MIN_BUSY_S, CPU_BUSY_FRACTION * elapsed)
        if self._cpu_busy:
            self._moved_now("cpu", now)
        self._cpu = current

    def _observe_gpu(self, now: float) -> None:
        if self._gpu is None or not self._gpu.available:
            self._gpu_samples = []
            return
        self._gpu_samples = self._gpu.samples()
        if any(s.busy for s in self._gpu_samples):
            self._moved_now("gpu", now)

    # ----------------------------------------------------------------------------------------
    # Judging

    def mean_epoch_s(self) -> float | None:
        """Mean epoch time over the recent observed epochs, seconds; None before one is known."""
        if self._intervals:
            return sum(s for s, _ in self._intervals) / sum(n for _, n in self._intervals)
        return self._first_epoch_s

    def first_epoch(self) -> bool:
        """True while the first-epoch allowance applies (see the module docstring)."""
        return not self._epoch_since_start or self.mean_epoch_s() is None

    def threshold_s(self) -> float | None:
        """Seconds without progress that make a stall; None when stall detection is off."""
        timeout = self._cfg.stall_timeout_s
        if timeout is None:
            return None
        mean = self.mean_epoch_s()
        steady = None if mean is None else max(timeout, self._cfg.stall_epoch_factor * mean)
        if steady is not None and not self.first_epoch():
            return steady
        first = self._cfg.first_epoch_timeout_s
        first = 3.0 * timeout if first is None else first
        return max(timeout, first, steady or 0.0)

    def _last_progress_at(self) -> float:
        times = [t for s in PROGRESS_SIGNALS if (t := self._moved[s]) is not None]
        assert self._started_at is not None
        return max([self._started_at, *times])

    def _alive(self, now: float, threshold: float) -> list[AliveSignal]:
        """The alive signals that moved within the alive window."""
        window = min(threshold, self._alive_window_s)
        return [s for s in ALIVE_SIGNALS if (t := self._moved[s]) is not None and now - t < window]

    def verdict(self) -> Stall | None:
        """A :class:`Stall` once no progress signal moved for the threshold (deferred by alive
        signals up to twice the threshold); None otherwise, and always when detection is off."""
        threshold = self.threshold_s()
        if threshold is None or self._started_at is None:
            return None
        now = self._clock()
        quiet = now - self._last_progress_at()
        if quiet < threshold:
            return None
        alive = self._alive(now, threshold)
        if alive and quiet < DEFER_CAP * threshold:
            return None
        return self._stall(now, quiet, threshold, alive)

    def _stall(self, now: float, quiet: float, threshold: float, alive: list[AliveSignal]) -> Stall:
        assert self._started_at is not None
        started = self._started_at
        quiet_by = {
            s: now - (started if (t := self._moved[s]) is None else t) for s in PROGRESS_SIGNALS
        }
        parts = []
        for s in PROGRESS_SIGNALS:
            never = " (never moved)" if self._moved[s] is None else ""
            parts.append(f"{_WORDS[s]} quiet {_dur(quiet_by[s])}{never}")
        if self._epochs is not None:
            parts[0] += f" at {self._epochs} epoch(s)"
        mean = self.mean_epoch_s()
        if self.first_epoch():
            why = "first-epoch allowance"
        elif mean is not None and self._cfg.stall_epoch_factor * mean > threshold - 1e-9:
            why = f"{self._cfg.stall_epoch_factor:g} x mean epoch {_dur(mean)}"
        else:
            why = "stall_timeout"
        if alive:
            words = " and ".join(_WORDS[s] for s in alive)
            tail = (
                f"; {words} still busy, which deferred the verdict to its cap of "
                f"{DEFER_CAP:g} x threshold: spinning without progress (a hung collective or a "
                "deadlock)"
            )
        else:
            tail = f"; alive evidence: {self._alive_words()}"
        message = (
            f"no training progress for {_dur(quiet)} (threshold {_dur(threshold)}, {why}): "
            + ", ".join(parts)
            + tail
        )
        evidence: dict[str, Any] = {
            "quiet_s": {s: round(v, 3) for s, v in quiet_by.items()},
            "completed_epochs": self._epochs,
            "mean_epoch_s": mean,
            "first_epoch": self.first_epoch(),
            "cpu_busy": self._cpu_busy,
            "gpu_busy": any(s.busy for s in self._gpu_samples),
            "gpus": [s.as_dict() for s in self._gpu_samples],
            "deferred_by": list(alive),
        }
        return Stall(message, quiet, threshold, evidence)

    def _alive_words(self) -> str:
        cpu = "process-tree CPU busy" if self._cpu_busy else "process-tree CPU idle"
        if self._gpu is None or not self._gpu_samples:
            return f"{cpu}, no GPU reading"
        gpus = "; ".join(
            s.describe() + (" (busy)" if s.busy else " (not busy)") for s in self._gpu_samples
        )
        return f"{cpu}, {gpus}"

    def snapshot(self) -> dict[str, Any]:
        """For ``/status``: the threshold, the quiet time, the epoch timing, and per signal the
        clock time it last moved and how long ago (None: not since start())."""
        threshold = self.threshold_s()
        now = self._clock()
        started = self._started_at
        quiet = None if started is None else now - self._last_progress_at()
        deferred = (
            threshold is not None
            and quiet is not None
            and threshold <= quiet < DEFER_CAP * threshold
            and bool(self._alive(now, threshold))
        )
        signals = {
            s: {
                "kind": "progress" if s in PROGRESS_SIGNALS else "alive",
                "moved_at": t,
                "ago_s": None if t is None else now - t,
            }
            for s, t in self._moved.items()
        }
        return {
            "enabled": threshold is not None,
            "threshold_s": threshold,
            "quiet_s": quiet,
            "mean_epoch_s": self.mean_epoch_s(),
            "first_epoch": self.first_epoch(),
            "completed_epochs": self._epochs,
            "deferred": deferred,
            "started_at": started,
            "signals": signals,
            "gpus": [s.as_dict() for s in self._gpu_samples],
        }


def _checkpoints(run_dir: Path) -> list[Path]:
    try:
        with os.scandir(run_dir / "weights") as it:
            return [Path(e.path) for e in it if e.name.endswith(".pt")]
    except OSError:
        return []


def _stat(path: Path) -> tuple[int, int] | None:
    """(size, mtime in ns), or None for a missing file: what counts as the file moving."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)


def _dur(seconds: float) -> str:
    """Durations for messages: ``2.5s`` below 10 s (short test thresholds), ``5m2s`` above."""
    return f"{seconds:.1f}s" if seconds < 10 else format_duration(seconds)
