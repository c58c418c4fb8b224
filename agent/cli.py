"""Command line: argument parsing, exit codes, and the only place that prints for humans.

Exit codes of ``run``: 0 the job ended as planned (whatever the training outcome), 1 the agent
failed, 2 the job file is bad (or a demo-only option came with one). ``preflight``: 0 nothing
failed, 1 something failed, 2 bad job. A bad job file is reported whole: every mistake, one line
each.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__, demo, logutil
from .config import ConfigError, Env, Job, ServerSection
from .jobfile import load_job
from .state import RunState, StateStore

if TYPE_CHECKING:
    from .daemon import Daemon

EXIT_OK, EXIT_FAIL, EXIT_CONFIG = 0, 1, 2

RUN_EPILOG = """\
exit codes:
  0  the job ended as planned (whatever the training outcome)
  1  the agent failed (the cause is printed; details in agent.log in the state directory)
  2  the job file is bad (every mistake is printed, one per line), or an option does not
     apply to it

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


def _err(message: str) -> None:
    print(f"libreyolo-agent: error: {message}", file=sys.stderr)


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
    refused = _demo_only_options(args)
    for message in refused:
        _err(message)
    if refused:
        return EXIT_CONFIG

    try:
        from . import hub  # noqa: F401 (refuses a too old huggingface_hub, with the fix)
        from .daemon import AgentError, Daemon
    except ImportError as exc:
        _err(str(exc))
        return EXIT_FAIL

    _setup_logging(args.verbose)
    stage_hook = None
    fresh_start = None
    demo_root: Path | None = None
    if args.job:
        job = _load(args.job)
        env = Env.from_environ()
        from . import guardplan

        guardplan.check_environ()  # a typo in the guard's variables is exit 2, not a crash
    else:
        demo_root = Path(args.demo_dir or demo.DEMO_DIR).resolve()
        job = demo.demo_job(demo_root, port=args.port if args.port is not None else 0)
        # The demo's state lives in its own folder, whatever LIBREYOLO_AGENT_STATE_DIR says:
        # that variable names a real job's state, which the demo must never touch.
        environ = dict(os.environ, LIBREYOLO_AGENT_STATE_DIR=str(demo_root / "state"))
        env = Env.from_environ(environ)
        data_root = demo_root / "data"
        print(f"demo job: everything goes under {demo_root}", file=sys.stderr)

        def stage_hook() -> None:
            demo.make_dataset(data_root)

        def fresh_start() -> None:
            # Runs once the demo holds its state directory's lock: never under a running agent.
            demo.reset(demo_root)

    daemon = Daemon(
        job,
        env,
        stage_hook=stage_hook,
        on_ready=_print_ready,
        fresh_start=fresh_start,
        start_guard=bool(args.job),
    )
    try:
        code = asyncio.run(daemon.run())
    except AgentError as exc:
        _err(str(exc))
        return EXIT_FAIL
    except Exception as exc:
        # A bug, not a user mistake: keep the traceback in agent.log, one line here. The state
        # file is left as it was, so a restarted agent (systemd Restart=on-failure) carries on.
        _err(f"the agent crashed: {type(exc).__name__}: {exc} (traceback in agent.log)")
        return EXIT_FAIL
    _print_summary(daemon, demo_root)
    return code


def _print_ready(daemon: Daemon) -> None:
    server = daemon.state.server or {}
    print(
        f"libreyolo-agent {__version__}: job {daemon.job.job.name!r}, status on "
        f"http://{server.get('host')}:{server.get('port')}/status, state in {daemon.env.state_dir}",
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


def _teardown_line(teardown: dict[str, Any] | None) -> str:
    if not teardown:
        return "-"
    return str(teardown.get("detail") or teardown.get("action") or "-")


# ---------------------------------------------------------------------------------- preflight


def cmd_preflight(args: argparse.Namespace) -> int:
    try:
        from . import hub
        from .preflight import format_table, run_preflight
    except ImportError as exc:
        _err(str(exc))
        return EXIT_FAIL

    job = _load(args.job) if args.job else None
    env = Env.from_environ()
    hub.configure(env)
    report = asyncio.run(run_preflight(job, env))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_table(report))
    return EXIT_OK if report.ok else EXIT_FAIL


