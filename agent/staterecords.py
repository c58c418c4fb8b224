"""The state file's records: the shapes of the plain dicts state.json holds (``agent.state``'s
:class:`~agent.state.RunState` fields). Types for mypy only: the running agent, and the
supervisor that lives as long as the job, never import this module (``typing`` is 0.5 MiB the
supervisor does not hold, issue 26); they read and write plain dicts.

The records are TypedDicts, not dataclasses: they stay plain dicts, so the JSON file keeps its
shape (a file written by an older agent loads unchanged) and the code that reads them keeps its
``record["key"]`` / ``record.get("key")``. Keys that only some writers set are optional
(``total=False``); mypy still rejects a misspelt or undeclared key. Nothing here validates a
file read from disk: readers of an older file still use ``.get``.
"""

from __future__ import annotations

from typing import Any, Required, TypedDict

#: One entry of ``history``: a phase change (``from``, ``to``, and the ``reason`` and ``note``
#: it was given) or an event (``event``: an agent restart, a reboot, a bad job file's mark with
#: its ``errors`` and ``sha256``). ``from`` is a keyword, hence the functional form.
HistoryEntry = TypedDict(
    "HistoryEntry",
    {
        "at": Required[float],
        "from": str,
        "to": str,
        "reason": str,
        "note": str,
        "event": str,
        #: The phase an agent restart found (``event: "agent restarted"``).
        "was": str,
        #: A bad job file's mark: its validation errors and its content's digest.
        "errors": list[str],
        "sha256": str | None,
        "judged_before": bool,
    },
    total=False,
)


class OutcomeRecord(TypedDict):
    """How the trainer exited (``outcome``): an ``ExitKind`` value, its exit code, one line."""

    kind: str
    exit_code: int | None
    message: str


class ServerRecord(TypedDict, total=False):
    """Where the HTTP server really listens (``server``; port 0 is resolved here). Both keys
    are always written; ``total=False`` lets readers write ``(state.server or {}).get(...)``."""

    host: str
    port: int


class TeardownRecord(TypedDict, total=False):
    """The teardown decided, and how far carrying it out got (``teardown``). Written first with
    the decision (``started_at``: irreversible steps are recorded as started), then grown by
    each step; the agent, the guard and the bad-job path all write it."""

    #: The provider's name (None: a bad job file whose ``[teardown]`` is unreadable).
    provider: str | None
    #: ``destroy`` | ``stop`` | ``keep`` (str: read from a file, checked by ``as_action``).
    action: str
    why: str
    #: Who decided when not the agent: ``guard``, or the agent's decision carried on by it.
    by: str
    started_at: float
    instance_id: str | None
    #: The provider accepted the call at ``sent_at`` (a restart then only reads back).
    sent_at: float
    sent: str
    #: The provider's result (:meth:`TeardownResult.to_dict`).
    performed: bool
    confirmed: bool
    detail: str
    #: Not confirmed yet: tried again with backoff.
    open: bool
    attempts: int
    next_attempt_at: float
    finished_at: float
    #: Why a new box is needed (a GPU fault): resuming on this one would fail again.
    box_fault: str | None
    #: The guard's rescue of ``last.pt`` before the box goes (:func:`agent.guard.save.rescue`).
    rescue: dict[str, Any]
    last_error: str
    notified_open_at: float
    #: The restore drill before the decision (:meth:`agent.sync.restore.RestoreDrill.to_dict`).
    restore_drill: dict[str, Any]
    #: ``on_success = "auto"``: its figures and arithmetic (agent/policy/autoteardown.py).
    auto: dict[str, Any]


class LaunchIntent(TypedDict):
    """A launch about to happen (``launch``), saved before the spawn: the id the trainer's
    environment carries, so a restarted agent finds its orphan instead of launching twice."""

    id: str
    argv: list[str]
    at: float


class CrashRecord(TypedDict):
    """An agent crash (``crashes``): when, in which phase, the exception in one line."""

    at: float
    phase: str
    error: str


class ResumeRecord(TypedDict):
    """A resume of a trainer that died without a clean end (``resumes``): the epochs done
    then (None: unknown), the death's kind (an ``ExitKind`` value, or ``reboot``,
    ``stalled``, ``preempted``, ``new_box``) and one line."""

    at: float
    epoch: int | None
    kind: str
    message: str


class _SteeringAction(TypedDict):
    at: float
    #: ``extend`` | ``hold`` | ``release`` | ``stop``.
    action: str


# The optional keys by a ``total=False`` subclass, not ``NotRequired[...]``: under ``from
# __future__ import annotations`` Python 3.11's TypedDict cannot see a string's NotRequired
# and would call every key required at run time (``__required_keys__``).
class SteeringRecord(_SteeringAction, total=False):
    """A person's action on the run (``steering``): ``extend`` (``seconds``, ``deadline_at``),
    ``hold`` (``seconds``, ``until``, ``renewed``), ``release``, ``stop`` (``phase``)."""

    seconds: float
    deadline_at: float
    until: float
    renewed: bool
    #: The phase a ``stop`` was asked in.
    phase: str


class HoldRecord(TypedDict, total=False):
    """``hold``: when it was asked, until when it holds (its own timeout), when released (None
    until then). Every writer sets all three; ``total=False`` lets readers write
    ``(state.hold or {}).get(...)``."""

    at: float
    until: float
    released_at: float | None


class PreemptionRecord(TypedDict):
    """A preemption notice this agent handled (``preempted``): when, who said it, its words."""

    at: float
    source: str
    message: str
