"""The target's commit budget: how many commits it took in the last hour, and whether one more
milestone may spend one (part of the sync engine, ``engine.py``).

The Hub refuses more than :data:`agent.hub.COMMITS_PER_HOUR` commits per repo per hour (HTTP
429 with ``Retry-After``). Epochs shorter than about half a minute would reach that within the
hour, stall every upload for the rest of it and turn a final destroy into a stop (an unverified
sync blocks it). So each milestone is one commit (``uploads.py`` groups its files), and near the
limit the engine asks :meth:`CommitWindow.decide` before queueing one: a deferred milestone sends
nothing and its files ride along with the next one that goes (newest ``last.pt`` and ``best.pt``,
every unsent ``epoch_N.pt``), so what is deferred is late, never lost.

What is never deferred: the final sync, a failure's report, and :meth:`SyncEngine.save_now`
(a preemption notice or a stall: the ``last.pt`` a resume needs). :data:`RESERVE_COMMITS` of the
hour's commits are kept for them.

Commits are counted where they are made (the upload thread, after ``upload_many`` returned) and
persisted in the state directory (``sync-commits.json``), so a restarted agent knows what its
predecessor spent this hour. A commit that failed is not counted (the Hub does not count a
refused one); a 429's ``Retry-After`` defers milestones until then.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.state import atomic_write_json
from agent.util.text import os_error

# One logger for all of sync: its lines are grepped and asserted as ``agent.sync.engine``.
log = logging.getLogger("agent.sync.engine")

#: The window the Hub counts commits over, seconds.
WINDOW_S = 3600.0
#: Commits of the hour kept for what is never deferred: the final sync (one commit, more when a
#: failed attempt is retried), a failure's report, ``save_now``, an unclean exit's ``at-exit``.
RESERVE_COMMITS = 8
#: Past this fraction of the limit, milestones are paced: the room left is spread over the time
#: until the oldest commit of the window ages out.
NEAR_FRACTION = 0.5


@dataclass(frozen=True)
class Decision:
    """Whether a milestone may make a commit now; when not, why and from when it may."""

    allowed: bool
    #: Commits made in the last hour.
    used: int
    reason: str | None = None
    #: When the next milestone may go (clock), when deferred.
    next_at: float | None = None


class CommitWindow:
    """The commits made to one target in the last :data:`WINDOW_S`, persisted in ``path``.

    ``limit`` None (a folder): nothing is counted against anything, every milestone goes.
    Thread-safe: the upload threads record, the event loop decides."""

    def __init__(self, path: Path, limit: int | None, *, clock: Callable[[], float]) -> None:
        self.path = path
        self.limit = limit
        self._clock = clock
        self._lock = threading.Lock()
        self._times: list[float] = []
        #: The target asked to wait until then (``Retry-After``), clock.
        self._asked_until = 0.0
        self._save_error: str | None = None
        if limit is None:
            return
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            self._times = sorted(float(t) for t in data.get("commits", []))
            self._asked_until = float(data.get("asked_until", 0.0))
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            # Unreadable: start counting afresh; the reserve and a 429's Retry-After still hold.
            log.warning("sync commit count %s unreadable (%s); counting afresh", path.name, exc)

    def record(self) -> None:
        """A commit was made now (from an upload thread)."""
        if self.limit is None:
            return
        with self._lock:
            self._times.append(self._clock())
            self._save()

    def asked_to_wait(self, until: float) -> None:
        """The target answered ``Retry-After``: no milestone before ``until`` (clock)."""
        if self.limit is None:
            return
        with self._lock:
            if until > self._asked_until:
                self._asked_until = until
                self._save()

    def used(self) -> int:
        """Commits made in the last hour."""
        with self._lock:
            return len(self._recent(self._clock()))

    def decide(self) -> Decision:
        """Whether a milestone may make one more commit now (see the module's docstring)."""
        now = self._clock()
        with self._lock:
            recent = self._recent(now)
            asked_until = self._asked_until
        used = len(recent)
        if self.limit is None:
            return Decision(True, used)
        budget = max(1, self.limit - RESERVE_COMMITS)
        if now < asked_until:
            return Decision(False, used, "the target asked to wait (Retry-After)", asked_until)
        if used >= budget:
            # Room again once enough of the window's oldest commits have aged out.
            frees_at = recent[used - budget] + WINDOW_S
            return Decision(
                False,
                used,
                f"{used} commits in the last hour; {RESERVE_COMMITS} of the {self.limit} "
                "are kept for the final sync",
                frees_at,
            )
        if used >= self.limit * NEAR_FRACTION:
            room = budget - used
            gap = (recent[0] + WINDOW_S - now) / room
            if now - recent[-1] < gap:
                return Decision(
                    False,
                    used,
                    f"{used} commits in the last hour (limit {self.limit}): one milestone "
                    f"every {gap:.0f} s",
                    recent[-1] + gap,
                )
        return Decision(True, used)

    def status(self) -> dict[str, Any]:
        """Commits in the last hour, the limit and the reserve, for ``/status``."""
        now = self._clock()
        with self._lock:
            used = len(self._recent(now))
            asked_until = self._asked_until if self._asked_until > now else None
        return {
            "commits_last_hour": used,
            "limit_per_hour": self.limit,
            "reserve": RESERVE_COMMITS if self.limit is not None else None,
            "asked_until": asked_until,
            "count_error": self._save_error,
        }

    def _recent(self, now: float) -> list[float]:
        """The commits of the window, oldest first (the older ones are forgotten)."""
        self._times = [t for t in self._times if t > now - WINDOW_S]
        return list(self._times)

    def _save(self) -> None:
        try:
            atomic_write_json(
                self.path,
                {"commits": self._times, "asked_until": self._asked_until},
                mode=0o600,
            )
        except OSError as exc:
            # Kept in memory: this agent still counts right; only a restart would forget.
            message = os_error(exc)
            if message != self._save_error:
                log.error("sync commit count not saved (%s): kept in memory", message)
            self._save_error = message
            return
        self._save_error = None


class Cadence:
    """The milestone cadence over a :class:`CommitWindow`: which milestones are deferred, said
    once in the log when it adapts and once when it is back, and shown in ``/status``."""

    def __init__(self, window: CommitWindow, description: str) -> None:
        self.window = window
        self.description = description
        #: Epochs whose milestone was deferred since the last one that went.
        self.deferred: list[int] = []
        #: Milestones deferred since this agent started.
        self.deferred_total = 0
        self._last: Decision | None = None

    def allows(self, epoch: int) -> bool:
        """Whether the milestone of ``epoch`` may go now; a deferred one is logged."""
        decision = self.window.decide()
        self._last = decision
        if decision.allowed:
            if self.deferred:
                log.info(
                    "sync cadence: milestone epoch=%d goes, with what the %d deferred before it "
                    "(epochs %s) held; %d commits to %s in the last hour",
                    epoch,
                    len(self.deferred),
                    _epochs(self.deferred),
                    decision.used,
                    self.description,
                )
            self.deferred = []
            return True
        wait = "" if decision.next_at is None else f"; next from {decision.next_at:.0f}"
        if not self.deferred:
            log.warning(
                "sync cadence adapted to the commit limit of %s: %s; milestone epoch=%d "
                "deferred, its files go with the next milestone (never the final sync)%s",
                self.description,
                decision.reason,
                epoch,
                wait,
            )
        else:
            log.info("milestone epoch=%d deferred: %s%s", epoch, decision.reason, wait)
        self.deferred.append(epoch)
        self.deferred_total += 1
        return False

    def status(self) -> dict[str, Any]:
        """The ``cadence`` part of the sync status: commits this hour, the limit, whether
        milestones are being deferred, which and why."""
        last = self._last
        adapted = bool(self.deferred)
        return {
            **self.window.status(),
            "adapted": adapted,
            "deferred_epochs": self.deferred[-20:],
            "milestones_deferred": self.deferred_total,
            "reason": last.reason if adapted and last else None,
            "next_at": last.next_at if adapted and last else None,
        }


def _epochs(epochs: list[int]) -> str:
    return ", ".join(map(str, epochs)) if len(epochs) <= 4 else f"{epochs[0]}..{epochs[-1]}"
