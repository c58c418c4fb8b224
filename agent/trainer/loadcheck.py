"""Does a checkpoint load? :mod:`agent.trainer.loadcheck_entry` asked in a child process (the
agent never imports torch), killed with its group past a timeout.

The same shape as :func:`agent.trainer.finite.check_weights` (its own session, no GPU, one
thread, one JSON line read back), for another question: finite.py reads every tensor for NaN;
this builds the model with LibreYOLO and loads the weights into it, the way a person who
fetched the checkpoint would.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from agent.util.procs import run_check_child

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
    argv = [*(argv if argv is not None else entry_argv()), str(path)]
    run = await run_check_child(argv, timeout_s=timeout_s, grace_s=2.0)
    if run.failure == "start":
        return LoadCheck("failed", run.elapsed_s, {}, f"cannot start the loader: {run.why}")
    if run.failure == "timeout":
        return LoadCheck("timed_out", run.elapsed_s, {}, f"the loader {run.why}")
    return _answer(run.stdout, run.stderr, run.returncode, run.elapsed_s)


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
