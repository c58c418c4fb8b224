"""``libreyolo-agent status --watch`` ends on Ctrl-C as ``logs --follow`` does: exit 0, nothing
on stderr, no traceback. A real CLI process watches a real endpoint; the test sends it SIGINT,
as a terminal does on Ctrl-C, once it has drawn what it read."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_cli import Docs, serving, status_doc

#: Bounds a hang; it times nothing (each wait ends on what the process wrote or did).
WAIT_S = 60


def _env(tmp_path: Path, term: str) -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "LIBREYOLO_AGENT_STATE_DIR": str(tmp_path / "state"),
        "NO_PROXY": "127.0.0.1,localhost",
        "TERM": term,
    }


def _read_until(fd: int, want: bytes) -> bytes:
    """What ``fd`` gives until ``want`` shows (a pty's leader: the terminal's screen)."""
    out = b""
    while want not in out:
        ready = select.select([fd], [], [], WAIT_S)[0]
        assert ready, out
        out += os.read(fd, 4096)
    return out


@pytest.mark.parametrize("json_out", [False, True], ids=["summary", "json"])
def test_ctrl_c_on_a_watch_over_a_pipe_exits_0_quietly(tmp_path: Path, json_out: bool) -> None:
    with serving(tmp_path, Docs(status_doc(epoch=3))):
        args = ["status", "--watch", "--interval", "0.05"] + (["--json"] if json_out else [])
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_env(tmp_path, "dumb"),
        )
        try:
            assert proc.stdout is not None
            while b"TRAINING" not in proc.stdout.readline():  # a read was shown
                assert proc.poll() is None
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err
    assert err == b"", err


def test_ctrl_c_on_a_watch_on_a_terminal_exits_0_quietly(tmp_path: Path) -> None:
    with serving(tmp_path, Docs(status_doc(epoch=5))):
        leader, follower = pty.openpty()
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "status", "--watch", "--interval", "0.05"],
            stdout=follower,
            stderr=subprocess.PIPE,
            env=_env(tmp_path, "xterm"),
        )
        os.close(follower)
        try:
            _read_until(leader, b"5/10")  # the live summary is drawn
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(leader)
    assert proc.returncode == 0, err
    assert err == b"", err
