"""The run lifecycle: ``Phase``, ``Reason``, the one transition function, the persisted state file.

The state file is what makes the agent restartable: a new agent process reads it, finds the trainer
(pid AND create time) and carries on. It is written atomically (temp file, fsync, rename) on every
change, so a crash or a power cut leaves either the old or the new version, never half of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path

from agent.util.text import os_error

#: ``typing.TYPE_CHECKING`` without importing typing (0.5 MiB the supervisor does not hold);
#: the standard library's dataclasses for mypy, agent.util.record's at run time (1.0 MiB less).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from dataclasses import asdict as plain
    from dataclasses import dataclass as record
    from dataclasses import field
    from typing import Any

    from agent.staterecords import (
        CrashRecord,
        HistoryEntry,
        HoldRecord,
        LaunchIntent,
        OutcomeRecord,
        PreemptionRecord,
        ResumeRecord,
        ServerRecord,
        SteeringRecord,
        TeardownRecord,
    )
else:
    from agent.util.record import field, plain, record

log = logging.getLogger(__name__)


class Phase(StrEnum):
    BOOTING = "BOOTING"  #: the agent started; reading the job and any previous state
    PREFLIGHT = "PREFLIGHT"  #: proving the machine can train (GPU, disk, shm, token)
    STAGING = "STAGING"  #: downloading and unpacking the dataset
    TRAINING = "TRAINING"  #: the trainer runs; checkpoints are synced at milestones
    FINISHING = "FINISHING"  #: final sync of everything and its verification
    TEARDOWN = "TEARDOWN"  #: the provider call that stops paying, and its read-back
    HELD = "HELD"  #: teardown held by a person; the box stays up until released
    DONE = "DONE"  #: the job ended as planned (whatever the training outcome)
    FAILED = "FAILED"  #: the agent itself failed; a person must look

    @property
    def terminal(self) -> bool:
        return self in (Phase.DONE, Phase.FAILED)


class Reason(StrEnum):
    COMPLETED = "completed"  #: training finished all its epochs
    TRAINING_FAILED = "training_failed"  #: the trainer exited with an error or was killed
    PREFLIGHT_FAILED = "preflight_failed"  #: the box or the inputs (dataset) cannot train
    STALLED = "stalled"  #: no progress for limits.stall_timeout
    TIMEOUT = "timeout"  #: limits.max_runtime reached
    BUDGET = "budget"  #: limits.budget_usd reached
    PREEMPTED = "preempted"  #: the provider announced the box is going away
    STOPPED_BY_USER = "stopped_by_user"  #: ``libreyolo-agent stop`` / POST /stop
    #: the disk cannot hold the next checkpoint, even after pruning verified ``epoch_N.pt``
    DISK_FULL = "disk_full"
    #: the losses or the weights went NaN/inf (agent/daemon/diverge.py): never resumed
    DIVERGED = "diverged"
    #: the agent itself crashed again and again in the same place: a person must look
    AGENT_FAILED = "agent_failed"


#: The phases in the order a run goes through them (members are declared in it): FAILED, which
#: can follow any phase but DONE, is off the spine.
SPINE: tuple[Phase, ...] = tuple(p for p in Phase if p is not Phase.FAILED)
#: The phases a run can still leave.
_LIVE = frozenset(p for p in Phase if not p.terminal)

#: Allowed source phases for each target phase (supervisor's ``_assertInState``).
ALLOWED: dict[Phase, frozenset[Phase]] = {
    # A restarted agent boots again from wherever the killed one was (then resumes that phase).
    Phase.BOOTING: _LIVE - {Phase.BOOTING},
    Phase.PREFLIGHT: frozenset({Phase.BOOTING}),
    # BOOTING -> STAGING when preflight is disabled; a re-attach goes BOOTING -> TRAINING.
    Phase.STAGING: frozenset({Phase.BOOTING, Phase.PREFLIGHT}),
    Phase.TRAINING: frozenset({Phase.BOOTING, Phase.STAGING}),
    Phase.FINISHING: frozenset({Phase.BOOTING, Phase.TRAINING}),
    # Preflight or staging failures have nothing to sync: straight to teardown.
    Phase.TEARDOWN: frozenset(
        {Phase.BOOTING, Phase.PREFLIGHT, Phase.STAGING, Phase.FINISHING, Phase.HELD}
    ),
    Phase.HELD: frozenset({Phase.TEARDOWN}),
    Phase.DONE: frozenset({Phase.TEARDOWN, Phase.HELD}),
    Phase.FAILED: _LIVE,
}


class TransitionError(Exception):
    """An illegal phase change was asked for: a bug, never a user mistake."""


@record
class TrainerRecord:
    """How to find the trainer again: pid and create time (pids are reused)."""

    pid: int
    create_time: float
    started_at: float
    argv: list[str]
    run_dir: str | None = None


@record
class RunState:
    """Everything the agent persists. Plain JSON; secrets never go in here."""

    job_name: str
    job_source: str
    phase: Phase = Phase.BOOTING
    reason: Reason | None = None
    #: One line on why the run ended that way (an error message, an exit classification).
    cause: str | None = None
    started_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    agent_pid: int = field(default_factory=os.getpid)
    trainer: TrainerRecord | None = None
    #: Trainer exit classification: kind, exit code, message.
    outcome: OutcomeRecord | None = None
    #: Where the HTTP server really listens (port 0 is resolved here).
    server: ServerRecord | None = None
    teardown: TeardownRecord | None = None
    history: list[HistoryEntry] = field(default_factory=list)
    #: A launch about to happen (id, argv, at), saved *before* the trainer is spawned: an agent
    #: killed between spawn and recording the pid finds its orphan by this id, never launching
    #: a second trainer.
    launch: LaunchIntent | None = None
    #: Agent crashes (unexpected exceptions) since the last progress; a crash loop ends in a
    #: gated teardown decision instead of restarts that bill.
    crashes: list[CrashRecord] = field(default_factory=list)
    #: The instance's price read from the provider (``price_usd_per_hour = "auto"``), USD/h.
    price_usd_per_hour: float | None = None
    #: The kernel's boot id when the state was written: another one means the box rebooted
    #: (every pid recorded before is meaningless then).
    boot_id: str | None = None
    #: Each resume of a trainer that died without a clean end: at, epoch, kind, message.
    resumes: list[ResumeRecord] = field(default_factory=list)
    #: What people did to the unattended run (extend, hold, release): at, action, value.
    steering: list[SteeringRecord] = field(default_factory=list)
    #: Seconds added to ``max_runtime`` by ``extend``.
    extended_s: float = 0.0
    #: ``hold``: at, until (the hold's own timeout), released_at.
    hold: HoldRecord | None = None
    #: A preemption notice this agent handled (at, source, message): the trainer was stopped
    #: cleanly and ``last.pt`` saved; the next boot resumes instead of counting a failure.
    preempted: PreemptionRecord | None = None

    def to_dict(self) -> dict[str, Any]:
        d = plain(self)
        d["phase"] = self.phase.value
        d["reason"] = self.reason.value if self.reason else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunState:
        trainer = d.get("trainer")
        return cls(
            job_name=str(d["job_name"]),
            job_source=str(d.get("job_source", "")),
            phase=Phase(d["phase"]),
            reason=Reason(d["reason"]) if d.get("reason") else None,
            cause=d.get("cause"),
            started_at=float(d.get("started_at", 0.0)),
            updated_at=float(d.get("updated_at", 0.0)),
            agent_pid=int(d.get("agent_pid", 0)),
            trainer=TrainerRecord(**trainer) if trainer else None,
            outcome=d.get("outcome"),
            server=d.get("server"),
            teardown=d.get("teardown"),
            history=list(d.get("history", [])),
            launch=d.get("launch"),
            crashes=list(d.get("crashes", [])),
            price_usd_per_hour=d.get("price_usd_per_hour"),
            boot_id=d.get("boot_id"),
            resumes=list(d.get("resumes", [])),
            steering=list(d.get("steering", [])),
            extended_s=float(d.get("extended_s", 0.0)),
            hold=d.get("hold"),
            preempted=d.get("preempted"),
        )


#: What every surface says of a teardown that is not confirmed (``status``, ``/status``, the page,
#: the log, the notices).
NOT_CONFIRMED = "NOT confirmed: the box may still bill"


def teardown_open(record: Mapping[str, Any] | None) -> bool:
    """A teardown decided and not confirmed (``state.teardown``): the box may still bill.
    ``keep`` (and the dry run of provider ``none``) count as done once carried out. Here, not
    in agent.policy.teardown, so that the guard in the supervisor reads it without importing
    the providers (8 MiB, issue 26)."""
    if not record or not record.get("action"):
        return False
    if record.get("confirmed") is True:
        return False
    return not (record.get("action") == "keep" and "confirmed" in record)


def transition(
    state: RunState, target: Phase, *, reason: Reason | None = None, note: str = ""
) -> None:
    """The only way a phase changes: checks the source phase, records and logs the change."""
    source = state.phase
    if source not in ALLOWED[target]:
        raise TransitionError(f"illegal phase change {source.value} -> {target.value}")
    if reason is not None:
        state.reason = reason
    state.phase = target
    now = time.time()
    state.updated_at = now
    entry: HistoryEntry = {"at": now, "from": source.value, "to": target.value}
    if reason is not None:
        entry["reason"] = reason.value
    if note:
        entry["note"] = note
    state.history.append(entry)
    extra = f" reason={reason.value}" if reason else ""
    log.info("phase %s -> %s%s%s", source.value, target.value, extra, f" ({note})" if note else "")


def atomic_write_text(path: Path, text: str, *, mode: int = 0o600) -> None:
    """Write ``text`` to ``path`` so readers see the old or the new file, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_temp(path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _new_temp(path: Path) -> tuple[int, str]:
    """A new file beside ``path`` (``.NAME.<pid>.<random>.tmp``, mode 0600), opened for writing,
    as ``tempfile.mkstemp`` makes one: this module is in the supervisor, which stays small
    (``tempfile`` and the ``shutil`` it imports are 0.7 MiB there; issue 26)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        tmp = os.path.join(path.parent, f".{path.name}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
        try:
            flags = (
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
            )
            return os.open(tmp, flags, 0o600), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def atomic_write_json(path: Path, data: Any, *, mode: int = 0o600) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n", mode=mode)


class StateDirLocked(Exception):
    """Another agent holds this state directory (its pid in ``holder``)."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def lock_with_pid(
    path: Path, *, tries: int = 1, held: Callable[[str], Exception] = StateDirLocked
) -> int:
    """Take ``path``'s exclusive flock, held as long as the returned descriptor is open, and
    write this process's pid inside. ``tries`` attempts, 50 ms apart; then raises
    ``held(holder)``, the holder's pid as it wrote it (``"?"`` when empty). Raises OSError
    when the file cannot be opened. The agent's ``agent.lock`` and the guard's ``guard.lock``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    for attempt in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            if attempt + 1 < tries:
                time.sleep(0.05)
    else:
        try:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        finally:
            os.close(fd)
        raise held(holder)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class StateStore:
    """The state directory: ``state.json``, the sync ledger, reports, ``agent.log``, ``token``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def state_path(self) -> Path:
        return self.root / "state.json"

    def path(self, name: str) -> Path:
        return self.root / name

    def ensure(self) -> None:
        """Create the directory, private to the agent's user (0700): it holds the control
        token, the log (with paths and errors) and the ledger."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(PermissionError):
            os.chmod(self.root, 0o700)

    def lock(self) -> int:
        """One agent per state directory (two would both drive, and stop, the same trainer):
        an exclusive flock held as long as the returned descriptor is open. Raises
        :class:`StateDirLocked` naming the holder's pid."""
        return lock_with_pid(self.path("agent.lock"))

    def log_handler(self) -> logging.FileHandler:
        """agent.log, appended, mode 0600: it names paths and errors of the user's run."""
        path = self.path("agent.log")
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        with contextlib.suppress(PermissionError):
            os.chmod(path, 0o600)
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        return handler

    def write_report(self, name: str, data: Any) -> None:
        """A report (preflight.json, staging.json) is worth keeping, not worth crashing for (a
        full disk): log and go on."""
        try:
            atomic_write_json(self.path(name), data)
        except OSError as exc:
            log.error("cannot write %s: %s", name, os_error(exc, filename=True))

    def load(self) -> RunState | None:
        try:
            data = json.loads(self.state_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        return RunState.from_dict(data)

    def save(self, state: RunState) -> None:
        state.updated_at = time.time()
        atomic_write_json(self.state_path, state.to_dict())

    def token(self) -> str:
        """The control token (created once, mode 0600); POST endpoints require it."""
        import secrets

        p = self.path("token")
        try:
            existing = p.read_text(encoding="utf-8").strip()
            if existing:
                return existing
        except FileNotFoundError:
            pass
        value = secrets.token_urlsafe(32)
        atomic_write_text(p, value + "\n", mode=0o600)
        return value
