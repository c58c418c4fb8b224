"""GPU health through NVML. A GPU fault cannot be produced on purpose, and this machine has no
GPU, so these tests hand :class:`GpuMonitor` a stand-in with exactly the ``pynvml`` names the
monitor calls, raising the agent's :class:`agent.gpu.nvml.NVMLError`. One test runs the real path
(the NVML host process) on a machine without a driver: the monitor is unavailable and never
raises. tests/test_nvmlhost.py runs the real path over a stand-in ``libnvidia-ml.so.1``."""

from __future__ import annotations

import ctypes
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from agent.gpu import nvml as nv
from agent.gpu.health import GpuMonitor, GpuSample


class Handle:
    def __init__(self, index: int) -> None:
        self.index = index


class FakeNvml:
    """The pynvml names GpuMonitor uses, over a scripted box of GPUs. ``fail[(fn, index)]``
    (index None: every GPU) makes ``fn`` raise ``nv.NVMLError(code)``."""

    NVMLError = nv.NVMLError
    NVML_ERROR_GPU_IS_LOST = nv.NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_RESET_REQUIRED = nv.NVML_ERROR_RESET_REQUIRED
    NVML_ERROR_NOT_SUPPORTED = nv.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_TIMEOUT = nv.NVML_ERROR_TIMEOUT
    NVML_ERROR_FUNCTION_NOT_FOUND = nv.NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = nv.NVML_VOLATILE_ECC
    NVML_TEMPERATURE_GPU = nv.NVML_TEMPERATURE_GPU
    nvmlEventTypeXidCriticalError = nv.nvmlEventTypeXidCriticalError
    nvmlClocksEventReasonHwThermalSlowdown = nv.nvmlClocksEventReasonHwThermalSlowdown
    nvmlClocksEventReasonSwThermalSlowdown = nv.nvmlClocksEventReasonSwThermalSlowdown

    def __init__(self, gpus: int = 2) -> None:
        self.count = gpus
        self.init_error: int | None = None
        self.util = dict.fromkeys(range(gpus), 0)
        self.power_mw = dict.fromkeys(range(gpus), 70_000)
        self.limit_mw = dict.fromkeys(range(gpus), 700_000)
        self.ecc = dict.fromkeys(range(gpus), 0)
        self.reasons = dict.fromkeys(range(gpus), 0)
        self.temp = dict.fromkeys(range(gpus), 95)
        self.events: list[SimpleNamespace] = []
        self.fail: dict[tuple[str, int | None], int] = {}
        self.calls: list[tuple[str, int | None]] = []
        self.event_set = object()

    def _call(self, fn: str, handle: Handle | None = None) -> None:
        index = None if handle is None else handle.index
        self.calls.append((fn, index))
        code = self.fail.get((fn, index), self.fail.get((fn, None)))
        if code is not None:
            raise nv.NVMLError(code)

    def nvmlInit(self) -> None:
        self._call("nvmlInit")
        if self.init_error is not None:
            raise nv.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        self._call("nvmlDeviceGetHandleByIndex", Handle(index))
        return Handle(index)

    def nvmlDeviceGetUUID(self, h: Handle) -> str:
        self._call("nvmlDeviceGetUUID", h)
        return f"GPU-0000000{h.index}-fake"

    def nvmlDeviceGetIndex(self, h: Handle) -> int:
        self._call("nvmlDeviceGetIndex", h)
        return h.index

    def nvmlDeviceGetUtilizationRates(self, h: Handle) -> SimpleNamespace:
        self._call("nvmlDeviceGetUtilizationRates", h)
        return SimpleNamespace(gpu=self.util[h.index], memory=0)

    def nvmlDeviceGetPowerUsage(self, h: Handle) -> int:
        self._call("nvmlDeviceGetPowerUsage", h)
        return self.power_mw[h.index]

    def nvmlDeviceGetEnforcedPowerLimit(self, h: Handle) -> int:
        self._call("nvmlDeviceGetEnforcedPowerLimit", h)
        return self.limit_mw[h.index]

    def nvmlDeviceGetTotalEccErrors(self, h: Handle, error_type: int, counter_type: int) -> int:
        self._call("nvmlDeviceGetTotalEccErrors", h)
        assert error_type == nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        assert counter_type == nv.NVML_VOLATILE_ECC
        return self.ecc[h.index]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Handle) -> int:
        self._call("nvmlDeviceGetCurrentClocksEventReasons", h)
        return self.reasons[h.index]

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: Handle) -> int:
        self._call("nvmlDeviceGetCurrentClocksThrottleReasons", h)
        return self.reasons[h.index]

    def nvmlDeviceGetTemperature(self, h: Handle, sensor: int) -> int:
        self._call("nvmlDeviceGetTemperature", h)
        assert sensor == nv.NVML_TEMPERATURE_GPU
        return self.temp[h.index]

    def nvmlEventSetCreate(self) -> object:
        self._call("nvmlEventSetCreate")
        return self.event_set

    def nvmlDeviceRegisterEvents(self, h: Handle, types: int, event_set: object) -> None:
        self._call("nvmlDeviceRegisterEvents", h)
        assert types == nv.nvmlEventTypeXidCriticalError and event_set is self.event_set

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> SimpleNamespace:
        self._call("nvmlEventSetWait")
        assert event_set is self.event_set and timeout_ms == 0  # never blocks
        if not self.events:
            raise nv.NVMLError(nv.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)

    def nvmlEventSetFree(self, event_set: object) -> None:
        self._call("nvmlEventSetFree")

    # Scripting
    def xid(self, index: int, xid: int) -> None:
        # A fresh handle object, as pynvml returns: the monitor must map it by index.
        self.events.append(
            SimpleNamespace(
                device=Handle(index),
                eventType=nv.nvmlEventTypeXidCriticalError,
                eventData=xid,
                gpuInstanceId=0,
                computeInstanceId=0,
            )
        )

    def count_calls(self, fn: str, index: int | None = None) -> int:
        return sum(1 for f, i in self.calls if f == fn and (index is None or i == index))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def monitor(nvml: Any, clock: Clock | None = None) -> GpuMonitor:
    return GpuMonitor(nvml, thermal_after_s=60.0, clock=clock or Clock())


