"""Steering a real agent (issue 25, items 8 and 10): the whole daemon in-process with the scripted
trainer as a real process, driven through its real HTTP endpoint (aiohttp) and the real CLI
(``python -m agent.cli``, a subprocess).

- every request is checked before anything changes: a refusal (400, 409) leaves state.json as it
  was, never a 500 that saved;
- ``stop`` in HELD releases the hold and the teardown goes ahead, saying which; ``stop`` and
  ``extend`` are refused (409, with the reason) once a stop is under way;
- after DONE the heartbeat starts no guard;
- a trainer that LibreYOLO refuses with a config error (exit 2) before its first epoch ends the
  run as a failed preflight (reason and teardown choice), not as a failed training.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.config.model import Env
from agent.state import Phase, Reason, StateStore
from tests.fakes.scripted_launcher import ScriptedLauncher
from tests.support import wait_for
from tests.test_supervise import WAIT_S, Clock, Run, history, make_job

REPO_ROOT = Path(__file__).resolve().parent.parent


async def post(run: Run, action: str, body: str = "") -> tuple[int, dict[str, Any]]:
    """``POST /<action>`` with the token: the HTTP status and the JSON answer, whatever they are."""
    token = (run.env.state_dir / "token").read_text().strip()
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{run.base}/{action}", data=body, headers={"Authorization": f"Bearer {token}"}
        ) as r,
    ):
        answer: dict[str, Any] = await r.json()
        return r.status, answer


def saved(run: Run) -> dict[str, Any]:
    """state.json as the agent last wrote it."""
    doc: dict[str, Any] = json.loads(StateStore(run.env.state_dir).state_path.read_text())
    return doc


async def cli(run: Run, *args: str) -> subprocess.CompletedProcess[str]:
    """``libreyolo-agent ARGS --state-dir STATE`` as a user types it, beside the running agent."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(run.tmp), "NO_PROXY": "127.0.0.1,localhost"}
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "agent.cli", *args, "--state-dir", str(run.env.state_dir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=60,
    )


