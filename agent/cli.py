"""Command line: argument parsing, exit codes, and the only place that prints for humans.

Exit codes of ``run``: 0 the job ended as planned (whatever the training outcome), 1 the agent
failed, 2 the job file is bad (or a demo-only option came with one). ``preflight``: 0 nothing
failed, 1 something failed, 2 bad job. A bad job file is reported whole: every mistake, one line
each; on a rented box (``supervise``, or ``run`` with a provider) the box then gets the failure
teardown decision before the exit 2 (agent/daemon/badjob.py).
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and sys.argv[1:2] == ["supervise"]:
    # The supervisor lives as long as the job: agent/supervise.py before the rest of the CLI
    # (agent/supervisor.py says what it holds, and why so little).
    from agent.supervise import main as _supervise

    sys.exit(_supervise(sys.argv[2:]))

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent import __version__, demo, logs
from agent.client import EXIT_CONFIG, EXIT_FAIL, EXIT_OK, HelpFormatter, err, refuse_extra
from agent.client import add_parsers as add_client_parsers
from agent.config.jobfile import load_job
from agent.config.model import ConfigError, Env, Job
from agent.policy import exitcode
from agent.util import logutil

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from agent.daemon.spine import Daemon


RUN_EPILOG = """\
exit codes:
  0  the job ended as planned (whatever the training outcome)
  1  the agent failed (the cause is printed; details in agent.log in the state directory)
  2  the job file is bad (every mistake is printed, one per line), or an option does not
     apply to it; with a [teardown] provider the box first gets the decision of a failed
     preflight (on_preflight_failure; kept when [teardown] itself cannot be read), recorded
     in state.json
  3  the agent exited before the job ended: the demo's (its trainer goes on; run it again
     to carry on), or any job's whose teardown was still open (not confirmed by the
     provider) when the agent was made to exit

