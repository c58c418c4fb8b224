"""``libreyolo-agent supervise JOB``, the command: its options (argparse's for ``--help`` and
mistakes, :func:`parse_plain` for a plain line), the job file checked in a forked child that
exits, then :class:`agent.supervisor.Supervisor` for the rest of the job.

The process this command becomes lives as long as the job, so what it imports stays for the
whole job (issue 26: every process of ours together under 80 MiB PSS): a plain command line is
read without argparse (0.4 MiB), the job's parser runs only in the forked child, and the CLI
(agent/cli.py) is never imported: agent/entry.py and the top of agent/cli.py come here first.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

from agent import supervisor
from agent.supervisor import EXIT_BAD_JOB, AlreadySupervised, Policy
from agent.util import logutil

#: ``typing.TYPE_CHECKING`` without importing typing (0.5 MiB the supervisor does not hold).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Sequence
    from typing import Any

HELP = "run the agent, restarting it when it fails (containers without systemd)"
DESCRIPTION = (
    "Run `libreyolo-agent run JOB`; start it again, after a backoff, when it "
    "fails or is killed, not after exit 0 (the job ended) or 2 (bad job file). Exit 0 the "
    "job ended or SIGTERM/SIGINT (passed on to the agent), 1 gave up or another supervisor "
    "runs, 2 bad job file. Files: supervisor.pid, supervisor.json in the state directory."
)

#: ``supervise --help``'s exit codes (the README's Commands table says the same).
EPILOG = """\
exit codes:
  0  the job ended (or SIGTERM/SIGINT, passed on to the agent)
  1  gave up (restarts in a row that did not stay up), or another supervisor runs
  2  the job file is bad
