"""Trainer exit -> the teardown call arriving at the provider (issue 26 item 3; goal < 0.3 s when
nothing is left to upload).

    .venv/bin/python bench/exit_teardown.py [--runs 5] [--target file|hf] [--epochs 3]
        [--epoch-s 0.3] [--ckpt-kb 1000] [--timeline]

Each run is a whole small job: the real Daemon in-process, the scripted trainer
(tests/fakes/scripted_trainer.py, a real process through the real launcher and its pidfd wait),
checkpoints synced every epoch to a folder (``file://``) or to the fake Hub (tests/fakes/hub.py,
the real huggingface_hub client over loopback, ``hf://``), and ``[teardown] provider = "vast"``
against the fake Vast API (tests/fakes/providers.py, 127.0.0.1, a per-instance key). The job
completes, its sync is verified, so the decision is a destroy: the fake's ``DELETE`` is the end.
``require_restore_drill = false``: the scripted trainer's checkpoints are bytes, not models, so
a drill would fail them and turn the destroy into a stop. With the drill on (the default), a
destroy waits for it as well: one child that imports torch and LibreYOLO and loads the final
checkpoints, seconds not milliseconds (docs/restore-drill.md measures it); it is a step that
must stay, as the final sync's read-back is.

The breakdown, per run, each step from the end of the one before:

- exit: the trainer process gone (its pidfd became readable, watched by a thread of this bench);
- noticed: the agent's ``trainer pid=N exited`` line (its own pidfd wait fired);
- acted: ``trainer outcome: ...`` (the supervision loop has left its turn and read the run);
- final sync: ``sync verified: ...`` (the last queue drained, then the read-back of what changed
  since its last verification: read back N, trusted M);
- decision: ``teardown decision: ...``;
- provider read: the fake's ``GET /instances/ID/`` (the instance identified for the record);
- report: the last ``report.md``/``report.json`` upload entered the sink (the post-mortem report
  leaves the box before a destroy may take it) and the notices flushed; then
- DELETE: the fake's ``DELETE /instances/ID/`` arrived (its read-back first, then the call).

Times are the log records' own ``created`` (a handler on the ``agent`` logger, the same records
agent.log gets, at full precision) and the fake's request times; both are this machine's clock.
p50 and max over the runs, and the ratio of the whole to the goal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import select
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
os.environ.setdefault("no_proxy", "127.0.0.1,localhost")
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_XET"] = "1"

GOAL_S = 0.3
VERIFIED = re.compile(r"\((\d+) read back now, (\d+) verified earlier")
KEY = "vast-instance-key-bench-0123456789"
INSTANCE = "4321"
HF_TOKEN = "hf_bench_token"
HF_REPO = "bench-user/exit-teardown"

#: The steps, each ended by a mark: (name, what ends it, the coarse step it belongs to).
STEPS = (
    ("noticed", "the agent's `trainer pid=N exited` line", "exit noticed"),
    ("acted", "`trainer outcome: ...` (the loop left, the run read)", "exit noticed"),
    ("queued", "FINISHING's `final sync: N file(s) queued`", "final sync"),
    ("drained", "its last `uploaded+verified` (the agent's files)", "final sync"),
    ("verified", "`sync verified: ...` (the read-back of what changed)", "final sync"),
    ("decision", "`teardown decision: ...`", "decision"),
    ("provider read", "the instance read answered (`provider: ... reads`)", "provider read"),
    ("report written", "report.json + report.md built and written", "report"),
    ("report sent", "the report's last `uploaded+verified`", "report"),
    ("DELETE", "the fake's DELETE arrived", "DELETE"),
)
ORDER = tuple(step for step, _, _ in STEPS)
COARSE = ("exit noticed", "final sync", "decision", "provider read", "report", "DELETE")


@dataclass
class Record:
    t: float
    name: str
    message: str


class Capture(logging.Handler):
    """Every ``agent`` log record, with its exact creation time."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[Record] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(Record(record.created, record.name, record.getMessage()))