def cmd_check(args: argparse.Namespace) -> int:
    from .trainargs import installed_train_options

    job = _load(args.job)
    env = Env.from_environ()
    sync = job.sync.target if job.sync else "none"
    options = installed_train_options()  # the one _load checked against (cached)
    checked = f"checked against {options.label}" if options.available else "not checked"
    print(
        f"{args.job}: ok (job {job.job.name!r}, {len(job.train.args)} train options "
        f"{checked}, sync {sync}, teardown {job.teardown.provider}, state dir {env.state_dir})"
    )
    if not options.available:
        print(f"note: [train] keys not checked against LibreYOLO: {options.reason}")
    return EXIT_OK


# ---------------------------------------------------------------------------------- supervise


def cmd_supervise(args: argparse.Namespace) -> int:
    from . import supervisor

    policy = supervisor.Policy.from_options(  # ConfigError: one line each, exit 2 (main)
        args.max_restarts, args.first_backoff, args.max_backoff, args.min_uptime
    )
    job = Path(args.job).absolute()
    _load(str(job))  # a bad job file is exit 2 here, before anything starts
    _setup_logging(args.verbose)
    state_dir = Env.from_environ().state_dir
    argv = supervisor.agent_argv(job, verbose=args.verbose)
    log_path = Path(args.log) if args.log else None
    try:
        return asyncio.run(
            supervisor.Supervisor(argv, state_dir, log_path=log_path, policy=policy).run()
        )
    except supervisor.AlreadySupervised as exc:
        _err(f"a supervisor (pid {exc.holder}) already runs on the state directory {state_dir}")
        return EXIT_FAIL
    except OSError as exc:
        _err(f"cannot supervise in {state_dir}: {exc.strerror or exc}")
        return EXIT_FAIL


# ------------------------------------------------------------------- status / stop / steering


def _read_state(state_dir: Path) -> RunState | None:
    """The state file of the agent that runs, or ran, in ``state_dir``; None when there is
    none or it cannot be read."""
    try:
        return StateStore(state_dir).load()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _endpoint(args: argparse.Namespace) -> tuple[str, Path]:
    state_dir = Path(args.state_dir or Env.from_environ().state_dir)
    if args.url:
        return args.url.rstrip("/"), state_dir
    default = ServerSection()
    host, port = default.host, default.port
    record = _read_state(state_dir)
    if record is not None and isinstance(record.server, dict):
        host = str(record.server.get("host", host))
        with contextlib.suppress(TypeError, ValueError):
            port = int(record.server.get("port", port))
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"http://{host}:{port}", state_dir


def _http(method: str, url: str, token: str | None = None, body: bytes = b"") -> dict[str, Any]:
    req = urllib.request.Request(url, method=method, data=body if method == "POST" else None)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if body:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=10) as resp:
        data: dict[str, Any] = json.loads(resp.read())
        return data


def _unreachable(exc: OSError) -> str:
    """Why nothing answered, in a few words: ``connection refused``, ``timed out``."""
    reason: object = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, TimeoutError):
        return "timed out"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return str(reason) or type(reason).__name__


def _ended_report(record: RunState | None, state_dir: Path) -> dict[str, Any] | None:
    """The post-mortem (report.json) of the job the state file describes, when it has ended;
    with no state file, whatever report.json is there. None when there is none, or when it is
    an older run's (the state file was removed and the job started again)."""
    from . import report

    found = report.load(state_dir)
    if found is None or record is None:
        return found
    if not record.phase.terminal or found.get("started_at") != record.started_at:
        return None
    return found


def _print_ended(args: argparse.Namespace, state_dir: Path) -> bool:
    """Print the record of the ended job in ``state_dir`` (report.json, else state.json's
    verdict); False when there is none (the job has not ended, or nothing is there)."""
    from . import report, statusfmt

    record = _read_state(state_dir)
    found = _ended_report(record, state_dir)
    if found is not None and not (args.json and record is not None):
        source = str(state_dir / report.JSON_NAME)
        text = statusfmt.report_summary(found, source)
        print(json.dumps(found, indent=2) if args.json else text, flush=True)
        return True
    if record is not None and record.phase.terminal:
        d = statusfmt.ended_record(record, StateStore(state_dir).state_path)
        print(json.dumps(d, indent=2) if args.json else statusfmt.format_ended(d), flush=True)
        return True
    return False


