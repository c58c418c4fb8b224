"""What every job proves before training, even with ``[preflight] enabled = false``: that the
agent can end this box's bill and save its work. Cheap (a second or two), so it always runs:

- ``provider.<name>``: the teardown provider can act on THIS box: the instance read with the key
  (``GET`` the instance, no change made: a 401/403 fails naming the variable, never its value),
  or the ``command`` provider's executables found (``teardown.command``, ``stop_command``);
  with preflight on, its own provider check (price and cap included) does this instead.
- ``target.canary``: the sync target takes a write: ``agent/.canary`` is written through the
  very sink the sync uses (``file://`` or ``hf://``), read back (size and sha256) and deleted.
  A ``file://`` path under a file, or an ``hf://`` token without write access, fails here,
  before a GPU hour is spent on checkpoints that could never leave the box.

A failure ends the job as ``preflight_failed`` (with its teardown) like any preflight failure;
the checks are in ``preflight.json`` when the full preflight is off, and in agent.log always.
An outage of the target that may pass (a 5xx, a rate limit, no answer within
:data:`CANARY_TIMEOUT_S`) is a warning: uploads retry, and a box that can train is not torn down
for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path

from agent.config.model import Env, Job
from agent.preflight.guardplan_check import guard_plan_check
from agent.preflight.report import FAIL, PASS, WARN, Check, make_check
from agent.sinks import Sink, SinkError

log = logging.getLogger(__name__)

#: Where the canary goes, under the target's own prefix (beside the agent's logs).
CANARY_PATH = "agent/.canary"
#: The most the canary may take (the Hub client retries a 5xx on its own for ~25 s).
CANARY_TIMEOUT_S = 90.0


def _write_canary(sink: Sink) -> tuple[str, bool]:
    """Prepare the target, write the canary, read it back, delete it: ``(what happened,
    retryable)``, or ``("", False)`` when all went well. Blocking."""
    data = f"libreyolo-agent canary {os.getpid()} {time.time():.6f}\n".encode()
    digest = hashlib.sha256(data).hexdigest()
    with tempfile.TemporaryDirectory(prefix="libreyolo-canary-") as tmp:
        local = Path(tmp) / ".canary"
        local.write_bytes(data)
        try:
            sink.prepare()
            sink.upload(local, CANARY_PATH)
            back = sink.stat(CANARY_PATH)
        except SinkError as exc:
            return str(exc), exc.retryable and not _local(sink)
        if back is None or (back.size, back.sha256) != (len(data), digest):
            seen = "nothing" if back is None else f"{back.size} bytes, sha256 {back.sha256[:12]}"
            return f"{CANARY_PATH} was written but reads back as {seen}", False
        try:
            sink.delete(CANARY_PATH)
        except SinkError as exc:
            # Written and read back: the target works; a leftover canary is only untidy.
            log.warning("preflight: the canary could not be removed: %s", exc)
    return "", False


def _local(sink: Sink) -> bool:
    # A local folder's errors (not a directory, read-only, no space) do not pass by themselves.
    return sink.description.startswith("file://")


async def target_check(sink: Sink, timeout_s: float = CANARY_TIMEOUT_S) -> Check:
    """``target.canary``: write, read back and delete ``agent/.canary`` on the target."""
    name = "target.canary"
    t0 = time.monotonic()
    try:
        work = asyncio.to_thread(_write_canary, sink)
        problem, retryable = await asyncio.wait_for(work, timeout_s)
    except TimeoutError:
        problem, retryable = f"no answer within {timeout_s:.0f} s", True
    took = time.monotonic() - t0
    if not problem:
        value = f"{sink.description}: {CANARY_PATH} written, read back and deleted ({took:.1f} s)"
        return make_check(name, PASS, value, None)
    if retryable:
        return make_check(
            name,
            WARN,
            f"{sink.description}: could not prove a write yet: {problem}",
            "uploads retry; check the target if this persists",
        )
    return make_check(
        name,
        FAIL,
        f"{sink.description}: cannot write there: {problem}",
        "fix sync.target (or the access it needs) before a GPU hour is spent on checkpoints "
        "that could never leave the box",
    )


async def command_checks(job: Job, env: Env) -> list[Check]:
    """What ``libreyolo-agent preflight JOB`` adds to the machine checks, so that it proves what
    ``run`` will: the target's canary and the guard's plan (the full preflight already reads the
    provider)."""
    from agent.sinks.target import make_sink

    checks: list[Check] = []
    if job.sync is not None:
        try:
            sink = make_sink(job.sync, env)
        except (SinkError, ValueError, OSError) as exc:
            checks.append(
                make_check(
                    "target.canary",
                    FAIL,
                    f"{job.sync.target}: cannot use it: {exc}",
                    "fix sync.target (or the access it needs)",
                )
            )
        else:
            checks.append(await target_check(sink))
    if (kept := guard_plan_check(job)) is not None:
        checks.append(kept)
    return checks