@dataclass
class Run:
    gone_at: float | None = None
    #: The trainer's ``main`` returned (its last status.json written); its shutdown follows.
    main_returned: float | None = None
    marks: dict[str, float] = field(default_factory=dict)
    read_back: int | None = None
    trusted: int | None = None
    records: list[Record] = field(default_factory=list)
    #: (wall time, method, route) of each request the fake Hub got.
    hub_requests: list[tuple[float, str, str]] = field(default_factory=list)
    requests: list[tuple[float, str, str]] = field(default_factory=list)
    error: str | None = None


def job_text(tmp: Path, target: str, vast_url: str, epochs: int, device: str) -> str:
    return f"""
[job]
name = "run1"
runs_dir = "{tmp / "runs"}"
[train]
model = "yolox-n"
pretrained = false
data = "{tmp / "data.yaml"}"
epochs = {epochs}
imgsz = 64
batch = 4
workers = 0
device = "{device}"
[preflight]
enabled = false
[server]
listen = "127.0.0.1:0"
[dataset]
doctor = false
[sync]
target = "{target}"
every_epochs = 1
[teardown]
provider = "vast"
api_url = "{vast_url}"
require_restore_drill = false
"""


async def agent_run(daemon: Any, slow_s: float) -> int:
    if slow_s > 0:
        asyncio.get_running_loop().slow_callback_duration = slow_s
    code: int = await asyncio.wait_for(daemon.run(), 300)
    return code


