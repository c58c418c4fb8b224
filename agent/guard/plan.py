"""The agent's side of the guard (:mod:`agent.guard.run`): the plan the guard follows, the heartbeat
it watches, and starting it.

At every start the agent (agent/daemon/spine.py) writes the plan (:func:`write_plan`), runs
:func:`heartbeat_task` for as long as it lives, and starts the guard (:func:`ensure_running`).
The guard process imports this module; the agent needs nothing else of the guard.

The files of the state directory this side writes or reads:

- ``guard-plan.json`` (:func:`write_plan`, by the agent at start; no secrets: provider keys stay in
  the environment the guard inherits): the job's ``[teardown]`` table, the job's start,
  ``hard_deadline`` = job start + ``limits.max_runtime`` + ``margin_s`` (default 15 min), and
  ``stale_after_s`` (default 10 min).
- ``heartbeat`` (:func:`beat`, every ``heartbeat_every_s`` from :func:`heartbeat_task`): its mtime
  is the agent's last sign of life (the plan's own write counts too, so a restarted agent is alive
  from its first line).
- ``guard.lock``: held by the running guard, its pid inside (:func:`guard_pid` reads it).
- ``guard.log``: the guard's stdout and stderr (:func:`ensure_running` opens it for the child).

Timing can be tuned through the environment the **agent** reads when it writes the plan:
``LIBREYOLO_AGENT_GUARD_STALE_AFTER`` and ``LIBREYOLO_AGENT_GUARD_MARGIN`` (durations: ``"10m"``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from agent.state import atomic_write_json
from agent.util.childenv import DEFAULT_SIGNALS
from agent.util.childenv import child_env as _child_env

#: ``typing.TYPE_CHECKING`` without importing typing (0.5 MiB the supervisor does not hold);
#: the standard library's dataclasses for mypy, agent.util.record's at run time (1.0 MiB less).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from dataclasses import asdict as plain
    from dataclasses import dataclass as record
    from typing import Any

    from agent.config.model import Job, TeardownSection
else:
    from agent.util.record import plain, record

# One logger for the guard, whichever side writes the line.
log = logging.getLogger(__name__)

PLAN_FILE = "guard-plan.json"
HEARTBEAT_FILE = "heartbeat"
LOCK_FILE = "guard.lock"
LOG_FILE = "guard.log"

#: The agent counts as dead once its heartbeat is this old, seconds (20 missed beats).
DEFAULT_STALE_AFTER_S = 600.0
#: The hard deadline is this long past ``limits.max_runtime``, seconds: a restarted agent gets the
#: chance to finish its own way (final sync, verified destroy) before the stop-only fallback.
DEFAULT_MARGIN_S = 900.0
#: Without ``limits.max_runtime``, the guard acts once the agent has been silent this long.
NO_DEADLINE_STALE_S = 6 * 3600.0
#: The agent beats, and the guard looks, at most this often apart (seconds); both go faster when
#: ``stale_after_s`` is short (a fifth of it), so a live agent is never taken for a dead one.
MAX_EVERY_S = 30.0
STALE_AFTER_ENV = "LIBREYOLO_AGENT_GUARD_STALE_AFTER"
MARGIN_ENV = "LIBREYOLO_AGENT_GUARD_MARGIN"
#: How long the guard's upload of ``last.pt`` may take (agent/guard/save.py reads it).
SAVE_TIMEOUT_ENV = "LIBREYOLO_AGENT_GUARD_SAVE_TIMEOUT"


# ----------------------------------------------------------------------------------- the plan


@record(frozen=True)
class GuardPlan:
    """``guard-plan.json``: everything the guard needs, written by the agent. No secrets."""

    job_name: str
    #: The job's first boot (epoch seconds; state.json's ``started_at``).
    started_at: float
    max_runtime_s: float | None
    margin_s: float
    #: ``started_at + max_runtime_s + margin_s``; None without ``limits.max_runtime``.
    hard_deadline: float | None
    #: A heartbeat older than this (seconds) means the agent is dead (or hung).
    stale_after_s: float
    #: Without a hard deadline, the guard acts after this much silence (seconds).
    no_deadline_stale_s: float
    #: How often the guard looks (seconds).
    check_every_s: float
    #: How often the agent beats (seconds).
    heartbeat_every_s: float
    #: The job's ``[teardown]`` table as plain JSON (provider name, policies, api_url...).
    teardown: dict[str, Any]
    #: When the agent wrote the plan: a sign of life too.
    written_at: float
    #: The job file (absolute), which the guard reads again when it acts: the ``[sync]`` target
    #: it saves ``last.pt`` to, the trainer's graces, the ``[notify]`` webhook (a secret: it
    #: stays in the job file, never in this plan). None when the job came from no file.
    job_file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return plain(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GuardPlan:
        """Raises ValueError naming the first bad field."""
        teardown = d.get("teardown")
        if not isinstance(teardown, dict) or not isinstance(teardown.get("provider"), str):
            raise ValueError("teardown: not a [teardown] table with a provider")
        name = d.get("job_name")
        if not isinstance(name, str):
            raise ValueError(f"job_name: {name!r} is not a string")
        return cls(
            job_name=name,
            started_at=_number(d, "started_at"),
            max_runtime_s=_optional_number(d, "max_runtime_s"),
            margin_s=_number(d, "margin_s"),
            hard_deadline=_optional_number(d, "hard_deadline"),
            stale_after_s=_number(d, "stale_after_s"),
            no_deadline_stale_s=_number(d, "no_deadline_stale_s"),
            check_every_s=_number(d, "check_every_s"),
            heartbeat_every_s=_number(d, "heartbeat_every_s"),
            teardown=dict(teardown),
            written_at=_number(d, "written_at"),
            job_file=d["job_file"] if isinstance(d.get("job_file"), str) else None,
        )

    def teardown_section(self) -> TeardownSection:
        """The ``[teardown]`` table again, for :func:`make_provider`. Keys this version does
        not know are left out (and named in the log); lists become tuples (argv). The job's
        configuration is imported here, when the guard acts, not while it waits."""
        from dataclasses import fields

        from agent.config.model import TeardownSection

        known = {f.name for f in fields(TeardownSection)}
        unknown = sorted(set(self.teardown) - known)
        if unknown:
            log.warning("guard: the plan's [teardown] keys %s are unknown here; ignored", unknown)
        kwargs: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v
            for k, v in self.teardown.items()
            if k in known
        }
        return TeardownSection(**kwargs)


def _number(d: Mapping[str, Any], key: str) -> float:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key}: {value!r} is not a number")
    return float(value)


def _optional_number(d: Mapping[str, Any], key: str) -> float | None:
    return None if d.get(key) is None else _number(d, key)


def _duration_from_env(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name)
    if not raw:
        return default
    from agent.config.jobvalues import parse_duration  # the agent's side, not the waiting guard

    return parse_duration(name, raw)


def _plain(value: Any) -> Any:
    """``value`` as JSON has it (tuples as lists, paths as strings)."""
    return json.loads(json.dumps(value, default=str))


def check_environ(environ: Mapping[str, str] | None = None) -> None:
    """Check the guard's variables up front (``run`` before anything starts), so a typo is
    a :class:`ConfigError` naming the variable (exit 2), not a failure of the running agent."""
    from agent.policy.teardown import timing_from_env

    e = os.environ if environ is None else environ
    _duration_from_env(e, STALE_AFTER_ENV, DEFAULT_STALE_AFTER_S)
    _duration_from_env(e, MARGIN_ENV, DEFAULT_MARGIN_S)
    timing_from_env(e)  # LIBREYOLO_AGENT_TEARDOWN_TIMING, read by the agent and the guard
    _duration_from_env(e, SAVE_TIMEOUT_ENV, 600.0)  # the guard's upload of last.pt


def write_plan(
    state_dir: Path,
    job: Job,
    started_at: float,
    *,
    environ: Mapping[str, str] | None = None,
    now: float | None = None,
    extended_s: float = 0.0,
) -> GuardPlan:
    """Write ``guard-plan.json`` for ``job``, whose first boot was ``started_at`` (state.json's
    ``started_at``, carried over restarts). Call it at every agent start: a restarted agent's
    plan counts as a sign of life. Timing comes from ``LIBREYOLO_AGENT_GUARD_STALE_AFTER`` and
    ``LIBREYOLO_AGENT_GUARD_MARGIN`` (raises :class:`ConfigError` naming a bad one), else the
    defaults. Raises OSError when the file cannot be written."""
    import dataclasses  # the agent's side: the job's sections are the standard library's

    e = os.environ if environ is None else environ
    stale_after_s = _duration_from_env(e, STALE_AFTER_ENV, DEFAULT_STALE_AFTER_S)
    margin_s = _duration_from_env(e, MARGIN_ENV, DEFAULT_MARGIN_S)
    max_runtime_s = job.limits.max_runtime_s
    if max_runtime_s is not None:
        max_runtime_s += extended_s  # ``libreyolo-agent extend`` moves the guard's deadline too
    every_s = min(MAX_EVERY_S, stale_after_s / 5)
    plan = GuardPlan(
        job_name=job.job.name,
        started_at=started_at,
        max_runtime_s=max_runtime_s,
        margin_s=margin_s,
        hard_deadline=None if max_runtime_s is None else started_at + max_runtime_s + margin_s,
        stale_after_s=stale_after_s,
        no_deadline_stale_s=NO_DEADLINE_STALE_S,
        check_every_s=every_s,
        heartbeat_every_s=every_s,
        teardown=_plain(dataclasses.asdict(job.teardown)),
        written_at=time.time() if now is None else now,
        job_file=_job_file(job.source),
    )
    atomic_write_json(state_dir / PLAN_FILE, plan.to_dict())
    return plan


def _job_file(source: str) -> str | None:
    """The job file's absolute path (the guard works from ``/``), or None for a job that came
    from no file."""
    path = Path(source)
    return str(path.absolute()) if path.is_file() else None


def read_plan(state_dir: Path) -> GuardPlan | None:
    """The plan, or None when there is none; raises ValueError when it is unreadable."""
    try:
        data = json.loads((state_dir / PLAN_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{PLAN_FILE} is unreadable: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{PLAN_FILE} is not a JSON object")
    return GuardPlan.from_dict(data)


# ------------------------------------------------------------------------------- the heartbeat


def beat(state_dir: Path) -> None:
    """Touch ``STATE_DIR/heartbeat`` (its mtime is the beat). Raises OSError."""
    path = state_dir / HEARTBEAT_FILE
    try:
        os.utime(path)
    except FileNotFoundError:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))


def last_sign_of_life(state_dir: Path, plan: GuardPlan) -> float:
    """The agent's last beat, or the plan's writing when that is later (epoch seconds)."""
    try:
        beat_at = os.stat(state_dir / HEARTBEAT_FILE).st_mtime
    except FileNotFoundError:
        beat_at = 0.0
    return max(beat_at, plan.written_at)


async def heartbeat_task(state_dir: Path, every_s: float) -> None:
    """The agent's long-lived task: beat every ``every_s`` seconds and keep the guard running
    (a guard that died is started again; an exited one is reaped). Never raises; runs until
    cancelled. A beat that cannot be written is logged once per distinct error."""
    import asyncio  # here: the guard imports this module, and waits without asyncio

    said: str | None = None
    while True:
        try:
            beat(state_dir)
            if said is not None:
                log.info("heartbeat written again")
            said = None
        except OSError as exc:
            message = f"cannot write the heartbeat in {state_dir}: {exc.strerror or exc}"
            if message != said:
                log.error("%s; the guard will take the agent for dead", message)
            said = message
        ensure_running(state_dir)
        await asyncio.sleep(every_s)


# ------------------------------------------------------------------------ starting the guard

#: Guards this process started, by state directory: not yet holding their lock right after
#: the spawn, and reaped here once they exit.
_spawned: dict[Path, int] = {}


def guard_pid(state_dir: Path) -> int | None:
    """The pid of the guard holding ``state_dir``'s lock (0 when unreadable), or None when no
    guard holds it. Raises OSError when the lock file cannot be opened."""
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # The holder writes its pid just after it took the lock: give it a moment.
            for _ in range(20):
                text = os.pread(fd, 32, 0).decode(errors="replace").strip()
                if text.isdigit():
                    return int(text)
                time.sleep(0.005)
            return 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _child_running(pid: int) -> bool:
    """True while the child ``pid`` this process spawned runs; reaps it once it exited."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == 0


