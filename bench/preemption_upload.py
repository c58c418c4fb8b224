"""Benchmark: from a spot notice to ``weights/last.pt`` leaving the box, the whole agent.

bench/preemption_notice.py times the watcher alone (flip -> ``on_notice``). This one runs the
real :class:`agent.daemon.spine.Daemon` in-process, once per trial on a fresh temporary folder, with

- the trainer: tests/fakes/scripted_trainer.py launched for real by a
  :class:`agent.trainer.process.ProcessLauncher` (its own session, SIGINT stops it), 0.5 s epochs
  and 20 MB checkpoints, so copying, hashing and uploading them takes measurable time;
- the sink: :class:`agent.sinks.local.LocalSink` on a temporary folder, wrapped to record
  ``time.monotonic()`` when ``upload`` and ``stat`` (the read-back) are entered and left;
- the notice: the fake AWS IMDSv2 / GCP metadata servers of tests/fakes/metadata.py on
  127.0.0.1, watched through the job's ``[preemption]`` table (AWS polled every second, GCP by
  its long poll); ``[sync] every_epochs = 1000``, so no milestone sends last.pt before the
  notice (best.pt still goes up at each new best, as it would in a real run).

Each trial flips the fake at a random moment 2-6 s after the trainer was launched, then times
the flip to: the sink's first ``upload(..., "weights/last.pt")`` starting; that upload read back
(the ``stat`` after it returned); the trainer exiting; the agent saying "preempted: last.pt
saved" (the trainer has stopped and the post-stop upload of any newer last.pt has drained).
Then the daemon is asked to exit (its shutdown trigger) instead of waiting out
PREEMPT_SURVIVAL_S, and the trial checks that the target's verified last.pt is the newest
completed epoch. Figures only; nothing is asserted about timing. A trial where the agent does
not get there says so, with the tail of its agent.log.

    .venv/bin/python bench/preemption_upload.py [--trials 5] [--seed N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.config.model import Env, Job
from agent.daemon.spine import Daemon
from agent.policy.resume import valid_checkpoint
from agent.sinks import RemoteFile
from agent.sinks.digests import sha256_file
from agent.sinks.local import LocalSink
from agent.state import TrainerRecord
from agent.sync.ledger import LedgerStatus
from agent.trainer.process import ProcessLauncher, TrainerProcess
from tests.fakes.metadata import FakeGCE, FakeIMDS, run_fake_gce, run_fake_imds
from tests.fakes.scripted_trainer import read_checkpoint_epoch
from tests.support import tiny_job

SCRIPTED = Path(__file__).resolve().parents[1] / "tests" / "fakes" / "scripted_trainer.py"
LAST = "weights/last.pt"
EPOCHS = 400
EPOCH_S = 0.5
CKPT_KB = 20_000
#: Give up on a trial this long after the flip (the agent allows itself 120 s for the upload).
TRIAL_TIMEOUT_S = 150.0


# --------------------------------------------------------------------------------------------
# The collaborators


@dataclass
class Call:
    op: str  # "upload" or "stat"
    remote_path: str
    thread: int
    entered: float
    left: float | None = None
    result: RemoteFile | None = None


class TimedSink:
    """A LocalSink that notes when each upload and read-back is entered and left."""

    def __init__(self, inner: LocalSink) -> None:
        self.inner = inner
        self.description = inner.description
        self.calls: list[Call] = []
        self._lock = threading.Lock()

    def _begin(self, op: str, remote_path: str) -> Call:
        call = Call(op, remote_path, threading.get_ident(), time.monotonic())
        with self._lock:
            self.calls.append(call)
        return call

    def prepare(self) -> None:
        self.inner.prepare()

    def upload(self, local: Path, remote_path: str) -> None:
        call = self._begin("upload", remote_path)
        try:
            self.inner.upload(local, remote_path)
        finally:
            call.left = time.monotonic()

    def stat(self, remote_path: str) -> RemoteFile | None:
        call = self._begin("stat", remote_path)
        try:
            call.result = self.inner.stat(remote_path)
            return call.result
        finally:
            call.left = time.monotonic()

    def download(self, remote_path: str, local: Path) -> RemoteFile | None:
        return self.inner.download(remote_path, local)

    def snapshot(self) -> list[Call]:
        with self._lock:
            return list(self.calls)


class ScriptedLauncher(ProcessLauncher):
    """The real process launcher, starting the scripted stand-in instead of LibreYOLO."""

    def __init__(self) -> None:
        self.trainers: list[TrainerProcess] = []
        self.launched_at: float | None = None

    def argv(self, job: Job) -> list[str]:
        return [
            sys.executable,
            str(SCRIPTED),
            f"epochs={EPOCHS}",
            f"epoch_s={EPOCH_S}",
            f"ckpt_kb={CKPT_KB}",
            f"project={job.job.runs_dir}",
            f"name={job.job.name}",
        ]

    async def launch(
        self, argv: list[str], *, log_path: Path, result_path: Path, cwd: Path, launch_id: str
    ) -> TrainerProcess:
        trainer = await super().launch(
            argv, log_path=log_path, result_path=result_path, cwd=cwd, launch_id=launch_id
        )
        self.trainers.append(trainer)
        if self.launched_at is None:
            self.launched_at = time.monotonic()
        return trainer

    def attach(self, record: TrainerRecord) -> TrainerProcess | None:
        return None  # every trial starts on a fresh state folder: nothing to re-attach

    def find_launched(self, launch_id: str, argv: list[str]) -> TrainerProcess | None:
        return None


def make_job(tmp: Path, source: str, url: str) -> Job:
    """The tests' tiny job (tests/support.py): last.pt goes up only on the notice."""
    data = tmp / "data.yaml"
    (tmp / "images").mkdir(parents=True, exist_ok=True)
    data.write_text("train: images\nval: images\nnames:\n  0: box\n")
    sections = f"""
[sync]
target = "file://{tmp / "target"}"
every_epochs = 1000
[preemption]
aws = {"true" if source == "aws" else "false"}
gcp = {"true" if source == "gcp" else "false"}
{source}_url = "{url}"
poll_interval = "1s"
"""
    return tiny_job(tmp, data, epochs=EPOCHS, sections=sections)


