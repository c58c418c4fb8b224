"""The agent's side of the guard (agent/guard/plan.py): the plan it writes, the heartbeat it beats,
and starting the guard process (a real one, in its own session), again when it died.

The fixtures and helpers here (``state_dir``, ``guards``, ``make_plan``) serve
tests/test_guard.py too, which tests the guard process itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.config.jobfile import parse_job
from agent.config.model import ConfigError
from agent.guard.plan import (
    HEARTBEAT_FILE,
    LOCK_FILE,
    LOG_FILE,
    NO_DEADLINE_STALE_S,
    PLAN_FILE,
    GuardPlan,
    check_environ,
    ensure_running,
    guard_pid,
    heartbeat_task,
    read_plan,
    write_plan,
)
from agent.state import atomic_write_json

TEARDOWN = {
    "provider": "none",
    "on_success": "destroy",
    "on_failure": "stop",
    "on_preflight_failure": "destroy",
    "require_verified_sync": True,
}


# ------------------------------------------------------------------------------------ helpers


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def guards() -> Iterator[list[int]]:
    """Pids of the guards a test started (children of pytest): killed and reaped at the end."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            if os.waitpid(pid, os.WNOHANG) == (0, 0):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def make_plan(
    state_dir: Path,
    *,
    deadline_in: float | None = -60.0,
    stale_after_s: float = 1.0,
    every_s: float = 0.1,
    started_ago: float = 3600.0,
    written_ago: float = 600.0,
    no_deadline_stale_s: float = NO_DEADLINE_STALE_S,
    **teardown: Any,
) -> GuardPlan:
    """A plan whose hard deadline is ``deadline_in`` seconds from now (None: no deadline)."""
    now = time.time()
    plan = GuardPlan(
        job_name="run1",
        started_at=now - started_ago,
        max_runtime_s=None if deadline_in is None else started_ago + deadline_in,
        margin_s=0.0,
        hard_deadline=None if deadline_in is None else now + deadline_in,
        stale_after_s=stale_after_s,
        no_deadline_stale_s=no_deadline_stale_s,
        check_every_s=every_s,
        heartbeat_every_s=every_s,
        teardown={**TEARDOWN, **teardown},
        written_at=now - written_ago,
    )
    atomic_write_json(state_dir / PLAN_FILE, plan.to_dict())
    return plan


def running(pid: int) -> bool:
    return os.waitpid(pid, os.WNOHANG) == (0, 0)


# ----------------------------------------------------------------------------------- the plan


def test_write_plan_sets_the_hard_deadline_and_holds_no_secret(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VAST_API_KEY", "secret-vast-key-123456")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_123456")
    job = parse_job('[train]\ndata = "/d/data.yaml"\n[limits]\nmax_runtime = "2h"\n', source="t")
    plan = write_plan(state_dir, job, 1000.0, environ={}, now=2000.0)
    assert plan.hard_deadline == 1000.0 + 7200 + 900
    assert (plan.stale_after_s, plan.heartbeat_every_s, plan.check_every_s) == (600, 30, 30)
    assert read_plan(state_dir) == plan
    assert plan.teardown_section() == job.teardown
    text = (state_dir / PLAN_FILE).read_text()
    assert "secret-vast-key" not in text and "hf_secret" not in text
    assert (state_dir / PLAN_FILE).stat().st_mode & 0o777 == 0o600

    env = {"LIBREYOLO_AGENT_GUARD_STALE_AFTER": "2s", "LIBREYOLO_AGENT_GUARD_MARGIN": "1m"}
    plan = write_plan(state_dir, job, 1000.0, environ=env)
    assert plan.hard_deadline == 1000.0 + 7200 + 60
    assert plan.stale_after_s == 2 and plan.heartbeat_every_s == pytest.approx(0.4)

    no_limit = parse_job('[train]\ndata = "/d/data.yaml"\n', source="t")
    assert write_plan(state_dir, no_limit, 1000.0, environ={}).hard_deadline is None


def test_a_bad_guard_variable_is_a_config_error_naming_it(state_dir: Path) -> None:
    job = parse_job('[train]\ndata = "/d/data.yaml"\n', source="t")
    bad = {"LIBREYOLO_AGENT_GUARD_STALE_AFTER": "soon"}
    with pytest.raises(ConfigError) as info:
        write_plan(state_dir, job, 0.0, environ=bad)
    assert str(info.value).startswith("LIBREYOLO_AGENT_GUARD_STALE_AFTER: 'soon' is not")
    with pytest.raises(ConfigError) as info:
        check_environ({"LIBREYOLO_AGENT_GUARD_MARGIN": "0s"})
    assert str(info.value).startswith("LIBREYOLO_AGENT_GUARD_MARGIN: '0s' must be a positive")
    check_environ({"LIBREYOLO_AGENT_GUARD_MARGIN": "90s"})
    assert not (state_dir / PLAN_FILE).exists()
    for name, value in (
        ("LIBREYOLO_AGENT_GUARD_SAVE_TIMEOUT", "forever"),
        ("LIBREYOLO_AGENT_TEARDOWN_TIMING", "retry_s=soon"),
    ):
        with pytest.raises(ConfigError) as info:
            check_environ({name: value})
        assert str(info.value).startswith(f"{name}: ")


def test_the_plan_carries_a_command_providers_argv_back_as_tuples(state_dir: Path) -> None:
    job = parse_job(
        '[train]\ndata = "/d/data.yaml"\n[teardown]\nprovider = "command"\n'
        'command = ["shutdown", "-h", "now"]\nstop_command = ["true"]\n',
        source="t",
    )
    plan = write_plan(state_dir, job, 0.0, environ={})
    again = read_plan(state_dir)
    assert again is not None and again.teardown_section() == job.teardown == plan.teardown_section()


# ------------------------------------------------------------- the heartbeat, starting the guard


def test_heartbeat_task_beats_and_starts_a_guard_again_when_it_dies(
    state_dir: Path, guards: list[int]
) -> None:
    make_plan(state_dir, deadline_in=3600)

    async def scenario() -> tuple[float, int, int]:
        task = asyncio.create_task(heartbeat_task(state_dir, 0.05))
        try:
            loop = asyncio.get_running_loop()
            end = loop.time() + 20
            while not (first := guard_pid(state_dir)):
                assert loop.time() < end, "no guard started"
                await asyncio.sleep(0.05)
            guards.append(first)
            os.kill(first, signal.SIGKILL)
            while (second := guard_pid(state_dir)) in (None, 0, first):
                assert loop.time() < end, "the dead guard was not replaced"
                await asyncio.sleep(0.05)
            assert second is not None
            guards.append(second)
            return os.stat(state_dir / HEARTBEAT_FILE).st_mtime, first, second
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    beat_at, first, second = asyncio.run(scenario())
    assert time.time() - beat_at < 5
    assert second != first and running(second)
    assert (state_dir / HEARTBEAT_FILE).stat().st_mode & 0o777 == 0o600
    with pytest.raises(ChildProcessError):
        os.waitpid(first, os.WNOHANG)  # the killed guard was reaped, not left a zombie


def test_ensure_running_hands_out_the_lock_holders_pid(state_dir: Path) -> None:
    # guard.lock held by some process that is not our child: its pid, and nothing spawned.
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, b"4242\n", 0)
        assert ensure_running(state_dir) == 4242
    finally:
        os.close(fd)
    assert not (state_dir / LOG_FILE).exists()
