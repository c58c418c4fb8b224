"""Verifying the target at the end of training (part of the sync engine, ``engine.py``): every
path the ledger expects and every checkpoint of a completed epoch on disk is read back from the
target with its size and sha256. Its result is what the teardown gate reads."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent.sinks import RemoteFile, Sink, SinkError
from agent.sync.ledger import LedgerEntry, LedgerStatus
from agent.sync.snapshots import live_snapshot
from agent.trainer.rundir import epoch_snapshots
from agent.util.threads import in_daemon_thread

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyResult:
    """What the teardown gate reads: everything the ledger expects and every completed
    checkpoint on disk is on the target, intact."""

    sync_verified: bool
    checked: int
    missing: list[dict[str, Any]]
    at: float
    #: Files on disk that were not checked, and why (a checkpoint torn at exit).
    skipped: list[dict[str, Any]] = field(default_factory=list)
    #: Paths read back from the target for this check.
    read_back: int = 0
    #: Paths not read again: the ledger holds them verified (read back after their upload)
    #: with exactly the content expected now (``changed_only``).
    trusted: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def verify_target(
    sink: Sink,
    entries: list[LedgerEntry],
    run_dir: Path | None,
    *,
    completed_epochs: int | None,
    timeout_s: float,
    now: Callable[[], float],
    changed_only: bool = False,
) -> VerifyResult:
    """Read back every path in ``entries`` and compare size and sha256; with ``run_dir``, also
    require every checkpoint on disk to be on the target: ``last.pt``, ``best.pt`` (at their
    path or, after an unclean exit, as ``<name>.at-exit.pt``) and each ``epoch_N.pt`` with
    N <= ``completed_epochs`` (None: all of them - call it once the trainer has exited). A
    checkpoint that is not a valid zip is skipped, with a note. Each read-back waits at most
    ``timeout_s``.

    With ``changed_only`` (the end of training, where every second is billed) a path the ledger
    holds as verified - read back with its size and sha256 after its upload - is trusted with
    that content and not read again; everything else is read back. Nothing unverified is
    trusted: a ledger entry still pending, and a checkpoint on disk whose content differs from
    what the ledger verified at its place, are read back as before."""
    read: dict[str, RemoteFile | None] = {}
    missing: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    expected = {e.remote_path for e in entries}
    verified: dict[str, tuple[str, int]] = (
        {
            e.remote_path: (e.sha256, e.size)
            for e in entries
            if e.status is LedgerStatus.VERIFIED and e.verified_at is not None
        }
        if changed_only
        else {}
    )
    trusted: set[str] = set()

    async def read_back(path: str) -> RemoteFile | None:
        if path not in read:
            read[path] = await asyncio.wait_for(
                asyncio.wrap_future(in_daemon_thread(sink.stat, path, name="sync-read-back")),
                timeout_s,
            )
        return read[path]

    for e in entries:
        if e.remote_path in verified:
            trusted.add(e.remote_path)
            continue
        try:
            remote = await read_back(e.remote_path)
        except (SinkError, OSError) as exc:  # TimeoutError is an OSError
            missing.append({"path": e.remote_path, "problem": f"read-back failed: {exc}"})
            continue
        if remote is None:
            missing.append({"path": e.remote_path, "problem": "not on the target"})
        elif remote.sha256 != e.sha256 or remote.size != e.size:
            missing.append(
                {
                    "path": e.remote_path,
                    "problem": f"hash mismatch: remote {remote.sha256[:12]} "
                    f"size {remote.size}, expected {e.sha256[:12]} size {e.size}",
                }
            )
    checked = len(entries)
    if run_dir is not None:
        on_disk = await asyncio.to_thread(_checkpoints_on_disk, run_dir, completed_epochs)
        for local, places in on_disk:
            ident = await asyncio.to_thread(_checkpoint_identity, local)
            if ident is None:
                skipped.append(
                    {"path": places[0], "note": "not a valid zip archive (torn?): not checked"}
                )
                continue
            checked += places[0] not in expected
            problem = "on disk but not on the target"
            if any(verified.get(place) == ident for place in places):
                trusted.update(p for p in places if verified.get(p) == ident)
                continue
            for place in places:
                try:
                    remote = await read_back(place)
                except (SinkError, OSError) as exc:  # TimeoutError is an OSError
                    problem = f"on disk, read-back failed: {exc}"
                    continue
                if remote is not None and (remote.sha256, remote.size) == ident:
                    break
            else:
                missing.append({"path": places[0], "problem": problem})
    return VerifyResult(
        not missing and checked > 0,
        checked,
        missing,
        now(),
        skipped,
        read_back=len(read),
        trusted=len(trusted - set(read)),
    )


def log_result(result: VerifyResult, target: str) -> None:
    """The one line that says whether the final sync is verified (the teardown gate's word)."""
    if result.sync_verified:
        log.info(
            "sync verified: %d file(s) match on %s (%d read back now, %d verified earlier "
            "and unchanged)",
            result.checked,
            target,
            result.read_back,
            result.trusted,
        )
    else:
        log.error(
            "sync NOT verified: %d problem(s): %s",
            len(result.missing),
            "; ".join(f"{m['path']}: {m['problem']}" for m in result.missing[:5]),
        )


def _checkpoints_on_disk(
    run_dir: Path, completed_epochs: int | None
) -> list[tuple[Path, list[str]]]:
    """Checkpoints of completed epochs in ``run_dir/weights`` and where each may be stored."""
    weights = run_dir / "weights"
    out: list[tuple[Path, list[str]]] = []
    for name in ("last.pt", "best.pt"):
        if (weights / name).is_file():
            stem = name.removesuffix(".pt")
            out.append((weights / name, [f"weights/{name}", f"weights/{stem}.at-exit.pt"]))
    for epoch, path in sorted(epoch_snapshots(run_dir).items()):
        if completed_epochs is None or epoch <= completed_epochs:
            out.append((path, [f"weights/{path.name}"]))
    return out


def _checkpoint_identity(path: Path) -> tuple[str, int] | None:
    """(sha256, size) of a valid checkpoint; None when it is torn or gone."""
    snap = live_snapshot(path, checkpoint=True)
    return None if snap is None else (snap.sha256, snap.size)
