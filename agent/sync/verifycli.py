"""``libreyolo-agent verify TARGET``: the restore drill (:mod:`agent.sync.restore`) on a sync
target, from any machine with the agent and LibreYOLO installed: ``weights/best.pt`` and
``weights/last.pt`` fetched into a scratch folder and loaded with LibreYOLO on the CPU.

Beside the commands: the CLI hands its help layout and error line down (as ``dataset push``
does), so this layer imports nothing of the commands'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from agent.config.jobvalues import check_sync_target, parse_duration
from agent.config.model import Env, SyncSection
from agent.sinks.target import make_sink
from agent.sync.restore import DEFAULT_TIMEOUT_S, RestoreDrill, run_drill

DESCRIPTION = (
    "The restore drill: fetch weights/best.pt and weights/last.pt from the sync TARGET "
    "(file:///dir or hf://org/name, the job's [sync] target) into a scratch folder, checked "
    "against the target's size and sha256, and load each with LibreYOLO on the CPU (no "
    "training), in a child process with a timeout. A checkpoint whose bytes are intact can "
    "still fail here: a pickle that raises, tensors missing from the state dict."
)
EPILOG = (
    "exit codes:\n"
    "  0  every checkpoint on the target loaded\n"
    "  1  one did not load, or timed out, or nothing is there\n"
    "  2  a bad TARGET\n"
)


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    *,
    formatter: type[argparse.HelpFormatter],
    err: Callable[[str], None],
) -> None:
    """``verify TARGET`` on the CLI's subparsers."""
    p = sub.add_parser(
        "verify",
        help="load the target's final checkpoints with LibreYOLO (the restore drill)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=formatter,
    )
    p.add_argument("target", metavar="TARGET", help="file:///dir or hf://org/name")
    p.add_argument(
        "--timeout",
        default=None,
        metavar="DURATION",
        help="per file, download and load (default 15m)",
    )
    p.add_argument("--json", action="store_true", help="the drill's result as JSON")
    p.set_defaults(func=lambda args: cmd_verify(args, err))


def cmd_verify(args: argparse.Namespace, err: Callable[[str], None]) -> int:
    check_sync_target("TARGET", args.target)  # a ConfigError: the CLI prints it, exit 2
    timeout_s = (
        DEFAULT_TIMEOUT_S if args.timeout is None else parse_duration("--timeout", args.timeout)
    )
    env = Env.from_environ()
    sink = make_sink(SyncSection(target=args.target), env)
    with tempfile.TemporaryDirectory(prefix="libreyolo-agent-verify-") as scratch:
        drill = asyncio.run(run_drill(sink, Path(scratch), timeout_s=timeout_s))
    print_drill(drill, as_json=args.json, err=err)
    return 0 if drill.status == "ok" else 1


def print_drill(drill: RestoreDrill, *, as_json: bool, err: Callable[[str], None]) -> None:
    if as_json:
        print(json.dumps(drill.to_dict(), indent=2))
        return
    for f in drill.files:
        print(f"{f.path}: {f.status} ({f.detail or '-'})")
    (print if drill.status == "ok" else err)(drill.why)
