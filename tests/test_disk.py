"""Free disk space where a path is, or will be created."""

from __future__ import annotations

import shutil
from pathlib import Path

from agent.util.disk import disk_free, nearest_existing


def test_nearest_existing_is_the_first_ancestor_that_exists(tmp_path: Path) -> None:
    assert nearest_existing(tmp_path) == tmp_path
    assert nearest_existing(tmp_path / "a" / "b" / "c") == tmp_path


def test_nearest_existing_keeps_symlinks(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert nearest_existing(tmp_path / "link" / "new") == tmp_path / "link"


def test_disk_free_of_a_path_not_created_yet(tmp_path: Path) -> None:
    free = disk_free(tmp_path / "not" / "yet")
    assert 0 < free <= shutil.disk_usage(tmp_path).total
