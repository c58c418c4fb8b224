"""Running the torch probe (``agent/preflight/probe.py``) in a child Python, in its own session.

The child gets a deadline; when it passes, its whole process group is killed (a hung GPU, a
hung NCCL worker), and the result says at which stage it hung. Its stderr is read by chunks and
only the tail is kept.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# KILL_GRACE_S and kill_group are also imported from here (preflight, warmstart, the driver).
from agent.util.procs import KILL_GRACE_S as KILL_GRACE_S
from agent.util.procs import finish_readers, stop_group
from agent.util.procs import kill_group as kill_group

log = logging.getLogger(__name__)

#: The probe script, run by path (it sits beside this package, in ``agent/``).
PROBE_PATH = Path(__file__).parent / "probe.py"
#: The probe's stage lines and document version (``agent/preflight/probe.py``, which this package
# does
#: not import: it runs in a child).
STAGE_PREFIX = "libreyolo-agent-probe: stage "
PROBE_SCHEMA = 1
_STDERR_TAIL = 4000


@dataclass(frozen=True)
class ProbeResult:
    """What the probe reported (``doc``), or how it failed to."""

    #: The probe's JSON report; None when it hung, died or printed none.
    doc: dict[str, Any] | None
    seconds: float
    returncode: int | None
    timed_out: bool = False
    #: The last stage the probe announced on stderr (``import torch``, ``gpu0.matmul``...).
    last_stage: str | None = None
    #: Why there is no report, when the exit code does not say it.
    error: str | None = None
    stderr_tail: str = ""


async def run_probe(
    python: str, config: dict[str, Any], timeout_s: float, extra_pythonpath: list[str]
) -> ProbeResult:
    """Run the probe under ``python`` with ``config``; kill its process group after ``timeout_s``.

    ``extra_pythonpath`` goes first on the child's import path. Never raises for a problem of
    the child: a probe that cannot start, dies or hangs comes back as a result without ``doc``.
    """
    env = dict(os.environ)
    paths = [*extra_pythonpath, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    # Run by path, so that the probe needs no installed agent; PYTHONSAFEPATH keeps agent/
    # itself (the script's directory) off sys.path.
    env["PYTHONSAFEPATH"] = "1"
    t0 = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            python,
            str(PROBE_PATH),
            json.dumps(config),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        return ProbeResult(None, 0.0, None, error=f"cannot start {python}: {exc}")
    assert proc.stdout is not None and proc.stderr is not None
    stages: list[str] = []
    tail = bytearray()

    def on_line(raw: bytes) -> None:
        line = raw.decode("utf-8", "replace")
        if line.startswith(STAGE_PREFIX):
            stages.append(line[len(STAGE_PREFIX) :].strip())
        else:
            tail.extend(raw + b"\n")
            del tail[:-_STDERR_TAIL]

    async def read_stderr(stream: asyncio.StreamReader) -> None:
        # By chunks, not readline(): a progress bar redrawn with \r makes one endless "line".
        pending = b""
        while chunk := await stream.read(65536):
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                on_line(raw)
            if len(pending) > _STDERR_TAIL:
                on_line(pending)
                pending = b""
        if pending:
            on_line(pending)

    out_task = asyncio.create_task(proc.stdout.read())
    err_task = asyncio.create_task(read_stderr(proc.stderr))
    timed_out = False
    try:
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            timed_out = True
            warn_hung(stages, timeout_s)
    finally:
        # Always, also after a normal exit: NCCL workers left behind share the group. A probe
        # stuck in the driver (state D) may never go: the wait is bounded.
        await stop_group(proc, sig=signal.SIGKILL)
        await finish_readers(out_task, err_task)
    seconds = time.monotonic() - t0
    ok_read = out_task.done() and not out_task.cancelled() and out_task.exception() is None
    stdout = out_task.result() if ok_read else b""
    result = ProbeResult(
        None,
        seconds,
        proc.returncode,
        timed_out=timed_out,
        last_stage=stages[-1] if stages else None,
        stderr_tail=tail.decode("utf-8", "replace"),
    )
    if timed_out:
        return result
    text = stdout.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(text.splitlines()[-1]) if text else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("schema") != PROBE_SCHEMA:
        what = "no report" if not text else "an unreadable report"
        return replace(result, error=f"{what} (exit code {proc.returncode})")
    return replace(result, doc=doc)


def warn_hung(stages: list[str], timeout_s: float) -> None:
    log.warning(
        "preflight: probe hung at %s, killing it after %.0f s",
        stages[-1] if stages else "start",
        timeout_s,
    )
