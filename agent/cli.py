"""Command line: argument parsing, exit codes, and the only place that prints for humans.

Exit codes of ``run``: 0 the job ended as planned (whatever the training outcome), 1 the agent
failed, 2 the job file is bad. ``preflight``: 0 nothing failed, 1 something failed, 2 bad job.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from . import __version__, logutil
from .config import ConfigError, Env, Job, load_job

EXIT_OK, EXIT_FAIL, EXIT_CONFIG = 0, 1, 2


def _err(message: str) -> None:
    print(f"libreyolo-agent: error: {message}", file=sys.stderr)


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("agent")
    for old in root.handlers:
        logutil.uninstall(old)
    root.handlers[:] = [handler]
    # Repeated warnings (an outage, a flood of accept errors) are rate-limited, not repeated.
    logutil.install(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


def _load(path: str) -> Job:
    return load_job(path)


# ---------------------------------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    from .daemon import AgentError, Daemon

    _setup_logging(args.verbose)
    stage_hook = None
    fresh_start = None
    demo_root: Path | None = None
    if args.job:
        job = _load(args.job)
        env = Env.from_environ()
    else:
        from . import demo

        demo_root = Path(args.demo_dir).resolve()
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

    daemon = Daemon(job, env, stage_hook=stage_hook, on_ready=_print_ready, fresh_start=fresh_start)
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


def _print_ready(daemon: Any) -> None:
    server = daemon.state.server or {}
    print(
        f"libreyolo-agent {__version__}: job {daemon.job.job.name!r}, status on "
        f"http://{server.get('host')}:{server.get('port')}/status, state in {daemon.env.state_dir}",
        file=sys.stderr,
    )


def _print_summary(daemon: Any, demo_root: Path | None) -> None:
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
        lines.append(f"teardown:   {st.teardown.get('detail') or st.teardown.get('action')}")
    lines.append(f"state dir:  {daemon.env.state_dir} (state.json, agent.log, trainer.log)")
    if demo_root:
        lines.append(f"demo data:  {demo_root / 'data'}")
    print("\n".join(lines))


# ---------------------------------------------------------------------------------- preflight


def cmd_preflight(args: argparse.Namespace) -> int:
    from .preflight import format_table, run_preflight

    job = _load(args.job) if args.job else None
    env = Env.from_environ()
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


# ------------------------------------------------------------------------------ status / stop


def _endpoint(args: argparse.Namespace) -> tuple[str, Path]:
    state_dir = Path(args.state_dir or Env.from_environ().state_dir)
    if args.url:
        return args.url.rstrip("/"), state_dir
    host, port = "127.0.0.1", 8421
    try:
        data = json.loads((state_dir / "state.json").read_text())
        server = data.get("server") or {}
        host, port = server.get("host", host), int(server.get("port", port))
    except (OSError, ValueError):
        pass
    return f"http://{host}:{port}", state_dir


def _http(method: str, url: str, token: str | None = None) -> dict[str, Any]:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        data: dict[str, Any] = json.loads(resp.read())
        return data


def _format_status(s: dict[str, Any]) -> str:
    epoch = f"{s.get('epoch')}/{s.get('total_epochs')}" if s.get("epoch") is not None else "-"
    eta = s.get("eta_seconds")
    sync = s.get("sync") or {}
    last = (sync.get("last_verified_checkpoint") or {}) if sync else {}
    rows = [
        ("job", s.get("job")),
        ("phase", s.get("phase")),
        ("reason", s.get("reason") or "-"),
        ("cause", s.get("cause") or "-"),
        ("epoch", epoch),
        ("eta", f"{eta:.0f}s" if isinstance(eta, int | float) else "-"),
        ("last synced epoch", s.get("last_synced_epoch")),
        ("last verified", f"{last.get('path')} (epoch {last.get('epoch')})" if last else "-"),
        ("upload queue", len(sync.get("queue", [])) if sync else "-"),
        ("run dir", s.get("run_dir") or "-"),
    ]
    return "\n".join(f"{k:<18} {v}" for k, v in rows)


def cmd_status(args: argparse.Namespace) -> int:
    base, _ = _endpoint(args)
    while True:
        try:
            s = _http("GET", f"{base}/status")
        except (urllib.error.URLError, OSError) as exc:
            _err(f"no agent answers on {base} ({exc}); is `libreyolo-agent run` running?")
            return EXIT_FAIL
        print(json.dumps(s, indent=2) if args.json else _format_status(s), flush=True)
        if not args.watch or s.get("phase") in ("DONE", "FAILED"):
            return EXIT_OK
        time.sleep(args.interval)
        if not args.json:
            print()


def cmd_stop(args: argparse.Namespace) -> int:
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
        answer = _http("POST", f"{base}/stop", token)
    except urllib.error.HTTPError as exc:
        _err(f"the agent refused: HTTP {exc.code}")
        return EXIT_FAIL
    except (urllib.error.URLError, OSError) as exc:
        _err(f"no agent answers on {base} ({exc})")
        return EXIT_FAIL
    print(answer.get("message", "stop requested"))
    return EXIT_OK


# ---------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="libreyolo-agent",
        description="Train LibreYOLO on a rented GPU box hands-off, from first boot to teardown.",
    )
    p.add_argument("--version", action="version", version=f"libreyolo-agent {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a job (no JOB: the embedded demo job)")
    r.add_argument("job", nargs="?", help="job file (TOML)")
    r.add_argument("--demo-dir", default="libreyolo-agent-demo", help="demo job's folder")
    r.add_argument("--port", type=int, default=None, help="demo job's HTTP port (default: free)")
    r.add_argument("-v", "--verbose", action="store_true")
    r.set_defaults(func=cmd_run)

    pf = sub.add_parser("preflight", help="check that this machine can train the job")
    pf.add_argument("job", nargs="?", help="job file (TOML)")
    pf.add_argument("--json", action="store_true", help="print every check as JSON")
    pf.set_defaults(func=cmd_preflight)

    c = sub.add_parser("check", help="validate a job file")
    c.add_argument("job")
    c.set_defaults(func=cmd_check)

    for name, func, text in (
        ("status", cmd_status, "show the running agent's status"),
        ("stop", cmd_stop, "stop the job: trainer gets SIGINT, final sync, teardown"),
    ):
        s = sub.add_parser(name, help=text)
        s.add_argument("--state-dir", help="agent state directory (default: env or /var/lib/...)")
        s.add_argument("--url", help="agent URL (default: read from the state directory)")
        if name == "status":
            s.add_argument("--json", action="store_true")
            s.add_argument("--watch", action="store_true", help="repeat until the job ends")
            s.add_argument("--interval", type=float, default=5.0)
        s.set_defaults(func=func)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