def cli_started(run: Run, *args: str) -> subprocess.Popen[str]:
    """``libreyolo-agent ARGS --state-dir STATE`` started, not waited for: its answer may come
    after the agent has already ended the job (a stop in HELD with nothing to wait for)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(run.tmp), "NO_PROXY": "127.0.0.1,localhost"}
    return subprocess.Popen(
        [sys.executable, "-m", "agent.cli", *args, "--state-dir", str(run.env.state_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )


def one_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    prefix = "libreyolo-agent: error: "
    assert line.startswith(prefix), line
    return line[len(prefix) :]


# ------------------------------------------------------------------------------ stop in HELD


def test_stop_in_held_releases_the_hold_and_the_teardown_goes_ahead(tmp_path: Path) -> None:
    run = Run(tmp_path, make_job(tmp_path), ScriptedLauncher(epoch_s=0.1, pause_at=3))
    seen: dict[str, Any] = {}

    async def during(run: Run) -> None:
        await run.paused()
        status, answer = await post(run, "hold", "2h")
        assert status == 200, answer
        run.resume_trainer()
        await wait_for(lambda: run.daemon.state.phase == Phase.HELD, WAIT_S)
        seen["stop"] = cli_started(run, "stop")  # the real CLI, as a person types it
        await asyncio.to_thread(seen["stop"].wait, 60)

    assert run.go(during) == 0
    started: subprocess.Popen[str] = seen["stop"]
    try:
        out, err = started.communicate(timeout=60)
    finally:
        if started.poll() is None:
            started.kill()
    assert started.returncode == 0, err
    assert out == (
        "stop: the box was held; the hold is released and the teardown goes ahead now "
        "(destroy: teardown.on_success = destroy)\n"
    )
    daemon = run.daemon
    assert history(run.env.state_dir)[-4:] == ["TEARDOWN", "HELD", "TEARDOWN", "DONE"]
    assert [h.get("note") for h in daemon.state.history if h.get("from") == "HELD"] == ["released"]
    assert [a["action"] for a in daemon.state.steering] == ["hold", "stop"]
    assert daemon.state.teardown is not None and daemon.state.teardown["action"] == "destroy"


def test_stop_while_training_under_a_hold_says_the_box_is_then_held(tmp_path: Path) -> None:
    # The hold was asked for: a stop ends the training, and the answer says the box is held
    # after it; a second stop in HELD then lets the teardown go.
    run = Run(tmp_path, make_job(tmp_path), ScriptedLauncher(epoch_s=0.1, pause_at=2))
    seen: dict[str, Any] = {}

    async def during(run: Run) -> None:
        await run.paused()
        status, answer = await post(run, "hold", "2h")
        assert status == 200, answer
        seen["stop"] = await post(run, "stop")
        await wait_for(lambda: run.daemon.state.phase == Phase.HELD, WAIT_S)
        seen["stop_held"] = await post(run, "stop")

    assert run.go(during) == 0
    status, answer = seen["stop"]
    assert status == 200
    assert answer["message"].startswith(
        "stop requested: the trainer gets SIGINT, then the final sync runs; the box is then "
        "HELD until "
    )
    assert answer["message"].endswith(" as asked (`release` lets the teardown go ahead)")
    status, answer = seen["stop_held"]
    assert status == 200
    assert answer["message"].startswith("stop: the box was held; the hold is released")
    assert run.daemon.state.reason == Reason.STOPPED_BY_USER
    assert history(run.env.state_dir)[-4:] == ["TEARDOWN", "HELD", "TEARDOWN", "DONE"]


# ------------------------------------------------------------------------------ a stop under way


def test_extend_and_a_second_stop_are_refused_while_a_stop_is_under_way(tmp_path: Path) -> None:
    # The trainer ignores SIGINT: the agent waits out train.stop_grace (30 s) in TRAINING with
    # the stop under way, which is when extend used to be accepted.
    job = make_job(tmp_path, limits='max_runtime = "1h"')
    run = Run(tmp_path, job, ScriptedLauncher(epoch_s=0.1, pause_at=2, ignore_sigint=True))
    seen: dict[str, Any] = {}

    async def during(run: Run) -> None:
        await run.paused()
        status, answer = await post(run, "stop")
        assert status == 200, answer
        assert answer["message"] == (
            "stop requested: the trainer gets SIGINT, then the final sync runs"
        )
        before = saved(run)
        status, answer = await post(run, "extend", "1h")
        seen["extend"] = (status, answer)
        seen["extend_cli"] = await cli(run, "extend", "1h")
        seen["stop_again"] = await post(run, "stop")
        assert run.daemon.state.phase == Phase.TRAINING  # still stopping: the case under test
        now = saved(run)
        seen["unchanged"] = (
            now["extended_s"] == before["extended_s"] == run.daemon.state.extended_s == 0.0
            and now["steering"] == before["steering"]
        )
        run.resume_trainer()  # it ignores SIGINT, so it trains to its end

    assert run.go(during) == 0
    status, answer = seen["extend"]
    assert status == 409
    assert answer == {
        "ok": False,
        "error": "cannot extend: the run is already stopping (a stop was requested); an "
        "extension cannot call the stop back",
    }
    proc = seen["extend_cli"]
    assert proc.returncode == 1 and proc.stdout == ""
    assert one_error(proc) == answer["error"]
    status, answer = seen["stop_again"]
    assert status == 409
    assert answer["error"] == (
        "a stop is already under way (a stop was requested): the final sync, then the teardown"
    )
    assert seen["unchanged"]
    assert run.daemon.state.reason == Reason.STOPPED_BY_USER
    assert [a["action"] for a in run.daemon.state.steering] == ["stop"]


# ------------------------------------------------------------------------------ bounds


def test_a_refused_hold_or_extend_changes_nothing_and_is_never_a_500(tmp_path: Path) -> None:
    job = make_job(tmp_path, limits='max_runtime = "1h"')
    # A job built in code can carry what `check` refuses: the endpoint bounds it again.
    job = dataclasses.replace(
        job, teardown=dataclasses.replace(job.teardown, hold_timeout_s=8.64e24)
    )
    clock = Clock()
    run = Run(tmp_path, job, ScriptedLauncher(epoch_s=0.1, pause_at=2), clock=clock)
    seen: dict[str, Any] = {}

    async def during(run: Run) -> None:
        await run.paused()
        before = saved(run)
        seen["hold_default"] = await post(run, "hold")
        seen["hold_huge"] = await post(run, "hold", '{"duration": "99999999999999999999d"}')
        for _ in range(3):  # 30 days in all
            status, answer = await post(run, "extend", "10d")
            assert status == 200, answer
        after_extends = saved(run)
        seen["extend_over"] = await post(run, "extend", "1m")
        seen["extend_cli"] = await cli(run, "extend", "1h")
        seen["unchanged"] = (
            before["hold"] is None
            and saved(run)["hold"] is None
            and saved(run)["extended_s"] == after_extends["extended_s"] == 30 * 86400.0
        )
        run.resume_trainer()

    assert run.go(during) == 0
    status, answer = seen["hold_default"]
    assert status == 400
    assert answer["error"].startswith("cannot hold for ")
    assert answer["error"].endswith(
        ": a hold lasts at most 30d from the request (hold again later to renew it)"
    )
    status, answer = seen["hold_huge"]
    assert status == 400
    assert answer["error"] == (
        "duration: '99999999999999999999d' is more than the 30d one request may ask for; ask "
        "for less (and again later if need be)"
    )
    status, answer = seen["extend_over"]
    assert status == 409
    assert answer["error"] == (
        "cannot extend by 1m: a run's extensions add up to at most 30d and 30d were already "
        "added; nothing more may be added (to train longer, raise limits.max_runtime in the job "
        "file for the next run)"
    )
    proc = seen["extend_cli"]
    assert proc.returncode == 1
    assert one_error(proc).startswith("cannot extend by 1h: a run's extensions add up to")
    assert seen["unchanged"]
    assert run.daemon.state.hold is None
    assert run.daemon.state.extended_s == 30 * 86400.0
    assert [a["action"] for a in run.daemon.state.steering] == ["extend"] * 3
    assert "Traceback" not in run.log()


# ------------------------------------------------------------------------------ the guard at DONE


def test_after_done_the_heartbeat_starts_no_guard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A beat every 0.2 s, and a webhook that hangs: the agent lingers after DONE (the last
    # notices get up to 5 s), which is when every beat used to start a guard that exited at once.
    monkeypatch.setenv("LIBREYOLO_AGENT_GUARD_STALE_AFTER", "1s")
    hung = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        hung.set()
        await asyncio.sleep(3600)
        return web.Response()

    runs: list[Run] = []

    async def main() -> int:
        app = web.Application()
        app.router.add_post("/hook", hang)
        runner = web.AppRunner(app, shutdown_timeout=1.0)  # the hung hook: not 60 s
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        notify = f'[notify]\nwebhook = "http://127.0.0.1:{port}/hook"\nevents = ["done"]\n'
        run = Run(tmp_path, make_job(tmp_path, sections=notify), ScriptedLauncher(epoch_s=0.1))
        run.daemon.start_guard = True
        runs.append(run)
        try:
            return await run.main()
        finally:
            await runner.cleanup()

    def guards() -> list[int]:
        log = runs[0].log() if runs else ""
        return [int(p) for p in re.findall(r"guard started \(pid (\d+)\)", log)]

    try:
        assert asyncio.run(main()) == 0
        assert hung.is_set()  # the agent did linger after DONE
        assert runs[0].daemon.state.phase == Phase.DONE
        assert len(guards()) == 1, f"guards started: {guards()}"  # at the start; none after DONE
    finally:
        for pid in guards():  # each exits by itself at DONE; never left behind if one did not
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


# ------------------------------------------------------------------------------ a config error


@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_config_error_before_the_first_epoch_is_a_failed_preflight(
    tmp_path: Path, fail_at: int
) -> None:
    # LibreYOLO exits 2 (config_type_error...) when it refuses an option. Before any epoch the
    # job's inputs are wrong, as a preflight would have found: preflight_failed and its
    # teardown choice (on_preflight_failure), not training_failed's (on_failure). After an
    # epoch it stays a failed training (the control).
    teardown = (
        '[teardown]\non_failure = "keep"\non_preflight_failure = "stop"\n'
        "require_verified_sync = false\n"
    )
    job = make_job(tmp_path, sections=teardown)
    launcher = ScriptedLauncher(epoch_s=0.1, fail_at=fail_at, exit_code=2, error="bad option")
    run = Run(tmp_path, job, launcher)
    assert run.go() == 0
    state = run.daemon.state
    assert state.outcome is not None and state.outcome["kind"] == "config"
    assert state.resumes == [] and len(launcher.launched) == 1
    assert state.teardown is not None
    if fail_at == 1:
        assert state.reason == Reason.PREFLIGHT_FAILED
        assert state.teardown["action"] == "stop"
        assert "teardown.on_preflight_failure = stop" in state.teardown["why"]
    else:
        assert state.reason == Reason.TRAINING_FAILED
        assert state.teardown["action"] == "keep"
    assert "bad option" in (state.cause or "")


@pytest.mark.training
@pytest.mark.skipif(
    shutil.which("libreyolo", path=str(Path(sys.executable).parent)) is None,
    reason="the training stack (libreyolo) is not installed: run ./install.sh",
)
def test_the_real_libreyolo_refusing_an_option_at_launch_is_a_failed_preflight(
    tmp_path: Path,
) -> None:
    # `cache` is text to LibreYOLO's types, so `check` lets "sometimes" through; the command
    # itself refuses it (config_type_error, exit 2) before epoch 1.
    from agent import demo
    from agent.daemon.spine import Daemon
    from tests.support import tiny_job

    data = demo.make_dataset(tmp_path / "ds")
    teardown = '[teardown]\non_failure = "keep"\non_preflight_failure = "stop"\n'
    job = tiny_job(tmp_path, data, train='cache = "sometimes"', sections=teardown)
    daemon = Daemon(job, Env(state_dir=tmp_path / "state"), poll_interval_s=0.2)
    assert asyncio.run(asyncio.wait_for(daemon.run(), 300)) == 0
    state = daemon.state
    assert state.outcome is not None, state.cause
    assert (state.outcome["kind"], state.outcome["exit_code"]) == ("config", 2)
    assert state.reason == Reason.PREFLIGHT_FAILED
    assert state.resumes == []
    assert state.teardown is not None and state.teardown["action"] == "stop"
    assert "cache" in (state.cause or "").lower()
