"""The commands that talk to a running agent over its HTTP endpoint: ``status`` (and
``--watch``), ``stop``, ``extend``, ``hold``, ``release``. The address and the bearer token are
read from the state directory (or ``--url``); when no agent answers, ``status`` reads what the
last one left (report.json, state.json). Part of the CLI (agent/cli.py builds the parser)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from agent.config.model import Env, ServerSection
from agent.state import RunState, StateStore

#: Exit codes of every command: done, failed (or no agent answers), a bad input.
EXIT_OK, EXIT_FAIL, EXIT_CONFIG = 0, 1, 2
#: ``status``: a teardown was decided and the provider has not confirmed it: the box may still
#: bill (the same number as the agent's own exit with its teardown open).
EXIT_TEARDOWN_OPEN = 3


def err(message: str) -> None:
    """One line on stderr, the CLI's way of saying what went wrong; under systemd with the
    syslog priority of an error (``<3>``), so ``journalctl -p err`` finds it."""
    from agent.util.logutil import syslog_prefix

    print(f"{syslog_prefix(3)}libreyolo-agent: error: {message}", file=sys.stderr)


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
    from agent.status import report

    found = report.load(state_dir)
    if found is None or record is None:
        return found
    if not record.phase.terminal or found.get("started_at") != record.started_at:
        return None
    return found


def _print_ended(args: argparse.Namespace, state_dir: Path) -> bool:
    """Print the record of the ended job in ``state_dir`` (report.json, else state.json's
    verdict); False when there is none (the job has not ended, or nothing is there)."""
    from agent.status import report
    from agent.status import summary as statusfmt

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
        return _teardown_code(_read_state(state_dir))
    record = _read_state(state_dir) if asked else None
    path = StateStore(state_dir).state_path
    why = _unreachable(exc)
    if record is not None:
        from agent.policy.teardown import open_words
        from agent.state import teardown_open

        open_td = (
            f"; its teardown is {open_words(record.teardown or {})}"
            if teardown_open(record.teardown)
            else ""
        )
        err(
            f"no agent is running for job {record.job_name!r} (nothing answers on {base}: "
            f"{why}), but its state file {path} says {record.phase.value}: the job has not "
            f"ended{open_td}; start the agent again (libreyolo-agent run JOB.toml) to carry on"
        )
        return EXIT_TEARDOWN_OPEN if open_td else EXIT_FAIL
    elif asked:
        err(
            f"no agent is running (nothing answers on {base}: {why}) and {state_dir} has no "
            "readable state.json; start one with libreyolo-agent run, or pass --state-dir or "
            "--url"
        )
    else:
        err(f"no agent answers on {base} ({why}); is --url right?")
    return EXIT_FAIL


def _teardown_code(record: RunState | None) -> int:
    """``status``'s exit code for a job its state file describes: 3 while a teardown is open."""
    from agent.state import teardown_open

    return EXIT_TEARDOWN_OPEN if record is not None and teardown_open(record.teardown) else EXIT_OK


def _get_status(base: str) -> dict[str, Any] | int | OSError:
    """``GET /status``: the document; an exit code after printing why it is unusable; or the
    error when nothing answers."""
    try:
        return _http("GET", f"{base}/status")
    except urllib.error.HTTPError as exc:
        err(f"the agent on {base} answered HTTP {exc.code} to GET /status")
        return EXIT_FAIL
    except (urllib.error.URLError, OSError) as exc:
        # The job ended (the agent exits then) or the agent is down: the state file says.
        return exc
    except ValueError:
        err(f"{base} answered GET /status, but not with libreyolo-agent's JSON; check --url")
        return EXIT_FAIL


def _fancy_terminal() -> bool:
    """Redraw in place only on a real terminal that understands ANSI escapes."""
    return sys.stdout.isatty() and os.environ.get("TERM", "dumb") not in ("dumb", "")