def watch_exit(pid: int, out: list[float]) -> None:
    """When the trainer process is gone: its pidfd readable, or where there is no pidfd (a
    seccomp filter, gVisor), ``waitid`` without reaping (the trainer is this process's child:
    the Daemon runs in-process; the agent's own wait still reaps it)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        # ChildProcessError: the agent's own wait reaped it first (both wake at the exit;
        # which runs first is the scheduler's choice): it is gone, at the latest now.
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        out.append(time.time())
        return
    try:
        select.select([fd], [], [])
        out.append(time.time())
    finally:
        os.close(fd)


def pidfd_works() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (OSError, AttributeError):
        return False
    return True


def one_run(tmp: Path, args: argparse.Namespace, hub: Any) -> Run:
    from agent.config.jobfile import parse_job
    from agent.config.model import Env
    from agent.daemon.spine import Daemon
    from agent.status import report
    from tests.fakes.providers import run_fake_vast
    from tests.fakes.scripted_launcher import ScriptedLauncher

    run = Run()
    gone: list[float] = []

    class Launcher(ScriptedLauncher):
        def _base(self) -> list[str]:
            timed = [sys.executable, str(REPO / "bench" / "common.py"), "trainer"]
            return [*timed, f"bench_log={tmp / 'trainer-times.jsonl'}", *super()._base()[2:]]

        async def launch(self, argv: list[str], **kw: Any) -> Any:
            trainer = await super().launch(argv, **kw)
            threading.Thread(target=watch_exit, args=(trainer.pid, gone), daemon=True).start()
            return trainer

    (tmp / "images").mkdir(parents=True, exist_ok=True)
    (tmp / "data.yaml").write_text("train: images\nval: images\nnames:\n  0: box\n")
    target = f"file://{tmp / 'target'}" if args.target == "file" else f"hf://{HF_REPO}"
    written: list[float] = []  # when each report.write returned
    real_write = report.write

    def timed_write(state_dir: Path, report: Mapping[str, Any]) -> tuple[Path, Path]:
        paths = real_write(state_dir, report)
        written.append(time.time())
        return paths

    report.write = timed_write
    capture = Capture()
    agent_log = logging.getLogger("agent")
    agent_log.addHandler(capture)
    debug = args.slow_callbacks > 0
    if debug:
        logging.getLogger("asyncio").addHandler(capture)
    # Wall clock minus monotonic: the fake's request times are monotonic.
    offset = time.time() - time.monotonic()
    try:
        with run_fake_vast(keys=set(), instance_keys={KEY: INSTANCE}) as fake:
            fake.add_instance(INSTANCE)
            if args.rtt_s:
                fake.hang("*", args.rtt_s, times=None)
            job = parse_job(
                job_text(tmp, target, fake.url, args.epochs, args.device),
                source="bench",
                base_dir=tmp,
            )
            hf: dict[str, Any] = {}
            if hub is not None:
                hf = {"hf_endpoint": hub.url, "hf_token": HF_TOKEN}
            env = Env(state_dir=tmp / "state", container_id=INSTANCE, container_api_key=KEY, **hf)
            options: dict[str, object] = {"epoch_s": args.epoch_s, "ckpt_kb": args.ckpt_kb}
            if args.linger_s:
                options["linger_s"] = args.linger_s
            if args.cuda:
                options["cuda"] = 1
            launcher = Launcher(**options)
            daemon = Daemon(job, env, launcher=launcher)
            try:
                code = asyncio.run(agent_run(daemon, args.slow_callbacks), debug=debug)
                if code != 0:
                    run.error = f"the agent exited {code}"
            except Exception as exc:  # a figure, not a test: say it and go on
                run.error = f"{type(exc).__name__}: {exc}"
            run.requests = [(c.at + offset, c.method, c.route) for c in list(fake.requests)]
            if hub is not None:
                run.hub_requests = [
                    (r.start + offset, r.method, r.route or "?") for r in list(hub.requests)
                ]
                hub.clear_requests()
    finally:
        report.write = real_write
        agent_log.removeHandler(capture)
        logging.getLogger("asyncio").removeHandler(capture)
    run.records = capture.records
    run.gone_at = gone[0] if gone else None
    with contextlib.suppress(OSError):
        for line in (tmp / "trainer-times.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if "exit" in row:
                    run.main_returned = float(row["exit"])
    if run.gone_at is None:
        run.error = run.error or "the trainer's exit was not seen"
        return run
    after = [r for r in capture.records if r.t >= run.gone_at - 1.0]
    run.marks = marks(after, run.requests, written)
    verified = [r.message for r in after if r.message.startswith("sync verified")]
    found = VERIFIED.search(verified[0]) if verified else None
    if found:
        run.read_back, run.trusted = int(found[1]), int(found[2])
    if "DELETE" not in run.marks:
        run.error = run.error or "no DELETE reached the fake provider"
    return run


def marks(
    records: list[Record], requests: list[tuple[float, str, str]], written: list[float]
) -> dict[str, float]:
    """When each step of :data:`STEPS` ended, from the log records after the exit, the fake
    provider's requests and the report's writes."""
    out: dict[str, float] = {}

    def first(prefix: str, since: float, name: str = "") -> float | None:
        for r in records:
            if r.t >= since and r.message.startswith(prefix) and r.name.startswith(name):
                return r.t
        return None

    t0 = records[0].t if records else 0.0
    for step, prefix in (("noticed", "trainer pid="), ("acted", "trainer outcome:")):
        t = first(prefix, t0)
        if t is not None:
            out[step] = t
    acted = out.get("acted", t0)
    queued = first("final sync:", acted)
    verified = first("sync verified:", acted)
    if queued is not None and verified is not None:
        out["queued"] = queued
        uploads = [
            r.t for r in records if queued <= r.t <= verified and "uploaded+verified" in r.message
        ]
        out["drained"] = max(uploads, default=queued)
        out["verified"] = verified
    decided = first("teardown decision:", acted)
    if decided is not None:
        out["decision"] = decided
        read = first("provider: ", decided, "agent.providers")
        if read is None:  # no answer logged: the request's arrival
            read = next((t for t, _, route in requests if route == "show" and t >= decided), None)
        if read is not None:
            out["provider read"] = read
        wrote = [t for t in written if t >= decided]
        if wrote:
            out["report written"] = wrote[0]
            sent = [
                r.t
                for r in records
                if r.t >= wrote[0] and "uploaded+verified agent/report." in r.message
            ]
            if sent:
                out["report sent"] = max(sent)
    deletes = [t for t, method, _ in requests if method == "DELETE"]
    if deletes:
        out["DELETE"] = deletes[0]
    return out


def on_the_path(run: Run) -> tuple[dict[str, int], dict[str, int]]:
    """How many requests the provider and the Hub got, by route, from the exit to the DELETE
    (the DELETE itself left out): each a round trip on a real network."""
    assert run.gone_at is not None
    end = run.marks["DELETE"]
    out: tuple[dict[str, int], dict[str, int]] = ({}, {})
    for index, reqs in enumerate((run.requests, run.hub_requests)):
        for t, method, route in reqs:
            if run.gone_at <= t < end:
                key = f"{method} {route}"
                out[index][key] = out[index].get(key, 0) + 1
    return out


def steps_of(run: Run) -> dict[str, float]:
    """Each step's seconds from the one before it (from the exit for the first)."""
    out: dict[str, float] = {}
    gone = prev = run.gone_at
    assert gone is not None and prev is not None
    for step in ORDER:
        t = run.marks.get(step)
        if t is None:
            continue
        # The agent's own line may come before this bench's thread woke: 0, not negative.
        out[step] = max(0.0, t - prev)
        prev = max(prev, t)
    for _, _, coarse in STEPS:
        out[coarse] = sum(out.get(step, 0.0) for step, _, c in STEPS if c == coarse)
    if "DELETE" in run.marks:
        out["total"] = run.marks["DELETE"] - gone
    return out