def _spawn(state_dir: Path) -> int:
    log_path = state_dir / LOG_FILE
    # -P: the agent's working directory must not put another ``agent`` package first.
    argv = [sys.executable, "-P", "-m", "agent.guard", str(state_dir)]
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(log_path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    return os.posix_spawn(
        sys.executable,
        argv,
        _child_env(),
        file_actions=actions,
        setsid=True,  # its own session: a signal to the agent's group never reaches it
        setsigdef=DEFAULT_SIGNALS,
    )


def ensure_running(state_dir: Path) -> int | None:
    """Start the guard of ``state_dir`` unless one holds its ``guard.lock``; return the
    guard's pid. None when no guard could be started (logged; :func:`heartbeat_task` tries
    again at its next beat) or when the running guard's pid cannot be read. Never raises."""
    state_dir = state_dir.absolute()
    try:
        holder = guard_pid(state_dir)
    except OSError as exc:
        log.error("guard: cannot open %s: %s", state_dir / LOCK_FILE, exc.strerror or exc)
        return None
    if holder is not None:
        return holder or None
    child = _spawned.get(state_dir)
    if child is not None and _child_running(child):
        return child  # started, not holding its lock yet
    try:
        pid = _spawn(state_dir)
    except OSError as exc:
        log.error("guard: cannot start the guard for %s: %s", state_dir, exc.strerror or exc)
        return None
    _spawned[state_dir] = pid
    log.info("guard started (pid %d): it stops the box if this agent dies for good", pid)
    return pid