def cmd_status(args: argparse.Namespace) -> int:
    from agent.status import summary as statusfmt

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
        if s.get("teardown_open") and "confirmed" in (s.get("teardown") or {}):
            err(f"the teardown is {s.get('teardown_warning')}: check the box at the provider")
        if not args.watch or s.get("phase") in ("DONE", "FAILED"):
            return EXIT_TEARDOWN_OPEN if s.get("teardown_open") else EXIT_OK
        time.sleep(args.interval)


def _watch(args: argparse.Namespace, base: str, state_dir: Path) -> int:
    """``status --watch``: the summary redrawn in place on a terminal (one plain line per change
    on a pipe or a dumb terminal) until the job ends or its agent goes away, then the ended
    job's record (report.json, else state.json), else the last summary read."""
    from agent.status import summary as statusfmt

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
        return _teardown_code(_read_state(state_dir))
    if isinstance(got, dict):  # ended, as the agent said; no record here (a remote --url)
        print(statusfmt.summary(got, time.time()), flush=True)
        return EXIT_OK
    if last is not None and not asked:
        print(statusfmt.summary(last, time.time()), flush=True)
        err(f"the agent on {base} stopped answering ({_unreachable(got)}) before the job ended")
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


def _read_token(state_dir: Path) -> str | None:
    """The control token the agent wrote in ``state_dir``; None, with why printed, when it
    cannot be read."""
    try:
        return (state_dir / "token").read_text().strip()
    except FileNotFoundError:
        # No agent ever started with this state directory (it writes the token first thing).
        err(
            f"no control token in {state_dir}: no agent has run with this state directory; pass "
            "--state-dir (or set LIBREYOLO_AGENT_STATE_DIR) to the one the agent uses"
        )
        return None
    except OSError as exc:
        err(
            f"cannot read the control token in {state_dir} ({exc.strerror}); run as the agent's "
            "user or pass --state-dir"
        )
        return None


def _refused(
    args: argparse.Namespace, name: str, why: str, code: int | None = None, *, said: bool = False
) -> int:
    """A control request that did not happen: one line on stderr, and with ``--json`` the
    same on stdout (``{"ok": false, "action": ..., "error": ...}``) so a script reads one
    document whatever happened. ``said``: the line is on stderr already."""
    if not said:
        err(why)
    if getattr(args, "json", False):
        doc: dict[str, Any] = {"ok": False, "action": name, "error": why}
        if code is not None:
            doc["http_status"] = code
        print(json.dumps(doc, indent=2))
    return EXIT_FAIL


def _post_action(args: argparse.Namespace, name: str, body: str = "") -> int:
    """``POST /<name>`` with the token from the state directory; prints the agent's answer
    (with ``--json``, the agent's JSON answer whole)."""
    base, state_dir = _endpoint(args)
    token = _read_token(state_dir)
    if token is None:
        return _refused(args, name, f"cannot read the control token in {state_dir}", said=True)
    try:
        answer = _http("POST", f"{base}/{name}", token, body.encode())
    except urllib.error.HTTPError as exc:
        return _refused(args, name, _refusal(exc, f"/{name}"), exc.code)
    except (urllib.error.URLError, OSError) as exc:
        return _refused(args, name, _no_agent_for(args, name, base, state_dir, exc))
    except ValueError:
        why = f"{base} answered POST /{name}, but not with libreyolo-agent's JSON; check --url"
        return _refused(args, name, why)
    if getattr(args, "json", False):
        print(json.dumps({"ok": True, "action": name, **answer}, indent=2))
    else:
        print(answer.get("message", f"{name} requested"))
    return EXIT_OK


def _no_agent_for(
    args: argparse.Namespace, name: str, base: str, state_dir: Path, exc: OSError
) -> str:
    """Why ``name`` could not be asked: the job ended (state.json says so: nothing to ask),
    or no agent runs for a job that has not ended; with ``--url`` alone, only the address."""
    why = f"no agent answers on {base} ({_unreachable(exc)})"
    record = _read_state(state_dir) if (args.state_dir or not args.url) else None
    if record is None:
        return why
    if record.phase.terminal:
        reason = f", reason {record.reason.value}" if record.reason else ""
        return (
            f"job {record.job_name!r} has ended ({record.phase.value}{reason}): no agent to "
            f"{name}; `libreyolo-agent status` shows its record"
        )
    return (
        f"{why}; job {record.job_name!r} is {record.phase.value} in {state_dir}: start its "
        "agent again (libreyolo-agent run JOB.toml), then ask again"
    )


