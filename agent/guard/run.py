"""The guard: a tiny process that outlives the agent and stops the box when the agent is dead.

If the agent dies (OOM-killed, a bug, a deleted venv) and nothing restarts it, nothing would stop
the bill. The guard is that something: ``python -m agent.guard STATE_DIR``, started by the agent
(:func:`~agent.guard.plan.ensure_running`) in its own session, standard library plus the agent's
providers (no torch, no HTTP server), so it survives whatever took the agent down.

The agent's side (the plan ``guard-plan.json``, the ``heartbeat``, starting the guard) lives in
:mod:`agent.guard.plan`; the process (its command line, log, lock and signals) in
:mod:`agent.guard.__main__`. The guard's own files in the state directory:

- ``guard.lock``: flock held by the one guard of the directory, its pid inside. A second guard
  exits at once.
- ``guard.json``: what the guard decided and did (written before anything is sent, then updated).
- ``guard.log``: the guard's log (stdout and stderr).

The guard acts when **both** hold: the heartbeat is stale past ``stale_after_s``, **and** the
hard deadline has passed - in every phase, HELD included (:mod:`agent.guard.decide`). A job
without ``limits.max_runtime`` has no deadline: the guard then acts only once the agent has been
silent for ``no_deadline_stale_s`` (6 h). Before the deadline a dead agent is left alone: the
trainer goes on and systemd or a person may restart the agent. Two more reasons to act on a dead
agent: a HELD run whose hold ended (released, or its own ``until`` passed), and a teardown the
agent decided and the provider never confirmed (state.json's record is open).

Acting means: take the agent's lock (``agent.lock``; a restarted agent then waits for the guard,
exits 1 and is restarted into the guard's verdict), record the decision durably, then, within a
bounded time, **save what it can** (:mod:`agent.guard.save`, imported only now): stop the trainer
(pid and create time checked; SIGINT, then SIGTERM and SIGKILL to its tree) and upload the newest
``last.pt`` to the job's ``[sync]`` target with the agent's sink code, read back; what it could
not save goes into the record, the log and a notice. Then tear down through the provider: **stop,
never destroy**, unless ``sync-result.json`` says ``sync_verified: true`` (written during this
job) and the job's policy for the case is ``destroy``. A provider that cannot stop (Lambda, a
command without ``stop_command``) keeps the box, and the guard says so loudly (preflight warns of
it beforehand: agent/preflight/guardplan_check.py). The result goes into ``guard.json`` and into
state.json's teardown record; the phase becomes ``DONE`` (reason ``agent_failed``) only once the
provider confirmed it, and the guard exits. Until then it tries again every ``check_every_s``
(reading back first), and keeps watching. The job's ``[notify]`` webhook gets the notices the
agent would send (decision, what was not saved, confirmed or NOT confirmed - repeated at most every
30 min -, failure). The log's ``guard: timing:`` lines give, for the newest ``last.pt`` verified
and for the provider call, the time and how long after the hard deadline it came
(bench/guard_timing.py reads them).

Edge cases: the phase ``DONE`` (its teardown confirmed) or ``FAILED`` -> the guard exits without
acting; a process holds ``agent.lock`` but does not beat (a hung agent) -> the guard checks once
more one interval later, then acts without writing state.json (the hung agent owns it). SIGTERM or
SIGINT end the guard after its current step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from agent.guard.decide import Due, choose_action, due, when
from agent.guard.plan import (
    LOCK_FILE,
    MAX_EVERY_S,
    PLAN_FILE,
    GuardPlan,
    last_sign_of_life,
    read_plan,
)
from agent.state import (
    NOT_CONFIRMED,
    Phase,
    Reason,
    RunState,
    StateDirLocked,
    StateStore,
    atomic_write_json,
    teardown_open,
    transition,
)
from agent.util.text import format_duration

#: ``typing.TYPE_CHECKING`` without importing typing (0.5 MiB the supervisor does not hold).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from agent.config.model import TeardownAction, TeardownSection
    from agent.providers import Provider, TeardownResult
    from agent.staterecords import TeardownRecord

# While it waits, the guard holds only what a look needs (issue 26: every process of ours
# together under 80 MiB PSS): asyncio, the providers, the teardown and agent.guard.save are
# imported when it acts (tests/test_guard_save.py and tests/test_guard.py check what a waiting
# guard holds).

log = logging.getLogger(__name__)

RECORD_FILE = "guard.json"
#: Seconds between glances at state.json while the guard waits for its next look.
GLANCE_S = 1.0
#: Written by agent/sync/engine.py after the final verification (what the teardown gate reads).
SYNC_RESULT_FILE = "sync-result.json"

#: An open teardown's notice is sent again at most this often, seconds (as the agent's).
REPEAT_OPEN_S = 1800.0
_PAST: dict[TeardownAction, str] = {"stop": "stopped", "destroy": "destroyed", "keep": "kept"}


def _reopen_unconfirmed(state: RunState, now: float, *, say: bool) -> bool:
    """:func:`agent.policy.restart.reopen_unconfirmed`, imported once state.json says DONE with
    its teardown open (an older agent's record): never at the end of a job that went well."""
    from agent.policy.restart import reopen_unconfirmed

    return reopen_unconfirmed(state, now, say=say)


# --------------------------------------------------------------------------------- the guard


class Guard:
    """The guard's loop over one state directory. ``clock`` and ``provider_factory`` come in
    from outside, so the decision is testable in milliseconds; ``stop`` ends :meth:`run`."""

    def __init__(
        self,
        state_dir: Path,
        *,
        clock: Callable[[], float] = time.time,
        provider_factory: Callable[[TeardownSection], Provider] | None = None,
        stop: threading.Event | None = None,
        lock_fd: int | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.store = StateStore(state_dir)
        self.clock = clock
        self._provider_factory = provider_factory
        self.stop = stop or threading.Event()
        self.lock_fd = lock_fd
        self.attempts = 0
        self._plan: GuardPlan | None = None
        self._said: tuple[str, str] | None = None
        #: agent.lock was found held by a silent process once; acting needs a second look.
        self._held_by_silent: str | None = None
        self._said_reopened = False

    def provider_factory(self, cfg: TeardownSection) -> Provider:
        """The provider of ``cfg``: the one given, else the agent's
        :func:`~agent.policy.teardown.make_teardown_provider`, imported only when the guard acts."""
        if self._provider_factory is None:
            from agent.policy.teardown import make_teardown_provider

            self._provider_factory = make_teardown_provider
        return self._provider_factory(cfg)

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
            if self._wait(every):
                log.info("guard: asked to exit; exiting")
                return 0

    def _wait(self, every: float) -> bool:
        """Wait until the next look, ``every`` seconds; sooner when state.json changes (the
        agent ended the job: the guard exits within ``GLANCE_S`` of DONE rather than a whole
        interval later). A glance is one ``stat``. True when asked to stop."""
        end = time.monotonic() + every
        seen = self._state_stamp()
        while (left := end - time.monotonic()) > 0:
            if self.stop.wait(min(GLANCE_S, left)):
                return True
            if self._state_stamp() != seen:
                return False
        return False

    def _state_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.store.state_path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_ino

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
            deadline = when(plan.hard_deadline) if plan.hard_deadline else "none"
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
        if state is not None and self._ended(state):
            return True
        alive_at = last_sign_of_life(self.state_dir, plan)
        verdict = due(plan, now=self.clock(), alive_at=alive_at, state=state)
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
            if agent_lock is not None and state is not None and self._ended(state):
                return True
            import asyncio  # only now: a waiting guard runs without it

            return asyncio.run(self._teardown(plan, verdict, state, owned=agent_lock is not None))
        finally:
            if agent_lock is not None:
                os.close(agent_lock)

    async def _teardown(
        self, plan: GuardPlan, verdict: Due, state: RunState | None, *, owned: bool
    ) -> bool:
        from dataclasses import replace

        from agent.config.model import as_action
        from agent.policy.teardown import carry_out, note_result

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
        job, job_problem = self._job(plan)
        notices: list[tuple[str, dict[str, Any]]] = []
        if "rescue" not in record:
            # Before the box goes: stop the trainer, get the newest last.pt off it (bounded).
            notices.append(
                (
                    "teardown",
                    {
                        "action": action,
                        "why": f"guard: {record.get('why')}",
                        "provider": provider.name,
                    },
                )
            )
            record["rescue"] = await self._rescue(plan, state, job, job_problem)
            save()
            if record["rescue"].get("unsaved"):
                notices.append(("warning", {"message": f"guard: {record['rescue']['words']}"}))
        if result is None:
            self._timing(plan, "provider call", f"{action} through {provider.name}")
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
                await self._notify(job, notices)
                return False
        note_result(record, result)
        if not result.confirmed:
            log.error(
                "guard: %s %s (%s); reading back in %s",
                action,
                NOT_CONFIRMED,
                result.detail,
                format_duration(plan.check_every_s),
            )
            record["open"] = True
            said = record.get("notified_open_at")
            if not isinstance(said, int | float) or self.clock() - said >= REPEAT_OPEN_S:
                record["notified_open_at"] = self.clock()
                notices.append(
                    (
                        "teardown_confirmed",
                        {**result.to_dict(), "open": True, "attempts": self.attempts},
                    )
                )
            save()
            await self._notify(job, notices)
            return False
        record["open"] = False
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
        notices.append(("teardown_confirmed", result.to_dict()))
        cause = state.cause if state is not None and owned else verdict.why
        notices.append(("failure", {"reason": Reason.AGENT_FAILED.value, "cause": cause}))
        await self._notify(job, notices)
        return True

    # ---------------------------------------------------------------- saving, notices

    def _job(self, plan: GuardPlan) -> tuple[Any, str | None]:
        """The job re-read from its file (agent/guard/save.py, imported only now)."""
        from agent.guard.save import read_job

        job, problem = read_job(plan.job_file)
        if problem:
            log.error("guard: %s: nothing can be saved or notified", problem)
        return job, problem

    async def _rescue(
        self, plan: GuardPlan, state: RunState | None, job: Any, job_problem: str | None
    ) -> dict[str, Any]:
        from agent.config.model import Env
        from agent.guard.save import rescue, rescue_words, save_timeout_s

        report = await rescue(
            state,
            job,
            job_problem,
            Env.from_environ(),
            self.state_dir,
            timeout_s=save_timeout_s(),
            clock=self.clock,
        )
        report["words"] = rescue_words(report)
        if report.get("last_pt", {}).get("saved"):
            last = report["last_pt"]
            self._timing(
                plan, "newest last.pt verified", str(last.get("path")), at=last.get("verified_at")
            )
        (log.error if report["unsaved"] else log.warning)("guard: saved: %s", report["words"])
        return report

    def _timing(self, plan: GuardPlan, what: str, detail: str, *, at: float | None = None) -> None:
        """One line a script can measure from: the time of ``what`` (``at``, else now) and how
        long after the hard deadline it came (``guard: timing: EVENT at EPOCH (+S s after the
        hard deadline)``)."""
        now = at if at is not None else self.clock()
        after = f"{now - plan.hard_deadline:+.1f}s" if plan.hard_deadline else "no deadline"
        log.warning(
            "guard: timing: %s at %.3f (%s after the hard deadline): %s", what, now, after, detail
        )

    async def _notify(self, job: Any, notices: list[tuple[str, dict[str, Any]]]) -> None:
        if notices and job is not None and job.notify is not None:
            from agent.config.model import Env
            from agent.guard.save import notify

            await notify(job, Env.from_environ(), notices)

    async def _decide(
        self, plan: GuardPlan, state: RunState | None, provider: Provider
    ) -> tuple[TeardownRecord, bool, TeardownResult | None]:
        """The teardown record to carry out, whether it resumes an earlier decision (which
        then stands: a record that says "sent" is only read back), and a result when nothing
        is left to send."""
        from agent.providers import TeardownResult

        previous = self._read_record()
        if previous is not None and previous.get("job_started_at") == plan.started_at:
            own: TeardownRecord | None = previous.get("teardown")
            if isinstance(own, dict) and own.get("action") and "finished_at" not in own:
                with contextlib.suppress(TypeError, ValueError):
                    self.attempts = max(self.attempts, int(previous.get("attempts", 0)) + 1)
                return own, True, None  # an earlier attempt of a guard decided
        prior = state.teardown if state is not None else None
        if prior and prior.get("action") and "finished_at" not in prior:
            if prior.get("sent_at"):
                # The dead agent's call was accepted: confirm it, never send a second one.
                return {**prior, "by": "agent, carried on by the guard"}, True, None
            from agent.config.model import as_action

            found = await provider.read_back(as_action(str(prior["action"])))
            if found is not None and found.confirmed:
                return {**prior, "by": "agent, confirmed by the guard"}, False, found
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
        record: TeardownRecord = {
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
        from agent.providers import ProviderError

        try:
            return (await provider.identify()).instance_id
        except ProviderError as exc:
            log.warning("guard: cannot identify this instance: %s", exc)
            return None

    def _take_over(self, state: RunState, verdict: Due, record: TeardownRecord) -> None:
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

    def _ended(self, state: RunState) -> bool:
        """The job ended: DONE (its teardown confirmed, or keep) or FAILED (a person must look).
        A DONE whose teardown was never confirmed (an older agent's) is not an end: the guard
        watches on (state.json is read as TEARDOWN then: agent/policy/restart.py)."""
        if state.phase == Phase.FAILED or (
            state.phase.terminal and not teardown_open(state.teardown)
        ):
            reason = state.reason.value if state.reason else None
            log.info("guard: job ended (%s, reason %s); exiting", state.phase.value, reason)
            return True
        return False

    def job_over(self) -> bool:
        """True when state.json says the job ended (what :meth:`check` exits on); reads only,
        never acts."""
        state, _ = self._read_state()
        return state is not None and self._ended(state)

    def _read_state(self) -> tuple[RunState | None, str | None]:
        try:
            state = self.store.load()
            # An older agent's DONE with an unconfirmed teardown is read as TEARDOWN (said once).
            said = self._said_reopened
            if (
                state is not None
                and state.phase == Phase.DONE  # reopen_unconfirmed's case, imported for it only
                and teardown_open(state.teardown)
                and _reopen_unconfirmed(state, self.clock(), say=not said)
            ):
                self._said_reopened = True
            return state, None
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
        self, plan: GuardPlan, verdict: Due, record: TeardownRecord, *, state_written: bool
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
