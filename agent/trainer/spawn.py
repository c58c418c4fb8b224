"""Starting a process detached from the agent, as every trainer starts: its own session, its
output in files, its environment marked with the launch that started it.

:mod:`agent.trainer.process` launches ``libreyolo train`` with it; :mod:`agent.trainer.warmstart`
the trainer's Python that runs preflight's probe first (with two pipes of its own).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from agent.util.childenv import DEFAULT_SIGNALS


class TrainerError(Exception):
    """The trainer could not be started (missing executable, unwritable log...)."""


#: Environment variable that marks a trainer with the id of the launch that started it.
LAUNCH_ENV = "LIBREYOLO_AGENT_LAUNCH_ID"

#: What a trainer never gets: the keys that can stop or destroy this box (the providers' own,
#: as the agent reads them: agent/config/model.py ``Env``) and the cloud credentials a ``command``
#: teardown's tool reads (``aws``, ``gcloud``). The trainer runs the job's code and writes a log
#: that leaves the box; it needs ``HF_TOKEN`` (weights, a private dataset) and nothing of these.
PROVIDER_SECRET_ENV = (
    "CONTAINER_API_KEY",
    "VAST_API_KEY",
    "RUNPOD_API_KEY",
    "LAMBDA_API_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "CLOUDSDK_AUTH_ACCESS_TOKEN",
)


def without_provider_secrets(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` less :data:`PROVIDER_SECRET_ENV`."""
    return {k: v for k, v in environ.items() if k not in PROVIDER_SECRET_ENV}


def trainer_env(argv: list[str], launch_id: str | None) -> dict[str, str]:
    """The environment a trainer starts with: ours less the provider keys
    (:data:`PROVIDER_SECRET_ENV`), unbuffered, marked with its launch id, and able to import
    this agent when it runs one of the agent's entry points."""
    env = without_provider_secrets(dict(os.environ))
    env.setdefault("PYTHONUNBUFFERED", "1")
    if launch_id is not None:
        env[LAUNCH_ENV] = launch_id
    if any(a.startswith("agent.trainer.") and a.endswith("_entry") for a in argv[:4]):
        # The launcher must import this very agent, installed or run from a source tree.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def spawn_detached(
    argv: list[str],
    env: dict[str, str],
    *,
    log_path: Path,
    result_path: Path,
    cwd: Path,
    header: str,
    keep_fds: dict[int, int] | None = None,
) -> int:
    """Start ``argv`` in its own session in ``cwd``: stdin from /dev/null, stdout into
    ``result_path`` (truncated), stderr appended to ``log_path`` after a ``header`` line.
    ``keep_fds`` maps our descriptors to the numbers the child gets them as (none other is
    inherited). Returns the pid; raises :class:`TrainerError`.

    ``posix_spawn`` rather than asyncio's subprocess: an asyncio subprocess transport kills
    its child when it is closed or garbage-collected, and the trainer must outlive the agent.
    """
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    log_fd = -1
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cwd.mkdir(parents=True, exist_ok=True)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        res_fd = os.open(result_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as exc:
        if log_fd >= 0:
            os.close(log_fd)
        raise TrainerError(f"cannot create {exc.filename}: {exc.strerror}") from exc
    actions: list[tuple[Any, ...]] = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_DUP2, res_fd, 1),
        (os.POSIX_SPAWN_DUP2, log_fd, 2),
    ]
    actions += [(os.POSIX_SPAWN_DUP2, ours, theirs) for ours, theirs in (keep_fds or {}).items()]
    try:
        os.write(log_fd, f"\n=== libreyolo-agent {stamp}: {header}\n".encode())
        # posix_spawn has no cwd: a tiny shell changes directory, then becomes the trainer.
        shell = ["/bin/sh", "-c", 'cd -- "$0" && exec "$@"', str(cwd), *argv]
        # The stop signals at their defaults whatever this process inherited (DEFAULT_SIGNALS).
        return os.posix_spawn(
            shell[0], shell, env, file_actions=actions, setsid=True, setsigdef=DEFAULT_SIGNALS
        )
    except OSError as exc:
        raise TrainerError(f"cannot start {argv[0]}: {exc.strerror or exc}") from exc
    finally:
        os.close(log_fd)
        os.close(res_fd)
