"""NVML, the NVIDIA driver's management library, through ctypes: the calls the agent makes.

This file is two things, and needs nothing outside the standard library for either:

- Imported (``agent.gpu.nvml``): :class:`NVMLError` and the constants, named as ``nvidia-ml-py``
  (``pynvml``) names them, for :mod:`agent.gpu.nvmlhost` and :mod:`agent.gpu.health`. Importing it
  loads no library.
- Run as a script (``python -I -S .../agent/gpu/nvml.py``): the NVML host process that
  :class:`agent.gpu.nvmlhost.NvmlHost` starts. It loads ``libnvidia-ml.so.1`` on the first
  ``nvmlInit``, then answers one JSON request per line on stdin with one JSON line on stdout:
  ``{"fn": "nvmlDeviceGetPowerUsage", "args": [handle]}`` -> ``{"ok": 79069}`` or
  ``{"err": 15, "msg": "GPU is lost"}``. Handles and event sets travel as integers (their
  addresses in the host), structures as objects. It ends at end of input.

Why the calls run in a process of their own, not in the agent: measured on an H200 (driver
580.159.04), ``nvmlInit`` maps the driver's ``libcuda`` into the caller and adds 18 MiB to it,
14.6 MiB of it anonymous; a GPU that fell off the bus can make an NVML call block for minutes
(or for good, in the kernel); a broken driver can crash its caller. The agent, which must stay
small and must outlive all of that to tear the box down, keeps none of it in its own process.

The functions mirror ``pynvml``'s of the same names (the same C symbols: ``nvmlInitWithFlags``,
``nvmlDeviceGetCount_v2``, ``nvmlDeviceGetHandleByIndex_v2``, ``nvmlEventSetWait_v2``, ...), and
each raises :class:`NVMLError` with the C return code as ``value``.
"""

from __future__ import annotations

import ctypes
import json
import signal
import sys

# The host imports as little as it can (issue 26: memory): ``typing`` (half a MiB in a process
# this small) only for the type checker; the annotations are never evaluated.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# Return codes (nvml.h), as pynvml names them.
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_UNKNOWN = 999

#: Not NVML's: the host process did not answer in time (it was killed), or it is gone.
HOST_UNRESPONSIVE = -1001
HOST_GONE = -1002

NVML_TEMPERATURE_GPU = 0
NVML_VOLATILE_ECC = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
nvmlEventTypeXidCriticalError = 0x8
nvmlClocksEventReasonGpuIdle = 0x1
nvmlClocksEventReasonSwThermalSlowdown = 0x20
nvmlClocksEventReasonHwThermalSlowdown = 0x40

_UUID_BUFFER = 96  # NVML_DEVICE_UUID_V2_BUFFER_SIZE
_VERSION_BUFFER = 80  # NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE

