"""A job file that cannot run, on a rented box: the same visible, gated decision as any failure
before training, instead of a box that bills with nothing running.

``libreyolo-agent supervise JOB`` (the box's entry: the bootstrap starts it) always comes here
with a job that fails validation; ``run JOB`` does when the salvaged ``[teardown]`` names a
provider (on a laptop, ``teardown.provider = "none"`` or a job whose ``[teardown]`` is unreadable
prints its mistakes and exits 2, as before). Either way the exit code stays 2: "bad job, do not
restart" for the supervisor and for systemd.

What can be read is salvaged: the TOML, when it parses, gives ``[teardown]`` and ``[notify]``
checked alone (the provider and its keys are in the environment even when ``[train]`` is
broken). Then, as the daemon does for ``preflight_failed``:

- ``[teardown]`` valid: :func:`agent.policy.teardown.decide` with nothing trained (the job's
  ``on_preflight_failure``, default destroy; checkpoints of this job already on disk keep the
  verified-sync gate: a destroy becomes a stop), the decision recorded in ``state.json``
  (TEARDOWN, reason ``preflight_failed``, cause ``bad job file: ...``) before anything is sent,
  carried out and read back by :func:`agent.policy.teardown.carry_until_confirmed`, as the daemon
  does; DONE once confirmed. One the provider does not confirm stays open: retried with backoff
  (reading back first; a sent destroy is never sent again) until confirmed or the process is
  asked to exit (state TEARDOWN, the record open: the next start carries on).
- ``[teardown]`` unreadable (or the TOML itself): the box is KEPT, said loudly in the log, in
  ``state.json`` (phase FAILED, what ``status`` prints when no agent answers) and to the
  webhook when ``[notify]`` could be read.

A state directory whose ``state.json`` shows a run under way (a trainer started) is never torn
down for a job file that went bad meanwhile: the box is kept, said loudly; fixing the file and
starting the agent again carries on. A record written here is marked (a history entry
``bad job file``): once the job file is fixed, ``run`` moves it aside (:func:`set_aside`) and the
job starts afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import signal
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.config.jobfile import MAX_JOB_FILE_BYTES, _load_notify, _load_teardown
from agent.config.jobvalues import ErrorList, Table, check_document
from agent.config.model import ConfigError, Env, JobSection, NotifySection, TeardownSection
from agent.events import EventBus
from agent.policy import teardown
from agent.state import Phase, Reason, RunState, StateDirLocked, StateStore, transition
from agent.util import logutil
from agent.util.text import format_when

if TYPE_CHECKING:
    from agent.staterecords import HistoryEntry, TeardownRecord

log = logging.getLogger(__name__)

#: The history entry that marks a state written for a bad job file.
MARK = "bad job file"
#: Seconds the last notices may take before the box may be gone.
NOTIFY_FLUSH_S = 10.0


@dataclass(frozen=True)
class Salvaged:
    """What a job file that fails validation still says."""

    #: ``[job] name`` when it is a plain string, else ``job``.
    name: str
    #: ``[teardown]`` checked alone; None when it cannot be read.
    teardown: TeardownSection | None
    #: Why ``teardown`` is None (one line).
    teardown_problem: str | None
    notify: NotifySection | None
    #: ``[job]``'s name and runs_dir, to look for checkpoints of this job already on disk.
    job: JobSection | None


def _read_doc(path: Path) -> tuple[Mapping[str, Any] | None, str | None]:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_JOB_FILE_BYTES + 1)
        if len(raw) > MAX_JOB_FILE_BYTES:
            return None, "the job file is too large"
        return tomllib.loads(raw.decode("utf-8-sig")), None
    except (OSError, RuntimeError) as exc:
        return None, f"the job file cannot be read ({type(exc).__name__})"
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError, ValueError):
        return None, "the job file is not valid TOML"


def salvage(path: Path) -> Salvaged:
    """Read what can be read of ``path``: ``[teardown]`` and ``[notify]``, each checked alone
    by the job file's own rules (agent/config/jobfile.py)."""
    doc, problem = _read_doc(path)
    if doc is None:
        return Salvaged("job", None, problem, None, None)
    td_raw, nf_raw = doc.get("teardown", {}), doc.get("notify")
    errors = ErrorList()
    check_document({"teardown": td_raw, "notify": nf_raw or {}}, errors)
    if errors.items:
        return Salvaged(_name(doc), None, str(errors.items[0]), None, None)
    td = _load_teardown(Table("teardown", td_raw, errors))
    cfg: TeardownSection | None = td
    problem = None
    if errors.items:
        cfg, problem = None, "; ".join(str(e) for e in errors.items)
    notify = None
    if nf_raw is not None:
        nf_errors = ErrorList()
        notify = _load_notify(Table("notify", nf_raw, nf_errors))
        if nf_errors.items:
            notify = None
    return Salvaged(_name(doc), cfg, problem, notify, _job_section(doc, path))


