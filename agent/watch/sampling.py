"""What the sizing verdict is fed each loop turn: GPU samples and the trainer tree's CPU time.

A :class:`Sampler` is where the readings come from: the daemon's :class:`ProcessSampler`
(NVML through ``GpuMonitor.samples`` and psutil) or, in tests, a recording;
:class:`agent.watch.sizing.SizingWatch` only does arithmetic on them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from agent.gpu.health import GpuSample
from agent.trainer.process import tree_cpu_seconds


class Sampler(Protocol):
    """Where the live samples come from (the daemon: NVML and psutil; tests: recordings).
    Both calls block: call them from a worker thread."""

    def gpus(self) -> Sequence[GpuSample]:
        """Utilisation and power of every GPU of the box (empty without NVML)."""
        ...

    def tree_cpu_s(self) -> float | None:
        """CPU seconds used so far by the trainer's process tree (monotonic); None: no tree."""
        ...

    def processes(self) -> int | None:
        """Processes in the trainer's tree now (main process, ranks, dataloader workers)."""
        ...


class TreeCpu:
    """CPU seconds used by a process tree, counted so that the total never goes down when a
    process (a dataloader worker) exits: per process (pid and create time), a process new since
    the previous call counts all its CPU time (agent/watch/progress.py does the same)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, float], float] = {}
        self._total = 0.0
        self.processes = 0

    def total(self, pids: Collection[int]) -> float:
        """The CPU seconds the trees of ``pids`` used since the first call (blocking: psutil)."""
        current = tree_cpu_seconds(pids)
        self._total += sum(max(0.0, cpu - self._seen.get(key, 0.0)) for key, cpu in current.items())
        self._seen = current
        self.processes = len(current)
        return self._total


class ProcessSampler:
    """The daemon's :class:`Sampler`: ``gpu_samples`` (``GpuMonitor.samples``) and the CPU of
    the trees of ``pids()`` (the trainer's pids, read at each call)."""

    def __init__(
        self,
        gpu_samples: Callable[[], Sequence[GpuSample]],
        pids: Callable[[], Collection[int]],
    ) -> None:
        self._gpu_samples = gpu_samples
        self._pids = pids
        self._cpu = TreeCpu()

    def gpus(self) -> Sequence[GpuSample]:
        return self._gpu_samples()

    def tree_cpu_s(self) -> float | None:
        pids = self._pids()
        return self._cpu.total(pids) if pids else None

    def processes(self) -> int | None:
        return self._cpu.processes or None
