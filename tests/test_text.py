"""How messages show things: one short line for a value, a byte count, an error. And the base
helper modules stay importable from every layer: they import nothing of the agent."""

from __future__ import annotations

import ast
import errno
import os
from pathlib import Path

import pytest

from agent.util.text import format_bytes, format_when, one_line, os_error, show

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_show_cuts_a_long_repr_to_the_limit() -> None:
    assert show("abc") == "'abc'"
    assert show("x" * 100) == "'" + "x" * 56 + "..."
    assert len(show("x" * 100, 80)) == 80
    assert show("a\nb") == "'a\\nb'"  # control characters come out escaped


def test_show_of_an_integer_too_long_for_str_names_its_size() -> None:
    assert show(1 << 100_000) == "<an integer of about 30104 digits>"


def test_one_line_collapses_whitespace_and_cuts() -> None:
    assert one_line("  a\n\tb   c \n") == "a b c"
    assert one_line("word " * 100, 20) == "word word word wo..."


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (3 << 30, "3.0 GiB"),
        (5 << 50, "5120.0 TiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_format_when_shows_a_unix_time_in_utc_and_anything_else_as_it_is() -> None:
    assert format_when(1796461015.85194) == "2026-12-05 08:56:55 UTC"
    assert format_when(0) == "1970-01-01 00:00:00 UTC"
    # A hand-edited or damaged record: shown, never a crash in a log line.
    assert format_when(None) == "None"
    assert format_when("yesterday") == "'yesterday'"
    assert format_when(True) == "True"
    assert format_when(float("nan")) == "nan"
    assert format_when(1e300) == "1e+300"


def test_os_error_is_short_and_greppable() -> None:
    exc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/state.json")
    assert os_error(exc) == "ENOSPC: No space left on device"
    assert os_error(exc, filename=True) == "ENOSPC: No space left on device (/runs/state.json)"
    assert os_error(OSError("odd")) == "OSError: odd"


@pytest.mark.parametrize("module", ["text", "disk", "threads", "backoff"])
def test_base_helpers_import_nothing_of_the_agent(module: str) -> None:
    # So the generic layers (agent.data.archive, agent.data.datacheck) can use them and stay
    # generic.
    tree = ast.parse((REPO_ROOT / "agent" / "util" / f"{module}.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert not {m for m in imported if m and (m == "agent" or m.startswith("agent."))}
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))
