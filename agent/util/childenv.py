"""The environment of the processes of our own that the agent and the supervisor start (the
guard, the agent under ``supervise``): standard library only, so the supervisor, which lives as
long as the job, imports nothing more for it."""

from __future__ import annotations

import os
import signal
import sysconfig
from pathlib import Path

#: Signals a process of ours starts with at their default action, whatever this process
#: inherited (``posix_spawn(setsigdef=...)``): a process started in the background by a
#: non-interactive shell (`cmd &`) ignores SIGINT and SIGQUIT, and an ignored signal stays ignored
#: across exec; a trainer ignoring SIGINT would never take LibreYOLO's clean stop.
DEFAULT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGPIPE)

#: Fault injection for tests (agent/util/crashpoints.py): never inherited by a process of our own.
CRASHPOINT_ENV = "LIBREYOLO_AGENT_CRASHPOINT"


def child_env() -> dict[str, str]:
    """This environment (provider keys come from it, never from a file), without the fault
    injection, and with this very ``agent`` package importable first."""
    env = {k: v for k, v in os.environ.items() if k != CRASHPOINT_ENV}
    root = str(Path(__file__).resolve().parents[2])
    site_dirs = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    if root not in site_dirs:  # a source checkout: the child must run this very code
        old = env.get("PYTHONPATH")
        env["PYTHONPATH"] = root + (os.pathsep + old if old else "")
    return env
