"""agent/util/arenas.py: the agent's process gets two malloc arenas, whatever the number of threads
that allocate (counted by glibc's own ``malloc_info``, in a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.util.arenas import ARENAS, limit_arenas

ROOT = Path(__file__).resolve().parent.parent

_COUNT_ARENAS = """
    import ctypes, json, sys, tempfile, threading
    from agent.util.arenas import limit_arenas

    limited = limit_arenas() if sys.argv[1] == "limit" else False
    barrier = threading.Barrier(8)

    def work():
        barrier.wait()
        keep = [bytearray(64 * 1024) for _ in range(64)]  # 4 MiB from this thread's arena
        barrier.wait()
        del keep

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
    libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.fclose.argtypes = (ctypes.c_void_p,)
    with tempfile.NamedTemporaryFile(suffix=".xml") as tmp:
        stream = libc.fopen(tmp.name.encode(), b"w")
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        xml = open(tmp.name).read()
    print(json.dumps({"limited": limited, "arenas": xml.count("<heap nr=")}))
"""


def _run(code: str, mode: str, drop: tuple[str, ...], **environ: str) -> dict[str, object]:
    """``code`` in a fresh interpreter (``mode`` its argument), without the variables ``drop``
    names and with ``environ``: the JSON of its last line."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), mode],
        cwd=ROOT,
        env={**env, **environ},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def _arenas(mode: str, **environ: str) -> dict[str, object]:
    return _run(_COUNT_ARENAS, mode, ("MALLOC_ARENA_MAX",), **environ)


def test_eight_allocating_threads_share_two_arenas() -> None:
    free = _arenas("free")
    limited = _arenas("limit")
    assert limited["limited"] is True
    assert limited["arenas"] == ARENAS
    # Without the cap the same threads got arenas of their own: the test can tell.
    assert isinstance(free["arenas"], int) and free["arenas"] > ARENAS


def test_the_users_malloc_arena_max_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _arenas("limit", MALLOC_ARENA_MAX="4")
    assert result["limited"] is False
    assert isinstance(result["arenas"], int) and ARENAS < result["arenas"] <= 4
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_arenas() is False


_MAPPED_AFTER_A_FREE = """
    import ctypes, json, sys
    from agent.util.arenas import fix_thresholds

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    fixed = fix_thresholds() if sys.argv[1] == "fix" else False
    first = bytearray(1 << 20)  # mapped: over glibc's starting threshold
    del first  # unmapped; glibc now raises the threshold past 1 MiB, unless it is held
    second = bytearray(1 << 20)
    mapped = libc.mallinfo2().hblkhd  # bytes in blocks mapped for themselves, now
    print(json.dumps({"fixed": fixed, "second_mapped": mapped >= 1 << 20}))
"""


def _mapped(mode: str, **environ: str) -> dict[str, object]:
    drop = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
    return _run(_MAPPED_AFTER_A_FREE, mode, drop, **environ)


def test_a_freed_buffer_is_given_back_not_kept_in_the_heap() -> None:
    # glibc's default: after a 1 MiB block is freed, the next one comes from the heap (and stays
    # there once freed); with the thresholds held, it is mapped again (and unmapped at its free).
    assert _mapped("free") == {"fixed": False, "second_mapped": False}
    assert _mapped("fix") == {"fixed": True, "second_mapped": True}


def test_the_users_malloc_thresholds_are_left_alone() -> None:
    assert _mapped("fix", MALLOC_MMAP_THRESHOLD_="4194304")["fixed"] is False
    assert _mapped("fix", GLIBC_TUNABLES="glibc.malloc.trim_threshold=1048576")["fixed"] is False
