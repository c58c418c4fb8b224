"""The command provider with real subprocesses: exit status is the result (exit 0 confirms, as
nothing can be read back), output redacted and cut, a command past its timeout killed with its
whole process group, a stop without ``stop_command`` never runs the destroy command."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from agent.config.model import Env, TeardownSection
from agent.providers import ProviderError, make_provider
from agent.providers.command import CommandProvider

PY = sys.executable


def provider(
    command: list[str],
    *,
    stop_command: list[str] | None = None,
    timeout_s: float = 20.0,
    env: Env | None = None,
) -> CommandProvider:
    cfg = TeardownSection(
        provider="command",
        command=tuple(command),
        stop_command=tuple(stop_command or ()),
        command_timeout_s=timeout_s,
        on_failure="keep",
    )
    return CommandProvider(cfg, env or Env(), kill_grace_s=1.0)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie of ours counts as gone.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def test_exit_zero_is_confirmed_by_its_own_success() -> None:
    p = provider([PY, "-c", "print('instance deleted')"])
    sent: list[str] = []
    result = asyncio.run(p.teardown("destroy", "completed", on_sent=sent.append))
    assert (result.performed, result.confirmed) == (True, True)
    assert "exited 0" in result.detail
    assert "not read back: a command provider cannot read back" in result.detail
    assert "instance deleted" in result.detail
    assert len(sent) == 1 and "started" in sent[0]


def test_nonzero_exit_is_not_confirmed_and_says_why() -> None:
    p = provider([PY, "-c", "import sys; print('quota exceeded', file=sys.stderr); sys.exit(3)"])
    result = asyncio.run(p.teardown("destroy", "completed"))
    assert (result.performed, result.confirmed) == (True, False)
    assert "exit 3" in result.detail and "quota exceeded" in result.detail


def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(3600)\n"
    )
    # Long enough for a loaded machine to start both and write their pids before the kill.
    p = provider([PY, "-c", script], timeout_s=10.0)
    start = time.monotonic()
    result = asyncio.run(p.teardown("destroy", "timeout"))
    took = time.monotonic() - start
    assert (result.performed, result.confirmed) == (True, False)
    assert "timed out after 10s and was killed" in result.detail
    assert took < 60  # the timeout, not the script's hour (a loaded machine adds seconds)
    parent, child = (int(x) for x in pids.read_text().split())
    deadline = time.monotonic() + 60  # a cap for a hang: the loop ends when both are gone
    while (alive(parent) or alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(parent) and not alive(child)


def test_a_child_holding_the_output_open_does_not_hang_the_teardown(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    script = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('shutdown scheduled')\n"
    )
    try:
        start = time.monotonic()
        result = asyncio.run(provider([PY, "-c", script]).teardown("destroy", "completed"))
        assert time.monotonic() - start < 60  # not the child's hour
        assert result.confirmed and "shutdown scheduled" in result.detail
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_output_is_redacted_and_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "runpod-secret-key-abcdef0123"
    monkeypatch.setenv("RUNPOD_API_KEY", secret)
    script = "import os\nprint('x' * 1_000_000)\nprint('key is', os.environ['RUNPOD_API_KEY'])\n"
    p = provider([PY, "-c", script], env=Env(runpod_api_key=secret))
    result = asyncio.run(p.teardown("destroy", "completed"))
    assert result.confirmed
    assert secret not in result.detail
    assert "key is <RUNPOD_API_KEY>" in result.detail
    assert len(result.detail) < 1000


def test_the_command_is_told_the_action_and_reason() -> None:
    script = (
        "import os; print(os.environ['LIBREYOLO_TEARDOWN_ACTION'], "
        "os.environ['LIBREYOLO_TEARDOWN_REASON'])"
    )
    result = asyncio.run(provider([PY, "-c", script]).teardown("destroy", "budget"))
    assert "output: destroy budget" in result.detail


def test_stop_without_stop_command_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "destroyed"
    p = provider([PY, "-c", f"open({str(marker)!r}, 'w')"])
    assert p.can_stop is False
    result = asyncio.run(p.teardown("stop", "training_failed"))
    assert (result.performed, result.confirmed) == (False, False)
    assert "KEPT" in result.detail
    assert not marker.exists()


def test_stop_runs_the_stop_command_not_the_destroy_command(tmp_path: Path) -> None:
    destroyed, stopped = tmp_path / "destroyed", tmp_path / "stopped"
    p = provider(
        [PY, "-c", f"open({str(destroyed)!r}, 'w')"],
        stop_command=[PY, "-c", f"open({str(stopped)!r}, 'w')"],
    )
    assert p.can_stop
    result = asyncio.run(p.teardown("stop", "stalled"))
    assert result.confirmed
    assert stopped.exists() and not destroyed.exists()
    assert "disk keeps billing" in result.detail and "may be gone on restart" in result.detail


def test_missing_program_is_reported() -> None:
    p = provider(["/nonexistent/teardown-tool", "--now"])
    with pytest.raises(ProviderError) as info:
        asyncio.run(p.identify())
    assert info.value.kind == "config" and "teardown.command" in str(info.value)
    result = asyncio.run(p.teardown("destroy", "completed"))
    assert (result.performed, result.confirmed) == (False, False)
    assert "cannot start" in result.detail


def test_identify_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    p = provider([PY, "-c", f"open({str(marker)!r}, 'w')"])
    ident = asyncio.run(p.identify())
    assert ident.instance_id is None and "would run" in ident.detail
    assert not marker.exists()


def test_nothing_to_read_back() -> None:
    p = provider([PY, "-c", "pass"])
    assert asyncio.run(p.read_back("destroy")) is None
    confirm = asyncio.run(p.confirm("destroy"))
    assert not confirm.confirmed and "cannot read back" in confirm.detail


def test_keep_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    p = provider([PY, "-c", f"open({str(marker)!r}, 'w')"])
    result = asyncio.run(p.teardown("keep", "completed"))
    assert result.confirmed and not result.performed
    assert not marker.exists()


def test_make_provider_builds_it() -> None:
    cfg = TeardownSection(provider="command", command=(PY, "-c", "pass"), on_failure="keep")
    p = make_provider(cfg, Env())
    assert p.name == "command"
    assert asyncio.run(p.teardown("destroy", "completed")).confirmed


def test_the_command_gets_the_cloud_credentials_but_not_the_hub_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_command_must_not_see_this_0123")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-for-the-teardown-tool")
    script = (
        "import os; print('hf', os.environ.get('HF_TOKEN'), "
        "'aws', 'AWS_SECRET_ACCESS_KEY' in os.environ)"
    )
    result = asyncio.run(provider([PY, "-c", script]).teardown("destroy", "completed"))
    assert result.confirmed
    assert "output: hf None aws True" in result.detail
