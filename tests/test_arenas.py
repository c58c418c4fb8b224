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


def _arenas(mode: str, **environ: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_COUNT_ARENAS), mode],
        cwd=ROOT,
        env={**env, **environ},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


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
