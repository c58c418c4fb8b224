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
    """One line on stderr, the CLI's way of saying what went wrong."""
    print(f"libreyolo-agent: error: {message}", file=sys.stderr)


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
        from agent.policy.teardown import is_open, open_words

        open_td = (
            f"; its teardown is {open_words(record.teardown or {})}"
            if is_open(record.teardown)
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
    from agent.policy.teardown import is_open

    return EXIT_TEARDOWN_OPEN if record is not None and is_open(record.teardown) else EXIT_OK


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


def _post_action(args: argparse.Namespace, name: str, body: str = "") -> int:
    """``POST /<name>`` with the token from the state directory; prints the agent's answer."""
    base, state_dir = _endpoint(args)
    try:
        token = (state_dir / "token").read_text().strip()
    except OSError as exc:
        err(
            f"cannot read the control token in {state_dir} ({exc.strerror}); run as the agent's "
            "user or pass --state-dir"
        )
        return EXIT_FAIL
    try:
        answer = _http("POST", f"{base}/{name}", token, body.encode())
    except urllib.error.HTTPError as exc:
        err(_refusal(exc, f"/{name}"))
        return EXIT_FAIL
    except (urllib.error.URLError, OSError) as exc:
        err(f"no agent answers on {base} ({_unreachable(exc)})")
        return EXIT_FAIL
    except ValueError:
        err(f"{base} answered POST /{name}, but not with libreyolo-agent's JSON; check --url")
        return EXIT_FAIL
    print(answer.get("message", f"{name} requested"))
    return EXIT_OK


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