def _name(doc: Mapping[str, Any]) -> str:
    job = doc.get("job")
    name = job.get("name") if isinstance(job, dict) else None
    if isinstance(name, str) and name and name.isprintable() and "/" not in name:
        return name[:200]
    return JobSection().name


def _job_section(doc: Mapping[str, Any], path: Path) -> JobSection | None:
    job = doc.get("job", {})
    runs_dir = job.get("runs_dir", str(JobSection().runs_dir)) if isinstance(job, dict) else None
    if not isinstance(runs_dir, str) or "\x00" in runs_dir:
        return None
    try:
        runs = Path(runs_dir).expanduser()
        base = path.resolve().parent
    except (OSError, RuntimeError):
        return None
    return JobSection(name=_name(doc), runs_dir=runs if runs.is_absolute() else base / runs)


def wanted_by_run(salvaged: Salvaged) -> bool:
    """``run``: a provider is configured, so this is a rented box (``supervise``: always)."""
    return salvaged.teardown is not None and salvaged.teardown.provider != "none"


def is_bad_job_record(state: RunState | None) -> bool:
    return state is not None and any(h.get("event") == MARK for h in state.history)


def _judged_before(previous: RunState | None, sha256: str | None) -> bool:
    """``previous`` tore the box down (confirmed) for a job file with this very content."""
    if previous is None or sha256 is None or not previous.phase.terminal:
        return False
    td = previous.teardown or {}
    marks = [h for h in previous.history if h.get("event") == MARK]
    if not marks or marks[-1].get("sha256") != sha256:
        return False
    torn_down = td.get("action") in ("stop", "destroy") and bool(td.get("confirmed"))
    return torn_down or bool(marks[-1].get("judged_before"))


def set_aside(store: StateStore) -> Path | None:
    """Before a now-valid job starts: move an ended bad-job record out of its way (the job never
    ran; the fixed file must run, not meet "already ended"). Returns where it went, or None."""
    try:
        state = store.load()
    except (ValueError, KeyError, TypeError):
        return None
    if state is None or not state.phase.terminal or not is_bad_job_record(state):
        return None
    dest = store.path(f"state-bad-job-{int(state.updated_at)}.json")
    store.state_path.replace(dest)
    return dest