environment:
  LIBREYOLO_AGENT_STATE_DIR  state directory: state.json, agent.log, the control token, the
                             sync ledger (default /var/lib/libreyolo-agent; the demo job keeps
                             its state in DEMO_DIR/state whatever this says)
  HF_TOKEN                   Hugging Face token, for hf:// sync targets and private datasets;
                             never logged
  HF_ENDPOINT                Hugging Face Hub base URL (default https://huggingface.co)
  HF_HOME                    Hugging Face cache folder; staged datasets download through
                             HF_HOME/hub
"""


def _setup_logging(verbose: bool) -> None:
    logutil.configure_console(verbose)


def _load(path: str) -> Job:
    return load_job(path)


# ---------------------------------------------------------------------------------------- run


def _demo_only_options(args: argparse.Namespace) -> list[str]:
    """Why each demo-only option given with a JOB is refused: a job file sets these itself,
    and taking them silently would run something else than what the user typed."""
    if not args.job:
        return []
    given = (
        ("--port", args.port is not None, "the job file sets [server] listen"),
        (
            "--demo-dir",
            args.demo_dir is not None,
            "the job file sets its folders (job.runs_dir, dataset.dest, sync.target) and "
            "LIBREYOLO_AGENT_STATE_DIR the state directory",
        ),
    )
    return [
        f"{option} applies to the demo job only (run without JOB); {instead}"
        for option, present, instead in given
        if present
    ]


def cmd_run(args: argparse.Namespace) -> int:
    from agent.util.arenas import fix_thresholds, limit_arenas
    from agent.util.lean import keep_out

    limit_arenas()  # before any thread allocates (agent/util/arenas.py)
    fix_thresholds()
    keep_out()  # before the Hub client is imported (agent/util/lean.py)
    refused = _demo_only_options(args)
    for message in refused:
        err(message)
    if refused:
        return EXIT_CONFIG

    try:
        from agent import hub  # noqa: F401 (refuses a too old huggingface_hub, with the fix)
        from agent.daemon.spine import AgentError, Daemon
    except ImportError as exc:
        err(str(exc))
        return EXIT_FAIL

    _setup_logging(args.verbose)
    stage_hook = None
    fresh_start = None
    demo_root: Path | None = None
    the_demo: demo.Demo | None = None
    on_ready: Callable[[Daemon], None] = _print_ready
    if args.job:
        try:
            job = _load(args.job)
        except ConfigError as exc:
            return _bad_job(args.job, exc, supervised=False)
        env = Env.from_environ()
        _set_aside_bad_job_record(env)
        from agent.guard import plan as guardplan

        guardplan.check_environ()  # a typo in the guard's variables is exit 2, not a crash
        broken = _hub_client_problem(job)
        if broken is not None:
            err(broken)
            return EXIT_CONFIG
    else:
        # agent/demo.py: its own state dir, a fresh start unless the last demo run goes on,
        # Ctrl-C stops the job, exit 0 only once it ended.
        the_demo = demo.Demo(
            Path(args.demo_dir or demo.DEMO_DIR), port=args.port if args.port is not None else 0
        )
        demo_root, job = the_demo.root, the_demo.job
        env = Env.from_environ(the_demo.environ(os.environ))
        print(f"demo job: everything goes under {demo_root}", file=sys.stderr)
        stage_hook, fresh_start = the_demo.stage, the_demo.fresh_start
        on_ready = the_demo.on_ready(_print_ready)

    daemon = Daemon(
        job,
        env,
        stage_hook=stage_hook,
        on_ready=on_ready,
        fresh_start=fresh_start,
        start_guard=bool(args.job),
    )
    try:
        code = asyncio.run(daemon.run())
    except AgentError as exc:
        err(str(exc))
        return EXIT_FAIL
    except Exception as exc:
        # A bug, not a user mistake: keep the traceback in agent.log, one line here. The state
        # file is left as it was, so a restarted agent (systemd Restart=on-failure) carries on.
        err(f"the agent crashed: {type(exc).__name__}: {exc} (traceback in agent.log)")
        return EXIT_FAIL
    _print_summary(daemon, demo_root)
    if the_demo is not None:
        code = the_demo.exit_code(daemon, code)
        if code == demo.EXIT_NOT_ENDED:
            err(the_demo.not_ended(daemon))
    return code


def _bad_job(path: str, exc: ConfigError, *, supervised: bool) -> int:
    """Every mistake, one line each; then, on a rented box, the failure teardown decision a job
    that cannot run gets (agent/daemon/badjob.py). Exit 2 all the same: a restart cannot fix it."""
    from agent.daemon import badjob

    for error in exc.errors:
        err(str(error))
    badjob.handle(Path(path).absolute(), exc.errors, supervised=supervised)
    return EXIT_CONFIG


def _set_aside_bad_job_record(env: Env) -> None:
    """A valid job file meets the record a bad one left (it never ran): out of its way."""
    from agent.daemon import badjob
    from agent.state import StateStore

    try:
        moved = badjob.set_aside(StateStore(env.state_dir))
    except OSError as exc:
        err(f"cannot move the bad job file's record aside: {exc.strerror or exc}")
        return
    if moved is not None:
        print(f"the job file is valid now: the bad job's record moved to {moved}", file=sys.stderr)


def _hub_client_problem(job: Job) -> str | None:
    """Why the Hub client this job needs (hf:// sync, a [dataset] download) cannot be loaded,
    or None. A broken install (a missing dependency of huggingface_hub, seen on a real box) is
    found here, with the fix, rather than as a crash of the agent in BOOTING that a restart
    cannot mend; a job that never talks to the Hub never loads the client."""
    hf_sync = job.sync is not None and job.sync.scheme == "hf"
    needs = [what for what, yes in (("hf:// sync", hf_sync), ("[dataset]", job.dataset)) if yes]
    if not needs:
        return None
    try:
        from agent import hub

        hub.load()
        if hf_sync:
            from agent.sinks import hf  # noqa: F401
    except ImportError as exc:
        return (
            f"the Hugging Face client cannot be loaded ({type(exc).__name__}: {exc}); this job "
            f"needs it for {' and '.join(needs)}: repair the install (pip install "
            "--force-reinstall huggingface_hub, or ./install.sh again) and run the agent again"
        )
    return None


def _print_ready(daemon: Daemon) -> None:
    server = daemon.state.server or {}
    print(
        f"libreyolo-agent {__version__}: job {daemon.job.job.name!r}, status on "
        f"http://{server.get('host')}:{server.get('port')}/status, state in {daemon.env.state_dir}",
        file=sys.stderr,
    )
    print(
        "the page's controls need the control token: libreyolo-agent token --login-url "
        f"--state-dir {daemon.env.state_dir} prints a link that logs the page in",
        file=sys.stderr,
    )


def _print_summary(daemon: Daemon, demo_root: Path | None) -> None:
    st = daemon.state
    lines = [
        "",
        f"phase:      {st.phase.value}",
        f"reason:     {st.reason.value if st.reason else '-'}",
        f"cause:      {st.cause or '-'}",
    ]
    if daemon.run_dir:
        lines.append(f"run dir:    {daemon.run_dir}")
    if daemon.sync:
        v = daemon.sync.verify_result
        lines.append(f"synced to:  {daemon.sync.sink.description}")
        if v is not None:
            lines.append(f"verified:   {v.sync_verified} ({v.checked} files checked)")
    if st.teardown:
        lines.append(f"teardown:   {_teardown_line(st.teardown)}")
    lines.append(f"state dir:  {daemon.env.state_dir} (state.json, agent.log, trainer.log)")
    if demo_root:
        lines.append(f"demo data:  {demo_root / 'data'}")
    print("\n".join(lines))


def _teardown_line(teardown: Mapping[str, Any] | None) -> str:
    if not teardown:
        return "-"
    return str(teardown.get("detail") or teardown.get("action") or "-")


# ---------------------------------------------------------------------------------- preflight


def cmd_preflight(args: argparse.Namespace) -> int:
    try:
        from agent import hub
        from agent.preflight import format_table, run_preflight
        from agent.preflight.report import PreflightReport
    except ImportError as exc:
        err(str(exc))
        return EXIT_FAIL

    job = _load(args.job) if args.job else None
    env = Env.from_environ()
    hub.configure(env)

    async def checks() -> PreflightReport:
        report = await run_preflight(job, env)
        if job is None:
            return report
        from agent.preflight.canary import command_checks  # what `run` proves before training too

        extra = await command_checks(job, env)
        return PreflightReport(report.checks + tuple(extra), report.wall_s)

    report = asyncio.run(checks())
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_table(report))
    return EXIT_OK if report.ok else EXIT_FAIL


def cmd_check(args: argparse.Namespace) -> int:
    from agent.install.libreyolo import installed_train_options
    from agent.policy import rent

    job = _load(args.job)
    env = Env.from_environ()
    sync = job.sync.target if job.sync else "none"
    options = installed_train_options()  # the one _load checked against (cached)
    checked = f"checked against {options.label}" if options.available else "not checked"
    try:
        estimate: rent.RentEstimate | None = rent.estimate(job, env, offline=args.offline)
        missing = None
    except ImportError as exc:  # an install without the agent's own dependencies (psutil)
        estimate, missing = None, f"what to rent is not worked out: {exc}"
    if args.json:
        doc = {
            "job": args.job,
            "ok": True,
            "train_options_checked": options.label if options.available else None,
            "rent": estimate.to_dict() if estimate is not None else {"problem": missing},
        }
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    print(
        f"{args.job}: ok (job {job.job.name!r}, {len(job.train.args)} train options "
        f"{checked}, sync {sync}, teardown {job.teardown.provider}, state dir {env.state_dir})"
    )
    if not options.available:
        print(f"note: [train] keys not checked against LibreYOLO: {options.reason}")
    print(rent.format_text(estimate) if estimate is not None else f"note: {missing}")
    return EXIT_OK


# ---------------------------------------------------------------------------------- supervise


def cmd_supervise(args: argparse.Namespace) -> int:
    from agent import supervise

    return supervise.run_from_args(args)


# ---------------------------------------------------------------------------------------- cost


#: ``cost``'s options that take a value, by their ``args`` name (each is read as text and checked
#: by agent/policy/cost.py: a mistake is one line, exit 2).
COST_VALUES = (
    "disk_gb",
    "storage_usd_per_gb_month",
    "rebuild_usd",
    "setup_minutes",
    "transfer_gb",
    "transfer_usd_per_gb",
    "running_usd_per_hour",
    "gap_hours",
    "hours_per_month",
)


def cmd_cost(args: argparse.Namespace) -> int:
    from agent.policy import cost

    given = [f"--{name.replace('_', '-')}" for name in COST_VALUES if getattr(args, name)]
    given += ["--epochs"] if args.epochs is not None else []
    cost.refuse_other_form(given, per_job=bool(args.per_job))  # ConfigError: exit 2 (main)
    if args.per_job:
        boxes, epochs = cost.parse_per_job(args.per_job, args.epochs)
        per_job = cost.compare_per_job(boxes, epochs)  # ConfigError: one line, exit 2 (main)
        print(
            json.dumps(per_job.to_dict(), indent=2) if args.json else cost.format_per_job(per_job)
        )
        return EXIT_OK
    raw = {name: getattr(args, name) for name in COST_VALUES}
    report = cost.compute(cost.parse_inputs(raw))  # ConfigError: one line, exit 2 (main)
    print(json.dumps(report.to_dict(), indent=2) if args.json else cost.format_report(report))
    return EXIT_OK


COST_USAGE = """\
libreyolo-agent cost --disk-gb GB --storage-usd-per-gb-month USD
                            (--rebuild-usd USD | --setup-minutes MIN --transfer-gb GB
                             --running-usd-per-hour USD [--transfer-usd-per-gb USD])
                            [--running-usd-per-hour USD] [--gap-hours HOURS]
                            [--hours-per-month HOURS] [--json]
       libreyolo-agent cost --per-job SECONDS_PER_EPOCH USD_PER_HOUR --per-job ... [--epochs N]
                            [--json]"""


def add_cost_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``cost``: two forms, each option in the group of the form it belongs to."""
    from agent.policy.cost import TRANSFER_USD_PER_GB

    co = sub.add_parser(
        "cost",
        help="stop or destroy the box after a run: which is cheaper for a gap; or which box "
        "is cheaper per job",
        usage=COST_USAGE,
        description="Stop or destroy: what a stopped box costs (its disk: GB x $/GB-month / "
        "hours per month), the gap at which that equals the cost of destroying it and "
        "rebuilding, and, with --gap-hours, the verdict. The rebuild cost is given "
        "(--rebuild-usd), or derived: setup minutes x running $/h / 60 + GB in x transfer "
        "$/GB (the guide's 15 minutes at $3.4828/h plus 43 GB: about $1.00). Or, with "
        "--per-job, which box is cheaper per job. An option of the other form is refused.",
        epilog="exit codes:\n  0  the figures printed\n  2  a missing or bad value, or an "
        "option of the other form (one line naming the option)\n",
        formatter_class=HelpFormatter,
    )
    sd = co.add_argument_group(
        "stop or destroy",
        "required: --disk-gb, --storage-usd-per-gb-month, and the rebuild cost: --rebuild-usd, "
        "or --setup-minutes, --transfer-gb and --running-usd-per-hour",
    )
    sd.add_argument("--disk-gb", metavar="GB", help="(required) the box's allocated disk, GB")
    sd.add_argument(
        "--storage-usd-per-gb-month",
        metavar="USD",
        help="(required) the provider's storage price, USD per GB per month (e.g. 0.20)",
    )
    sd.add_argument(
        "--rebuild-usd",
        metavar="USD",
        help="(required, unless derived) what destroying and coming back costs: setup time at "
        "the running price plus the dataset's inbound transfer, USD (e.g. 1.00)",
    )
    sd.add_argument(
        "--setup-minutes",
        metavar="MIN",
        help="derive the rebuild cost: minutes a new box takes to set up (e.g. 15)",
    )
    sd.add_argument(
        "--transfer-gb",
        metavar="GB",
        help="derive the rebuild cost: GB transferred in on a rebuild (e.g. 43)",
    )
    sd.add_argument(
        "--transfer-usd-per-gb",
        metavar="USD",
        help="derive the rebuild cost: the inbound transfer price, USD per GB (default "
        f"{TRANSFER_USD_PER_GB:g}, $3 per TB)",
    )
    sd.add_argument(
        "--running-usd-per-hour",
        metavar="USD",
        help="the box's price while running, USD/h (required to derive the rebuild cost; "
        "else shown for comparison)",
    )
    sd.add_argument(
        "--gap-hours",
        metavar="HOURS",
        help="the expected gap before the next run, hours: gives the verdict",
    )
    sd.add_argument(
        "--hours-per-month",
        metavar="HOURS",
        help="hours in a billing month (default 720, a 30-day month: it matches the measured "
        "stopped rate; 730 is the average month)",
    )
    pj = co.add_argument_group("per job", "required: --per-job, given once per box (two or more)")
    pj.add_argument(
        "--per-job",
        nargs=2,
        action="append",
        metavar=("SECONDS_PER_EPOCH", "USD_PER_HOUR"),
        help="which box is cheaper per job, from the seconds per epoch measured on it and "
        "its price",
    )
    pj.add_argument("--epochs", metavar="N", help="the job's epochs, for totals per job")
    co.add_argument("--json", action="store_true", help="print the figures as JSON")
    co.set_defaults(func=cmd_cost)


# ---------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="libreyolo-agent",
        description="Train LibreYOLO on a rented GPU box hands-off, from first boot to teardown.",
    )
    p.add_argument("--version", action="version", version=f"libreyolo-agent {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser(
        "run",
        help="run a job (no JOB: the embedded demo job)",
        # Raw text (for the epilog's table): the description carries its own line breaks.
        description="Run a job in the foreground, from preflight to teardown. With no JOB, run\n"
        "the embedded demo job: a synthetic dataset, a tiny model trained from scratch,\n"
        "checkpoints synced to a local folder, teardown 'none'.",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("job", nargs="?", help="job file (TOML); leave out for the demo job")
    r.add_argument(
        "--demo-dir",
        default=None,
        help=f"demo job only: the folder it puts everything in (default: {demo.DEMO_DIR})",
    )
    r.add_argument(
        "--port",
        type=int,
        default=None,
        help="demo job only: HTTP port of its status endpoint (default: a free one)",
    )
    r.add_argument("-v", "--verbose", action="store_true", help="log debug lines too")
    r.add_argument("--exit-codes", choices=("agent", "engine"), default="agent", help=exitcode.HELP)
    r.set_defaults(func=exitcode.wrap(cmd_run))

    pf = sub.add_parser(
        "preflight",
        help="check that this machine can train the job",
        description="Check this machine (GPUs, driver, CUDA, disk, the Hub) before anything is "
        "paid for in vain; with a JOB also what `run` proves before training: the sync "
        "target's canary and the guard's plan.",
        epilog="exit codes:\n  0  nothing failed\n  1  a check failed\n  2  the job file is "
        "bad (every mistake, one per line)\n",
        formatter_class=HelpFormatter,
    )
    pf.add_argument(
        "job",
        nargs="?",
        help="job file (TOML); leave out to check the machine alone (every GPU must work)",
    )
    pf.add_argument("--json", action="store_true", help="print every check as JSON")
    pf.set_defaults(func=cmd_preflight)

    c = sub.add_parser(
        "check",
        help="validate a job file (every mistake, one per line; exit 2) and say what to rent",
        description="Validate a job file: every mistake, one per line, exit 2. A valid one gets "
        "what to rent: the disk (the dataset's archive and unpacked copy, from the Hub's "
        "listing; the checkpoints the job keeps; the install; plus 30 %) and which of the "
        "teardown's variables this environment holds (names only). Needs no torch.",
        epilog="exit codes:\n  0  valid\n  2  invalid (every mistake, one per line; a misspelt "
        "section or option is given its closest name)\n",
        formatter_class=HelpFormatter,
    )
    c.add_argument("job", help="job file (TOML)")
    c.add_argument("--json", action="store_true", help="print the verdict and the estimate as JSON")
    c.add_argument(
        "--offline", action="store_true", help="do not ask the Hub for the dataset's size"
    )
    c.set_defaults(func=cmd_check)

    from agent.supervise import DESCRIPTION, EPILOG, HELP, add_arguments

    sv = sub.add_parser(
        "supervise",
        help=HELP,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    add_arguments(sv)
    sv.set_defaults(func=cmd_supervise)

    add_client_parsers(sub)  # status, stop, extend, hold, release, token: agent/client.py
    logs.add_parser(sub)
    from agent.data import pushcli

    pushcli.add_parser(sub, formatter=HelpFormatter, err=err)  # dataset push
    from agent.sync import verifycli

    verifycli.add_parser(sub, formatter=HelpFormatter, err=err)  # the restore drill

    add_cost_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args: argparse.Namespace | None = None
    try:
        try:
            args, extra = (parser := build_parser()).parse_known_args(argv)
            if extra:
                refuse_extra(parser, args.command, extra)  # exits 2, as parse_args would
            code: int = args.func(args)
        finally:
            # Written now, inside the handler below: at the interpreter's exit a closed pipe
            # would raise where nothing catches it (also after --help, which exits).
            sys.stdout.flush()
        return code
    except ConfigError as exc:
        for error in exc.errors:  # every mistake of the job file, one line each
            err(str(error))
        return EXIT_CONFIG
    except KeyboardInterrupt:
        # Ctrl-C is how a person ends `status --watch` (as `logs --follow`): a normal end.
        return EXIT_OK if getattr(args, "watch", False) else EXIT_FAIL
    except BrokenPipeError:
        # The reader went away (`status | head`): no traceback. Python's documented remedy:
        # stdout to /dev/null, so the flush at exit does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