def _status_without_agent(
    args: argparse.Namespace, base: str, state_dir: Path, exc: OSError
) -> int:
    # With --url alone the local state directory may belong to another agent: not asked then.
    asked = bool(args.state_dir or not args.url)
    if asked and _print_ended(args, state_dir):
        return EXIT_OK
    record = _read_state(state_dir) if asked else None
    path = StateStore(state_dir).state_path
    why = _unreachable(exc)
    if record is not None:
        _err(
            f"no agent is running for job {record.job_name!r} (nothing answers on {base}: "
            f"{why}), but its state file {path} says {record.phase.value}: the job has not "
            "ended; start the agent again (libreyolo-agent run JOB.toml) to carry on"
        )
    elif asked:
        _err(
            f"no agent is running (nothing answers on {base}: {why}) and {state_dir} has no "
            "readable state.json; start one with libreyolo-agent run, or pass --state-dir or "
            "--url"
        )
    else:
        _err(f"no agent answers on {base} ({why}); is --url right?")
    return EXIT_FAIL


def _get_status(base: str) -> dict[str, Any] | int | OSError:
    """``GET /status``: the document; an exit code after printing why it is unusable; or the
    error when nothing answers."""
    try:
        return _http("GET", f"{base}/status")
    except urllib.error.HTTPError as exc:
        _err(f"the agent on {base} answered HTTP {exc.code} to GET /status")
        return EXIT_FAIL
    except (urllib.error.URLError, OSError) as exc:
        # The job ended (the agent exits then) or the agent is down: the state file says.
        return exc
    except ValueError:
        _err(f"{base} answered GET /status, but not with libreyolo-agent's JSON; check --url")
        return EXIT_FAIL


def _fancy_terminal() -> bool:
    """Redraw in place only on a real terminal that understands ANSI escapes."""
    return sys.stdout.isatty() and os.environ.get("TERM", "dumb") not in ("dumb", "")


def cmd_status(args: argparse.Namespace) -> int:
    from . import statusfmt

    base, state_dir = _endpoint(args)
    if args.watch and not args.json:
        return _watch(args, base, state_dir)
    while True:
        got = _get_status(base)
        if isinstance(got, int):
            return got
        if isinstance(got, OSError):
            return _status_without_agent(args, base, state_dir, got)
        s = got
        print(
            json.dumps(s, indent=2) if args.json else statusfmt.summary(s, time.time()),
            flush=True,
        )
        if not args.watch or s.get("phase") in ("DONE", "FAILED"):
            return EXIT_OK
        time.sleep(args.interval)


def _watch(args: argparse.Namespace, base: str, state_dir: Path) -> int:
    """``status --watch``: the summary redrawn in place on a terminal (one plain line per change
    on a pipe or a dumb terminal) until the job ends or its agent goes away, then the ended
    job's record (report.json, else state.json), else the last summary read."""
    from . import statusfmt

    view = statusfmt.WatchView(
        fancy=_fancy_terminal(), width=shutil.get_terminal_size().columns - 1
    )
    last: dict[str, Any] | None = None
    while True:
        got = _get_status(base)
        if isinstance(got, int):
            return got
        if isinstance(got, OSError) or got.get("phase") in ("DONE", "FAILED"):
            break
        last = got
        sys.stdout.write(view.frame(got, time.time()))
        sys.stdout.flush()
        time.sleep(args.interval)
    sys.stdout.write(view.erase())  # the final record replaces the live summary
    asked = bool(args.state_dir or not args.url)
    if asked and _print_ended(args, state_dir):
        return EXIT_OK
    if isinstance(got, dict):  # ended, as the agent said; no record here (a remote --url)
        print(statusfmt.summary(got, time.time()), flush=True)
        return EXIT_OK
    if last is not None and not asked:
        print(statusfmt.summary(last, time.time()), flush=True)
        _err(f"the agent on {base} stopped answering ({_unreachable(got)}) before the job ended")
        return EXIT_FAIL
    return _status_without_agent(args, base, state_dir, got)


def _refusal(exc: urllib.error.HTTPError, path: str) -> str:
    """What the agent said when it refused a control request: its own message when it gave one
    (a steering error, a missing token), else the HTTP status."""
    try:
        answer = json.loads(exc.read())
    except (OSError, ValueError):
        answer = None
    if isinstance(answer, dict):
        said = answer.get("message") or answer.get("error")
        if isinstance(said, str) and said:
            return said
    if exc.code in (404, 405):
        return (
            f"the agent has no POST {path} (HTTP {exc.code}): it is an older version; upgrade "
            "it, or check --url"
        )
    return f"the agent refused: HTTP {exc.code}"