def _sha256(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            return hashlib.sha256(f.read(MAX_JOB_FILE_BYTES + 1)).hexdigest()
    except OSError:
        return None


def cause_line(errors: Sequence[ConfigError]) -> str:
    more = f" (+{len(errors) - 1} more, every one in agent.log)" if len(errors) > 1 else ""
    return f"bad job file: {errors[0] if errors else 'invalid'}{more}"


def handle(
    path: Path,
    errors: Sequence[ConfigError],
    *,
    supervised: bool,
    clock: Callable[[], float] = time.time,
) -> None:
    """The bad-job decision for ``path`` (its ``errors`` already printed); never raises for a
    problem it can say in one line. The caller exits 2. ``clock`` stamps every record and event
    (the daemon's one clock, as :class:`agent.daemon.spine.Daemon` takes it)."""
    salvaged = salvage(path)
    if not supervised and not wanted_by_run(salvaged):
        return
    try:
        env = Env.from_environ()
    except ConfigError as exc:
        log.error("nothing torn down: %s", exc)
        return
    store = StateStore(env.state_dir)
    try:
        store.ensure()
        lock = store.lock()
    except StateDirLocked as exc:
        log.error(
            "an agent (pid %s) runs on %s: nothing torn down for this job file",
            exc.holder,
            env.state_dir,
        )
        return
    except OSError as exc:
        log.error(
            "cannot record the bad job file's teardown in %s (%s): nothing torn down; the box "
            "is KEPT and keeps billing",
            env.state_dir,
            exc.strerror or exc,
        )
        return
    try:
        logutil.redact_secrets(env.secrets())
        with logutil.to_file(store.log_handler()):
            log.error(  # one line here (each mistake is printed above), all in agent.log
                "the job file %s cannot run: %s", path, " | ".join(str(e) for e in errors)
            )
            try:
                asyncio.run(_Handler(path, errors, salvaged, env, store, clock).run())
            except ConfigError as exc:  # LIBREYOLO_AGENT_TEARDOWN_TIMING: a typo
                log.error("nothing torn down, the box is KEPT and keeps billing: %s", exc)
    finally:
        os.close(lock)


class _Handler:
    def __init__(
        self,
        path: Path,
        errors: Sequence[ConfigError],
        salvaged: Salvaged,
        env: Env,
        store: StateStore,
        clock: Callable[[], float],
    ) -> None:
        self.path = path
        self.clock = clock
        self.salvaged = salvaged
        self.env = env
        self.store = store
        self.cause = cause_line(errors)
        self.errors = [str(e) for e in errors]
        self.sha256 = _sha256(path)
        self.events = EventBus(clock=clock)
        self.notifier: Any = None
        self.stop = asyncio.Event()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop.set)
        notify_task = self._start_notifier()
        try:
            await self._decide()
        finally:
            if self.notifier is not None:
                await self.notifier.flush(NOTIFY_FLUSH_S)
                await self.notifier.close()
            if notify_task is not None:
                notify_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await notify_task
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)

    def _start_notifier(self) -> asyncio.Task[None] | None:
        if self.salvaged.notify is None:
            return None
        from agent.status.notify import Notifier

        self.notifier = Notifier(
            self.salvaged.notify,
            self.events,
            secrets=[v for _, v in self.env.secrets()],
            job=self.salvaged.name,
        )
        return asyncio.create_task(self.notifier.run(), name="notify")

    async def _decide(self) -> None:
        try:
            previous = self.store.load()
        except (ValueError, KeyError, TypeError) as exc:
            return self._keep_alone(f"{self.store.state_path} is unreadable ({exc})")
        if previous is not None and not is_bad_job_record(previous):
            if previous.phase.terminal:
                log.info(
                    "the job in %s already ended (phase %s): nothing torn down for this job file",
                    self.env.state_dir,
                    previous.phase.value,
                )
                return None
            return self._keep_alone(
                f"a run was under way (phase {previous.phase.value}) when the job file became "
                "invalid"
            )
        if previous is not None and previous.phase == Phase.TEARDOWN and previous.teardown:
            state = previous  # a teardown decided for the bad job file, not confirmed yet
            state.history.append({"at": self.clock(), "event": "bad job file: resumed"})
            return await self._carry_out(state, state.teardown or {}, resumed=True)
        now = self.clock()
        state = RunState(
            job_name=self.salvaged.name, job_source=str(self.path), started_at=now, updated_at=now
        )
        mark: HistoryEntry = {
            "at": self.clock(),
            "event": MARK,
            "errors": self.errors[:50],
            "sha256": self.sha256,
        }
        state.history.append(mark)
        state.cause = self.cause
        cfg = self.salvaged.teardown
        if cfg is None:
            return self._keep(state, *self._unreadable())
        if _judged_before(previous, self.sha256):
            # The box was torn down for this very file, and someone started it again since
            # (a stopped box does not start by itself): tearing it down again would leave
            # no time to mend the file.
            assert previous is not None
            mark["judged_before"] = True  # and so on at every later start with this file
            when = format_when(previous.updated_at)
            return self._keep(
                state,
                f"the box is KEPT and keeps billing: this same job file was judged bad at {when} "
                "and the box torn down; it was started again since (by a person): fix the job "
                "file and start the agent again, or stop the box by hand",
                "the same bad job file, judged before",
            )
        provider = teardown.make_teardown_provider(cfg, self.env)
        job = self.salvaged.job
        to_save = True if job is None else teardown.anything_to_save(state, None, job)
        decision = teardown.decide(
            Reason.PREFLIGHT_FAILED,
            cfg,
            sync_verified=False,
            anything_to_save=to_save,
            can_stop=provider.can_stop,
        )
        why = f"{decision.why} (bad job file)"
        transition(state, Phase.TEARDOWN, reason=Reason.PREFLIGHT_FAILED, note=MARK)
        (log.error if "KEPT" in why else log.info)(
            "teardown decision: %s (%s)", decision.action, why
        )
        self.events.publish(
            "teardown",
            action=decision.action,
            why=why,
            provider=provider.name,
            downgraded="downgraded" in why or "KEPT" in why,
        )
        record: TeardownRecord = {
            "provider": provider.name,
            "action": decision.action,
            "why": why,
            "started_at": self.clock(),
            "instance_id": await teardown.instance_id(provider),
        }
        state.teardown = record
        self.store.save(state)  # the decision is recorded before anything is sent
        return await self._carry_out(state, record, resumed=False, provider=provider)

    async def _carry_out(
        self,
        state: RunState,
        record: TeardownRecord,
        *,
        resumed: bool,
        provider: Any = None,
    ) -> None:
        cfg = self.salvaged.teardown
        if provider is None:
            if cfg is None:
                return self._keep(state, *self._unreadable())
            if record.get("instance_id") and not cfg.instance_id:
                # The instance the first attempt identified, as the daemon resumes it.
                cfg = dataclasses.replace(cfg, instance_id=str(record["instance_id"]))
            provider = teardown.make_teardown_provider(cfg, self.env)
        if self.notifier is not None:
            await self.notifier.flush(NOTIFY_FLUSH_S)  # the last word leaves before the box
        opened = 0

        def on_open(result: Any) -> None:
            nonlocal opened
            opened += 1
            state.cause = f"{self.cause}; teardown {teardown.open_words(record)}"
            self.store.save(state)
            if opened & (opened - 1) == 0:  # notices 1, 2, 4, 8...: bounded, not a storm
                self.events.publish("teardown_confirmed", **result.to_dict())

        async def wait(seconds: float) -> bool:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), seconds)
            return not self.stop.is_set()

        result = await teardown.carry_until_confirmed(
            provider,
            record,
            Reason.PREFLIGHT_FAILED,
            resumed=resumed,
            save=lambda: self.store.save(state),
            wait=wait,
            on_open=on_open,
            clock=self.clock,
        )
        if not result.confirmed:
            log.error("asked to exit with the teardown NOT confirmed: state stays TEARDOWN")
            return None
        self.events.publish("teardown_confirmed", **result.to_dict())
        record["finished_at"] = self.clock()
        state.cause = self.cause
        transition(state, Phase.DONE)  # TEARDOWN -> DONE
        self.store.save(state)
        self.events.publish("failure", reason=Reason.PREFLIGHT_FAILED.value, cause=state.cause)
        self.events.publish("done", reason=Reason.PREFLIGHT_FAILED.value, cause=state.cause)
        log.info("job %s done: reason=preflight_failed cause=%s", state.job_name, state.cause)
        return None

    def _unreadable(self) -> tuple[str, str]:
        return (
            f"the box is KEPT and keeps billing: [teardown] cannot be read "
            f"({self.salvaged.teardown_problem}), so no provider can be called; stop or "
            "destroy the box by hand, or fix the job file and start the agent again",
            "[teardown] cannot be read",
        )

    def _keep(self, state: RunState, why: str, short: str = "see cause") -> None:
        """Keep the box, loudly: state FAILED (a person must look), reason preflight_failed."""
        state.cause = f"{self.cause}; {why}"
        state.teardown = {
            "provider": self.salvaged.teardown.provider if self.salvaged.teardown else None,
            "action": "keep",
            "why": why,
            # No "confirmed": a box kept for want of a readable [teardown] is an open teardown
            # (agent/state.py teardown_open), so `status` exits 3 until a person acts.
            "detail": f"KEPT (still billing): {short}",
            "started_at": self.clock(),
        }
        transition(state, Phase.FAILED, reason=Reason.PREFLIGHT_FAILED, note=MARK)
        self.store.save(state)
        self._loud(why, state.cause)

    def _keep_alone(self, what: str) -> None:
        """Keep the box, touching no state file: a previous run's record stays as it is."""
        why = (
            f"{what}: nothing torn down, the box is KEPT and keeps billing; fix the job file "
            "and start the agent again (it carries on), or stop the box by hand"
        )
        self._loud(why, f"{self.cause}; {why}")

    def _loud(self, why: str, cause: str) -> None:
        log.error("%s", why)
        self.events.publish("teardown", action="keep", why=why, provider=None, downgraded=True)
        self.events.publish("failure", reason=Reason.PREFLIGHT_FAILED.value, cause=cause)
