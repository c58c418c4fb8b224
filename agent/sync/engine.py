"""Getting checkpoints off the box: the sync engine. It decides what to send when (the milestone
policy), re-queues at start-up what a killed agent promised (``recover.py``), verifies the target
at the end and reports all of it for ``/status``. The parts live beside it: ``snapshots.py``
(stable copies of the files LibreYOLO rewrites in place, made while they are written by
``follow.py``), ``verify.py`` (the read-back of everything at the end), ``uploads.py`` (the
queue: timeouts, backoff, read-back; one commit per milestone), ``commits.py`` (the Hub's commit
limit: milestones deferred near it), ``ledger.py`` (what the target must hold, persisted) and
``sinks/`` (the targets).

Consistency rule (DESIGN.md): LibreYOLO writes checkpoints in place, before that epoch's
status.json. When status.json says ``completed_epochs = N`` the weights of epoch N are whole, so
the agent copies them to a snapshot then, checks the copy is a valid zip with an unchanged
source, and uploads the snapshot - never the live file. The one exception is a disk too full to
copy to: then the live file is checked the same way in place, uploaded, and re-hashed before any
retry (the read-back catches a file rewritten while it was sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

from agent.config.model import SyncSection
from agent.sinks import Sink
from agent.sinks.digests import DIGESTS
from agent.state import atomic_write_json
from agent.sync.commits import Cadence, CommitWindow
from agent.sync.follow import CheckpointFollower
from agent.sync.ledger import ItemKind, Ledger, LedgerEntry, LedgerStatus
from agent.sync.recover import requeue_owed, source_of
from agent.sync.redactlog import as_sent
from agent.sync.snapshots import Snapshotter, has_content, note_disk, unlink_quietly
from agent.sync.throttle import Throttle
from agent.sync.uploads import Item, Queued, UploadQueue
from agent.sync.verify import VerifyResult, log_result, verify_target
from agent.trainer.rundir import SMALL_FILES, RunStatus, epoch_snapshots, is_epoch_file
from agent.util.crashpoints import crashpoint
from agent.util.text import os_error

log = logging.getLogger(__name__)

#: How long a failed preflight/staging waits to get its report off the box before teardown.
REPORT_SYNC_TIMEOUT_S = 120.0

#: Extra files from the state directory that ride along under ``agent/`` in the target.
#: ``save_now``: how often a torn (being written) checkpoint is tried again, and the first wait.
SAVE_NOW_TRIES = 6
SAVE_NOW_WAIT_S = 0.25
AGENT_FILES = ("state.json", "trainer.log", "preflight.json", "staging.json", "agent.log")
#: During training the agent's own files (logs that only grow) go at most this often, seconds:
#: at the first milestone, then at a milestone once this much time has passed. The final sync,
#: a failure's report and teardown send them whatever the time.
AGENT_FILES_EVERY_S = 300.0
#: At most one warning line per path and distinct error in this many seconds.
LOG_EVERY_S = 60.0
#: How often a ledger that could not be written is tried again, seconds.
LEDGER_RETRY_S = 5.0
#: ``status()`` reports the queue as stalled when no upload completed for this long while
#: work was waiting, seconds.
STALLED_AFTER_S = 120.0


class SyncEngine:
    """The milestone policy, start-up recovery and verification, over an upload queue."""

    def __init__(
        self,
        sink: Sink,
        cfg: SyncSection,
        *,
        state_dir: Path,
        max_parallel: int = 2,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
        log_every_s: float = LOG_EVERY_S,
        ledger_retry_s: float = LEDGER_RETRY_S,
        stalled_after_s: float = STALLED_AFTER_S,
        agent_files_every_s: float = AGENT_FILES_EVERY_S,
        follow: bool = True,
    ) -> None:
        self.sink = sink
        self.agent_files_every_s = agent_files_every_s
        #: When the agent's files were last queued at a milestone (clock), None before.
        self._agent_files_at: float | None = None
        self.cfg = cfg
        self.state_dir = state_dir
        self.ledger = Ledger(state_dir / "sync-ledger.json")
        self.snapshots = Snapshotter(state_dir / "snapshots")
        #: Copies checkpoints as they are written (``follow.py``), once :meth:`follow` says where.
        self.follower = CheckpointFollower(self.snapshots, self._wanted) if follow else None
        self.snapshots.follower = self.follower
        self._clock = clock
        self._throttle = Throttle(log_every_s)
        commits = CommitWindow(state_dir / "sync-commits.json", sink.commits_per_hour, clock=clock)
        #: Milestones deferred near the target's commit limit (``commits.py``).
        self.cadence = Cadence(commits, sink.description)
        self.uploads = UploadQueue(
            sink,
            cfg,
            self.ledger,
            throttle=self._throttle,
            max_parallel=max_parallel,
            rng=rng or random.Random(),
            clock=clock,
            ledger_retry_s=ledger_retry_s,
            stalled_after_s=stalled_after_s,
            commits=commits,
        )
        # Snapshot work runs in threads: one batch at a time, so milestones stay in order.
        self._files = asyncio.Lock()
        #: ``{"since", "message"}`` while snapshots cannot be written (uploads go from the
        #: live files), else None.
        self.disk_full: dict[str, Any] | None = None
        #: Remote paths the ledger still owes but whose snapshot and source are both gone.
        self.sources_gone: list[str] = []
        # Milestone state
        self.last_epoch_seen = 0
        self._total_epochs: int | None = None
        self._best_epoch_sent: int | None = None
        #: A milestone's ``last.pt`` was deferred (commit limit): the next milestone sends it.
        self._last_owed = False
        self._epoch_files_sent: set[int] = set()
        self.verify_result: VerifyResult | None = None

    # ---------------------------------------------------------------- the queue

    def submit(self, item: Item) -> None:
        """Queue ``item``; a queued older version of the same path is dropped (superseded)."""
        self.uploads.submit(item)

    @property
    def queue(self) -> list[dict[str, Any]]:
        return self.uploads.queue

    @property
    def failures(self) -> list[dict[str, Any]]:
        """The latest upload failures (at most 20), oldest first."""
        return self.uploads.failures

    @property
    def last_synced_epoch(self) -> int | None:
        """The newest epoch whose ``last.pt`` or ``epoch_N.pt`` is verified on the target."""
        return self.uploads.last_synced_epoch

    async def run(self) -> None:
        """The upload worker (:meth:`UploadQueue.run`); ends once :meth:`close` was called."""
        await self.uploads.run()

    async def drain(self, timeout: float) -> bool:
        """Wait until nothing is queued or in flight; False when ``timeout`` ran out first."""
        return await self.uploads.drain(timeout)

    def retry_now(self) -> None:
        """Forget backoff (the final sync should not wait out a long pause)."""
        self.uploads.retry_now()

    # ---------------------------------------------------------------- milestones

    @contextlib.asynccontextmanager
    async def _queueing(self) -> AsyncIterator[None]:
        """One batch of snapshots at a time, with the upload worker held: what is queued inside
        leaves as one commit (``uploads.py``)."""
        async with self._files:
            with self.uploads.hold():
                yield

    def follow(self, run_dir: Path) -> None:
        """Copy this run's checkpoints while they are written (the first call starts it)."""
        if self.follower is not None:
            self.follower.watch(run_dir)

    def _wanted(self, name: str) -> bool:
        """Whether the next epoch's milestone will send ``weights/<name>`` (the follower's
        question, from its thread): only those are copied while written."""
        if name == "best.pt" or is_epoch_file(name):
            return True
        return name == "last.pt" and self._milestone(self.last_epoch_seen + 1, self._total_epochs)

    def _milestone(self, n: int, total: int | None) -> bool:
        """Whether epoch ``n`` of ``total`` sends ``last.pt``: every Nth, the last, and the one
        after a deferred milestone that owed it."""
        return (
            self._last_owed or n % self.cfg.every_epochs == 0 or (total is not None and n >= total)
        )

    async def on_epoch(
        self, run_dir: Path, status: RunStatus, *, extra_files: Iterable[Path] = ()
    ) -> int:
        """status.json moved on: snapshot what this epoch's milestone policy asks for and queue
        it (the copying and hashing run in a thread). Near the target's commit limit the
        milestone may be deferred: nothing goes now, the next one carries it. Returns how many
        items were queued."""
        n = status.completed_epochs
        if n <= self.last_epoch_seen:
            return 0
        self.last_epoch_seen = n
        self._total_epochs = status.total_epochs
        if not self.cadence.allows(n):
            self._last_owed = self._milestone(n, status.total_epochs)
            return 0
        extra = list(extra_files)
        now = self._clock()
        recent = self._agent_files_at is not None and now - self._agent_files_at < (
            self.agent_files_every_s
        )
        if recent:
            extra = []  # logs that only grow: not every epoch (AGENT_FILES_EVERY_S)
        if extra:
            self._agent_files_at = now
        async with self._queueing():
            weights = run_dir / "weights"
            queued = 0
            if self._milestone(n, status.total_epochs):
                outcome = await self._queue_file(
                    weights / "last.pt", "weights/last.pt", n, ItemKind.LAST
                )
                self._last_owed = outcome == "unavailable" and self._last_owed
                queued += outcome == "queued"
            best = status.best_epoch
            if best is not None and best != self._best_epoch_sent:
                outcome = await self._queue_file(
                    weights / "best.pt", "weights/best.pt", best, ItemKind.BEST
                )
                if outcome != "unavailable":
                    self._best_epoch_sent = best
                queued += outcome == "queued"
            queued += await self._queue_epoch_files(run_dir)
            queued += await self._queue_small(run_dir, n, extra)
        if queued:
            log.info("milestone epoch=%d: %d file(s) queued", n, queued)
        return queued

    async def save_now(self, run_dir: Path, epoch: int | None) -> int:
        """Queue ``last.pt`` (and ``best.pt``) at once, whatever the milestone policy says: a
        preemption notice or a stall leaves minutes, not another milestone."""
        async with self._queueing():
            queued = 0
            for name, kind in (("last.pt", ItemKind.LAST), ("best.pt", ItemKind.BEST)):
                src = run_dir / "weights" / name
                for attempt in range(SAVE_NOW_TRIES):
                    outcome = await self._queue_file(src, f"weights/{name}", epoch, kind)
                    # A torn file is the trainer writing it right now: it is whole again in
                    # moments, and this may be the last chance to get it off the box.
                    if outcome != "unavailable" or not src.exists():
                        break
                    await asyncio.sleep(SAVE_NOW_WAIT_S * (attempt + 1))
                queued += outcome == "queued"
        self.retry_now()
        log.info("saving now: %d checkpoint(s) queued", queued)
        return queued

    def verified_remote(self, remote_path: str) -> LedgerEntry | None:
        """The ledger's verified entry for ``remote_path``, or None."""
        entry = self.ledger.entries.get(remote_path)
        return entry if entry is not None and entry.status == LedgerStatus.VERIFIED else None

    def is_verified(self, path: Path) -> bool:
        """Whether the target holds ``path``'s current content, verified (ledger entry with this
        size and sha256): only such a local file may be pruned to make room."""
        entry = self.ledger.entries.get(f"weights/{path.name}")
        if entry is None or entry.status != LedgerStatus.VERIFIED:
            return False
        try:
            if path.stat().st_size != entry.size:
                return False
            return DIGESTS.sha256(path) == entry.sha256
        except OSError:
            return False

    async def final(
        self,
        run_dir: Path | None,
        status: RunStatus | None,
        extra_files: Iterable[Path],
        *,
        clean_exit: bool = True,
    ) -> int:
        """The end of training: everything, whatever the policy skipped.

        ``clean_exit`` False (interrupted, killed, failed): last.pt/best.pt may have been written
        at an unsafe moment - a SIGINT during ``torch.save`` can leave a structurally valid but
        incomplete zip. Such a file never replaces a verified checkpoint: it goes up beside it
        as ``weights/<name>.at-exit.pt``."""
        extra = list(extra_files)
        queued = 0
        n = status.completed_epochs if status else None
        async with self._queueing():
            if run_dir is not None:
                # The trainer has exited: every epoch file on disk is final, seen or not (a
                # restarted agent, epochs that went by between two reads of status.json, or a
                # failed run whose status.json has no completed_epochs). Torn ones fail the
                # zip check.
                on_disk = epoch_snapshots(run_dir)
                self.last_epoch_seen = max(self.last_epoch_seen, n or 0, *on_disk, 0)
                weights = run_dir / "weights"
                for name, kind in (("last.pt", ItemKind.LAST), ("best.pt", ItemKind.BEST)):
                    epoch = status.best_epoch if (status and kind == ItemKind.BEST) else n
                    remote = f"weights/{name}"
                    if not await self._differs(weights / name, remote):
                        continue
                    entry = self.ledger.entries.get(remote)
                    # The epoch's own checkpoint is verified, queued or being sent: an unsafe
                    # rewrite goes beside it, never over it.
                    has_good = (
                        entry is not None and entry.status == LedgerStatus.VERIFIED
                    ) or self.uploads.queued_or_in_flight(remote)
                    if not clean_exit and has_good:
                        remote = f"weights/{kind.value}.at-exit.pt"
                        log.warning(
                            "%s changed after the last verified epoch and the trainer did not "
                            "exit cleanly: uploading it as %s, keeping the verified one",
                            name,
                            remote,
                        )
                    outcome = await self._queue_file(weights / name, remote, epoch, kind)
                    queued += outcome == "queued"
                queued += await self._queue_epoch_files(run_dir)
            queued += await self._queue_small(run_dir, n, extra)
        log.info("final sync: %d file(s) queued", queued)
        return queued

    def _unchanged(self, src: Path, remote_path: str) -> str | None:
        """The sha256 of ``src`` when it is, by its identity (:class:`~agent.sinks.digests.
        Digests`: any write changes its ctime), the version the target holds or is about to:
        then nothing is copied. None otherwise."""
        try:
            st = src.stat()
        except OSError:
            return None
        digest = DIGESTS.peek(st)
        if digest is not None and self._expected(remote_path) == (digest, st.st_size):
            return digest
        return None

    def _expected(self, remote_path: str) -> tuple[str, int] | None:
        """(sha256, size) of what the target holds or is about to: the queued version, else
        the one being sent, else the verified one."""
        owed = self.uploads.expected(remote_path)
        if owed is not None:
            return owed
        entry = self.ledger.entries.get(remote_path)
        if entry is not None and entry.status == LedgerStatus.VERIFIED:
            return entry.sha256, entry.size
        # Promised by the ledger (a previous agent queued it) but not delivered yet, or new.
        return None

    async def _differs(self, local: Path, remote_path: str) -> bool:
        expected = self._expected(remote_path)
        if expected is None:
            return True
        # Compared with what is queued and in flight too: a failing or slow target must not
        # make the final sync copy, upload and verify an unchanged checkpoint twice.
        return not await asyncio.to_thread(has_content, local, *expected)

    async def _queue_epoch_files(self, run_dir: Path) -> int:
        queued = 0
        for epoch, path in sorted(epoch_snapshots(run_dir).items()):
            if epoch in self._epoch_files_sent or epoch > max(self.last_epoch_seen, 0):
                continue
            outcome = await self._queue_file(path, f"weights/{path.name}", epoch, ItemKind.EPOCH)
            if outcome != "unavailable":
                self._epoch_files_sent.add(epoch)
            queued += outcome == "queued"
        return queued

    async def _queue_small(self, run_dir: Path | None, epoch: int | None, extra: list[Path]) -> int:
        files: list[tuple[Path, str, ItemKind]] = []
        if run_dir is not None:
            files += [(run_dir / name, name, ItemKind.SMALL) for name in SMALL_FILES]
        # Logs go up as /logs shows them: secrets redacted (agent/sync/redactlog.py).
        extra = await asyncio.to_thread(as_sent, extra, self.state_dir / "redacted")
        files += [(path, f"agent/{path.name}", ItemKind.AGENT) for path in extra]
        queued = 0
        for src, remote, kind in files:
            outcome = await self._queue_file(src, remote, epoch, kind, checkpoint=False)
            queued += outcome == "queued"
        return queued

    async def _queue_file(
        self,
        src: Path,
        remote_path: str,
        epoch: int | None,
        kind: ItemKind,
        *,
        checkpoint: bool = True,
    ) -> Queued:
        held = self._unchanged(src, remote_path)
        if held is not None:
            if epoch is not None:
                self.uploads.raise_epoch(remote_path, held, epoch)
            return "unchanged"
        try:
            snap = await asyncio.to_thread(self.snapshots.take, src, checkpoint=checkpoint)
        except OSError as exc:  # take() catches its own; listing the folder can still fail
            self._throttle.warning(
                remote_path, os_error(exc), "snapshot of %s failed: %s", src.name, exc
            )
            return "unavailable"
        if snap is None:
            return "unavailable"
        self.disk_full = note_disk(
            self.disk_full,
            snap,
            checkpoint=checkpoint,
            now=self._clock,
            root=self.snapshots.root,
            warn=self._throttle.warning,
        )
        if self._expected(remote_path) == (snap.sha256, snap.size):
            if not snap.live:
                unlink_quietly(snap.path)
            if epoch is not None:
                self.uploads.raise_epoch(remote_path, snap.sha256, epoch)
            return "unchanged"
        self.submit(
            Item(
                remote_path,
                snap.path,
                snap.sha256,
                snap.size,
                epoch,
                kind,
                snapshot=not snap.live,
                mtime_ns=snap.mtime_ns if snap.live else None,
            )
        )
        return "queued"

    # ---------------------------------------------------------------- start-up and the end

    async def recover(self, run_dir: Path | None) -> int:
        """At start-up, before the first milestone: re-queue what a previous agent promised
        but never verified (:func:`~agent.sync.recover.requeue_owed`), then delete the snapshot
        files nothing needs any more. An entry whose snapshot and source are both gone stays
        pending, is logged and listed in ``status()["sources_gone"]``; verification reports
        it. Returns how many items were queued."""
        async with self._queueing():
            done = await requeue_owed(
                self.ledger,
                self.uploads,
                self.snapshots,
                source_of=lambda remote: source_of(remote, self.state_dir, run_dir),
                queue_file=self._queue_file,
            )
            for path, epoch in done.sources_gone:
                if path in self.sources_gone:
                    continue
                self.sources_gone.append(path)
                log.warning(
                    "recover: %s (epoch %s) is owed to the target but neither its snapshot "
                    "nor its source is left; it stays pending and verification reports it",
                    path,
                    epoch,
                )
            files, size = await asyncio.to_thread(
                self.snapshots.remove_except, self.uploads.snapshot_files()
            )
        if files:
            log.info("recover: removed %d stale snapshot file(s), %d bytes", files, size)
        if done.queued:
            log.info("recover: %d unverified file(s) queued again", done.queued)
        return done.queued

    async def cleanup(self) -> int:
        """At DONE: delete the snapshot files. Those of uploads still owed (queued or in
        flight) are kept for a restarted agent; once everything is verified the folder ends up
        empty. Returns how many files were removed."""
        async with self._files:
            if self.follower is not None:
                await asyncio.to_thread(self.follower.close)
                log.info(
                    "checkpoints copied while written: %d used as snapshots, %d thrown away",
                    self.follower.claimed,
                    self.follower.discarded,
                )
            files, size = await asyncio.to_thread(
                self.snapshots.remove_except, self.uploads.snapshot_files()
            )
        if files:
            log.info("removed %d snapshot file(s), %d bytes", files, size)
        return files

    # ---------------------------------------------------------------- verification

    async def send_reports(self, extra_files: Iterable[Path]) -> bool:
        """A box that failed before training is usually destroyed at once: get the reason off
        it first (preflight/staging report, agent.log, state.json), within a short wait."""
        await self.final(None, None, extra_files)
        if await self.drain(min(self.cfg.finish_timeout_s, REPORT_SYNC_TIMEOUT_S)):
            return True
        log.warning("the failure report could not be uploaded in time; tearing down anyway")
        return False

    async def finish(
        self,
        run_dir: Path | None,
        status: RunStatus | None,
        extra_files: Iterable[Path],
        *,
        clean_exit: bool,
        timeout_s: float,
        exiting: asyncio.Event,
    ) -> bool:
        """FINISHING: queue everything, wait for it (at most ``timeout_s``), then verify that
        what is on disk is on the target (not only what the ledger promised). False when
        ``exiting`` was set first: the final sync is left to a restarted agent."""
        await self.final(run_dir, status, extra_files, clean_exit=clean_exit)
        self.retry_now()
        crashpoint("finishing")
        drain = asyncio.ensure_future(self.drain(timeout_s))
        leaving = asyncio.ensure_future(exiting.wait())
        await asyncio.wait({drain, leaving}, return_when=asyncio.FIRST_COMPLETED)
        leaving.cancel()
        if not drain.done():
            drain.cancel()
            log.info("agent exiting during the final sync; a restarted agent finishes it")
            return False
        if not drain.result():
            log.error("final sync did not finish within %.0fs", timeout_s)
        result = await self.verify_all(
            run_dir,
            completed_epochs=status.completed_epochs if status else None,
            changed_only=True,
        )
        log_result(result, self.sink.description)
        return True

    async def verify_all(
        self,
        run_dir: Path | None = None,
        *,
        completed_epochs: int | None = None,
        changed_only: bool = False,
    ) -> VerifyResult:
        """Read back what the target must hold (:func:`~agent.sync.verify.verify_target`; with
        ``changed_only``, what the ledger has not verified at its present content), keep the
        result for ``/status`` and write it to ``sync-result.json``."""
        result = await verify_target(
            self.sink,
            list(self.ledger.entries.values()),
            run_dir,
            completed_epochs=completed_epochs,
            timeout_s=self.cfg.upload_timeout_s,
            now=self._clock,
            changed_only=changed_only,
        )
        self.verify_result = result
        try:
            atomic_write_json(self.state_dir / "sync-result.json", result.to_dict(), mode=0o600)
        except OSError as exc:
            log.error("sync-result.json not written: %s", os_error(exc))
        return result

    def status(self) -> dict[str, Any]:
        """The sync part of ``/status``: queue, uploads in flight (since when, which attempt),
        whether uploads are stalled and why, and the disk-full condition."""
        last = self.ledger.last_verified_checkpoint()
        return {
            "target": self.sink.description,
            "last_synced_epoch": self.last_synced_epoch,
            "last_verified_checkpoint": (
                {"path": last.remote_path, "epoch": last.epoch, "at": last.verified_at}
                if last
                else None
            ),
            **self.uploads.status(),
            "disk_full": self.disk_full,
            "cadence": self.cadence.status(),
            "ledger_error": self.ledger.save_error,
            "sources_gone": list(self.sources_gone),
            "verified": self.verify_result.to_dict() if self.verify_result else None,
        }

    async def close(self) -> None:
        """Stop the worker, cancel watchers; threads still sending are left to finish on their
        own."""
        if self.follower is not None:
            await asyncio.to_thread(self.follower.close)
        await self.uploads.close()