"""


#: ``supervise``'s options that take a value: their type and default, for argparse
#: (:func:`add_arguments`) and for the plain reading (:func:`parse_plain`) alike.
VALUE_OPTIONS: dict[str, tuple[Callable[[str], Any], Any]] = {
    "--log": (str, None),
    "--max-restarts": (int, 10),
    "--first-backoff": (float, 5.0),
    "--max-backoff": (float, 300.0),
    "--min-uptime": (float, 60.0),
}


def add_arguments(sv: argparse.ArgumentParser) -> None:
    """``supervise``'s options (agent/cli.py's subcommand and :func:`main` share them)."""
    sv.add_argument("job", help="job file (TOML)")
    sv.add_argument(
        "--log",
        metavar="FILE",
        help="append the agent's output here (default: supervisor.log in the state directory)",
    )
    for flag, text in (
        ("--max-restarts", "give up after N restarts in a row (none up --min-uptime)"),
        ("--first-backoff", "seconds before the first restart; doubles each time"),
        ("--max-backoff", "the longest wait before a restart, seconds"),
        ("--min-uptime", "seconds up that reset the count of restarts in a row"),
    ):
        kind, default = VALUE_OPTIONS[flag]
        sv.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default:g})")
    sv.add_argument("-v", "--verbose", action="store_true", help="log debug lines too")


def _err(message: str) -> None:
    from agent.client import err  # only on the way out: the CLI's one way of saying what went wrong

    err(message)


def check_job(job: Path) -> int:
    """The job file read and checked in a forked child, which exits: 0 good; 2 bad (every
    mistake printed, and on a rented box the failure teardown decision, as ``run`` does:
    agent/cli.py's ``_bad_job``); 1 the check itself failed. The parser and its imports never
    stay in the supervisor. The child has a process group of its own: SIGTERM and SIGINT reach
    it once, passed on from here (a bad job's teardown, waiting on a provider, stops on them as
    it would in the supervisor itself)."""
    sys.stdout.flush()
    sys.stderr.flush()
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # until they are passed on
    try:
        pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    if pid == 0:  # the child: no thread runs yet in the supervisor, so forking is safe
        code = 1
        try:
            os.setpgid(0, 0)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            from agent.cli import _bad_job, _load
            from agent.client import err
            from agent.config.model import ConfigError, Env

            try:
                _load(str(job))
            except ConfigError as exc:
                code = _bad_job(str(job), exc, supervised=True)
            else:
                try:
                    Env.from_environ()  # a bad HF_ENDPOINT: exit 2 here too, as before
                    code = 0
                except ConfigError as exc:
                    for error in exc.errors:
                        err(str(error))
                    code = EXIT_BAD_JOB
        except KeyboardInterrupt:
            code = 1
        except BaseException:  # the same traceback the supervisor itself would have printed
            import traceback

            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def pass_on(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    old = {sig: signal.signal(sig, pass_on) for sig in stop_signals}
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                return os.waitstatus_to_exitcode(status)
            except InterruptedError:
                continue
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def run_from_args(args: argparse.Namespace | SimpleNamespace) -> int:
    """``libreyolo-agent supervise``: the options checked, the job file checked (exit 2 before
    anything starts), then :meth:`Supervisor.run`."""
    policy = Policy.from_options(  # ConfigError: one line each, exit 2 (the caller)
        args.max_restarts, args.first_backoff, args.max_backoff, args.min_uptime
    )
    job = Path(args.job).absolute()
    logutil.configure_console(args.verbose)
    checked = check_job(job)
    if checked != 0:
        return checked if checked > 0 else 1
    state_dir = Path(os.environ.get("LIBREYOLO_AGENT_STATE_DIR") or supervisor.DEFAULT_STATE_DIR)
    argv = supervisor.agent_argv(job, verbose=args.verbose)  # a test stands one in here
    log_path = Path(args.log) if args.log else None
    try:
        sv = supervisor.Supervisor(
            argv, state_dir, log_path=log_path, policy=policy, host_guard=True
        )
        return sv.run()
    except AlreadySupervised as exc:
        _err(f"a supervisor (pid {exc.holder}) already runs on the state directory {state_dir}")
        return 1
    except OSError as exc:
        _err(f"cannot supervise in {state_dir}: {exc.strerror or exc}")
        return 1


def _negative_number(token: str) -> bool:
    """argparse's own test (its ``_negative_number_matcher``) for a value that looks like an
    option but is a negative number (``-1``, ``-.5``): this parser has no option like one."""
    return re.fullmatch(r"-\d+|-\d*\.\d+", token) is not None


def parse_plain(argv: Sequence[str]) -> SimpleNamespace | None:
    """``supervise``'s options read without argparse (0.4 MiB the supervisor would hold for the
    whole job, issue 26), for a plain command line only: the job, the options spelt out
    (``--log FILE`` or ``--log=FILE``), ``-v``. Anything else (``--help``, an abbreviation, a
    mistake, a value that does not convert) gives None, and :func:`main` asks argparse, which
    answers it as it always did. Where this returns a namespace, argparse's would be equal
    (tests/test_supervisor_args.py holds the two side by side)."""
    values: dict[str, Any] = {
        k[2:].replace("-", "_"): default for k, (_, default) in VALUE_OPTIONS.items()
    }
    values["verbose"] = False
    job: str | None = None
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("-"):
            if job is not None or token == "":
                return None  # a second job (argparse: unrecognized arguments), or an empty one
            job = token
            continue
        if token in ("-v", "--verbose"):
            values["verbose"] = True
            continue
        name, eq, value = token.partition("=")
        if name not in VALUE_OPTIONS:
            return None
        if not eq:
            if i >= len(tokens):
                return None
            value = tokens[i]
            i += 1
            if value.startswith("-") and not _negative_number(value):
                return None
        convert, _ = VALUE_OPTIONS[name]
        try:
            values[name[2:].replace("-", "_")] = convert(value)
        except ValueError:
            return None
    if job is None:
        return None
    return SimpleNamespace(job=job, **values)


def main(argv: Sequence[str] | None = None) -> int:
    """``libreyolo-agent supervise ...`` without the rest of the CLI (agent/cli.py dispatches
    here first); ``argv`` without the word ``supervise``."""
    args: argparse.Namespace | SimpleNamespace | None
    args = parse_plain(sys.argv[1:] if argv is None else argv)
    if args is None:  # help, or a mistake: argparse's words, as the rest of the CLI
        import argparse

        parser = argparse.ArgumentParser(
            prog="libreyolo-agent supervise",
            description=DESCRIPTION,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_arguments(parser)
        args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except KeyboardInterrupt:
        return 1
    except Exception as exc:
        from agent.config.jobvalues import ConfigError

        if not isinstance(exc, ConfigError):
            raise
        for error in exc.errors:  # a bad option: one line each
            _err(str(error))
        return EXIT_BAD_JOB