def shown(r: Record) -> str:
    """A log line, or for asyncio's slow-callback warning what ran and how long."""
    if r.name == "asyncio" and " took " in r.message:
        where = re.search(r"running at (\S+)", r.message)
        took = r.message.rsplit(" took ", 1)[1]
        return f"the loop was held {took} ({where[1] if where else r.message[:60]})"
    return r.message


def timeline(run: Run) -> None:
    assert run.gone_at is not None
    t0 = run.gone_at
    rows = [(r.t, f"{r.name}: {shown(r)}") for r in run.records if r.t >= t0 - 0.5]
    rows += [(t, f"fake vast: {m} {route}") for t, m, route in run.requests if t >= t0 - 0.5]
    rows.append((t0, "<- the trainer process gone (pidfd)"))
    for t, text in sorted(rows):
        print(f"  {t - t0:+8.4f}  {text[:150]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--target", choices=("file", "hf"), default="file")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--epoch-s", type=float, default=0.3)
    ap.add_argument("--ckpt-kb", type=int, default=1000)
    ap.add_argument(
        "--linger-s",
        type=float,
        default=0.3,
        help="the trainer's shutdown after its last status.json (an interpreter's exit with "
        "torch: 0.3-0.4 s on a 2-core VM); 0: it exits at once",
    )
    ap.add_argument("--cuda", action="store_true", help="the trainer holds a CUDA context")
    ap.add_argument(
        "--rtt-s",
        type=float,
        default=0.0,
        help="every answer of the fake provider (and of the fake Hub) this many seconds late: "
        "a real API's round trip, which loopback does not have",
    )
    ap.add_argument(
        "--no-pidfd",
        action="store_true",
        help="pidfd_open refused in this process (as a container's seccomp filter may): the "
        "agent's fallback notices the exit",
    )
    ap.add_argument(
        "--device", default="cpu", help="[train] device (not cpu: the agent watches the GPUs)"
    )
    ap.add_argument("--timeline", action="store_true", help="print every log line after the exit")
    ap.add_argument(
        "--slow-callbacks",
        type=float,
        default=0.0,
        metavar="S",
        help="asyncio debug mode: log every callback that held the loop longer than S seconds",
    )
    args = ap.parse_args(argv)

    if args.no_pidfd:

        def refused(pid: int, flags: int = 0) -> int:
            raise PermissionError(errno.EPERM, "pidfd_open refused (bench --no-pidfd)")

        os.pidfd_open = refused
    runs: list[Run] = []
    hub_cm: Any = contextlib.nullcontext()
    if args.target == "hf":
        from tests.fakes.hub import run_fake_hub

        hub_cm = run_fake_hub(tokens={HF_TOKEN}, user="bench-user")
    rtt_note = f", every answer {args.rtt_s} s late" if args.rtt_s else ""
    root = Path(tempfile.mkdtemp(prefix="exit-teardown-"))
    try:
        with hub_cm as hub:
            for i in range(args.runs):
                tmp = root / f"run{i + 1}"
                tmp.mkdir()
                if hub is not None:
                    global HF_REPO
                    HF_REPO = f"bench-user/exit-teardown-{os.getpid()}-{i + 1}"
                if hub is not None and args.rtt_s and i == 0:
                    hub.delay("*", args.rtt_s)
                run = one_run(tmp, args, hub)
                runs.append(run)
                if run.error:
                    print(f"run {i + 1}: {run.error}")
                    continue
                s = steps_of(run)
                parts = ", ".join(f"{k} {s[k]:.3f}" for k in COARSE if k in s)
                print(
                    f"run {i + 1}: {s.get('total', float('nan')):.3f} s "
                    f"(read back {run.read_back}, trusted {run.trusted}): {parts}",
                    flush=True,
                )
                if args.timeline:
                    timeline(run)
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    good = [steps_of(r) for r in runs if not r.error and "DELETE" in r.marks]
    if not good:
        print("no run reached the DELETE")
        return 1
    print(
        f"\ntrainer exit -> DELETE at the fake Vast, {args.target}:// sync, {len(good)} run(s) "
        f"({args.epochs} epochs of {args.epoch_s} s, {args.ckpt_kb} KiB checkpoints, trainer "
        f"shutdown {args.linger_s} s{', a CUDA context' if args.cuda else ''}, device "
        f"{args.device}{rtt_note}; pidfd {'works' if pidfd_works() else 'NOT available'} "
        "here)"
    )
    print(f"  {'step':<15} {'p50 s':>7} {'max s':>7}  ended by")
    for step, ends, _ in STEPS:
        values = [g[step] for g in good if step in g]
        if values:
            print(f"  {step:<15} {statistics.median(values):7.3f} {max(values):7.3f}  {ends}")
    print(f"  {'in short':<15} {'p50 s':>7} {'max s':>7}")
    for step in (*COARSE, "total"):
        values = [g[step] for g in good if step in g]
        if values:
            print(f"  {step:<15} {statistics.median(values):7.3f} {max(values):7.3f}")
    shutdown = [r.gone_at - r.main_returned for r in runs if r.gone_at and r.main_returned]
    if shutdown:
        print(
            f"  before the exit, the trainer's own shutdown (its main returned, its last "
            f"status.json written -> the process gone): p50 {statistics.median(shutdown):.3f} s, "
            f"max {max(shutdown):.3f} s (no agent can see an exit before it)"
        )
    on_path = [on_the_path(r) for r in runs if not r.error and "DELETE" in r.marks]
    for who, index in (("provider", 0), ("Hub", 1)):
        counts = sorted({sum(c[index].values()) for c in on_path})
        if any(counts):
            routes = sorted({k for c in on_path for k in c[index]})
            print(
                f"  requests to the {who} between the exit and the DELETE: {counts} per run "
                f"({', '.join(routes)})"
            )
    totals = [g["total"] for g in good]
    rb = [r.read_back for r in runs if r.read_back is not None]
    tr = [r.trusted for r in runs if r.trusted is not None]
    print(f"  final verification: read back {rb}, trusted {tr}")
    p50 = statistics.median(totals)
    print(
        f"  total p50 {p50:.3f} s, max {max(totals):.3f} s; goal {GOAL_S} s: "
        f"p50 {p50 / GOAL_S:.2f}x, max {max(totals) / GOAL_S:.2f}x of the goal"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
