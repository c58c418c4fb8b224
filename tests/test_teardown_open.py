"""A teardown is done only when the provider confirms it: until then it stays open, through a
provider outage, an agent made to exit and a new ``run``.

Driven through the real CLI (``python -m agent.cli run`` / ``status``) against the fake Vast API
on 127.0.0.1 (tests/fakes/providers.py), with the provider timing shrunk through
``LIBREYOLO_AGENT_TEARDOWN_TIMING`` (a retry window of 1 s stands for the real 300 s). The job
fails at staging (its data YAML does not exist): nothing trained, so the plan is a destroy, and
the test reaches the teardown in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agent.config.model import NotifySection
from agent.events import EventBus
from agent.guard.plan import guard_pid
from agent.policy.teardown import EXIT_TEARDOWN_OPEN, timing_from_env
from agent.state import (
    NOT_CONFIRMED,
    Phase,
    Reason,
    RunState,
    StateStore,
    atomic_write_json,
    teardown_open,
)
from agent.status.notify import Notifier
from tests.fakes.providers import FakeVast, run_fake_vast
from tests.support import tiny_job_text

KEY = "vast-instance-key-open-0123456789"
TIMING = (
    "retry_s=1,backoff_first_s=0.05,backoff_max_s=0.2,retry_after_max_s=0.2,confirm_s=20,"
    "poll_first_s=0.1,poll_max_s=0.3,open_first_s=0.3,open_max_s=1"
)


def eventually(pred: Callable[[], Any], timeout: float = 90.0, what: str = "") -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(what or "condition not met in time")
        time.sleep(0.1)


def load(state_dir: Path) -> RunState | None:
    try:
        return StateStore(state_dir).load()
    except (OSError, ValueError):
        return None  # written at this very moment: read again


def job_file(tmp_path: Path, fake: FakeVast, extra: str = "") -> Path:
    job = tmp_path / "job.toml"
    teardown = f'[teardown]\nprovider = "vast"\napi_url = "{fake.url}"\n'
    data = tmp_path / "nothere" / "data.yaml"
    job.write_text(extra + tiny_job_text(tmp_path, data, epochs=1, sections=teardown))
    return job


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A webhook receiver on 127.0.0.1: the URL, and the JSON bodies it got."""
    bodies: list[dict[str, Any]] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", bodies
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Agents a test started, and the guard of its state directory: all ended, pass or fail."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    state_dir = tmp_path / "state"
    with contextlib.suppress(OSError):
        pid = guard_pid(state_dir)
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_an_api_down_past_the_retry_window_then_back_ends_in_one_destroy_confirmed(
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    webhook: tuple[str, list[dict[str, Any]]],
) -> None:
    hook, bodies = webhook
    state_dir = tmp_path / "state"
    base = {k: v for k, v in os.environ.items() if k != "LIBREYOLO_AGENT_CRASHPOINT"}
    env = dict(
        base,
        LIBREYOLO_AGENT_STATE_DIR=str(state_dir),
        LIBREYOLO_AGENT_TEARDOWN_TIMING=TIMING,
        LIBREYOLO_AGENT_GUARD_STALE_AFTER="1h",  # the guard stays out of this test's way
        CONTAINER_ID="1234",
        CONTAINER_API_KEY=KEY,
    )
    cli = [sys.executable, "-m", "agent.cli"]
    with run_fake_vast(keys=set(), instance_keys={KEY: "1234"}) as fake:
        fake.add_instance("1234")
        outage = fake.down(503)
        job = job_file(tmp_path, fake, f'[notify]\nwebhook = "{hook}"\n')

        def attempts() -> int:
            state = load(state_dir)
            td = state.teardown if state is not None else None
            return int((td or {}).get("attempts") or 0)

        with (tmp_path / "first.err").open("wb") as log:
            processes.append(subprocess.Popen([*cli, "run", str(job)], env=env, stderr=log))
        first = processes[-1]
        # Two whole retry windows went by, answered 503: the old agent called this final.
        eventually(lambda: attempts() >= 2 or first.poll() is not None)
        assert first.poll() is None, (tmp_path / "first.err").read_text()[-3000:]
        state = load(state_dir)
        assert state is not None and state.phase == Phase.TEARDOWN  # never DONE unconfirmed
        assert state.teardown is not None and teardown_open(state.teardown)
        assert state.teardown["action"] == "destroy" and state.teardown["confirmed"] is False
        assert "finished_at" not in state.teardown

        # `status` (and /status behind it) says so, and its exit code is not 0.
        shown = subprocess.run(
            [*cli, "status"], env=env, capture_output=True, text=True, timeout=60
        )
        assert shown.returncode == EXIT_TEARDOWN_OPEN, shown.stderr
        assert NOT_CONFIRMED in shown.stdout + shown.stderr
        served = subprocess.run(
            [*cli, "status", "--json"], env=env, capture_output=True, text=True, timeout=60
        )
        doc = json.loads(served.stdout)
        assert doc["teardown_open"] is True and doc["teardown_warning"] == NOT_CONFIRMED
        assert served.returncode == EXIT_TEARDOWN_OPEN

        # The agent made to exit meanwhile exits non-zero (the supervisor starts it again).
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == EXIT_TEARDOWN_OPEN
        state = load(state_dir)
        assert state is not None and state.phase == Phase.TEARDOWN and teardown_open(state.teardown)
        assert not [c for c in fake.requests if c.method == "DELETE" and c.status == 200]

        # A new `run` carries the teardown on (it used to say "already ended, nothing to do").
        before = attempts()
        with (tmp_path / "second.err").open("wb") as log:
            processes.append(subprocess.Popen([*cli, "run", str(job)], env=env, stderr=log))
        second = processes[-1]
        eventually(lambda: attempts() > before or second.poll() is not None)
        assert second.poll() is None, (tmp_path / "second.err").read_text()[-3000:]
        assert outage.hits > 10
        fake.up()  # the API is back
        assert second.wait(120) == 0, (tmp_path / "second.err").read_text()[-3000:]

        accepted = [c for c in fake.requests if c.method == "DELETE" and c.status == 200]
        assert len(accepted) == 1, [(c.method, c.path, c.status) for c in fake.requests]
        assert fake.instance("1234") is None
        assert not [c for c in fake.requests if c.method == "PUT"]  # nothing but the destroy
        state = load(state_dir)
        assert state is not None and state.phase == Phase.DONE
        td = state.teardown
        assert td is not None and td["confirmed"] is True and td["action"] == "destroy"
        assert not teardown_open(td) and td["open"] is False and td["attempts"] >= before
        # The confirmation came from a read that showed the instance gone, after the DELETE.
        reads = [c for c in fake.requests if c.method == "GET" and c.at > accepted[0].at]
        assert reads, "confirmed without a read-back"
        second_err = (tmp_path / "second.err").read_text()
        # Said once, in words: when it was decided (a UTC time, not a raw unix time), and each
        # failed attempt's number once per line.
        assert re.search(
            r"teardown resumed: destroy was decided at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC",
            second_err,
        ), second_err[-3000:]
        retries = [line for line in second_err.splitlines() if "trying again in" in line]
        assert retries and all(line.count("(attempt") == 1 for line in retries), retries[:3]
        done = subprocess.run([*cli, "status"], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert (
            KEY not in (tmp_path / "first.err").read_text() + (tmp_path / "second.err").read_text()
        )
    # Said, not stormed: one "NOT confirmed" notice per agent for all its failed attempts.
    eventually(lambda: any(b["event"]["kind"] == "done" for b in bodies))
    opened = [b for b in bodies if b["event"]["data"].get("open")]
    assert len(opened) == 2 < td["attempts"], [b["text"] for b in bodies]
    assert all(NOT_CONFIRMED in b["text"] for b in opened)
    confirmed = [
        b
        for b in bodies
        if b["event"]["kind"] == "teardown_confirmed" and b["event"]["data"].get("confirmed")
    ]
    assert len(confirmed) == 1


def test_a_done_record_whose_teardown_never_confirmed_is_reopened_by_a_new_run(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    # What an older agent left: DONE with an unconfirmed destroy (the API was down past its
    # retry window). A new run must not say "nothing to do": it reads back, then destroys.
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    with run_fake_vast(keys=set(), instance_keys={KEY: "1234"}) as fake:
        fake.add_instance("1234")
        job = job_file(tmp_path, fake)
        now = time.time()
        old = RunState(
            job_name="run1",
            job_source=str(job),
            phase=Phase.DONE,
            reason=Reason.PREFLIGHT_FAILED,
            started_at=now,
        )
        old.teardown = {
            "provider": "vast",
            "action": "destroy",
            "why": "preflight failed: nothing trained, nothing to save",
            "started_at": now,
            "instance_id": None,
            "performed": False,
            "confirmed": False,
            "detail": "vast: destroy: no usable answer; destroy NOT confirmed",
            "finished_at": now,
        }
        atomic_write_json(state_dir / "state.json", old.to_dict())
        # Before: "status" on that record exits non-zero and says so.
        env = dict(
            {k: v for k, v in os.environ.items() if k != "LIBREYOLO_AGENT_CRASHPOINT"},
            LIBREYOLO_AGENT_STATE_DIR=str(state_dir),
            LIBREYOLO_AGENT_TEARDOWN_TIMING=TIMING,
            LIBREYOLO_AGENT_GUARD_STALE_AFTER="1h",
            CONTAINER_ID="1234",
            CONTAINER_API_KEY=KEY,
        )
        cli = [sys.executable, "-m", "agent.cli"]
        shown = subprocess.run(
            [*cli, "status"], env=env, capture_output=True, text=True, timeout=60
        )
        assert shown.returncode == EXIT_TEARDOWN_OPEN
        assert NOT_CONFIRMED in shown.stdout + shown.stderr
        with (tmp_path / "run.err").open("wb") as log:
            processes.append(subprocess.Popen([*cli, "run", str(job)], env=env, stderr=log))
        code = processes[-1].wait(120)
        err = (tmp_path / "run.err").read_text()
        assert code == 0, err[-3000:]
        assert "reopening it" in err
        assert [(c.method, c.status) for c in fake.requests if c.method == "DELETE"] == [
            ("DELETE", 200)
        ]
        state = load(state_dir)
        assert state is not None and state.phase == Phase.DONE
        assert state.teardown is not None and state.teardown["confirmed"] is True


# ----------------------------------------------------------------------- the pieces, directly


def test_the_timing_variable_shrinks_the_provider_and_the_open_pause() -> None:
    timing, pause = timing_from_env({"LIBREYOLO_AGENT_TEARDOWN_TIMING": TIMING})
    assert timing is not None and timing.retry_s == 1.0 and timing.confirm_s == 20.0
    assert pause == (0.3, 1.0)
    assert timing_from_env({}) == (None, (15.0, 300.0))
    from agent.config.model import ConfigError

    for bad in ("retry=1", "retry_s=abc", "retry_s=-1", "open_max_s=inf"):
        with pytest.raises(ConfigError, match="LIBREYOLO_AGENT_TEARDOWN_TIMING"):
            timing_from_env({"LIBREYOLO_AGENT_TEARDOWN_TIMING": bad})


def test_an_open_teardown_is_notified_at_once_then_at_most_every_repeat_interval() -> None:
    now = [1000.0]
    bus = EventBus(clock=lambda: now[0])

    async def main() -> list[str]:
        notifier = Notifier(
            NotifySection(webhook="http://127.0.0.1:9/hook"),
            bus,
            job="run1",
            repeat_open_s=1800.0,
            clock=lambda: now[0],
        )
        for minute in range(0, 95, 5):  # an attempt every 5 minutes for 90 minutes
            now[0] = 1000.0 + minute * 60
            bus.publish(
                "teardown_confirmed",
                action="destroy",
                performed=False,
                confirmed=False,
                open=True,
                attempts=minute // 5 + 1,
                detail="HTTP 503",
            )
        texts = [json.loads(n.body)["text"] for n in notifier._queue]
        bus.publish("teardown_confirmed", action="destroy", performed=True, confirmed=True)
        assert len(notifier._queue) == len(texts) + 1  # the confirmation is never held back
        assert notifier.repeats_held == 19 - len(texts)
        await notifier.close()
        return texts

    texts = asyncio.run(main())
    assert len(texts) == 4  # minutes 0, 30, 60, 90
    assert all(NOT_CONFIRMED in t for t in texts)
    assert "attempt 1" in texts[0] and "attempt 7" in texts[1]


def test_the_supervisor_starts_an_agent_that_exited_with_its_teardown_open_again() -> None:
    from agent.supervisor import Policy

    verdict = Policy().after_exit(EXIT_TEARDOWN_OPEN, uptime_s=600.0, in_a_row=0)
    assert verdict.restart and verdict.state == "waiting"


def test_every_status_text_says_an_open_teardown_may_still_bill() -> None:
    from agent.status import summary as statusfmt

    open_td = {"action": "destroy", "performed": False, "confirmed": False, "attempts": 4}
    done_td = {"action": "destroy", "performed": True, "confirmed": True, "detail": "gone"}
    now = time.time()
    texts = {
        "summary": statusfmt.teardown_text({"teardown": open_td}, now),
        "line": statusfmt.plain_line({"phase": "TEARDOWN", "teardown": open_td}, now),
        "ended": statusfmt.teardown_line(open_td),
        "report": statusfmt.report_summary({"teardown": open_td}, "report.json"),
    }
    for where, text in texts.items():
        assert f"destroy {NOT_CONFIRMED} (attempt 4)" in text, where
    assert NOT_CONFIRMED not in statusfmt.teardown_text({"teardown": done_td}, now)
    assert NOT_CONFIRMED not in statusfmt.report_summary({"teardown": done_td}, "report.json")
    assert not teardown_open({"action": "keep", "confirmed": True})
    assert (
        not teardown_open(done_td) and teardown_open(open_td) and teardown_open({"action": "stop"})
    )