def _post_action(args: argparse.Namespace, name: str, body: str = "") -> int:
    """``POST /<name>`` with the token from the state directory; prints the agent's answer."""
    base, state_dir = _endpoint(args)
    try:
        token = (state_dir / "token").read_text().strip()
    except OSError as exc:
        _err(
            f"cannot read the control token in {state_dir} ({exc.strerror}); run as the agent's "
            "user or pass --state-dir"
        )
        return EXIT_FAIL
    try:
        answer = _http("POST", f"{base}/{name}", token, body.encode())
    except urllib.error.HTTPError as exc:
        _err(_refusal(exc, f"/{name}"))
        return EXIT_FAIL
    except (urllib.error.URLError, OSError) as exc:
        _err(f"no agent answers on {base} ({_unreachable(exc)})")
        return EXIT_FAIL
    except ValueError:
        _err(f"{base} answered POST /{name}, but not with libreyolo-agent's JSON; check --url")
        return EXIT_FAIL
    print(answer.get("message", f"{name} requested"))
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    return _post_action(args, "stop")


def _duration_body(text: str | None) -> str | None:
    """The JSON body carrying ``text`` as the duration ("" for none), after checking it here
    first (the agent checks again): None, with the mistake printed, when it is not one."""
    from .steering import SteeringError, parse_request_duration

    if text is None:
        return ""
    try:
        parse_request_duration(text)
    except SteeringError as exc:
        _err(str(exc))
        return None
    return json.dumps({"duration": text.strip()})


def cmd_extend(args: argparse.Namespace) -> int:
    body = _duration_body(args.duration)
    return EXIT_CONFIG if body is None else _post_action(args, "extend", body)


def cmd_hold(args: argparse.Namespace) -> int:
    body = _duration_body(args.duration)
    return EXIT_CONFIG if body is None else _post_action(args, "hold", body)


def cmd_release(args: argparse.Namespace) -> int:
    return _post_action(args, "release")


# ---------------------------------------------------------------------------------------- cost