def test_real_nvml_host_without_a_driver_is_unavailable_and_never_raises() -> None:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        pass
    else:
        pytest.skip("an NVIDIA driver is installed here: this test is for GPU-less machines")
    gpu = GpuMonitor()  # the real NVML host process
    assert gpu.available is False
    assert "NVML Shared Library Not Found" in (gpu.unavailable_reason or "")
    assert gpu._nvml.pid is None  # nothing to watch: the host was ended at once
    assert gpu.samples() == []
    assert gpu.faults() == []
    gpu.close()
    gpu.close()


def test_driver_that_does_not_start_makes_the_monitor_unavailable() -> None:
    nvml = FakeNvml()
    nvml.init_error = nv.NVML_ERROR_DRIVER_NOT_LOADED
    gpu = monitor(nvml)
    assert gpu.available is False
    assert "Driver Not Loaded" in (gpu.unavailable_reason or "")
    assert gpu.samples() == [] and gpu.faults() == []
    gpu.close()
    assert nvml.count_calls("nvmlShutdown") == 0  # nothing was started


def test_samples_report_utilisation_and_power_in_watts() -> None:
    nvml = FakeNvml(gpus=3)
    nvml.util.update({0: 97, 1: 100, 2: 99})
    nvml.power_mw.update({0: 520_000, 1: 85_000})
    nvml.fail[("nvmlDeviceGetPowerUsage", 2)] = nv.NVML_ERROR_NOT_SUPPORTED
    samples = monitor(nvml).samples()
    assert samples == [
        GpuSample(0, 97.0, 520.0, 700.0),
        GpuSample(1, 100.0, 85.0, 700.0),
        GpuSample(2, 99.0, None, 700.0),
    ]
    # Training; a hung NCCL collective (100 % util near idle power); unknown power.
    assert [s.busy for s in samples] == [True, False, False]
    assert samples[1].describe() == "GPU 1: 100% util at 85 W of 700 W"