def cmd_stop(args: argparse.Namespace) -> int:
    return _post_action(args, "stop")


def _duration_body(text: str | None) -> str | None:
    """The JSON body carrying ``text`` as the duration ("" for none), after checking it here
    first (the agent checks again): None, with the mistake printed, when it is not one."""
    from agent.policy.steering import SteeringError, parse_request_duration

    if text is None:
        return ""
    try:
        parse_request_duration(text)
    except SteeringError as exc:
        err(str(exc))
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


def cmd_token(args: argparse.Namespace) -> int:
    """``token``: the control token of the agent in the state directory, on one line (for a
    script: ``curl -H "Authorization: Bearer $(libreyolo-agent token)"``); with ``--login-url``
    the page's address carrying it in its fragment (``http://localhost:8421/#token=...``: the
    page keeps it and drops it from the address bar; a fragment never reaches a server)."""
    from urllib.parse import quote

    state_dir = Path(args.state_dir or Env.from_environ().state_dir)
    token = _read_token(state_dir)
    if token is None:
        return EXIT_FAIL
    if not token:
        err(f"the control token file in {state_dir} is empty; start the agent (it writes one)")
        return EXIT_FAIL
    if not args.login_url:
        print(token)
        return EXIT_OK
    print(f"{login_base(_read_state(state_dir))}/#token={quote(token, safe='')}")
    return EXIT_OK


def login_base(record: RunState | None) -> str:
    """The page's address as the person opens it: through the SSH tunnel the README gives
    (``-L 8421:127.0.0.1:8421``) a loopback or wildcard listen address is ``localhost`` on
    their machine; any other is shown as it is. The port is the one the agent listens on."""
    default = ServerSection()
    host, port = default.host, default.port
    if record is not None and isinstance(record.server, dict):
        host = str(record.server.get("host", host))
        with contextlib.suppress(TypeError, ValueError):
            port = int(record.server.get("port", port))
    if host in ("127.0.0.1", "::1", "0.0.0.0", "::", "localhost", ""):
        host = "localhost"
    elif ":" in host:  # IPv6
        host = f"[{host}]"
    return f"http://{host}:{port}"


# ------------------------------------------------------------------------------ the parsers


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions and epilogs wrapped line by line: a paragraph is filled to the terminal's
    width, and the line breaks written into the text stay (an exit code per line, its
    continuation indented under its words)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        lines = []
        for line in text.splitlines():
            words = line.lstrip()
            lead = indent + line[: len(line) - len(words)]
            more = lead + ("   " if lead != indent else "")
            fill = textwrap.fill(words, width, initial_indent=lead, subsequent_indent=more)
            lines.append(fill if words else "")
        return "\n".join(lines)


