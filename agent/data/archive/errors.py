"""The errors of an unpack, and how their one-line messages name members and headroom."""

from __future__ import annotations

from pathlib import Path

from agent.util.text import show

#: Unsafe members named in one error message; the rest are counted.
_MAX_NAMED_PROBLEMS = 10


class ArchiveError(Exception):
    """The archive cannot be unpacked (unreadable, unsafe, too big for the disk...): nothing
    was unpacked. The message is one readable line that says what to do about it."""


class UnsafeArchiveError(ArchiveError):
    """The archive has members that must not be unpacked; ``problems`` maps member -> why."""

    def __init__(self, archive: Path, problems: list[tuple[str, str]]) -> None:
        super().__init__(
            f"archive {archive.name} has {len(problems)} unsafe member(s), nothing was unpacked: "
            f"{name_problems(problems)}; rebuild the archive from plain files and folders with "
            "relative paths (e.g. tar -C DIR -cf dataset.tar .)"
        )
        self.problems = problems
        self.members = [name for name, _ in problems]


def name_problems(problems: list[tuple[str, str]]) -> str:
    """``'member': why; ...`` for the first few, the rest counted."""
    shown = "; ".join(f"{show(name, 80)}: {why}" for name, why in problems[:_MAX_NAMED_PROBLEMS])
    more = len(problems) - _MAX_NAMED_PROBLEMS
    if more > 0:
        shown += f"; and {more} more"
    return shown


def percent(headroom: float) -> str:
    """``1.3`` -> ``"30 %"``."""
    return f"{(headroom - 1) * 100:.0f} %"