def test_xid_critical_error_is_a_box_fault_naming_the_gpu(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nvml = FakeNvml()
    gpu = monitor(nvml)
    assert gpu.faults() == []
    nvml.xid(1, 79)
    with caplog.at_level(logging.DEBUG, logger="agent.gpu"):
        faults = gpu.faults()
    # Returned, not logged: the supervision logs it once (tests/test_nvmlhost.py counts).
    assert "Xid 79" not in caplog.text
    assert [(f.index, f.kind) for f in faults] == [(1, "xid")]
    message = faults[0].message
    assert "GPU 1 (GPU-00000001-fake)" in message
    assert "Xid 79 (GPU has fallen off the bus)" in message
    assert "box fault" in message
    assert gpu.faults() == []  # reported once


def test_xid_an_application_causes_is_logged_not_a_fault(caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml()
    gpu = monitor(nvml)
    nvml.xid(0, 45)  # preemptive cleanup: a CUDA process was killed
    nvml.xid(0, 48)  # double-bit ECC error
    with caplog.at_level(logging.WARNING, logger="agent.gpu"):
        faults = gpu.faults()
    assert [(f.index, f.kind) for f in faults] == [(0, "xid")]
    assert "Xid 48" in faults[0].message
    assert "Xid 45" in caplog.text and "not a box fault" in caplog.text


def test_new_double_bit_ecc_errors_are_a_box_fault() -> None:
    nvml = FakeNvml()
    nvml.ecc[0] = 2  # before the agent started: the baseline
    gpu = monitor(nvml)
    assert gpu.faults() == []
    nvml.ecc[0] = 3
    faults = gpu.faults()
    assert [(f.index, f.kind) for f in faults] == [(0, "ecc_dbe")]
    assert "1 new uncorrected (double-bit) ECC error(s), 3 since the driver loaded" in (
        faults[0].message
    )
    assert gpu.faults() == []


def test_ecc_not_supported_is_skipped_and_not_asked_again() -> None:
    nvml = FakeNvml(gpus=1)
    nvml.fail[("nvmlDeviceGetTotalEccErrors", None)] = nv.NVML_ERROR_NOT_SUPPORTED
    gpu = monitor(nvml)
    assert gpu.faults() == [] and gpu.faults() == []
    assert nvml.count_calls("nvmlDeviceGetTotalEccErrors") == 1


def test_gpu_lost_in_any_call_is_reported_once() -> None:
    nvml = FakeNvml()
    gpu = monitor(nvml)
    assert gpu.available
    nvml.fail[("nvmlDeviceGetUtilizationRates", 0)] = nv.NVML_ERROR_GPU_IS_LOST
    assert gpu.samples()[0] == GpuSample(0, None, None, None)
    faults = gpu.faults()
    assert [(f.index, f.kind) for f in faults] == [(0, "lost")]
    assert "GPU 0 (GPU-00000000-fake)" in faults[0].message
    assert "GPU is lost" in faults[0].message and "box fault" in faults[0].message
    assert gpu.faults() == []
    calls = len(nvml.calls)
    gpu.samples()
    assert ("nvmlDeviceGetUtilizationRates", 0) not in nvml.calls[calls:]  # no longer asked


def test_gpu_lost_while_checking_ecc_or_at_start() -> None:
    nvml = FakeNvml()
    nvml.fail[("nvmlDeviceGetHandleByIndex", 1)] = nv.NVML_ERROR_GPU_IS_LOST
    gpu = monitor(nvml)
    assert [(f.index, f.kind) for f in gpu.faults()] == [(1, "lost")]
    nvml.fail[("nvmlDeviceGetTotalEccErrors", 0)] = nv.NVML_ERROR_RESET_REQUIRED
    faults = gpu.faults()
    assert [(f.index, f.kind) for f in faults] == [(0, "lost")]
    assert "GPU requires restart" in faults[0].message


def test_thermal_slowdown_counts_only_when_sustained() -> None:
    nvml = FakeNvml(gpus=1)
    clock = Clock()
    gpu = monitor(nvml, clock)
    hw = nv.nvmlClocksEventReasonHwThermalSlowdown
    nvml.reasons[0] = hw
    assert gpu.faults() == []
    clock.t = 40.0
    nvml.reasons[0] = 0  # a short burst ends
    assert gpu.faults() == []
    clock.t = 50.0
    nvml.reasons[0] = hw | nv.nvmlClocksEventReasonGpuIdle
    assert gpu.faults() == []
    clock.t = 109.0
    assert gpu.faults() == []  # 59 s in a row
    clock.t = 110.0
    faults = gpu.faults()
    assert [(f.index, f.kind) for f in faults] == [(0, "thermal")]
    assert "hardware thermal slowdown for 60s at 95 C" in faults[0].message
    assert "box fault" in faults[0].message
    clock.t = 200.0
    assert gpu.faults() == []  # one report per episode


def test_software_thermal_slowdown_on_an_old_driver_uses_throttle_reasons() -> None:
    nvml = FakeNvml(gpus=1)
    nvml.fail[("nvmlDeviceGetCurrentClocksEventReasons", None)] = nv.NVML_ERROR_FUNCTION_NOT_FOUND
    clock = Clock()
    gpu = monitor(nvml, clock)
    nvml.reasons[0] = nv.nvmlClocksEventReasonSwThermalSlowdown
    assert gpu.faults() == []
    clock.t = 60.0
    faults = gpu.faults()
    assert [f.kind for f in faults] == ["thermal"]
    assert "software thermal slowdown" in faults[0].message
    assert nvml.count_calls("nvmlDeviceGetCurrentClocksThrottleReasons") == 2
    assert nvml.count_calls("nvmlDeviceGetCurrentClocksEventReasons") == 1


def test_gpu_without_xid_events_still_reports_ecc() -> None:
    nvml = FakeNvml(gpus=1)
    nvml.fail[("nvmlDeviceRegisterEvents", None)] = nv.NVML_ERROR_NOT_SUPPORTED
    gpu = monitor(nvml)
    assert gpu.available
    nvml.ecc[0] = 1
    assert [f.kind for f in gpu.faults()] == ["ecc_dbe"]


def test_close_frees_the_event_set_and_shuts_nvml_down_once() -> None:
    nvml = FakeNvml()
    gpu = monitor(nvml)
    assert gpu.available
    gpu.close()
    gpu.close()
    assert nvml.count_calls("nvmlEventSetFree") == 1
    assert nvml.count_calls("nvmlShutdown") == 1
    assert gpu.available is False and gpu.samples() == [] and gpu.faults() == []