_STATE_DIR_HELP = (
    "agent state directory (default: $LIBREYOLO_AGENT_STATE_DIR, else /var/lib/libreyolo-agent)"
)
_REFUSED = "the agent refused (its reason printed as it says it) or no agent answers"
_JSON_HELP = (
    'print the agent\'s answer as JSON ({"ok": true, "action": ..., ...}); a refusal too '
    '({"ok": false, "error": ...}, also on stderr)'
)
#: Each command that talks to the agent: its one-line help, its description, its exit codes.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "status": (
        "show the running agent's status (or an ended job's record)",
        "Ask the running agent (its address read from the state directory) for its status: "
        "phase, epoch, ETA, last synced checkpoint, money, deadline, and the teardown: the plan "
        "before the decision, the decision after. Once the job has ended (no agent answers), "
        "the record it left: report.json, else state.json.",
        "  0  shown (also the record of an ended job)\n"
        "  1  no agent answers and the job has not ended\n"
        "  3  a teardown was decided and the provider has not confirmed it: the box may still "
        "bill",
    ),
    "stop": (
        "stop the job: trainer gets SIGINT, final sync, teardown",
        "Stop the job (not the agent): the trainer gets SIGINT (LibreYOLO's clean stop), then "
        "SIGTERM, then SIGKILL, each after a grace period; then the final sync and teardown. "
        "While HELD it releases the hold. Refused where it cannot act (a stop under way, "
        "training over). POST /stop.",
        f"  0  requested\n  1  {_REFUSED}",
    ),
    "extend": (
        "move the job's max_runtime deadline later",
        "Move the job's max_runtime deadline later (the extensions of a run add up to at "
        "most 30 days); refused once training is over, once a stop is under way, or when the "
        "job has no max_runtime. POST /extend.",
        f"  0  extended (the new deadline printed)\n  1  {_REFUSED}\n  2  not a duration",
    ),
    "hold": (
        "keep the box up after the run (phase HELD, nothing torn down) until release or the "
        "hold's timeout",
        "Keep the box up after the run: phase HELD, nothing torn down, until `release` or the "
        "hold's own timeout; a second hold renews it; refused once the teardown is decided. "
        "POST /hold.",
        f"  0  held\n  1  {_REFUSED}\n  2  not a duration",
    ),
    "release": (
        "end the hold: the teardown goes ahead",
        "End the hold: the teardown goes ahead (at once when HELD). POST /release.",
        f"  0  released\n  1  {_REFUSED} (also: nothing is held)",
    ),
}


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``status``, ``stop``, ``extend``, ``hold``, ``release`` and ``token`` on the CLI's
    subparsers."""
    funcs = {
        "status": cmd_status,
        "stop": cmd_stop,
        "extend": cmd_extend,
        "hold": cmd_hold,
        "release": cmd_release,
    }
    for name, (text, description, codes) in COMMANDS.items():
        s = sub.add_parser(
            name,
            help=text,
            description=description,
            epilog=f"exit codes:\n{codes}\n",
            formatter_class=HelpFormatter,
        )
        s.add_argument("--state-dir", help=_STATE_DIR_HELP)
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
        else:
            s.add_argument("--json", action="store_true", help=_JSON_HELP)
        s.set_defaults(func=funcs[name])

    t = sub.add_parser(
        "token",
        help="print the control token (or a login URL for the page)",
        description="Print the control token the agent wrote in its state directory (the file "
        "`token`, readable by the agent's user only): the page's controls and the API's POSTs "
        "need it. With --login-url, the page's address carrying it "
        "(http://localhost:8421/#token=...): opened once, the page keeps the token, so it need "
        "not be pasted after every reload. Both are secrets: anyone with them can stop the job.",
        epilog="exit codes:\n  0  printed\n  1  no token readable in the state directory "
        "(wrong --state-dir, another user, or the agent never started)\n",
        formatter_class=HelpFormatter,
    )
    t.add_argument("--state-dir", help=_STATE_DIR_HELP)
    t.add_argument(
        "--login-url",
        action="store_true",
        help="print http://localhost:PORT/#token=TOKEN (the port the agent listens on) instead",
    )
    t.set_defaults(func=cmd_token)


def refuse_extra(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> None:
    """What ``parse_args`` says of arguments nothing takes, but in the command's own usage, and
    with the fix where one looks like a job file given to a command that reads the state
    directory (``status job.toml``). Exits 2."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    command_parser = commands.get(command, parser)
    message = f"unrecognized arguments: {' '.join(extra)}"
    takes_job = any(a.dest == "job" for a in command_parser._actions)
    if any(word.endswith(".toml") for word in extra) and not takes_job:
        message += (
            f"; `{command}` takes no job file: it reads the agent's state directory "
            "(--state-dir DIR; default $LIBREYOLO_AGENT_STATE_DIR, else /var/lib/libreyolo-agent)"
        )
    command_parser.error(message)