# --------------------------------------------------------------------------------------------
# One trial


@dataclass
class Result:
    source: str
    flip_after_launch_s: float
    upload_start_s: float | None = None
    verified_s: float | None = None
    trainer_exit_s: float | None = None
    #: Uploads of last.pt that started after the flip (2: the trainer wrote a newer one first).
    last_uploads: int = 0
    #: Flip -> the watcher's "preemption: notice from ..." line.
    notice_s: float | None = None
    #: Flip -> the agent's "preempted: last.pt saved" line.
    saved_s: float | None = None
    #: The epoch inside the last.pt stored on the target (verified in the ledger), the epoch
    #: the ledger records for it, and the newest epoch status.json calls completed.
    target_epoch: int | None = None
    ledger_epoch: int | None = None
    completed_epochs: int | None = None
    #: The trainer's last.pt on disk: "same" as the target's, "torn" (not a valid zip: the
    #: SIGINT hit it mid-write), or "other" (valid, not uploaded).
    local: str = "?"
    exit_code: int | None = None
    problem: str | None = None
    log_tail: list[str] = field(default_factory=list)


class AgentLines(logging.Handler):
    """Notes when the agent logs that it saw the notice, and that last.pt is saved after it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.notice_at: float | None = None
        self.saved_at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if self.notice_at is None and text.startswith("preemption: notice from"):
            self.notice_at = time.monotonic()
        if self.saved_at is None and text.startswith("preempted: last.pt saved"):
            self.saved_at = time.monotonic()


def first_upload_after(calls: list[Call], flipped: float) -> tuple[Call | None, Call | None, int]:
    """The first upload of last.pt entered after the flip, the read-back that followed it in
    the same thread, and how many uploads of last.pt were entered after the flip."""
    uploads = [c for c in calls if c.op == "upload" and c.remote_path == LAST]
    after = [c for c in uploads if c.entered >= flipped]
    first = after[0] if after else None
    check = None
    if first is not None and first.left is not None:
        check = next(
            (
                c
                for c in calls
                if c.op == "stat"
                and c.remote_path == LAST
                and c.thread == first.thread
                and c.entered >= first.left
                and c.left is not None
            ),
            None,
        )
    return first, check, len(after)


def check_outcome(daemon: Daemon, target: Path, result: Result) -> None:
    """What the target holds after the notice, against what the trainer completed."""
    if daemon.status is not None:
        result.completed_epochs = daemon.status.completed_epochs
    entry = daemon.sync.ledger.entries.get(LAST) if daemon.sync is not None else None
    if entry is not None and entry.status == LedgerStatus.VERIFIED:
        result.ledger_epoch = entry.epoch
        result.target_epoch = read_checkpoint_epoch(target / LAST)
    if daemon.run_dir is None:
        return
    local = daemon.run_dir / "weights" / "last.pt"
    if not valid_checkpoint(local):
        result.local = "torn"
    elif entry is not None and local.stat().st_size == entry.size:
        result.local = "same" if sha256_file(local) == entry.sha256 else "other"
    else:
        result.local = "other"


ROUTINE = ("uploaded+verified", "milestone epoch=", "/400 done", "snapshot of")


def log_excerpt(state_dir: Path, flipped_wall: str | None) -> list[str]:
    """agent.log from the flip on (its last 40 lines when there was no flip), less the routine
    per-epoch lines, and the end of trainer.log."""
    lines: list[str] = []
    with contextlib.suppress(OSError):
        text = (state_dir / "agent.log").read_text(errors="replace").splitlines()
        if flipped_wall is None:
            lines += [f"agent.log: {x}" for x in text[-40:]]
        else:
            # Lines start with "YYYY-MM-DD HH:MM:SS,mmm": they compare as text.
            after = [x for x in text if x[:23] >= flipped_wall]
            kept = [x for x in after if not any(r in x for r in ROUTINE)]
            lines += [f"agent.log: {x}" for x in kept[:40]]
    with contextlib.suppress(OSError):
        text = (state_dir / "trainer.log").read_text(errors="replace").splitlines()
        lines += [f"trainer.log: {x}" for x in text[-15:]]
    return lines


async def until(pred: Any, deadline: float, step: float = 0.005) -> bool:
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(step)
    return True


def kill_leftovers(launcher: ScriptedLauncher) -> None:
    """SIGKILL the process group of a trainer this trial started that is still alive."""
    for trainer in launcher.trainers:
        if trainer.exit_code is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(trainer.pid, signal.SIGKILL)


async def trial(
    source: str, fake: FakeIMDS | FakeGCE, tmp: Path, rng: random.Random, poll_s: float
) -> Result:
    fake.clear()
    fake.clear_requests()
    job = make_job(tmp, source, fake.url)
    target = tmp / "target"
    sink = TimedSink(LocalSink(target))
    launcher = ScriptedLauncher()
    daemon = Daemon(
        job,
        Env(state_dir=tmp / "state"),
        launcher=launcher,
        sink=sink,
        poll_interval_s=poll_s,
    )
    shutdown = asyncio.Event()
    task = asyncio.create_task(daemon.run(shutdown_trigger=shutdown))
    exited_at: float | None = None
    flipped_wall: str | None = None
    result = Result(source, 0.0)
    lines = AgentLines()
    agent_log = logging.getLogger("agent")
    agent_log.addHandler(lines)

    async def note_exit(trainer: TrainerProcess) -> None:
        nonlocal exited_at
        await trainer.wait()
        exited_at = time.monotonic()

    try:
        if not await until(lambda: launcher.trainers or task.done(), time.monotonic() + 60):
            result.problem = "no trainer launched within 60 s"
            return result
        if task.done():
            result.problem = "the daemon ended before launching a trainer"
            return result
        trainer = launcher.trainers[0]
        exit_watch = asyncio.create_task(note_exit(trainer))
        assert launcher.launched_at is not None
        result.flip_after_launch_s = rng.uniform(2.0, 6.0)
        await asyncio.sleep(launcher.launched_at + result.flip_after_launch_s - time.monotonic())
        if trainer.exit_code is not None:
            result.problem = f"the trainer exited before the flip (code {trainer.exit_code})"
            return result
        flipped = time.monotonic()
        now = datetime.now()
        flipped_wall = f"{now:%Y-%m-%d %H:%M:%S},{now.microsecond // 1000:03d}"
        fake.notice()
        done = await until(
            lambda: exited_at is not None and lines.saved_at is not None, flipped + TRIAL_TIMEOUT_S
        )
        first, check, result.last_uploads = first_upload_after(sink.snapshot(), flipped)
        if first is not None:
            result.upload_start_s = first.entered - flipped
        if check is not None and check.left is not None:
            result.verified_s = check.left - flipped
        if exited_at is not None:
            result.trainer_exit_s = exited_at - flipped
        if lines.notice_at is not None:
            result.notice_s = lines.notice_at - flipped
        if lines.saved_at is not None:
            result.saved_s = lines.saved_at - flipped
        result.exit_code = trainer.exit_code
        check_outcome(daemon, target, result)
        if not done:
            result.problem = (
                f"{TRIAL_TIMEOUT_S:.0f} s after the flip: trainer "
                f"{'exited' if exited_at is not None else 'still running'}, "
                f"{result.last_uploads} upload(s) of last.pt, no 'last.pt saved' line"
            )
        elif first is None or result.target_epoch is None:
            result.problem = "no verified upload of last.pt after the notice"
        elif result.completed_epochs is not None and result.target_epoch < result.completed_epochs:
            result.problem = (
                f"the target's last.pt holds epoch {result.target_epoch}, the trainer completed "
                f"{result.completed_epochs}"
            )
        exit_watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await exit_watch
        return result
    finally:
        agent_log.removeHandler(lines)
        shutdown.set()
        try:
            await asyncio.wait_for(task, 60)
        except Exception as exc:  # a crashed or hung agent: say so, clean up anyway
            result.problem = (result.problem or "") + f"; daemon: {type(exc).__name__}: {exc}"
        kill_leftovers(launcher)
        for trainer in launcher.trainers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(trainer.wait(), 10)
        if result.problem or (result.exit_code is not None and result.exit_code != 130):
            # No upload, or the trainer needed more than SIGINT: the tails of what the agent
            # and the trainer wrote, for the report.
            result.log_tail = log_excerpt(tmp / "state", flipped_wall)


# --------------------------------------------------------------------------------------------
# The report


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def cell(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values) * 1000:.0f} / {max(values) * 1000:.0f}"


def report(results: dict[str, list[Result]], poll_s: float) -> None:
    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    print()
    print(
        f"flip -> ..., milliseconds, median / max; {cores} cores ({usable} usable); "
        f"checkpoints {CKPT_KB // 1000} MB, epochs {EPOCH_S:g} s; agent poll {poll_s:g} s, "
        "AWS IMDS polled every 1 s, GCP long poll"
    )
    head = ["notice seen", "upload starts", "upload verified", "trainer exited", "last.pt saved"]
    print(f"{'source':<7} {'trials':>6}  " + "  ".join(f"{h:>15}" for h in head))
    for source, rows in results.items():
        ok = [r for r in rows if not r.problem]
        trials = f"{len(ok)}/{len(rows)}"
        cols = [
            cell([v for v in (getattr(r, name) for r in ok) if v is not None])
            for name in ("notice_s", "upload_start_s", "verified_s", "trainer_exit_s", "saved_s")
        ]
        print(f"{source.upper():<7} {trials:>6}  " + "  ".join(f"{c:>15}" for c in cols))
    rows = [r for rs in results.values() for r in rs]
    twice = sum(r.last_uploads > 1 for r in rows)
    torn = sum(r.local == "torn" for r in rows)
    print(
        "notice seen: the watcher's log line; upload starts/verified: the sink's first upload of "
        "last.pt after the flip, and its read-back; last.pt saved: the agent's line once the "
        "trainer stopped and the uploads drained"
    )
    if twice:
        print(
            f"{twice} trial(s) sent last.pt twice: an epoch ended between the notice's snapshot "
            "and the SIGINT, so its newer last.pt went up after the trainer stopped"
        )
    mislabelled = sum(r.ledger_epoch is not None and r.ledger_epoch != r.target_epoch for r in rows)
    if mislabelled:
        print(
            f"{mislabelled} trial(s): the ledger's epoch for last.pt is not the epoch inside it "
            "(the trainer writes last.pt before status.json, and the notice's snapshot fell "
            "between the two)"
        )
    if torn:
        print(
            f"{torn} trial(s) left a torn last.pt on disk (the SIGINT hit the checkpoint write); "
            "the agent skipped it and the target kept the last completed epoch's"
        )


async def bench(trials: int, seed: int | None, poll_s: float) -> int:
    rng = random.Random(seed)
    results: dict[str, list[Result]] = {"aws": [], "gcp": []}
    with (
        tempfile.TemporaryDirectory(prefix="preemption-upload-") as root,
        run_fake_imds() as imds,
        run_fake_gce() as gce,
    ):
        fakes: dict[str, FakeIMDS | FakeGCE] = {"aws": imds, "gcp": gce}
        for i in range(trials):
            for source, fake in fakes.items():
                tmp = Path(root) / f"{source}-{i + 1}"
                tmp.mkdir()
                try:
                    r = await trial(source, fake, tmp, rng, poll_s)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                results[source].append(r)
                print(
                    f"trial {i + 1:2d} {source}: flip {r.flip_after_launch_s:.1f}s after launch; "
                    f"notice {ms(r.notice_s)} ms, upload starts {ms(r.upload_start_s)} ms, "
                    f"verified {ms(r.verified_s)} ms, "
                    f"trainer exited {ms(r.trainer_exit_s)} ms (code {r.exit_code}), "
                    f"saved {ms(r.saved_s)} ms; last.pt uploads {r.last_uploads}, target holds "
                    f"epoch {r.target_epoch} (ledger: {r.ledger_epoch}), completed "
                    f"{r.completed_epochs}, local {r.local}",
                    flush=True,
                )
                if r.problem:
                    print(f"  PROBLEM: {r.problem}", flush=True)
                elif r.log_tail:
                    print(f"  the trainer did not stop on SIGINT (exit code {r.exit_code})")
                if r.log_tail:
                    for line in r.log_tail:
                        print(f"    | {line}", flush=True)
    report(results, poll_s)
    return 1 if any(r.problem for rows in results.values() for r in rows) else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    ap.add_argument("--trials", type=int, default=5, help="trials per source (default 5)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument(
        "--poll-interval",
        type=float,
        default=5.0,
        help="the Daemon's poll_interval_s (default 5, the agent's own default)",
    )
    args = ap.parse_args()
    sys.exit(asyncio.run(bench(args.trials, args.seed, args.poll_interval)))


if __name__ == "__main__":
    main()
