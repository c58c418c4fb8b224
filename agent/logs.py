"""``libreyolo-agent logs``: the state directory's log files, shown as ``GET /logs`` shows them.

Four processes write four files in the state directory: the agent (``agent.log``), the trainer
(``trainer.log``: LibreYOLO's own output), the supervisor (``supervisor.log``: the agent's output
as ``supervise`` captured it) and the guard (``guard.log``). Every line shown is redacted
(:func:`agent.util.redact.redact`), like ``/logs``: the files on disk are the agent's, the
terminal may be shared or recorded.

``--follow`` is ``tail -F``: it keeps the file's path, not the open file, so a log rotated
(renamed, a new file in its place) or truncated (``copytruncate``) is followed on, and one
that does not exist yet is waited for. Part of the CLI (agent/cli.py builds the parser).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import IO

from agent.util.redact import redact

#: The logs by the option that picks them, and the file each is in the state directory.
LOG_FILES = {
    "agent": "agent.log",
    "trainer": "trainer.log",
    "supervisor": "supervisor.log",
    "guard": "guard.log",
}
#: Lines shown before following (and without ``--follow``), unless ``-n`` says otherwise.
DEFAULT_LINES = 20
#: How often ``--follow`` looks for new lines, a rotation or a truncation, seconds (``tail -F``
#: polls once a second; a person waiting for a line notices a second).
POLL_S = 0.25
#: A line longer than this without a newline is shown as it is (a progress bar never ending
#: its line must not grow a buffer without bound).
MAX_PENDING_BYTES = 1 << 20

DESCRIPTION = (
    "Show a log of the state directory, redacted as GET /logs shows it: agent.log (the "
    "default), trainer.log (--trainer, LibreYOLO's own output), supervisor.log (--supervisor, "
    "the agent's output as `supervise` captured it) or guard.log (--guard); the word does as "
    "its option (`logs guard` is `logs --guard`). --follow goes on "
    "showing new lines like `tail -F`: through a rotation or a truncation, until Ctrl-C."
)

EPILOG = """\
exit codes:
  0  shown (with --follow: ended by Ctrl-C or by the reader going away)
  1  the log cannot be read (no such file without --follow, or no permission)
  2  a usage mistake (two logs named, a negative -n)
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``logs`` subcommand, on the CLI's subparsers."""
    from agent.client import HelpFormatter

    lg = sub.add_parser(
        "logs",
        help="show (or follow) a log of the state directory, redacted",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    lg.add_argument(
        "name",
        nargs="?",
        choices=list(LOG_FILES),
        metavar="LOG",
        help=f"which log, as a word: {', '.join(LOG_FILES)} (the same as its option)",
    )
    which = lg.add_mutually_exclusive_group()
    for name, file in LOG_FILES.items():
        which.add_argument(
            f"--{name}",
            dest="log",
            action="store_const",
            const=name,
            help=f"{file}" + (" (the default)" if name == "agent" else ""),
        )
    lg.add_argument(
        "-f", "--follow", action="store_true", help="go on showing new lines until Ctrl-C"
    )
    lg.add_argument(
        "-n",
        "--lines",
        type=int,
        default=DEFAULT_LINES,
        metavar="N",
        help=f"the last N lines first (default: {DEFAULT_LINES}; 0: only new ones)",
    )
    lg.add_argument(
        "--state-dir",
        help="agent state directory (default: $LIBREYOLO_AGENT_STATE_DIR, else "
        "/var/lib/libreyolo-agent)",
    )
    lg.set_defaults(func=cmd_logs, log=None)


def log_path(args: argparse.Namespace) -> Path:
    """The file ``args`` asks for, in the state directory it names (else the environment's)."""
    from agent.config.model import Env

    state_dir = Path(args.state_dir or Env.from_environ().state_dir)
    return state_dir / LOG_FILES[chosen_log(args)]


def chosen_log(args: argparse.Namespace) -> str:
    """The log asked for by its word (``logs guard``) or its option (``--guard``); agent.log
    when neither. Both, naming two logs, is a :class:`ValueError`."""
    name, option = getattr(args, "name", None), args.log
    if name and option and name != option:
        raise ValueError(f"'{name}' and --{option} name two logs: give one")
    return name or option or "agent"


def cmd_logs(args: argparse.Namespace) -> int:
    from agent.client import err

    try:
        args.log = chosen_log(args)
    except ValueError as exc:
        err(str(exc))
        return 2
    try:
        return _show(args)
    except KeyboardInterrupt:  # Ctrl-C is how a person ends a follow (or a long tail)
        return 0
    except BrokenPipeError:
        # The reader went away (`logs --follow | grep -m1 ...`): as normal an end as Ctrl-C.
        # stdout to /dev/null, so the flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _show(args: argparse.Namespace) -> int:
    from agent.client import EXIT_FAIL, EXIT_OK, err
    from agent.status.views import tail_lines

    path = log_path(args)
    if args.lines < 0:
        err(f"-n {args.lines}: expected 0 or more lines")
        return 2
    try:
        # Where following starts is taken before the tail is read: a line written in between
        # may be shown twice, never lost.
        start = path.stat().st_size if args.follow else 0
        lines = tail_lines(path, args.lines)
    except FileNotFoundError:
        start, lines = 0, []
    except OSError as exc:
        err(f"cannot read {path}: {exc.strerror or exc}")
        return EXIT_FAIL
    if not lines and not args.follow and not path.exists():
        err(f"no {path.name} in {path.parent} (pass --state-dir, or the agent never wrote it)")
        return EXIT_FAIL
    out = sys.stdout
    for line in lines:
        out.write(line + "\n")
    out.flush()
    if not args.follow:
        return EXIT_OK
    try:
        follow(path, start, out)
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):
            raise  # cmd_logs: the reader went away
        err(f"cannot read {path}: {exc.strerror or exc}")
        return EXIT_FAIL
    return EXIT_OK


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def follow(path: Path, position: int, out: IO[str], *, poll_s: float = POLL_S) -> None:
    """Write each new whole line of ``path`` to ``out``, redacted, from byte ``position`` on,
    forever (until an exception: Ctrl-C, a closed pipe). Like ``tail -F``: when ``path`` is
    renamed away (rotated) the old file's last lines are read, then the new file from its
    start; when it shrinks (truncated) it is read again from its start; while it does not
    exist it is waited for."""
    f: IO[bytes] | None = None
    pending = b""
    try:
        while True:
            if f is None:
                try:
                    f = open(path, "rb")  # noqa: SIM115 (kept open across turns)
                except FileNotFoundError:
                    time.sleep(poll_s)
                    continue
                f.seek(min(position, os.fstat(f.fileno()).st_size))
                position = 0  # a file opened after this one is read from its start
            chunk = f.read(1 << 16)
            if chunk:
                pending = _write_lines(pending + chunk, out)
                continue
            try:
                now = path.stat()
            except FileNotFoundError:
                now = None
            held = os.fstat(f.fileno())
            if now is not None and not _same_file(now, held):
                # Rotated: the old file is read to its end above; on to the new one.
                pending = _flush_pending(pending, out)
                f.close()
                f = None
                continue
            if held.st_size < f.tell():
                # Truncated in place (copytruncate): start over from its beginning.
                pending = _flush_pending(pending, out)
                f.seek(0)
                continue
            time.sleep(poll_s)
    finally:
        if f is not None:
            f.close()


def _write_lines(data: bytes, out: IO[str]) -> bytes:
    """Write the whole lines of ``data`` (redacted), return the unfinished rest."""
    *whole, rest = data.split(b"\n")
    if len(rest) > MAX_PENDING_BYTES:
        whole.append(rest)
        rest = b""
    if whole:
        for raw in whole:
            # Redacted before it is cut at a carriage return: no secret survives half-visible.
            text = redact(raw.decode("utf-8", errors="replace"))
            out.write(text.rstrip("\r").rpartition("\r")[2] + "\n")
        out.flush()
    return rest


def _flush_pending(pending: bytes, out: IO[str]) -> bytes:
    """The unfinished last line of a file that is gone (rotated, truncated): shown as it is."""
    if pending:
        _write_lines(pending + b"\n", out)
    return b""
