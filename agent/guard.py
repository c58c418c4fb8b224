"""The guard: a tiny process that outlives the agent and stops the box when the agent is dead.

If the agent dies (OOM-killed, a bug, a deleted venv) and nothing restarts it, nothing would stop
the bill. The guard is that something: ``python -m agent.guard STATE_DIR``, started by the agent
(:func:`ensure_running`) in its own session, standard library plus the agent's providers (no torch,
no HTTP server), so it survives whatever took the agent down.

How it works, file by file in the state directory:

- ``guard-plan.json`` (:func:`write_plan`, by the agent at start; no secrets: provider keys stay in
  the environment the guard inherits): the job's ``[teardown]`` table, the job's start,
  ``hard_deadline`` = job start + ``limits.max_runtime`` + ``margin_s`` (default 15 min), and
  ``stale_after_s`` (default 10 min).
- ``heartbeat`` (:func:`beat`, every ``heartbeat_every_s`` from :func:`heartbeat_task`): its mtime
  is the agent's last sign of life (the plan's own write counts too, so a restarted agent is alive
  from its first line).
- ``guard.lock``: flock held by the one guard of the directory, its pid inside. A second guard
  exits at once.
- ``guard.json``: what the guard decided and did (written before anything is sent, then updated).
- ``guard.log``: the guard's log (stdout and stderr).

The guard acts when **both** hold: the heartbeat is stale past ``stale_after_s``, **and** the
hard deadline has passed. A job without ``limits.max_runtime`` has no deadline: the guard then
acts only once the agent has been silent for ``no_deadline_stale_s`` (6 h): long enough for a
person to notice and restart the agent, short enough that a dead agent costs at most that.
Before the deadline a dead agent is left alone: the trainer goes on (it outlives the agent) and
systemd or a person may restart the agent, which then carries on and beats again.

Acting means: take the agent's lock (``agent.lock``; a restarted agent then waits for the guard,
exits 1 and is restarted into the guard's verdict), record the decision durably, then tear down
through :func:`agent.providers.make_provider`: **stop, never destroy**, unless ``sync-result.json``
says ``sync_verified: true`` (written during this job) and the job's policy for the case is
``destroy`` (``on_success`` when the trainer had completed, else ``on_failure``). A provider that
cannot stop (``provider.can_stop`` false: Lambda, a command without ``stop_command``) keeps the
box, and the guard says so loudly: it never destroys checkpoints not verified off the box. The
result goes into ``guard.json`` and into state.json's teardown record, the phase becomes ``DONE``
with reason ``agent_failed``; then the guard exits. A failed teardown is tried again every
``check_every_s`` (reading back first).

Edge cases: the phase ``DONE`` or ``FAILED`` -> the guard exits without acting; ``HELD`` (a person
holds the teardown) -> the guard never acts; a process holds ``agent.lock`` but does not beat (a
hung agent) -> the guard checks once more one interval later, then acts without writing
state.json (the hung agent owns it). SIGTERM or SIGINT end the guard after its current step.

Timing can be tuned through the environment the **agent** reads when it writes the plan:
``LIBREYOLO_AGENT_GUARD_STALE_AFTER`` and ``LIBREYOLO_AGENT_GUARD_MARGIN`` (durations: ``"10m"``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import logging
import math
import os
import signal
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any, Literal

from . import logutil
from .config import Job, TeardownAction, TeardownSection, as_action, format_duration, parse_duration
from .providers import Provider, ProviderError, TeardownResult, make_provider
from .state import (
    Phase,
    Reason,
    RunState,
    StateDirLocked,
    StateStore,
    atomic_write_json,
    transition,
)
from .teardown import carry_out

log = logging.getLogger("agent.guard")

PLAN_FILE = "guard-plan.json"
HEARTBEAT_FILE = "heartbeat"
LOCK_FILE = "guard.lock"
RECORD_FILE = "guard.json"
LOG_FILE = "guard.log"
#: Written by agent/sync.py after the final verification (what the teardown gate reads).
SYNC_RESULT_FILE = "sync-result.json"

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
#: Fault injection is for the agent; a guard must never inherit it.
_CRASHPOINT_ENV = "LIBREYOLO_AGENT_CRASHPOINT"
#: A guard that finds guard.lock taken tries again this many times, 50 ms apart, before it
#: concludes another guard holds it (:func:`guard_pid` takes the lock for a moment to probe).
_LOCK_TRIES = 10

#: Where the guard stands at one look: alive agent, dead agent before the deadline, due.
DueKind = Literal["alive", "before_deadline", "no_deadline_wait", "due"]
_PAST: dict[TeardownAction, str] = {"stop": "stopped", "destroy": "destroyed", "keep": "kept"}


# ----------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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
        )

    def teardown_section(self) -> TeardownSection:
        """The ``[teardown]`` table again, for :func:`make_provider`. Keys this version does
        not know are left out (and named in the log); lists become tuples (argv)."""
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
    return default if not raw else parse_duration(name, raw)


def _plain(value: Any) -> Any:
    """``value`` as JSON has it (tuples as lists, paths as strings)."""
    return json.loads(json.dumps(value, default=str))


def check_environ(environ: Mapping[str, str] | None = None) -> None:
    """Check the guard's variables up front (``run`` before anything starts), so a typo is
    a :class:`ConfigError` naming the variable (exit 2), not a failure of the running agent."""
    e = os.environ if environ is None else environ
    _duration_from_env(e, STALE_AFTER_ENV, DEFAULT_STALE_AFTER_S)
    _duration_from_env(e, MARGIN_ENV, DEFAULT_MARGIN_S)


def write_plan(
    state_dir: Path,
    job: Job,
    started_at: float,
    *,
    environ: Mapping[str, str] | None = None,
    now: float | None = None,
) -> GuardPlan:
    """Write ``guard-plan.json`` for ``job``, whose first boot was ``started_at`` (state.json's
    ``started_at``, carried over restarts). Call it at every agent start: a restarted agent's
    plan counts as a sign of life. Timing comes from ``LIBREYOLO_AGENT_GUARD_STALE_AFTER`` and
    ``LIBREYOLO_AGENT_GUARD_MARGIN`` (raises :class:`ConfigError` naming a bad one), else the
    defaults. Raises OSError when the file cannot be written."""
    e = os.environ if environ is None else environ
    stale_after_s = _duration_from_env(e, STALE_AFTER_ENV, DEFAULT_STALE_AFTER_S)
    margin_s = _duration_from_env(e, MARGIN_ENV, DEFAULT_MARGIN_S)
    max_runtime_s = job.limits.max_runtime_s
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
        teardown=_plain(asdict(job.teardown)),
        written_at=time.time() if now is None else now,
    )
    atomic_write_json(state_dir / PLAN_FILE, plan.to_dict())
    return plan


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


class GuardRunning(Exception):
    """Another guard holds the state directory's ``guard.lock`` (its pid in ``holder``)."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def _lock(path: Path, *, tries: int = 1) -> int:
    """Hold ``path``'s flock (returned descriptor), the pid written inside; raises
    :class:`GuardRunning` naming the holder."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    for attempt in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt + 1 < tries:
                time.sleep(0.05)
    else:
        try:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        finally:
            os.close(fd)
        raise GuardRunning(holder)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


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


def _child_env() -> dict[str, str]:
    """The agent's environment (provider keys come from it, never from a file), without the
    fault injection, and with this very ``agent`` package importable first."""
    env = {k: v for k, v in os.environ.items() if k != _CRASHPOINT_ENV}
    root = str(Path(__file__).resolve().parent.parent)
    site_dirs = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    if root not in site_dirs:  # a source checkout: the guard must run the agent's own code
        old = env.get("PYTHONPATH")
        env["PYTHONPATH"] = root + (os.pathsep + old if old else "")
    return env


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
        setsigdef=(signal.SIGINT, signal.SIGTERM, signal.SIGPIPE),
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


# ------------------------------------------------------------------------------ the decision


@dataclass(frozen=True)
class Due:
    """Whether the guard acts now, and why (one line for the log and the records)."""

    kind: DueKind
    why: str

    @property
    def act(self) -> bool:
        return self.kind == "due"


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def due(plan: GuardPlan, *, now: float, alive_at: float) -> Due:
    """Act only when the agent has been silent past ``stale_after_s`` AND the hard deadline
    has passed (without one: silent past ``no_deadline_stale_s``)."""
    silent = max(0.0, now - alive_at)
    if silent < plan.stale_after_s:
        return Due("alive", f"agent alive (heartbeat {format_duration(silent)} ago)")
    if plan.hard_deadline is None:
        if silent < plan.no_deadline_stale_s:
            return Due(
                "no_deadline_wait",
                f"agent silent since {_when(alive_at)}; without limits.max_runtime the guard "
                f"acts after {format_duration(plan.no_deadline_stale_s)} of silence",
            )
        return Due(
            "due",
            f"agent dead since {_when(alive_at)}, silent for {format_duration(silent)} "
            "(no limits.max_runtime)",
        )
    if now < plan.hard_deadline:
        return Due(
            "before_deadline",
            f"agent silent since {_when(alive_at)}; the hard deadline {_when(plan.hard_deadline)} "
            f"is in {format_duration(plan.hard_deadline - now)}",
        )
    return Due(
        "due",
        f"agent dead since {_when(alive_at)}, past the hard deadline {_when(plan.hard_deadline)}",
    )


def sync_verified(result: Mapping[str, Any] | None, *, since: float) -> bool:
    """``sync-result.json`` says verified, and was written during this job (not a leftover)."""
    if not result or result.get("sync_verified") is not True:
        return False
    at = result.get("at")
    return isinstance(at, int | float) and not isinstance(at, bool) and at >= since


def choose_action(
    plan: GuardPlan, *, reason: Reason | None, sync_result: Mapping[str, Any] | None
) -> tuple[TeardownAction, str]:
    """Stop, never destroy, unless the sync is verified and the job's policy for the case
    (``on_success`` after a completed training, else ``on_failure``) is destroy."""
    case = "on_success" if reason == Reason.COMPLETED else "on_failure"
    policy = plan.teardown.get(case)
    if policy == "destroy" and sync_verified(sync_result, since=plan.started_at):
        return "destroy", f"the sync is verified and teardown.{case} = destroy"
    if policy == "destroy":
        return "stop", f"teardown.{case} = destroy, but the sync is not verified: the guard stops"
    return "stop", f"the guard stops the box of a dead agent (teardown.{case} = {policy})"


# --------------------------------------------------------------------------------- the guard


class Guard:
    """The guard's loop over one state directory. ``clock`` and ``provider_factory`` come in
    from outside, so the decision is testable in milliseconds; ``stop`` ends :meth:`run`."""

    def __init__(
        self,
        state_dir: Path,
        *,
        clock: Callable[[], float] = time.time,
        provider_factory: Callable[[TeardownSection], Provider] = make_provider,
        stop: threading.Event | None = None,
        lock_fd: int | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.store = StateStore(state_dir)
        self.clock = clock
        self.provider_factory = provider_factory
        self.stop = stop or threading.Event()
        self.lock_fd = lock_fd
        self.attempts = 0
        self._plan: GuardPlan | None = None
        self._said: tuple[str, str] | None = None
        #: agent.lock was found held by a silent process once; acting needs a second look.
        self._held_by_silent: str | None = None

    # ---------------------------------------------------------------- loop

    def run(self) -> int:
        """Look every ``check_every_s`` until the job ended or the guard acted; exit code."""
        while True:
            try:
                if self.check():
                    return 0
            except Exception:  # one bad look must not end the safety net
                log.exception("guard: a check failed; trying again")
            every = self._plan.check_every_s if self._plan else MAX_EVERY_S
            if self.stop.wait(every):
                log.info("guard: asked to exit; exiting")
                return 0

    def check(self) -> bool:
        """One look. True when the guard's work is over (the job ended, or it acted)."""
        if not self._lock_still_ours():
            log.info("guard: %s was reset (guard.lock replaced); exiting", self.state_dir)
            return True
        try:
            plan = read_plan(self.state_dir)
        except ValueError as exc:
            log.error("guard: %s; trying again", exc)
            return False
        if plan is None:
            log.info("guard: no %s in %s: nothing to guard; exiting", PLAN_FILE, self.state_dir)
            return True
        if self._plan is None or plan.written_at != self._plan.written_at:
            deadline = _when(plan.hard_deadline) if plan.hard_deadline else "none"
            log.info(
                "guard: plan for job %r: hard deadline %s, agent dead after %s of silence, "
                "provider %s",
                plan.job_name,
                deadline,
                format_duration(plan.stale_after_s),
                plan.teardown.get("provider"),
            )
        self._plan = plan
        state, _ = self._read_state()
        if state is not None and self._ended_or_held(state):
            return state.phase.terminal
        verdict = due(plan, now=self.clock(), alive_at=last_sign_of_life(self.state_dir, plan))
        if not verdict.act:
            self._held_by_silent = None
            self._say(verdict.kind, f"guard: waiting: {verdict.why}")
            return False
        return self._act(plan, verdict)

    # ---------------------------------------------------------------- acting

    def _act(self, plan: GuardPlan, verdict: Due) -> bool:
        try:
            agent_lock: int | None = self.store.lock()
        except StateDirLocked as exc:
            if self._held_by_silent != exc.holder:
                # An agent that has just started holds the lock before its first beat: look
                # once more, one interval later, before calling it hung.
                self._held_by_silent = exc.holder
                log.warning(
                    "guard: pid %s holds %s but the agent does not beat (%s); looking again",
                    exc.holder,
                    self.state_dir,
                    verdict.why,
                )
                return False
            log.error(
                "guard: pid %s holds %s and has not beaten since: a hung agent; acting "
                "without writing state.json (that process owns it)",
                exc.holder,
                self.state_dir,
            )
            agent_lock = None
        try:
            # Read again under the lock: an agent may have ended the job meanwhile.
            state, _ = self._read_state()
            if agent_lock is not None and state is not None and self._ended_or_held(state):
                return state.phase.terminal
            return asyncio.run(self._teardown(plan, verdict, state, owned=agent_lock is not None))
        finally:
            if agent_lock is not None:
                os.close(agent_lock)

    async def _teardown(
        self, plan: GuardPlan, verdict: Due, state: RunState | None, *, owned: bool
    ) -> bool:
        self.attempts += 1
        cfg = plan.teardown_section()
        provider = self.provider_factory(cfg)
        record, resumed, result = await self._decide(plan, state, provider)
        if record.get("instance_id") and not cfg.instance_id:
            # The instance identified when the decision was made (Lambda finds itself by IP,
            # and a terminated instance can leave the list), as the agent does on a restart.
            cfg = replace(cfg, instance_id=str(record["instance_id"]))
            provider = self.provider_factory(cfg)
        action = as_action(str(record["action"]))
        written = owned and state is not None
        if state is not None and owned:
            self._take_over(state, verdict, record)

        def save() -> None:
            self._write_record(plan, verdict, record, state_written=written)
            self._save(state, owned)

        # Irreversible steps are recorded as started, durably, before anything is sent.
        save()
        log.warning("guard: %s: %s through provider %s", verdict.why, action, provider.name)
        if result is None:
            try:
                result = await carry_out(
                    provider, record, Reason.AGENT_FAILED, resumed=resumed, save=save
                )
            except Exception as exc:  # a provider failure must not end the safety net
                record["last_error"] = f"{type(exc).__name__}: {exc}"
                log.error(
                    "guard: %s failed (%s); trying again in %s",
                    action,
                    record["last_error"],
                    format_duration(plan.check_every_s),
                )
                save()
                return False
        record.update(result.to_dict())
        if not result.confirmed:
            log.error(
                "guard: %s not confirmed (%s); reading back in %s",
                action,
                result.detail,
                format_duration(plan.check_every_s),
            )
            save()
            return False
        record["finished_at"] = self.clock()
        if state is not None and owned:
            if action == "keep":
                state.cause = f"{verdict.why}; {result.detail}"
            elif result.performed:
                state.cause = f"{verdict.why}; guard {_PAST[action]} the box"
            else:
                state.cause = (
                    f"{verdict.why}; guard would have {_PAST[action]} the box "
                    f"(provider {provider.name!r}: nothing was done)"
                )
            transition(state, Phase.DONE, note="guard")  # TEARDOWN -> DONE
        save()
        log.warning("guard: %s confirmed: %s", action, result.detail)
        return True

    async def _decide(
        self, plan: GuardPlan, state: RunState | None, provider: Provider
    ) -> tuple[dict[str, Any], bool, TeardownResult | None]:
        """The teardown record to carry out, whether it resumes an earlier decision (which
        then stands: a record that says "sent" is only read back), and a result when nothing
        is left to send."""
        previous = self._read_record()
        if previous is not None and previous.get("job_started_at") == plan.started_at:
            own = previous.get("teardown")
            if isinstance(own, dict) and own.get("action") and "finished_at" not in own:
                with contextlib.suppress(TypeError, ValueError):
                    self.attempts = max(self.attempts, int(previous.get("attempts", 0)) + 1)
                return own, True, None  # an earlier attempt of a guard decided
        prior = state.teardown if state is not None else None
        if prior and prior.get("action") and "finished_at" not in prior:
            if prior.get("sent_at"):
                # The dead agent's call was accepted: confirm it, never send a second one.
                return dict(prior, by="agent, carried on by the guard"), True, None
            found = await provider.read_back(as_action(str(prior["action"])))
            if found is not None and found.confirmed:
                return dict(prior, by="agent, confirmed by the guard"), False, found
        reason = state.reason if state is not None else None
        action, why = choose_action(
            plan, reason=reason, sync_result=self._read_json(SYNC_RESULT_FILE)
        )
        result = None
        if action == "stop" and not provider.can_stop:
            action = "keep"
            why = (
                f"provider {provider.name} cannot stop a box, and the guard never destroys one "
                "whose checkpoints are not verified off it: the box is KEPT and bills on; stop "
                "or destroy it by hand"
            )
            log.error("guard: %s", why)
            result = TeardownResult("keep", False, True, why)
        record: dict[str, Any] = {
            "provider": provider.name,
            "action": action,
            "why": why,
            "by": "guard",
            "started_at": self.clock(),
        }
        if result is None:
            record["instance_id"] = await self._instance_id(provider)
        return record, False, result

    async def _instance_id(self, provider: Provider) -> str | None:
        """This box's id at the provider, for the record (a later attempt reads back that one)."""
        try:
            return (await provider.identify()).instance_id
        except ProviderError as exc:
            log.warning("guard: cannot identify this instance: %s", exc)
            return None

    def _take_over(self, state: RunState, verdict: Due, record: dict[str, Any]) -> None:
        """The agent is dead: the guard owns state.json now and carries the job to DONE."""
        if state.phase != Phase.TEARDOWN or state.reason != Reason.AGENT_FAILED:
            if state.phase != Phase.BOOTING:
                # The agent's successor boots in its place, as a restarted agent would.
                transition(state, Phase.BOOTING, note=f"guard (pid {os.getpid()}) took over")
            # BOOTING -> TEARDOWN
            transition(state, Phase.TEARDOWN, reason=Reason.AGENT_FAILED, note="guard")
        state.cause = f"{verdict.why}; guard sending {record['action']}"
        state.teardown = record

    # ---------------------------------------------------------------- files

    def _ended_or_held(self, state: RunState) -> bool:
        if state.phase.terminal:
            reason = state.reason.value if state.reason else None
            log.info("guard: job ended (%s, reason %s); exiting", state.phase.value, reason)
            return True
        if state.phase == Phase.HELD:
            self._say("held", "guard: teardown held by a person (HELD): the guard does not act")
            return True
        return False

    def _read_state(self) -> tuple[RunState | None, str | None]:
        try:
            return self.store.load(), None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = f"state.json unreadable ({type(exc).__name__}: {exc})"
            self._say("state", f"guard: {why}; it is left as it is")
            return None, why

    def _save(self, state: RunState | None, owned: bool) -> None:
        if not owned or state is None:
            return
        try:
            self.store.save(state)
        except OSError as exc:
            log.error("guard: cannot write %s: %s", self.store.state_path, exc.strerror or exc)

    def _read_json(self, name: str) -> dict[str, Any] | None:
        try:
            data = json.loads((self.state_dir / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _read_record(self) -> dict[str, Any] | None:
        return self._read_json(RECORD_FILE)

    def _write_record(
        self, plan: GuardPlan, verdict: Due, record: dict[str, Any], *, state_written: bool
    ) -> None:
        doc = {
            "pid": os.getpid(),
            "job_name": plan.job_name,
            "job_started_at": plan.started_at,
            "why": verdict.why,
            "hard_deadline": plan.hard_deadline,
            "attempts": self.attempts,
            "state_written": state_written,
            "updated_at": self.clock(),
            "teardown": record,
        }
        try:
            atomic_write_json(self.state_dir / RECORD_FILE, doc)
        except OSError as exc:
            log.error("guard: cannot write %s: %s", RECORD_FILE, exc.strerror or exc)

    def _lock_still_ours(self) -> bool:
        """False once the state directory was wiped or replaced under this guard."""
        if self.lock_fd is None:
            return True
        try:
            return os.stat(self.state_dir / LOCK_FILE).st_ino == os.fstat(self.lock_fd).st_ino
        except FileNotFoundError:
            return False

    def _say(self, kind: str, message: str) -> None:
        """Log ``message`` at INFO when its kind changed, else at DEBUG: one line per change."""
        key = (kind, message) if kind == "state" else (kind, "")
        log.log(logging.INFO if key != self._said else logging.DEBUG, "%s", message)
        self._said = key


# ---------------------------------------------------------------------------------- process


def _configure_logging() -> logging.Handler:
    """``agent`` loggers (the providers' too) to stderr, which is guard.log, dated lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("agent")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False
    logutil.install(handler)
    return handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agent.guard",
        description="Watch the agent's heartbeat in STATE_DIR and stop the box when the agent "
        "is dead past the job's hard deadline. Started by `libreyolo-agent run`.",
    )
    parser.add_argument("state_dir", type=Path, help="the agent's state directory")
    args = parser.parse_args(argv)
    _configure_logging()
    state_dir: Path = args.state_dir.absolute()
    try:
        lock_fd = _lock(state_dir / LOCK_FILE, tries=_LOCK_TRIES)
    except GuardRunning as exc:
        log.info("guard: another guard (pid %s) watches %s; exiting", exc.holder, state_dir)
        return 0
    except OSError as exc:
        log.error("guard: cannot lock %s: %s", state_dir / LOCK_FILE, exc.strerror or exc)
        return 1
    # Hold no directory that someone may want to unmount or remove.
    with contextlib.suppress(OSError):
        os.chdir("/")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Only set the event: the current step (a teardown call) finishes first.
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    log.info("guard: watching %s (pid %d)", state_dir, os.getpid())
    try:
        return Guard(state_dir, stop=stop, lock_fd=lock_fd).run()
    finally:
        os.close(lock_fd)


if __name__ == "__main__":
    sys.exit(main())
