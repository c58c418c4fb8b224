"""GPU health and load through NVML, without torch, and without the driver in the agent.

Two uses while training runs:

- :meth:`GpuMonitor.samples`: utilisation and power of every GPU, the "alive" evidence of
  :mod:`agent.watch.progress` (:attr:`GpuSample.busy`).
- :meth:`GpuMonitor.faults`: hardware faults that make the box useless, reported as soon as they
  are seen so the run fails fast with that cause instead of waiting for the stall timeout. Each
  one is a *box* fault: resuming on the same box is pointless.

  - ``xid``: an Xid critical error event (``nvmlEventTypeXidCriticalError``), except the Xids an
    application causes on a healthy GPU (:data:`APPLICATION_XIDS`), which are only logged.
  - ``ecc_dbe``: the volatile uncorrected (double-bit) ECC count went up.
  - ``lost``: any NVML call answered "GPU is lost" (fell off the bus) or "GPU requires reset".
  - ``thermal``: the clocks are slowed for heat (HW or SW thermal slowdown) for at least
    ``thermal_after_s`` in a row, judged on consecutive :meth:`~GpuMonitor.faults` calls.

The NVML calls run in the NVML host process (:class:`agent.gpu.nvmlhost.NvmlHost`, started with
the first of them), so the driver's libraries are never mapped into the agent and a call that
hangs or crashes in a broken driver takes the host down, not the agent. Every call still blocks
until the host answers (at most its timeout): call :meth:`samples`, :meth:`faults` and
:attr:`available` from a worker thread (:mod:`agent.util.threads`), never from the event loop.
Without a driver or a GPU the monitor is simply unavailable: ``available`` is False,
``samples()`` and ``faults()`` return empty lists, and :attr:`unavailable_reason` says why. A
host that stopped answering (killed after its timeout) or died makes the monitor unavailable
from then on, with that as the reason, logged as an error: the GPUs are no longer watched, and
the run's stall limits are what is left to catch a GPU that stopped.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from agent.gpu.nvml import HOST_GONE, HOST_UNRESPONSIVE

log = logging.getLogger(__name__)

#: What went wrong with a GPU.
FaultKind = Literal["xid", "ecc_dbe", "lost", "thermal"]

#: A GPU counts as busy (real work) from this utilisation, percent...
BUSY_UTIL_PCT = 50.0
#: ...AND this fraction of its power limit: a hung NCCL collective spins at 100 % utilisation
#: near idle power, while real work draws far more. Measured on an H200 (700 W limit): idle
#: 84 W (12 %), a spinning kernel (``torch.cuda._sleep``) 100 % at 122 W (17 %), an fp32
#: matmul loop 100 % at 689 W (98 %). A small model may draw less than this and then is
#: simply not "busy": that only withholds the deferral, its log still shows progress.
BUSY_POWER_FRACTION = 0.3

#: Xids an application causes on a healthy GPU (NVIDIA's Xid catalogue,
#: https://docs.nvidia.com/deploy/xid-errors/): 13 graphics engine exception and 31 MMU fault
#: (illegal memory access in a kernel), 43 the GPU stopped an application's work, 45 preemptive
#: cleanup (a CUDA process was killed, e.g. the agent stopping the trainer), 63 a page retirement
#: or row remap was recorded (the repair itself), 94 contained ECC error (only the application
#: that touched the memory dies; the GPU stays usable). They are logged, not box faults.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 63, 94})

#: Words for the Xids that mean the box is broken, for the fault message.
_XID_WORDS = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    64: "row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}

#: Most Xid events drained per :meth:`GpuMonitor.faults` call (a storm must not pin the thread).
_MAX_EVENTS = 64

# Bits of the clocks event (formerly "throttle") reasons, when the module names neither.
_HW_THERMAL = 0x40
_SW_THERMAL = 0x20


@dataclass(frozen=True)
class GpuSample:
    """One GPU's load at one moment; None where NVML cannot tell (not supported, lost)."""

    index: int
    util_pct: float | None
    power_w: float | None
    power_limit_w: float | None
    #: Device memory in use and in all, bytes (``nvmlDeviceGetMemoryInfo``): what the page
    #: charts per epoch and ``/metrics`` exports; None where NVML does not say.
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None

    @property
    def busy(self) -> bool:
        """Doing real work: utilisation >= :data:`BUSY_UTIL_PCT` AND power >=
        :data:`BUSY_POWER_FRACTION` of the limit. High utilisation at low power (a spinning
        collective) and 0 % utilisation are not busy; unknown power is not busy either,
        because utilisation alone cannot tell spinning from working."""
        if self.util_pct is None or self.power_w is None or not self.power_limit_w:
            return False
        return (
            self.util_pct >= BUSY_UTIL_PCT
            and self.power_w >= BUSY_POWER_FRACTION * self.power_limit_w
        )

    def describe(self) -> str:
        """``GPU 0: 100% util at 85 W of 700 W``, for messages."""
        util = "?" if self.util_pct is None else f"{self.util_pct:.0f}%"
        power = "?" if self.power_w is None else f"{self.power_w:.0f} W"
        limit = "" if self.power_limit_w is None else f" of {self.power_limit_w:.0f} W"
        return f"GPU {self.index}: {util} util at {power}{limit}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "util_pct": self.util_pct,
            "power_w": self.power_w,
            "power_limit_w": self.power_limit_w,
            "memory_used_bytes": self.memory_used_bytes,
            "memory_total_bytes": self.memory_total_bytes,
            "busy": self.busy,
        }


