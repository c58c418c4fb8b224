"""What a process of ours cannot go below: the floors under bench/pss.py's figures (issue 26).

    python3 -m bench.pss_floor [--copies 4] [--nvml] [--agent]

Figures only, nothing asserted. Each row is a fresh child process that reads its own
``/proc/self/smaps_rollup`` at named steps and prints PSS, RSS and Pss_Anon in MiB:

- ``python``: the interpreter alone (``-I -S``, then with ``site``), ``--copies`` of it side by
  side, so the pages they share are split between them as they are between our processes.
- ``--nvml``: the NVML host's steps (load ``libnvidia-ml.so.1``, ``nvmlInitWithFlags``, a handle,
  the calls the agent makes), then glibc's ``malloc_trim(0)``, for ``nvmlInitWithFlags(0)`` and
  ``(2)`` (``NVML_INIT_FLAG_NO_ATTACH``), each with and without ``MALLOC_ARENA_MAX=1``; and the
  largest mappings after the init (which library, or ``[anon]``).
- ``--agent``: the agent's imports (the daemon, the Hub sink, the preflight) step by step, each
  third-party stack in the order the agent's modules bring it (asyncio, aiohttp's client, its
  server, the Hub client's HTTP stack, ``HfApi``), then ``gc.collect()`` and ``malloc_trim(0)``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The child's code: stdlib only, so it runs under ``-I -S``.
_PROBE = r"""
import ctypes, os, sys
def mem():
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Pss", "Rss", "Pss_Anon"):
                out[k] = int(v.split()[0]) / 1024
    return out
def say(step):
    m = mem()
    anon = m.get('Pss_Anon', 0)
    print(f"  {step:<34} PSS {m['Pss']:6.1f}  RSS {m['Rss']:6.1f}  Pss_Anon {anon:6.1f}",
          flush=True)
def trim():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
def top(n=6):
    rows, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head[0]) > 8 and ":" not in head[0]:
                cur = [head[5] if len(head) > 5 else "[anon]", 0]
                rows.append(cur)
            elif line.startswith("Pss:") and cur is not None:
                cur[1] += int(head[1])
    agg = {}
    for name, kib in rows:
        agg[name] = agg.get(name, 0) + kib
    for name, kib in sorted(agg.items(), key=lambda r: -r[1])[:n]:
        print(f"      {kib / 1024:6.1f} MiB  {name}")
"""

_NVML = r"""
flags = int(sys.argv[1])
say("python -I -S + ctypes")
lib = ctypes.CDLL("libnvidia-ml.so.1")
say("libnvidia-ml loaded")
rc = lib.nvmlInitWithFlags(ctypes.c_uint(flags))
say(f"nvmlInitWithFlags({flags}) rc={rc}")
top()
h = ctypes.c_void_p()
rc = lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(0), ctypes.byref(h))
class U(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]
u = U(); p = ctypes.c_uint()
rcs = [rc, lib.nvmlDeviceGetUtilizationRates(h, ctypes.byref(u)),
       lib.nvmlDeviceGetPowerUsage(h, ctypes.byref(p))]
ev = ctypes.c_void_p()
rcs.append(lib.nvmlEventSetCreate(ctypes.byref(ev)))
rcs.append(lib.nvmlDeviceRegisterEvents(h, ctypes.c_ulonglong(8), ev))
say(f"handle, util {u.gpu}%, power {p.value} mW rc={rcs}")
trim()
say("malloc_trim(0)")
"""

_AGENT = r"""
say("python")
sys.path.insert(0, sys.argv[1])
import importlib
from agent.util.lean import keep_out  # as `libreyolo-agent run` does first (agent/util/lean.py)
keep_out()
# In the order the agent's own imports would bring them, each step's cost on top of the last.
for step in ("asyncio", "psutil yaml watchdog.observers", "aiohttp", "aiohttp.web",
             "httpx2 huggingface_hub", "huggingface_hub.hf_api", "agent.sinks.hf",
             "agent.preflight.runner", "agent.daemon.spine"):
    for name in step.split():
        try:
            importlib.import_module(name)
        except ImportError as exc:
            print(f"  ({name}: {exc})")
    say("+ " + step)
say("agent's imports")
import gc; gc.collect(); trim()
say("gc.collect(), malloc_trim(0)")
"""


def child(
    code: str, *args: str, flags: tuple[str, ...] = ("-I", "-S"), env: dict[str, str] | None = None
) -> str:
    proc = subprocess.run(
        [sys.executable, *flags, "-c", _PROBE + code, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )
    return proc.stdout + (proc.stderr[-400:] if proc.returncode else "")


def pythons(copies: int, flags: tuple[str, ...]) -> None:
    code = (
        "import time\nsay('python "
        + " ".join(flags)
        + "')\ntime.sleep(1.5)\nsay('after 1.5 s beside the others')\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, *flags, "-c", _PROBE + code], stdout=subprocess.PIPE, text=True
        )
        for _ in range(copies)
    ]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    print(f"{copies} copies of {sys.executable} {' '.join(flags)}; the last one's figures:")
    print(outs[-1], end="")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--nvml", action="store_true")
    ap.add_argument("--agent", action="store_true")
    args = ap.parse_args()
    print(f"python {sys.version.split()[0]} at {sys.executable}; {time.strftime('%Y-%m-%d %H:%M')}")
    pythons(args.copies, ("-I", "-S"))
    pythons(args.copies, ("-I",))
    if args.nvml:
        for flags in ("0", "2"):
            for arena in ({}, {"MALLOC_ARENA_MAX": "1"}):
                print(f"NVML host, nvmlInitWithFlags({flags}) {arena or ''}")
                print(child(_NVML, flags, env=arena), end="")
    if args.agent:
        print("agent imports:")
        print(child(_AGENT, str(REPO), flags=("-P",)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
