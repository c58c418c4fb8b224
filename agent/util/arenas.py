"""Fewer malloc arenas for the agent's process: its memory stays near what it holds.

glibc gives every thread that allocates memory an arena of its own, up to 8 per core (128 on a
16-core GPU box), and each arena keeps the memory its thread freed. The agent runs short jobs in
threads (snapshots, uploads, NVML, the Hub client), so its resident memory grew with the number
of cores rather than with what it holds: on an H200 box (16 cores) the agent peaked at 84.6-86.4
MiB with the default and 76.5 MiB with two arenas (bench P1, docs/benchmarks.md). Two arenas are
plenty for a daemon that spends its time waiting: the event loop's thread has one, the workers
share the other.

``MALLOC_ARENA_MAX`` in the environment is the user's choice and is left alone; a C library
without ``mallopt`` (musl) is left alone too. The trainer is another process: untouched.
"""

from __future__ import annotations

import os

#: ``M_ARENA_MAX`` of glibc's ``<malloc.h>``.
M_ARENA_MAX = -8
#: Arenas the agent's process may have.
ARENAS = 2


def limit_arenas(count: int = ARENAS) -> bool:
    """Cap this process's malloc arenas at ``count`` (call it before threads start). False
    when the environment already says (``MALLOC_ARENA_MAX``) or the C library cannot."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, count))
