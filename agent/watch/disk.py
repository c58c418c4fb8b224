"""Free space for the next checkpoint, watched while training runs.

LibreYOLO writes its checkpoints in place with ``torch.save``; on a full disk that dies half-way
through, leaving a torn ``last.pt`` and a dead trainer. So the daemon asks :func:`check_disk` each
loop turn: when the free space falls under what the next checkpoint write needs, the periodic
``weights/epoch_N.pt`` files that are verified off the box are removed (oldest epoch first);
``last.pt``, ``best.pt`` and anything not yet verified are never touched. If that still leaves too
little, the verdict carries a stop message and the daemon stops training cleanly, with its last
complete checkpoint intact, rather than let ``torch.save`` fail.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.trainer.rundir import epoch_snapshots
from agent.util.disk import disk_free
from agent.util.text import format_bytes, os_error

log = logging.getLogger(__name__)

#: The least free space the next checkpoint is taken to need, bytes (64 MiB): before any
#: checkpoint exists there is nothing to size it from, and status.json, metrics and logs need
#: room too.
NEED_FLOOR_BYTES = 64 * 1024 * 1024
#: What the next checkpoint is taken to need is the current files' sizes times this: a model's
#: checkpoint grows a little (optimizer state after the first step, EMA, metadata).
NEED_MARGIN = 1.2


@dataclass(frozen=True)
class DiskVerdict:
    """What :func:`check_disk` found and did."""

    #: Free bytes on the run directory's disk after any pruning.
    free_bytes: int
    #: Bytes the next checkpoint write needs (:func:`need_bytes`).
    need_bytes: int
    #: The ``epoch_N.pt`` files removed this time.
    pruned: tuple[Path, ...]
    #: Set when pruning cannot make room: stop the run cleanly (it says why and the fix).
    stop_message: str | None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def need_bytes(
    run_dir: Path, *, save_period_due: bool = True, snapshots_on_same_disk: bool = True
) -> int:
    """Bytes the next checkpoint write needs on the run directory's disk.

    ``(last.pt + best.pt [+ epoch_N.pt]) x (2 with snapshots on this disk, else 1) x 1.2``, and at
    least ``NEED_FLOOR_BYTES``. The epoch term is there when ``save_period_due`` (a ``save_period``
    checkpoint may come): the newest ``epoch_N.pt``'s size, or last.pt's before there is one (it
    is the same model). The factor 2 is the agent's snapshot copy of each file (``sync.py``
    uploads a copy, never the live file); pass ``snapshots_on_same_disk=False`` when the
    snapshots live on another file system.
    """
    weights = run_dir / "weights"
    last = _size(weights / "last.pt")
    total = last + _size(weights / "best.pt")
    if save_period_due:
        epochs = epoch_snapshots(run_dir)
        total += _size(epochs[max(epochs)]) if epochs else last
    copies = 2 if snapshots_on_same_disk else 1
    return max(NEED_FLOOR_BYTES, int(total * copies * NEED_MARGIN))


def check_disk(
    run_dir: Path,
    *,
    is_verified: Callable[[Path], bool],
    free_bytes: Callable[[Path], int] = disk_free,
    save_period_due: bool = True,
    snapshots_on_same_disk: bool = True,
) -> DiskVerdict:
    """Make room for the next checkpoint, or say the run must stop.

    When ``free_bytes(run_dir)`` is under :func:`need_bytes`, removes ``weights/epoch_N.pt`` files
    that ``is_verified(path)`` says are safely off the box, oldest epoch first (by N, not mtime,
    which a copy or a restore can change), until there is room. Never ``last.pt`` or ``best.pt``
    (the resume point and the result), never a file not verified (it exists nowhere else). Each
    removal is logged. ``is_verified`` is asked only about files that would be removed.
    """
    need = need_bytes(
        run_dir, save_period_due=save_period_due, snapshots_on_same_disk=snapshots_on_same_disk
    )
    free = free_bytes(run_dir)
    if free >= need:
        return DiskVerdict(free, need, (), None)
    pruned: list[Path] = []
    unverified: list[Path] = []
    for epoch, path in sorted(epoch_snapshots(run_dir).items()):
        if free >= need:
            break
        if not is_verified(path):
            unverified.append(path)
            continue
        size = _size(path)
        try:
            path.unlink()
        except FileNotFoundError:
            pass  # gone already: the space is free either way
        except OSError as exc:
            log.warning("disk: cannot remove %s to make room: %s", path.name, os_error(exc))
            continue
        pruned.append(path)
        free = free_bytes(run_dir)
        log.info(
            "disk: removed %s (epoch %d, %s, verified off the box) to make room for the next "
            "checkpoint: %s free, %s needed",
            path.name,
            epoch,
            format_bytes(size),
            format_bytes(free),
            format_bytes(need),
        )
    if free >= need:
        return DiskVerdict(free, need, tuple(pruned), None)
    return DiskVerdict(
        free, need, tuple(pruned), _stop_message(run_dir, free, need, pruned, unverified)
    )


def _stop_message(
    run_dir: Path, free: int, need: int, pruned: list[Path], unverified: list[Path]
) -> str:
    done = f"removed {len(pruned)} verified epoch_N.pt, " if pruned else ""
    kept = "kept last.pt and best.pt"
    if unverified:
        names = ", ".join(p.name for p in unverified[:5])
        more = f" and {len(unverified) - 5} more" if len(unverified) > 5 else ""
        kept += f" and {len(unverified)} epoch_N.pt not yet verified off the box ({names}{more})"
    return (
        f"disk full: {format_bytes(free)} free on the disk of {run_dir}, the next checkpoint "
        f"needs about {format_bytes(need)} (last.pt, best.pt, the next epoch_N.pt and their "
        f"snapshot copies, +20%); {done}{kept}; stopping training now rather than let "
        "torch.save fail half-way. Fix: free space on the box or give it a bigger disk (a larger "
        "train.save_period writes fewer epoch_N.pt)"
    )
