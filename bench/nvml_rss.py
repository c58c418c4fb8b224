"""What NVML costs a Python process in memory, step by step, and this CPU's hash and copy rates.

Run on a GPU box (docs/gpu-validation.md 9d-9e, docs/benchmarks.md):

    python3 bench/nvml_rss.py [plain|host]

``plain``: in this process, through the agent's own binding (agent/gpu/nvml.py), prints VmRSS,
RssAnon, RssFile, RssShmem and VmHWM (MiB) after each step: the interpreter, ``import
agent.gpu.nvml``, ``nvmlInit``, a handle, 20 polls of utilisation and power, an Xid event set,
``malloc_trim(0)``; then the largest resident mappings, and sha256, CRC-32 and copy rates over
64 MiB, the passes the checkpoint follower (agent/sync/follow.py) makes over every byte.
``host``: the same calls through the NVML host process (agent/gpu/nvmlhost.py), as the agent makes
them: this process's figures (it never maps the driver) and the host's, read from /proc.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import time
import zlib
from typing import Any

_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def status() -> dict[str, float]:
    out: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in _FIELDS:
                out[key] = int(value.split()[0]) / 1024
    return out


def show(step: str) -> None:
    d = status()
    print(f"{step:34s} " + " ".join(f"{k} {d.get(k, 0):6.1f}" for k in _FIELDS), flush=True)


def largest_mappings(n: int = 12) -> None:
    current = "[anon]"
    sizes: dict[str, int] = {}
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                current = parts[5] if len(parts) > 5 else "[anon]"
            elif parts and parts[0] == "Rss:":
                sizes[current] = sizes.get(current, 0) + int(parts[1])
    for name, kib in sorted(sizes.items(), key=lambda kv: -kv[1])[:n]:
        print(f"   {kib / 1024:7.1f} MiB  {name}")


def rates() -> None:
    buf = os.urandom(1 << 20) * 64
    passes: dict[str, Any] = {
        "sha256": lambda: hashlib.sha256(buf).digest(),
        "crc32": lambda: zlib.crc32(buf),
        "copy (bytes(bytearray))": lambda: bytes(bytearray(buf)),
    }
    for name, run in passes.items():
        t0 = time.perf_counter()
        run()
        print(f"{name}: {len(buf) / (time.perf_counter() - t0) / 1e6:.0f} MB/s")
    with open("/proc/cpuinfo") as f:
        print(f"{f.read().count('sha_ni')} CPUs with sha_ni")


def host_status(pid: int) -> str:
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in _FIELDS:
                out[key] = int(value.split()[0]) / 1024
    return " ".join(f"{k} {out.get(k, 0):6.1f}" for k in _FIELDS)


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "plain"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    show("python")
    if mode == "host":
        from agent.gpu.nvmlhost import NvmlHost

        show("import agent.gpu.nvmlhost")
        nvml: Any = NvmlHost()
    else:
        from agent.gpu import nvml as binding

        show("import agent.gpu.nvml")
        nvml = binding.Library()
    nvml.nvmlInit()
    show(f"nvmlInit ({mode})")
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        show(f"handle ({nvml.nvmlDeviceGetCount()} GPUs)")
        for _ in range(20):
            nvml.nvmlDeviceGetUtilizationRates(handle)
            nvml.nvmlDeviceGetPowerUsage(handle)
            nvml.nvmlDeviceGetEnforcedPowerLimit(handle)
        show("20 polls")
        events = nvml.nvmlEventSetCreate()
        nvml.nvmlDeviceRegisterEvents(handle, 0x8, events)  # Xid critical errors
        show("event set + Xid registered")
    except Exception as exc:
        print(f"NVML: {exc}")
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    show("malloc_trim(0)")
    largest_mappings()
    if mode == "host":
        print(f"{'the NVML host (pid ' + str(nvml.pid) + ')':34s} {host_status(nvml.pid)}")
        nvml.close()
    else:
        rates()
    return 0


if __name__ == "__main__":
    sys.exit(main())
