"""Disk watch: pruning verified epoch_N.pt for the next checkpoint, or a clean stop.

Real files in ``tmp_path`` (sparse, so a "100 MiB checkpoint" costs nothing) and a fake
free-space reader: a disk of a given capacity holding exactly the bytes in the test's directory,
so removing a file really frees its size. A real small tmpfs needs root to mount.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from agent.util.disk import disk_free
from agent.watch.disk import NEED_FLOOR_BYTES, DiskVerdict, check_disk, need_bytes

MiB = 1024 * 1024


class FakeDisk:
    """Free space = capacity - the sizes of every file under ``root``."""

    def __init__(self, root: Path, capacity: int) -> None:
        self.root = root
        self.capacity = capacity

    def used(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def __call__(self, path: Path) -> int:
        assert path.is_relative_to(self.root)
        return self.capacity - self.used()


def write(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.truncate(size)
    return path


def make_run(root: Path, epochs: dict[int, int], *, last: int = 100 * MiB) -> Path:
    """A run dir with last.pt, best.pt (``last`` bytes each) and ``epoch_N.pt`` of given sizes.
    Newer epochs get *older* mtimes, so pruning by mtime would pick the wrong ones."""
    run = root / "run1"
    write(run / "weights" / "last.pt", last)
    write(run / "weights" / "best.pt", last)
    for n, size in epochs.items():
        p = write(run / "weights" / f"epoch_{n}.pt", size)
        os.utime(p, (2_000_000_000 - n * 100, 2_000_000_000 - n * 100))
    return run


class Verified:
    """``is_verified`` that says yes for the given epochs and records what it was asked."""

    def __init__(self, epochs: set[int]) -> None:
        self.epochs = epochs
        self.asked: list[str] = []

    def __call__(self, path: Path) -> bool:
        self.asked.append(path.name)
        return path.name in {f"epoch_{n}.pt" for n in self.epochs}


def names(paths: tuple[Path, ...]) -> list[str]:
    return [p.name for p in paths]


# --------------------------------------------------------------------------------------------
# need_bytes


def test_need_has_a_floor_before_any_checkpoint(tmp_path: Path) -> None:
    assert need_bytes(tmp_path / "run1") == NEED_FLOOR_BYTES
    write(tmp_path / "run1" / "weights" / "last.pt", 1000)
    assert need_bytes(tmp_path / "run1") == NEED_FLOOR_BYTES


def test_need_counts_checkpoints_snapshot_copies_and_margin(tmp_path: Path) -> None:
    run = make_run(tmp_path, {5: 100 * MiB, 10: 120 * MiB})
    # last + best + the newest epoch_N.pt, each twice (the snapshot copy), + 20%.
    assert need_bytes(run) == int((100 + 100 + 120) * MiB * 2 * 1.2)
    assert need_bytes(run, save_period_due=False) == int(200 * MiB * 2 * 1.2)
    assert need_bytes(run, snapshots_on_same_disk=False) == int(320 * MiB * 1.2)


def test_need_sizes_the_first_epoch_file_from_last(tmp_path: Path) -> None:
    run = make_run(tmp_path, {}, last=80 * MiB)
    assert need_bytes(run) == int(80 * 3 * MiB * 2 * 1.2)


# --------------------------------------------------------------------------------------------
# check_disk


def test_enough_room_touches_nothing(tmp_path: Path) -> None:
    run = make_run(tmp_path, {1: 100 * MiB, 2: 100 * MiB})
    disk = FakeDisk(tmp_path, capacity=10_000 * MiB)
    verified = Verified({1, 2})
    verdict = check_disk(run, is_verified=verified, free_bytes=disk)
    assert verdict == DiskVerdict(10_000 * MiB - 400 * MiB, need_bytes(run), (), None)
    assert verified.asked == []
    assert len(list((run / "weights").iterdir())) == 4


def test_prunes_oldest_epoch_first_by_number_until_there_is_room(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.watch.disk")
    run = make_run(tmp_path, {2: 100 * MiB, 3: 100 * MiB, 10: 100 * MiB, 20: 100 * MiB})
    need = need_bytes(run)  # (100 + 100 + 100) MiB x 2.4 = 720 MiB
    # 600 MiB used: free = capacity - 600 MiB; two removals bring it to exactly what is needed.
    disk = FakeDisk(tmp_path, capacity=need + 400 * MiB)
    assert disk(run) == need - 200 * MiB
    verdict = check_disk(run, is_verified=Verified({2, 3, 10, 20}), free_bytes=disk)
    assert names(verdict.pruned) == ["epoch_2.pt", "epoch_3.pt"]
    assert verdict.stop_message is None
    assert verdict.free_bytes == need
    left = sorted(p.name for p in (run / "weights").iterdir())
    assert left == ["best.pt", "epoch_10.pt", "epoch_20.pt", "last.pt"]
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(logged) == 2
    assert logged[0].startswith("disk: removed epoch_2.pt (epoch 2, 100.0 MiB, verified off the")
    assert "epoch_3.pt" in logged[1]


def test_unverified_last_and_best_are_kept_and_the_stop_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.watch.disk")
    run = make_run(tmp_path, {1: 100 * MiB, 2: 100 * MiB, 3: 100 * MiB})
    need = need_bytes(run)
    disk = FakeDisk(tmp_path, capacity=need)  # free = need - 500 MiB
    verified = Verified({2})  # epoch 1 and 3 are not off the box yet
    verdict = check_disk(run, is_verified=verified, free_bytes=disk)
    assert names(verdict.pruned) == ["epoch_2.pt"]
    assert verified.asked == ["epoch_1.pt", "epoch_2.pt", "epoch_3.pt"]
    left = sorted(p.name for p in (run / "weights").iterdir())
    assert left == ["best.pt", "epoch_1.pt", "epoch_3.pt", "last.pt"]
    assert verdict.free_bytes == need - 400 * MiB
    message = verdict.stop_message
    assert message is not None
    assert message.startswith(
        f"disk full: 320.0 MiB free on the disk of {run}, the next checkpoint needs about 720.0 MiB"
    )
    assert "removed 1 verified epoch_N.pt" in message
    assert "kept last.pt and best.pt and 2 epoch_N.pt not yet verified off the box" in message
    assert "(epoch_1.pt, epoch_3.pt)" in message
    assert "Fix: free space on the box or give it a bigger disk" in message
    assert any("removed epoch_2.pt" in r.getMessage() for r in caplog.records)


def test_stop_without_any_epoch_file_to_prune(tmp_path: Path) -> None:
    run = make_run(tmp_path, {}, last=200 * MiB)
    disk = FakeDisk(tmp_path, capacity=500 * MiB)
    verified = Verified(set())
    verdict = check_disk(run, is_verified=verified, free_bytes=disk)
    assert verdict.pruned == ()
    assert verdict.free_bytes == 100 * MiB
    assert verdict.stop_message is not None
    assert "kept last.pt and best.pt;" in verdict.stop_message
    assert "removed" not in verdict.stop_message
    assert verified.asked == []
    assert (run / "weights" / "last.pt").stat().st_size == 200 * MiB


def test_last_and_best_are_never_candidates_even_when_verified(tmp_path: Path) -> None:
    run = make_run(tmp_path, {4: 50 * MiB})
    disk = FakeDisk(tmp_path, capacity=300 * MiB)
    verdict = check_disk(run, is_verified=lambda p: True, free_bytes=disk)
    assert names(verdict.pruned) == ["epoch_4.pt"]
    assert verdict.stop_message is not None
    assert (run / "weights" / "last.pt").exists() and (run / "weights" / "best.pt").exists()


def test_an_epoch_file_removed_meanwhile_still_counts(tmp_path: Path) -> None:
    """The sync may clean up the same file between the listing and the unlink."""
    run = make_run(tmp_path, {1: 300 * MiB, 2: 300 * MiB})
    need = need_bytes(run)
    disk = FakeDisk(tmp_path, capacity=need + 600 * MiB)  # free = need - 200 MiB

    def removed_by_someone_else(path: Path) -> bool:
        path.unlink()
        return True

    verdict = check_disk(run, is_verified=removed_by_someone_else, free_bytes=disk)
    assert names(verdict.pruned) == ["epoch_1.pt"]
    assert verdict.stop_message is None
    assert (run / "weights" / "epoch_2.pt").exists()


def test_an_epoch_name_that_cannot_be_removed_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = make_run(tmp_path, {2: 100 * MiB})
    (run / "weights" / "epoch_1.pt").mkdir()  # unlink() fails on a directory
    disk = FakeDisk(tmp_path, capacity=need_bytes(run) + 250 * MiB)  # free = need - 50 MiB
    verdict = check_disk(run, is_verified=lambda p: True, free_bytes=disk)
    assert names(verdict.pruned) == ["epoch_2.pt"]
    assert verdict.stop_message is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("disk: cannot remove epoch_1.pt")


def test_real_free_space_reader_by_default(tmp_path: Path) -> None:
    run = tmp_path / "not-created-yet"
    verdict = check_disk(run, is_verified=lambda p: False)
    assert verdict.need_bytes == NEED_FLOOR_BYTES
    assert verdict.free_bytes > 0
    assert abs(verdict.free_bytes - disk_free(tmp_path)) < 64 * MiB
    assert verdict.pruned == ()