_WORDS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """An NVML call failed; ``value`` is its return code (or a ``HOST_*`` code)."""

    def __init__(self, value: int, message: str | None = None) -> None:
        self.value = value
        self.message = message or _WORDS.get(value) or f"NVML error {value}"
        super().__init__(value, self.message)

    def __str__(self) -> str:
        return self.message


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Memory(ctypes.Structure):
    """``nvmlMemory_t`` (v1, what ``nvmlDeviceGetMemoryInfo`` fills): bytes."""

    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class _EventData(ctypes.Structure):
    _fields_ = [
        ("device", ctypes.c_void_p),
        ("eventType", ctypes.c_ulonglong),
        ("eventData", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class Library:
    """The calls, over ``libnvidia-ml.so.1`` (loaded by the first :meth:`nvmlInit`)."""

    def __init__(self, name: str = "libnvidia-ml.so.1") -> None:
        self._name = name
        self._lib: Any = None

    def _fn(self, symbol: str) -> Any:
        if self._lib is None:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        try:
            return getattr(self._lib, symbol)
        except AttributeError:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND) from None

    def _call(self, symbol: str, *args: Any) -> None:
        ret = self._fn(symbol)(*args)
        if ret != NVML_SUCCESS:
            raise NVMLError(ret, self._words(ret))

    def _words(self, code: int) -> str | None:
        if code in _WORDS:
            return None
        try:
            fn = self._fn("nvmlErrorString")
            fn.restype = ctypes.c_char_p
            text = fn(code)
        except NVMLError:
            return None
        return text.decode("utf-8", "replace") if text else None

    def _uint(self, symbol: str, *args: Any, kind: Any = ctypes.c_uint) -> int:
        out = kind()
        self._call(symbol, *args, ctypes.byref(out))
        return int(out.value)

    # ---- pynvml's names ------------------------------------------------------------------

    def nvmlInit(self) -> None:
        if self._lib is None:
            try:
                self._lib = ctypes.CDLL(self._name)
            except OSError:
                raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND) from None
        self._call("nvmlInitWithFlags", ctypes.c_uint(0))

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        return self._uint("nvmlDeviceGetCount_v2")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        handle = ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(handle))
        return int(handle.value or 0)

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        buf = ctypes.create_string_buffer(_UUID_BUFFER)
        self._call("nvmlDeviceGetUUID", ctypes.c_void_p(handle), buf, ctypes.c_uint(_UUID_BUFFER))
        return buf.value.decode("utf-8", "replace")

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return self._uint("nvmlDeviceGetIndex", ctypes.c_void_p(handle))

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> dict[str, int]:
        util = _Utilization()
        self._call("nvmlDeviceGetUtilizationRates", ctypes.c_void_p(handle), ctypes.byref(util))
        return {"gpu": int(util.gpu), "memory": int(util.memory)}

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> dict[str, int]:
        # The v1 symbol and structure, as pynvml calls it without a version: every driver has
        # them (``_v2`` adds a version field and ``reserved``, and older drivers lack it).
        memory = _Memory()
        self._call("nvmlDeviceGetMemoryInfo", ctypes.c_void_p(handle), ctypes.byref(memory))
        return {"total": int(memory.total), "free": int(memory.free), "used": int(memory.used)}

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return self._uint("nvmlDeviceGetPowerUsage", ctypes.c_void_p(handle))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:
        return self._uint("nvmlDeviceGetEnforcedPowerLimit", ctypes.c_void_p(handle))

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return self._uint("nvmlDeviceGetTemperature", ctypes.c_void_p(handle), ctypes.c_int(sensor))

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter_type: int) -> int:
        return self._uint(
            "nvmlDeviceGetTotalEccErrors",
            ctypes.c_void_p(handle),
            ctypes.c_int(error_type),
            ctypes.c_int(counter_type),
            kind=ctypes.c_ulonglong,
        )

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return self._uint(
            "nvmlDeviceGetCurrentClocksEventReasons",
            ctypes.c_void_p(handle),
            kind=ctypes.c_ulonglong,
        )

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: int) -> int:
        return self._uint(
            "nvmlDeviceGetCurrentClocksThrottleReasons",
            ctypes.c_void_p(handle),
            kind=ctypes.c_ulonglong,
        )

    def nvmlEventSetCreate(self) -> int:
        events = ctypes.c_void_p()
        self._call("nvmlEventSetCreate", ctypes.byref(events))
        return int(events.value or 0)

    def nvmlDeviceRegisterEvents(self, handle: int, event_types: int, events: int) -> None:
        self._call(
            "nvmlDeviceRegisterEvents",
            ctypes.c_void_p(handle),
            ctypes.c_ulonglong(event_types),
            ctypes.c_void_p(events),
        )

    def nvmlEventSetWait(self, events: int, timeout_ms: int) -> dict[str, int]:
        data = _EventData()
        self._call(
            "nvmlEventSetWait_v2",
            ctypes.c_void_p(events),
            ctypes.byref(data),
            ctypes.c_uint(timeout_ms),
        )
        return {
            "device": int(data.device or 0),
            "eventType": int(data.eventType),
            "eventData": int(data.eventData),
            "gpuInstanceId": int(data.gpuInstanceId),
            "computeInstanceId": int(data.computeInstanceId),
        }

    def nvmlEventSetFree(self, events: int) -> None:
        self._call("nvmlEventSetFree", ctypes.c_void_p(events))

    def nvmlSystemGetDriverVersion(self) -> str:
        buf = ctypes.create_string_buffer(_VERSION_BUFFER)
        self._call("nvmlSystemGetDriverVersion", buf, ctypes.c_uint(_VERSION_BUFFER))
        return buf.value.decode("utf-8", "replace")

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._uint("nvmlSystemGetCudaDriverVersion", kind=ctypes.c_int)


#: The calls a host answers: :class:`Library`'s public methods.
FUNCTIONS = frozenset(name for name in vars(Library) if name.startswith("nvml"))


def answer(lib: Library, line: bytes) -> dict[str, Any]:
    """One request line -> its answer (never raises)."""
    try:
        request = json.loads(line)
        fn = request["fn"]
        args = request.get("args", [])
        if fn not in FUNCTIONS or not isinstance(args, list):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT, f"no such call: {fn!r}")
        return {"ok": getattr(lib, fn)(*args)}
    except NVMLError as exc:
        return {"err": exc.value, "msg": exc.message}
    except Exception as exc:  # a malformed request: say so, keep serving
        return {"err": NVML_ERROR_INVALID_ARGUMENT, "msg": f"bad request: {exc!r}"}


def serve(stdin: Any = None, stdout: Any = None) -> int:
    """The host's loop: a request per line on stdin, an answer per line on stdout, until end of
    input. SIGINT is ignored (a Ctrl-C meant for the agent); the agent ends it by closing
    stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    lib = Library()
    for line in stdin:
        if not line.strip():
            continue
        stdout.write(json.dumps(answer(lib, line)).encode() + b"\n")
        stdout.flush()
    return 0


if __name__ == "__main__":
    # Started as ``python -I -S nvml.py``: nothing but the standard library is importable, and
    # nothing of the agent's environment decides what Python loads.
    sys.exit(serve())
