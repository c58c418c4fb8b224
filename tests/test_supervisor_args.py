"""``supervise``'s command line read without argparse (agent.supervise.parse_plain, issue 26:
argparse is 0.4 MiB the supervisor would hold for the whole job), held against argparse itself:
where the plain reading answers, argparse answers the same; where it does not (help, a
mistake, anything unusual), argparse reads the line as it always did."""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.supervise import add_arguments, parse_plain

ROOT = Path(__file__).resolve().parents[1]


def by_argparse(argv: list[str]) -> dict[str, Any] | None:
    """argparse's namespace as a dict, or None where it exits (an error, --help)."""
    parser = argparse.ArgumentParser(prog="libreyolo-agent supervise")
    add_arguments(parser)
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            return vars(parser.parse_args(argv))
        except SystemExit:
            return None


def same_as_argparse(argv: list[str]) -> dict[str, Any] | None:
    plain = parse_plain(argv)
    theirs = by_argparse(argv)
    if plain is not None:
        assert theirs is not None, f"argparse refuses {argv!r}, the plain reading took it"
        mine = vars(plain)
        # NaN is never equal to itself: compare what the values say, not their identity
        assert {k: repr(v) for k, v in mine.items()} == {k: repr(v) for k, v in theirs.items()}
        assert {k: type(v) for k, v in mine.items()} == {k: type(v) for k, v in theirs.items()}
        return mine
    return None


@pytest.mark.parametrize(
    "argv",
    [
        ["job.toml"],
        ["/etc/libreyolo-agent/job.toml", "-v"],
        ["--verbose", "job.toml"],
        ["job.toml", "--log", "/var/log/agent.log"],
        ["--log=/var/log/agent.log", "job.toml"],
        ["--log=", "job.toml"],
        ["job.toml", "--max-restarts", "3", "--first-backoff", "0.5"],
        ["job.toml", "--max-restarts=0", "--max-backoff=60", "--min-uptime", "0"],
        ["--max-restarts", "-1", "job.toml"],  # argparse takes a negative number as a value
        ["--first-backoff", "-.5", "job.toml"],
        ["--first-backoff", "nan", "job.toml"],
        ["--first-backoff", "1e3", "job.toml"],
        ["--log", "a", "--log", "b", "job.toml"],  # the last one wins, in both
        ["job.toml", "-v", "-v"],
        ["--log", "-1", "job.toml"],
    ],
)
def test_a_plain_command_line_is_read_as_argparse_reads_it(argv: list[str]) -> None:
    assert same_as_argparse(argv) is not None, "the plain reading should have taken this line"


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--help"],
        ["-h"],
        ["job.toml", "other.toml"],
        ["job.toml", "--max-restarts"],
        ["job.toml", "--max-restarts", "three"],
        ["job.toml", "--max-restarts", "1.5"],
        ["job.toml", "--log", "--verbose"],
        ["job.toml", "--log", "-"],
        ["job.toml", "--max-r", "3"],  # argparse's abbreviation: argparse reads it
        ["job.toml", "-vv"],
        ["job.toml", "--verbose=1"],
        ["--", "job.toml"],
        ["-1"],
        ["job.toml", "--first-backoff", "-1."],
        ["job.toml", "--unknown"],
        [""],
    ],
)
def test_anything_else_is_left_to_argparse(argv: list[str]) -> None:
    assert parse_plain(argv) is None


TOKENS = st.sampled_from(
    [
        "job.toml",
        "j2.toml",
        "-v",
        "--verbose",
        "--log",
        "--log=x",
        "--log=",
        "--max-restarts",
        "--max-restarts=2",
        "--first-backoff",
        "--first-backoff=0.25",
        "--max-backoff",
        "--min-uptime",
        "--max-r",
        "--",
        "-",
        "3",
        "-3",
        "-.5",
        "1.5",
        "nan",
        "inf",
        "x",
        "-x",
        "--x",
        "",
        "٣",
        "-٣",
        " 4",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(TOKENS, max_size=7))
def test_the_plain_reading_never_differs_from_argparse(argv: list[str]) -> None:
    same_as_argparse(argv)


def test_supervise_help_and_mistakes_still_come_from_argparse(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from agent import entry; sys.exit(entry.main())",
                "supervise",
                *args,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    shown = run("--help")
    assert shown.returncode == 0 and "usage: libreyolo-agent supervise" in shown.stdout
    assert "exit codes:" in shown.stdout and "--max-restarts" in shown.stdout
    wrong = run(str(tmp_path / "job.toml"), "--max-restarts", "three")
    assert wrong.returncode == 2
    assert "argument --max-restarts: invalid int value: 'three'" in wrong.stderr
    missing = run()
    assert missing.returncode == 2 and "the following arguments are required: job" in missing.stderr