def cmd_cost(args: argparse.Namespace) -> int:
    from . import cost

    if args.per_job:
        boxes, epochs = cost.parse_per_job(args.per_job, args.epochs)
        per_job = cost.compare_per_job(boxes, epochs)  # ConfigError: one line, exit 2 (main)
        print(
            json.dumps(per_job.to_dict(), indent=2) if args.json else cost.format_per_job(per_job)
        )
        return EXIT_OK
    names = ("disk_gb", "storage_usd_per_gb_month", "rebuild_usd", "running_usd_per_hour")
    raw = {name: getattr(args, name) for name in (*names, "gap_hours", "hours_per_month")}
    report = cost.compute(cost.parse_inputs(raw))  # ConfigError: one line, exit 2 (main)
    print(json.dumps(report.to_dict(), indent=2) if args.json else cost.format_report(report))
    return EXIT_OK


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
    r.set_defaults(func=cmd_run)

    pf = sub.add_parser("preflight", help="check that this machine can train the job")
    pf.add_argument(
        "job",
        nargs="?",
        help="job file (TOML); leave out to check the machine alone (every GPU must work)",
    )
    pf.add_argument("--json", action="store_true", help="print every check as JSON")
    pf.set_defaults(func=cmd_preflight)

    c = sub.add_parser("check", help="validate a job file (every mistake, one per line; exit 2)")
    c.add_argument("job", help="job file (TOML)")
    c.set_defaults(func=cmd_check)

    sv = sub.add_parser(
        "supervise",
        help="run the agent, restarting it when it fails (containers without systemd)",
        description="Run `libreyolo-agent run JOB`; start it again, after a backoff, when it "
        "fails or is killed, not after exit 0 (the job ended) or 2 (bad job file). Exit 0 the "
        "job ended or SIGTERM/SIGINT (passed on to the agent), 1 gave up or another supervisor "
        "runs, 2 bad job file. Files: supervisor.pid, supervisor.json in the state directory.",
    )
    sv.add_argument("job", help="job file (TOML)")
    sv.add_argument(
        "--log",
        metavar="FILE",
        help="append the agent's output here (default: supervisor.log in the state directory)",
    )
    for flag, kind, default, text in (
        ("--max-restarts", int, 10, "give up after N restarts in a row (none up --min-uptime)"),
        ("--first-backoff", float, 5.0, "seconds before the first restart; doubles each time"),
        ("--max-backoff", float, 300.0, "the longest wait before a restart, seconds"),
        ("--min-uptime", float, 60.0, "seconds up that reset the count of restarts in a row"),
    ):
        sv.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default:g})")
    sv.add_argument("-v", "--verbose", action="store_true", help="log debug lines too")
    sv.set_defaults(func=cmd_supervise)

    for name, func, text in (
        ("status", cmd_status, "show the running agent's status (or an ended job's record)"),
        ("stop", cmd_stop, "stop the job: trainer gets SIGINT, final sync, teardown"),
        ("extend", cmd_extend, "move the job's max_runtime deadline later"),
        (
            "hold",
            cmd_hold,
            "keep the box up after the run (phase HELD, nothing torn down) until release or "
            "the hold's timeout",
        ),
        ("release", cmd_release, "end the hold: the teardown goes ahead"),
    ):
        s = sub.add_parser(name, help=text)
        s.add_argument(
            "--state-dir",
            help="agent state directory (default: $LIBREYOLO_AGENT_STATE_DIR, else "
            "/var/lib/libreyolo-agent)",
        )
        s.add_argument("--url", help="agent URL (default: read from the state directory)")
        if name == "extend":
            s.add_argument(
                "duration",
                metavar="DURATION",
                help='how much later, e.g. "2h", "90m", "1h30m" or seconds (at most 30 days)',
            )
        elif name == "hold":
            s.add_argument(
                "duration",
                metavar="DURATION",
                nargs="?",
                help="how long the hold lasts, from now (default: the job's "
                "teardown.hold_timeout, 12h unless set; at most 30 days)",
            )
        if name == "status":
            s.add_argument("--json", action="store_true", help="print the status as JSON")
            s.add_argument(
                "--watch",
                action="store_true",
                help="redraw a progress summary until the job ends (one line per change on a "
                "pipe or a dumb terminal), then print the ended job's record",
            )
            s.add_argument(
                "--interval",
                type=float,
                default=2.0,
                help="seconds between two reads with --watch (default: 2)",
            )
        s.set_defaults(func=func)

    # Values are read as text and checked by agent/cost.py: a mistake is one line, exit 2.
    co = sub.add_parser(
        "cost",
        help="stop or destroy the box after a run: which is cheaper for a gap",
        description="What a stopped box costs (its disk: GB x $/GB-month / hours per month), "
        "the gap at which that equals the cost of destroying it and rebuilding, and, with "
        "--gap-hours, the verdict. Exit 2 on a bad value.",
    )
    co.add_argument(
        "--disk-gb", metavar="GB", help="the box's allocated disk, GB (required; e.g. 250)"
    )
    co.add_argument(
        "--storage-usd-per-gb-month",
        metavar="USD",
        help="the provider's storage price, USD per GB per month (required; e.g. 0.20)",
    )
    co.add_argument(
        "--rebuild-usd",
        metavar="USD",
        help="what destroying and coming back costs: setup time at the running price plus "
        "the dataset's inbound transfer, USD (required; e.g. 1.00)",
    )
    co.add_argument(
        "--running-usd-per-hour",
        metavar="USD",
        help="the box's price while running, USD/h (for comparison)",
    )
    co.add_argument(
        "--gap-hours",
        metavar="HOURS",
        help="the expected gap before the next run, hours: gives the verdict",
    )
    co.add_argument(
        "--hours-per-month",
        metavar="HOURS",
        help="hours in a billing month (default 720, a 30-day month: it matches the measured "
        "stopped rate; 730 is the average month)",
    )
    co.add_argument(
        "--per-job",
        nargs=2,
        action="append",
        metavar=("SECONDS_PER_EPOCH", "USD_PER_HOUR"),
        help="instead: which box is cheaper per job, from the seconds per epoch measured on "
        "it and its price; give it once per box (two or more)",
    )
    co.add_argument(
        "--epochs", metavar="N", help="with --per-job: the job's epochs, for totals per job"
    )
    co.add_argument("--json", action="store_true", help="print the figures as JSON")
    co.set_defaults(func=cmd_cost)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except ConfigError as exc:
        for error in exc.errors:  # every mistake of the job file, one line each
            _err(str(error))
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
