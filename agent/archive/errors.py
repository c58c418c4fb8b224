"""The errors of an unpack, and how their one-line messages name members, sizes and headroom."""

from __future__ import annotations

from pathlib import Path

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
    shown = "; ".join(f"{show(name)}: {why}" for name, why in problems[:_MAX_NAMED_PROBLEMS])
    more = len(problems) - _MAX_NAMED_PROBLEMS
    if more > 0:
        shown += f"; and {more} more"
    return shown


def show(name: str) -> str:
    """A member name for a message: its repr, cut to 80 characters."""
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."


def one_line(text: str, limit: int = 200) -> str:
    """``text`` on one line, whitespace collapsed, cut to ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def percent(headroom: float) -> str:
    """``1.3`` -> ``"30 %"``."""
    return f"{(headroom - 1) * 100:.0f} %"


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
