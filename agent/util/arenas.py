"""Fewer malloc arenas and fixed thresholds for the agent's process: its memory stays near what
it holds.

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

#: ``M_ARENA_MAX``, ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` of glibc's ``<malloc.h>``.
M_ARENA_MAX = -8
M_MMAP_THRESHOLD = -3
M_TRIM_THRESHOLD = -1
#: Arenas the agent's process may have.
ARENAS = 2
#: Blocks this large or larger are mapped for themselves and unmapped when freed; the heap's
#: free top is given back past this much (glibc's own starting value for both, held fixed).
THRESHOLD = 128 * 1024


def _mallopt(*settings: tuple[int, int]) -> bool:
    """glibc's ``mallopt`` for each ``(parameter, value)``: True when every one took; False
    where the C library has no ``mallopt`` (musl)."""
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return all([bool(mallopt(param, value)) for param, value in settings])


def limit_arenas(count: int = ARENAS) -> bool:
    """Cap this process's malloc arenas at ``count`` (call it before threads start). False
    when the environment already says (``MALLOC_ARENA_MAX``) or the C library cannot."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    return _mallopt((M_ARENA_MAX, count))


def fix_thresholds(threshold: int = THRESHOLD) -> bool:
    """Hold glibc's mmap and trim thresholds at ``threshold`` (call it before threads start).

    glibc raises both each time a mapped block is freed, up to 32 MiB, so after the first one the
    agent's 1 MiB buffers (hashing and copying checkpoints, reading logs) come from the heap and
    their memory stays with the process once freed. Held fixed, each buffer is mapped and given
    back. Measured with bench/pss.py (a whole job with hf:// sync, this 2-core VM, n=2): the
    agent's peak PSS 54.5 / 54.5 MiB against 56.7 / 57.3. The cost is a map and an unmap per
    buffer (microseconds, a few per MiB of a checkpoint).

    False when the environment already sets either (``MALLOC_MMAP_THRESHOLD_``,
    ``MALLOC_TRIM_THRESHOLD_``, or ``GLIBC_TUNABLES``' ``glibc.malloc``) or the C library cannot.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (
        os.environ.get("MALLOC_MMAP_THRESHOLD_")
        or os.environ.get("MALLOC_TRIM_THRESHOLD_")
        or "mmap_threshold" in tunables
        or "trim_threshold" in tunables
    ):
        return False
    return _mallopt((M_MMAP_THRESHOLD, threshold), (M_TRIM_THRESHOLD, threshold))