@dataclass(frozen=True)
class GpuFault:
    """A hardware fault of one GPU: the box is broken, resuming on it is pointless."""

    index: int
    kind: FaultKind
    #: Names the GPU (index, uuid when known), the error, and says it is a box fault.
    message: str


@dataclass
class _Gpu:
    index: int
    handle: Any
    uuid: str | None = None
    lost: bool = False
    lost_error: str = ""
    lost_reported: bool = False
    #: Volatile uncorrected ECC count at the last check; None when ECC cannot be read.
    ecc_base: int | None = None
    ecc_supported: bool = True
    thermal_since: float | None = None
    thermal_reported: bool = False

    @property
    def name(self) -> str:
        return f"GPU {self.index} ({self.uuid})" if self.uuid else f"GPU {self.index}"


_UNSUPPORTED = object()


class GpuMonitor:
    """NVML-backed GPU load and fault watcher. ``nvml``: anything with ``pynvml``'s names (an
    :class:`~agent.gpu.nvmlhost.NvmlHost`, a stand-in in tests); None starts an
    :class:`~agent.gpu.nvmlhost.NvmlHost` on first use, which :meth:`close` ends. Thread-safe: one
    lock serialises every NVML call of the monitor."""

    def __init__(
        self,
        nvml: Any | None = None,
        *,
        thermal_after_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nvml: Any = nvml
        self._own_host = nvml is None
        self._host_failed = False
        self._thermal_after_s = thermal_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._opened = False
        self._initialised = False
        self._closed = False
        self._reason: str | None = None
        self._gpus: list[_Gpu] = []
        self._events: Any = None
        self._reasons_fn = "nvmlDeviceGetCurrentClocksEventReasons"
        self._hw_thermal = _HW_THERMAL
        self._sw_thermal = _SW_THERMAL

    # ----------------------------------------------------------------------------------------
    # Public

    @property
    def available(self) -> bool:
        """True when NVML runs and sees at least one GPU (starts NVML on first use: blocking)."""
        with self._lock:
            self._open()
            return self._usable()

    @property
    def unavailable_reason(self) -> str | None:
        """Why the monitor is unavailable (no driver, no GPU, the NVML host gone), else None."""
        with self._lock:
            self._open()
            return None if self._usable() else self._reason

    def samples(self) -> list[GpuSample]:
        """Utilisation, power and memory of every GPU (blocking NVML calls: run it in a
        thread)."""
        with self._lock:
            self._open()
            if not self._usable():
                return []
            out = []
            for g in self._gpus:
                util = power = limit = None
                used = total = None
                if not g.lost:
                    rates = self._query(g, "nvmlDeviceGetUtilizationRates", g.handle)
                    util = _number(getattr(rates, "gpu", None))
                    # NVML reports milliwatts.
                    power = _milli(self._query(g, "nvmlDeviceGetPowerUsage", g.handle))
                    limit = _milli(self._query(g, "nvmlDeviceGetEnforcedPowerLimit", g.handle))
                    memory = self._query(g, "nvmlDeviceGetMemoryInfo", g.handle)
                    used = _count(getattr(memory, "used", None))
                    total = _count(getattr(memory, "total", None))
                out.append(GpuSample(g.index, util, power, limit, used, total))
            return out

    def faults(self) -> list[GpuFault]:
        """Faults that are new since the last call (blocking NVML calls: run it in a thread),
        each returned once and not logged: the caller reports them. Call it every few seconds:
        thermal slowdown counts as sustained only while each call sees it."""
        with self._lock:
            self._open()
            if not self._usable():
                return []
            out = self._drain_xids()
            now = self._clock()
            for g in self._gpus:
                if not g.lost:
                    self._check_ecc(g, out)
                if not g.lost:
                    self._check_thermal(g, now, out)
                if g.lost and not g.lost_reported:
                    g.lost_reported = True
                    out.append(
                        _fault(g, "lost", f"{g.lost_error} (fell off the bus or needs a reset)")
                    )
            # Returned, not logged: the caller logs each fault once, with what it does about
            # it (agent/daemon/training.py); a line here too wrote every fault twice.
            return out

    def close(self) -> None:
        """Free the event set, shut NVML down and end the host the monitor started; safe to
        call again."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            nvml = self._nvml
            if self._initialised and not self._host_failed:
                if self._events is not None:
                    with contextlib.suppress(nvml.NVMLError):
                        nvml.nvmlEventSetFree(self._events)
                    self._events = None
                with contextlib.suppress(nvml.NVMLError):
                    nvml.nvmlShutdown()
            self._initialised = False
            if self._own_host and nvml is not None:
                nvml.close()

    # ----------------------------------------------------------------------------------------
    # Start-up

    def _usable(self) -> bool:
        return self._initialised and bool(self._gpus) and not self._closed and not self._host_failed

    def _open(self) -> None:
        """Start NVML and find the GPUs, once (under the lock)."""
        if self._opened or self._closed:
            return
        self._opened = True
        if self._nvml is None:
            from agent.gpu.nvmlhost import NvmlHost

            self._nvml = NvmlHost()
        nvml = self._nvml
        self._hw_thermal = _bit(nvml, "HwThermalSlowdown", _HW_THERMAL)
        self._sw_thermal = _bit(nvml, "SwThermalSlowdown", _SW_THERMAL)
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            if not self._host_lost(exc):
                self._reason = f"NVML did not start: {exc} (no NVIDIA driver or GPU here)"
                log.info("no GPU health watch: %s", self._reason)
            if self._own_host:
                nvml.close()  # nothing to watch: the host need not wait for the agent's end
            return
        self._initialised = True
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            if not self._host_lost(exc):
                self._reason = f"NVML cannot count the GPUs: {exc}"
                log.warning("no GPU health watch: %s", self._reason)
            return
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except nvml.NVMLError as exc:
                if self._host_lost(exc):
                    return
                if self._is_lost(exc):
                    # Reported by the first faults() call: a GPU gone before training began.
                    self._gpus.append(_Gpu(index, None, lost=True, lost_error=str(exc)))
                else:
                    log.warning("GPU %d is not watched: NVML cannot open it (%s)", index, exc)
                continue
            g = _Gpu(index, handle)
            uuid = self._query(g, "nvmlDeviceGetUUID", handle)
            if isinstance(uuid, bytes):
                uuid = uuid.decode(errors="replace")
            g.uuid = uuid if isinstance(uuid, str) else None
            self._gpus.append(g)
        if not self._gpus:
            self._reason = "NVML sees no GPU"
            return
        self._watch_xids()
        for g in self._gpus:
            if not g.lost:
                g.ecc_base = self._ecc_count(g)
        if not self._host_failed:
            log.info("watching %d GPU(s) for Xid, ECC, lost and thermal faults", len(self._gpus))

    def _watch_xids(self) -> None:
        nvml = self._nvml
        try:
            self._events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            if not self._host_lost(exc):
                log.warning("Xid errors are not watched: NVML cannot create an event set (%s)", exc)
            return
        for g in self._gpus:
            if g.lost:
                continue
            try:
                nvml.nvmlDeviceRegisterEvents(
                    g.handle, nvml.nvmlEventTypeXidCriticalError, self._events
                )
            except nvml.NVMLError as exc:
                if self._host_lost(exc):
                    return
                if self._is_lost(exc):
                    self._mark_lost(g, exc)
                else:
                    # Some virtualised GPUs and containers refuse events: ECC, lost and thermal
                    # are still watched.
                    log.info("Xid errors of %s are not watched: %s", g.name, exc)

    # ----------------------------------------------------------------------------------------
    # Checks

    def _drain_xids(self) -> list[GpuFault]:
        out: list[GpuFault] = []
        if self._events is None:
            return out
        nvml = self._nvml
        for _ in range(_MAX_EVENTS):
            try:
                data = nvml.nvmlEventSetWait(self._events, 0)
            except nvml.NVMLError as exc:
                if self._host_lost(exc):
                    return out
                if _code(exc) != nvml.NVML_ERROR_TIMEOUT:  # a timeout: no event waiting
                    log.debug("NVML event wait failed: %s", exc)
                break
            if not int(getattr(data, "eventType", 0)) & nvml.nvmlEventTypeXidCriticalError:
                continue
            xid = int(getattr(data, "eventData", 0))
            g = self._gpu_of(getattr(data, "device", None))
            if xid in APPLICATION_XIDS:
                log.warning(
                    "%s reported Xid %d, which the application causes on a healthy GPU: "
                    "not a box fault",
                    g.name,
                    xid,
                )
                continue
            words = _XID_WORDS.get(xid, "critical error")
            out.append(_fault(g, "xid", f"Xid {xid} ({words})"))
        return out

    def _gpu_of(self, device: Any) -> _Gpu:
        """The watched GPU an event came from (by index), or an 'unknown GPU' stand-in."""
        nvml = self._nvml
        for g in self._gpus:
            if device == g.handle:  # the host's handles are integers, equal not identical
                return g
        try:
            index = int(nvml.nvmlDeviceGetIndex(device))
        except (nvml.NVMLError, TypeError, ValueError):
            return _Gpu(-1, None, uuid="unknown")
        for g in self._gpus:
            if g.index == index:
                return g
        return _Gpu(index, None)

    def _ecc_count(self, g: _Gpu) -> int | None:
        if not g.ecc_supported:
            return None
        nvml = self._nvml
        count = self._query(
            g,
            "nvmlDeviceGetTotalEccErrors",
            g.handle,
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvml.NVML_VOLATILE_ECC,
        )
        if count is _UNSUPPORTED:
            # ECC off or not on this card (consumer GPUs): never asked again.
            g.ecc_supported = False
            return None
        return int(count) if isinstance(count, int) else None

    def _check_ecc(self, g: _Gpu, out: list[GpuFault]) -> None:
        count = self._ecc_count(g)
        if count is None:
            return
        if g.ecc_base is not None and count > g.ecc_base:
            out.append(
                _fault(
                    g,
                    "ecc_dbe",
                    f"{count - g.ecc_base} new uncorrected (double-bit) ECC error(s), "
                    f"{count} since the driver loaded",
                )
            )
        g.ecc_base = count

    def _check_thermal(self, g: _Gpu, now: float, out: list[GpuFault]) -> None:
        reasons = self._clock_reasons(g)
        if not isinstance(reasons, int):
            return
        hot = reasons & (self._hw_thermal | self._sw_thermal)
        if not hot:
            g.thermal_since = None
            g.thermal_reported = False
            return
        if g.thermal_since is None:
            g.thermal_since = now
        held = now - g.thermal_since
        if g.thermal_reported or held < self._thermal_after_s:
            return
        g.thermal_reported = True
        which = "hardware" if hot & self._hw_thermal else "software"
        temp = self._query(g, "nvmlDeviceGetTemperature", g.handle, self._nvml.NVML_TEMPERATURE_GPU)
        at = f" at {temp} C" if isinstance(temp, int) else ""
        out.append(
            _fault(
                g,
                "thermal",
                f"clocks slowed by {which} thermal slowdown for {held:.0f}s{at} (cooling fault)",
            )
        )

    def _clock_reasons(self, g: _Gpu) -> Any:
        """``nvmlDeviceGetCurrentClocksEventReasons``, or its older name on an old driver."""
        nvml = self._nvml
        if self._reasons_fn == "nvmlDeviceGetCurrentClocksEventReasons":
            if not hasattr(nvml, self._reasons_fn):
                self._reasons_fn = "nvmlDeviceGetCurrentClocksThrottleReasons"
            else:
                try:
                    return nvml.nvmlDeviceGetCurrentClocksEventReasons(g.handle)
                except nvml.NVMLError as exc:
                    if _code(exc) != nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                        self._classify(g, exc)
                        return None
                    # A driver older than the function: the deprecated name has the same bits.
                    self._reasons_fn = "nvmlDeviceGetCurrentClocksThrottleReasons"
        return self._query(g, self._reasons_fn, g.handle)

    # ----------------------------------------------------------------------------------------
    # NVML calls

    def _query(self, g: _Gpu, fn: str, *args: Any) -> Any:
        """``nvml.<fn>(*args)`` about GPU ``g``: its value, :data:`_UNSUPPORTED`, or None on any
        other NVML error (a lost GPU is marked lost)."""
        if g.lost or self._host_failed:  # NVML would only say so again
            return None
        nvml = self._nvml
        call = getattr(nvml, fn, None)
        if call is None:  # a function the binding (or a stand-in) does not have
            return _UNSUPPORTED
        try:
            return call(*args)
        except nvml.NVMLError as exc:
            if _code(exc) == nvml.NVML_ERROR_NOT_SUPPORTED:
                return _UNSUPPORTED
            self._classify(g, exc)
            return None

    def _classify(self, g: _Gpu, exc: BaseException) -> None:
        if self._host_lost(exc):
            return
        if self._is_lost(exc):
            self._mark_lost(g, exc)
        else:
            log.debug("NVML call about %s failed: %s", g.name, exc)

    def _host_lost(self, exc: BaseException) -> bool:
        """The NVML host stopped answering or died (:mod:`agent.gpu.nvmlhost`): nothing more can
        be asked; the monitor is unavailable from now on, with the host's words as the reason
        (the host has logged them as an error)."""
        if _code(exc) not in (HOST_UNRESPONSIVE, HOST_GONE):
            return False
        if not self._host_failed:
            self._host_failed = True
            self._reason = f"{exc}; GPU health is no longer watched"
        return True

    def _is_lost(self, exc: BaseException) -> bool:
        nvml = self._nvml
        lost_codes = {nvml.NVML_ERROR_GPU_IS_LOST, getattr(nvml, "NVML_ERROR_RESET_REQUIRED", -1)}
        return _code(exc) in lost_codes

    @staticmethod
    def _mark_lost(g: _Gpu, exc: BaseException) -> None:
        if not g.lost:
            g.lost = True
            g.lost_error = f"NVML: {exc}"


def _fault(g: _Gpu, kind: FaultKind, what: str) -> GpuFault:
    return GpuFault(
        g.index,
        kind,
        f"{g.name}: {what}: a box fault, resuming on this box is pointless; replace the box",
    )


def _code(exc: BaseException) -> Any:
    return getattr(exc, "value", None)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _milli(value: Any) -> float | None:
    n = _number(value)
    return None if n is None else n / 1000.0


def _bit(nvml: Any, reason: str, default: int) -> int:
    """A clocks event reason bit under its current name, its deprecated "throttle" name, or
    ``default`` (the values never changed)."""
    for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
        value = getattr(nvml, prefix + reason, None)
        if isinstance(value, int):
            return value
    return default
