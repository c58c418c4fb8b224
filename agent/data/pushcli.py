"""The ``dataset push`` command: its options, its progress lines and what it prints.

Beside :mod:`agent.data.push` rather than in ``agent/cli.py`` (which only adds it, as it adds
``logs``): the command is one noun with its library, and cli.py is at the size of one noun.
Building the parser imports nothing of the Hub: the library is imported when the command runs.
Progress and steps go to stderr, the result to stdout (text, or ``--json``), so
``dataset push ... --json | jq`` reads a document whatever the progress said.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from agent.config.model import Env
from agent.util.text import format_bytes

if TYPE_CHECKING:
    from agent.data.push import PushResult

#: Exit codes of ``dataset push`` (its help and the README's Commands table say the same).
EXIT_PUSHED, EXIT_HUB, EXIT_USAGE = 0, 1, 2

DESCRIPTION = (
    "Push a dataset folder to a private Hugging Face dataset repo as one tar, the way the box "
    "will stage it: LibreYOLO's doctor and the agent's data YAML check first (nothing leaves "
    "the laptop before they pass), a tar with safe member names under one top folder "
    "(NAME.tar beside DIR, unless --tar), one commit through huggingface_hub with its "
    "progress bar, the Hub's sha256 read back and compared, and the [dataset] lines to paste "
    "into the job file, pinned to the commit. The token: HF_TOKEN, else `hf auth login`'s."
)
EPILOG = (
    "exit codes:\n"
    "  0  pushed, and the Hub's sha256 of the archive equals the local one\n"
    "  1  the Hub refused or could not be reached, or the read-back differs (one line: the "
    "fix)\n"
    "  2  a mistake to fix before pushing: DIR missing, no images, no data YAML or one with "
    "absolute paths, doctor errors, files the box's unpacker refuses, a bad repo name, no "
    "token, libreyolo not installed without --no-doctor (one line: the fix)\n"
    "\nenvironment:\n"
    "  HF_TOKEN     a token with write access (else the one `hf auth login` stored); never "
    "printed\n"
    "  HF_ENDPOINT  Hugging Face Hub base URL (default https://huggingface.co)\n"
)


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    *,
    formatter: type[argparse.HelpFormatter],
    err: Callable[[str], None],
) -> None:
    """``dataset push``, on the CLI's subparsers; ``formatter`` and ``err`` are the CLI's (its
    help layout, its error line), handed down: this layer does not import the commands'."""
    ds = sub.add_parser(
        "dataset",
        help="put a dataset folder on the Hub for the box to stage (dataset push DIR org/name)",
        description="Datasets for the box: `dataset push DIR org/name` packs, checks, uploads "
        "and reads back a dataset, and prints the [dataset] lines of the job file.",
        epilog=EPILOG,
        formatter_class=formatter,
    )
    what = ds.add_subparsers(dest="dataset_command", required=True, metavar="push")
    p = what.add_parser(
        "push",
        help="pack DIR into one tar and push it to a private dataset repo",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=formatter,
    )
    p.add_argument("dir", metavar="DIR", help="the dataset's folder (images, labels, data YAML)")
    p.add_argument("repo", metavar="org/name", help="the dataset repo (created private)")
    p.add_argument(
        "--tar",
        metavar="PATH",
        help="where to write the archive (default: NAME.tar beside DIR; kept after the push)",
    )
    p.add_argument(
        "--data-yaml",
        metavar="PATH",
        help="the data YAML, relative to DIR, when DIR holds several",
    )
    p.add_argument(
        "--no-doctor",
        action="store_true",
        help="skip `libreyolo doctor` (the agent's own data YAML check still runs)",
    )
    p.add_argument("--json", action="store_true", help="print the result (or error) as JSON")
    p.set_defaults(func=functools.partial(cmd_push, err=err))


def cmd_push(args: argparse.Namespace, *, err: Callable[[str], None]) -> int:
    # Imported here: every other command builds this parser, and none needs the Hub client.
    from agent.data.push import PushError, push

    env = Env.from_environ()  # a bad HF_ENDPOINT is a ConfigError: one line, exit 2 (main)
    bar = _PackBar(sys.stderr)
    try:
        result = push(
            Path(args.dir),
            args.repo,
            env,
            tar=Path(args.tar) if args.tar else None,
            data_yaml=args.data_yaml,
            doctor=not args.no_doctor,
            on_step=lambda step, detail: print(f"{step}: {detail}", file=sys.stderr, flush=True),
            on_pack=bar.update,
        )
    except PushError as exc:
        code = EXIT_USAGE if exc.kind == "usage" else EXIT_HUB
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc), "exit_code": code}, indent=2))
        err(str(exc))
        return code
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_result(result))
    return EXIT_PUSHED


def format_result(r: PushResult) -> str:
    """What a person reads after a push: what went where, verified, and the lines to paste."""
    went = "already there (nothing new went up)" if r.unchanged else "uploaded"
    return (
        f"pushed {r.file} ({format_bytes(r.archive_bytes)}: {r.files} files, {r.images} "
        f"images) to {r.repo}@{r.commit}, {went}\n"
        f"verified: the Hub's sha256 {r.remote_sha256} is the local archive's ({r.archive})\n"
        f"doctor: {r.doctor}; repo {'private' if r.private else 'PUBLIC'}\n"
        "\nadd to the job file:\n\n"
        f"{r.job_lines()}"
    )


class _PackBar:
    """Packing progress on stderr: one line redrawn on a terminal, else a line per 10 %."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._tty = out.isatty()
        self._shown = -1
        self._drawn_at = 0.0

    def update(self, done: int, total: int) -> None:
        percent = 100 if total == 0 else done * 100 // total
        line = f"packing: {percent:3d} % ({format_bytes(done)} of {format_bytes(total)})"
        if self._tty:
            now = time.monotonic()
            if percent == 100 or now - self._drawn_at >= 0.2:
                self._drawn_at = now
                end = "\n" if percent == 100 else ""
                print(f"\r{line}", end=end, file=self._out, flush=True)
        elif percent // 10 > self._shown // 10 or (percent == 100 and self._shown < 100):
            self._shown = percent
            print(line, file=self._out, flush=True)
