"""Does a checkpoint load? :mod:`agent.trainer.loadcheck_entry` asked in a child process (the
agent never imports torch), killed with its group past a timeout.

The same shape as :func:`agent.trainer.finite.check_weights` (its own session, no GPU, one
thread, one JSON line read back), for another question: finite.py reads every tensor for NaN;
this builds the model with LibreYOLO and loads the weights into it, the way a person who
fetched the checkpoint would.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from agent.util.childenv import child_env
from agent.util.procs import stop_group

#: ``ok``: LibreYOLO built the model and every tensor it has came from the checkpoint;
#: ``failed``: it did not (``error`` says why); ``timed_out``: the child was killed.
LoadStatus = Literal["ok", "failed", "timed_out"]


@dataclass(frozen=True)
class LoadCheck:
    """One checkpoint's load, as the child answered."""

    status: LoadStatus
    #: Child start to answer, seconds (interpreter, ``import torch``, LibreYOLO, the load).
    seconds: float
    #: The child's answer (``family``, ``size``, ``tensors``, ``epoch``, ``load_s``...).
    answer: dict[str, Any]
    error: str | None = None


def entry_argv(python: str = sys.executable) -> list[str]:
    """The child's command line, the checkpoint's path appended."""
    return [python, "-m", "agent.trainer.loadcheck_entry"]


async def check_loads(
    path: Path, *, timeout_s: float, argv: Sequence[str] | None = None
) -> LoadCheck:
    """Load the checkpoint ``path`` in a child (``argv`` + the path; default
    :func:`entry_argv`), killed with its group past ``timeout_s``. Never raises for a bad file
    or a bad child; re-raises a cancellation after killing the child."""
    env = child_env()
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU only: the drill never takes a GPU
    env.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *(argv if argv is not None else entry_argv()),
            str(path),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        why = f"cannot start the loader: {exc.strerror or exc}"
        return LoadCheck("failed", time.monotonic() - started, {}, why)
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        await stop_group(proc, grace_s=2.0)
        why = f"the loader took over {timeout_s:.0f}s and was killed"
        return LoadCheck("timed_out", time.monotonic() - started, {}, why)
    except asyncio.CancelledError:
        await stop_group(proc, grace_s=2.0)
        raise
    return _answer(stdout, stderr, proc.returncode, time.monotonic() - started)


def _answer(stdout: bytes, stderr: bytes, code: int | None, seconds: float) -> LoadCheck:
    line = next((ln for ln in reversed(stdout.decode(errors="replace").splitlines()) if ln), "")
    try:
        doc = json.loads(line)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        tail = " ".join(stderr.decode(errors="replace").split()[-40:])
        why = f"the loader exited {code} without an answer" + (f": {tail}" if tail else "")
        return LoadCheck("failed", seconds, {}, why[:500])
    if doc.get("error") or code != 0:
        return LoadCheck("failed", seconds, doc, str(doc.get("error") or f"exit {code}"))
    return LoadCheck("ok", seconds, doc)
