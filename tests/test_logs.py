"""``libreyolo-agent logs``: the state directory's logs through the real CLI, redacted; ``--follow``
like ``tail -F`` (an appended line, a rotated file, a truncated one), ended by Ctrl-C (exit 0)
or by its reader going away (no traceback)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agent.logs import LOG_FILES

REPO = Path(__file__).resolve().parents[1]
#: A hang cap, not a guess at speed: every wait below ends on the line it waits for.
WAIT_S = 60.0
SECRET_LINE = "uploading with Authorization: Bearer abcdefghijklmnopqrstuvwxyz0123"


def logs_cli(state: Path, *args: str, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "logs", "--state-dir", str(state), *args],
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "HOME": str(state)},
        **kwargs,  # type: ignore[call-overload]
    )


def run_logs(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = logs_cli(state, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=WAIT_S)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir()
    return d


def test_the_last_lines_of_the_agents_log_redacted(state: Path) -> None:
    lines = [f"line {i}" for i in range(30)] + [SECRET_LINE]
    (state / "agent.log").write_text("\n".join(lines) + "\n")
    proc = run_logs(state, "-n", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "line 28",
        "line 29",
        "uploading with Authorization: Bearer <secret>",
    ]


@pytest.mark.parametrize("which", sorted(LOG_FILES))
def test_each_option_shows_its_own_file(state: Path, which: str) -> None:
    for name, file in LOG_FILES.items():
        (state / file).write_text(f"this is {name}\n")
    proc = run_logs(state, f"--{which}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"this is {which}\n"


@pytest.mark.parametrize("which", sorted(LOG_FILES))
def test_each_log_can_be_named_as_a_word_too(state: Path, which: str) -> None:
    # `logs guard` as a person types it, the same as `logs --guard` (it was a usage error).
    for name, file in LOG_FILES.items():
        (state / file).write_text(f"this is {name}\n")
    proc = run_logs(state, which)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"this is {which}\n"
    same = run_logs(state, which, f"--{which}")
    assert (same.returncode, same.stdout) == (0, f"this is {which}\n"), same.stderr


def test_a_word_and_an_option_naming_two_logs_is_one_line_and_exit_2(state: Path) -> None:
    (state / "guard.log").write_text("guard\n")
    proc = run_logs(state, "guard", "--trainer")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == "libreyolo-agent: error: 'guard' and --trainer name two logs: give one\n"
    unknown = run_logs(state, "gaurd")
    assert unknown.returncode == 2 and "invalid choice: 'gaurd'" in unknown.stderr
    assert "Traceback" not in proc.stderr + unknown.stderr


def test_a_missing_log_is_one_line_and_exit_1(state: Path) -> None:
    proc = run_logs(state, "--trainer")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.startswith("libreyolo-agent: error: no trainer.log in ")
    assert len(proc.stderr.splitlines()) == 1


class Follower:
    """``logs --follow`` running, its stdout read line by line in a thread."""

    def __init__(self, state: Path, *args: str) -> None:
        self.proc = logs_cli(
            state, "--follow", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def next(self) -> str:
        return self.lines.get(timeout=WAIT_S)

    def interrupt(self) -> tuple[int, str]:
        """Ctrl-C, as a terminal sends it."""
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout=WAIT_S)
        self._reader.join(WAIT_S)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        err = self.proc.stderr.read()
        self.proc.stdout.close()
        self.proc.stderr.close()
        return code, err


def append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def test_follow_sees_appended_lines_a_rotation_and_a_truncation_and_ends_on_ctrl_c(
    state: Path,
) -> None:
    log = state / "agent.log"
    log.write_text("old 1\nold 2\n")
    f = Follower(state, "-n", "1")
    try:
        assert f.next() == "old 2"
        append(log, "appended\n")
        assert f.next() == "appended"
        append(log, "half a li")  # not shown until its line ends
        append(log, f"ne\n{SECRET_LINE}\n")
        assert f.next() == "half a line"
        assert f.next() == "uploading with Authorization: Bearer <secret>"
        # Rotated (logrotate's default): the old file renamed, a new one in its place.
        append(log, "last of the old file\n")
        log.rename(state / "agent.log.1")
        assert f.next() == "last of the old file"
        log.write_text("first of the new file\n")
        assert f.next() == "first of the new file"
        # Truncated in place (copytruncate), then written again.
        log.write_text("")
        append(log, "after truncation\n")
        assert f.next() == "after truncation"
    finally:
        code, err = f.interrupt()
    assert code == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_follow_waits_for_a_log_that_does_not_exist_yet(state: Path) -> None:
    f = Follower(state, "--guard")
    try:
        (state / "guard.log").write_text("guard: watching\n")
        assert f.next() == "guard: watching"
    finally:
        code, err = f.interrupt()
    assert code == 0, err


def test_follow_whose_reader_went_away_ends_without_a_traceback(state: Path) -> None:
    # `libreyolo-agent logs --follow | head -1`: head reads one line and exits.
    log = state / "agent.log"
    log.write_text("first\n")
    r, w = os.pipe()
    proc = logs_cli(state, "--follow", "-n", "1", stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    with os.fdopen(r) as reader:
        assert reader.readline() == "first\n"
    # The next line it writes meets the closed pipe.
    append(log, "second\n")
    assert proc.wait(timeout=WAIT_S) == 0  # as normal an end as Ctrl-C
    assert proc.stderr is not None
    with proc.stderr:
        err = proc.stderr.read()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_logs_piped_to_head_gets_no_traceback(state: Path) -> None:
    (state / "agent.log").write_text("".join(f"line {i}\n" for i in range(5000)))
    proc = subprocess.run(
        f"{sys.executable} -m agent.cli logs -n 5000 --state-dir {state} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=WAIT_S,
    )
    assert proc.stdout == "line 0\n"
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
