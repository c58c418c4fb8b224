"""The processes a test leaves behind are found and killed (tests/leftovers.py, the autouse fixture
in tests/conftest.py), those in sessions of their own included, and nothing else is touched."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests import leftovers

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    proc = leftovers._stat(str(pid))
    return proc is not None and proc.state != "Z"


def _orphan_in_own_session(env: dict[str, str]) -> int:
    """A ``sleep`` in a session of its own whose parent has exited: it is no descendant of
    pytest any more (like a trainer or a guard whose agent died)."""
    out = subprocess.run(
        [sys.executable, "-c", _SPAWN_ORPHAN],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return int(out.strip())


_SPAWN_ORPHAN = """
import subprocess
p = subprocess.Popen(
    ["sleep", "300"], start_new_session=True,
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
print(p.pid)
"""


def _next_tick() -> int:
    """The tick now, once it is later than every process started so far; what starts from
    here on starts after it."""
    start = leftovers.now_ticks()
    while leftovers.now_ticks() <= start + 1:
        time.sleep(0.005)
    since = leftovers.now_ticks()
    while leftovers.now_ticks() <= since:
        time.sleep(0.005)
    return since


def test_a_tagged_process_that_left_the_tree_is_found_and_killed() -> None:
    tag = uuid.uuid4().hex
    since = leftovers.now_ticks()
    pid = _orphan_in_own_session(dict(os.environ, **{leftovers.TAG_ENV: tag}))
    try:
        assert os.getppid() != pid and _alive(pid)
        assert pid in {p.pid for p in leftovers.find(tag, since)}
        killed = leftovers.end_leftovers(tag, since)
        assert any(line.startswith(f"pid {pid}: sleep 300") for line in killed), killed
        assert not _alive(pid)
        assert leftovers.find(tag, since) == []
    finally:
        if _alive(pid):
            os.kill(pid, 9)


def test_a_child_with_an_environment_of_its_own_is_found_by_descent() -> None:
    tag = uuid.uuid4().hex
    since = _next_tick()
    child = subprocess.Popen(["sleep", "300"], env={"PATH": os.environ.get("PATH", "")})
    try:
        killed = leftovers.end_leftovers(tag, since)
        assert [line.split(":")[0] for line in killed] == [f"pid {child.pid}"]
        assert child.wait(timeout=30) == -9
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_what_the_test_did_not_start_is_left_alone() -> None:
    # Started before the test (a module fixture's server), and another test's tagged process.
    older = subprocess.Popen(["sleep", "300"])
    other = subprocess.Popen(
        ["sleep", "300"], env=dict(os.environ, **{leftovers.TAG_ENV: "another-test"})
    )
    try:
        since = _next_tick()
        assert leftovers.end_leftovers(uuid.uuid4().hex, since) == []
        assert older.poll() is None and other.poll() is None
    finally:
        for p in (older, other):
            p.kill()
            p.wait()


def test_a_process_that_exits_by_itself_within_the_grace_is_not_reported() -> None:
    tag = uuid.uuid4().hex
    since = _next_tick()
    child = subprocess.Popen(["sleep", "0.3"])
    try:
        assert leftovers.end_leftovers(tag, since) == []
    finally:
        child.wait(timeout=30)
    assert child.returncode == 0


def test_the_fixture_kills_what_a_failing_test_left_and_says_so(
    pytester: pytest.Pytester,
) -> None:
    # The real fixture, in a pytest run of its own: a test starts an orphan in its own session
    # (the 120-epoch trainer of the report), then fails.
    pidfile = pytester.path / "orphan.pid"
    pytester.makeconftest("from tests.conftest import _ends_its_processes, pytest_configure\n")
    pytester.makeini("[pytest]\nfilterwarnings =\n    error\n")  # as this project's
    pytester.makepyfile(
        test_leaky=f"""
import pathlib, subprocess, sys

def test_leaks():
    out = subprocess.run([sys.executable, "-c", {_SPAWN_ORPHAN!r}], capture_output=True,
                         text=True, check=True).stdout
    pathlib.Path({str(pidfile)!r}).write_text(out)
    assert False, "the test fails, its process is still running"
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    pid = int(pidfile.read_text())
    try:
        result.assert_outcomes(failed=1)
        out = result.stdout.str()
        assert "LeftoverProcessWarning" in out
        assert f"test_leaky.py::test_leaks left 1 process(es) running; killed: pid {pid}" in out
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, 9)


def test_a_test_stopped_by_its_timeout_has_its_processes_killed_too(
    pytester: pytest.Pytester,
) -> None:
    # Seen: a 120-epoch trainer and a guard kept running after a test's timeout.
    pidfile = pytester.path / "orphan.pid"
    pytester.makeconftest("from tests.conftest import _ends_its_processes, pytest_configure\n")
    pytester.makepyfile(
        test_slow=f"""
import pathlib, subprocess, sys, time

def test_hangs():
    out = subprocess.run([sys.executable, "-c", {_SPAWN_ORPHAN!r}], capture_output=True,
                         text=True, check=True).stdout
    pathlib.Path({str(pidfile)!r}).write_text(out)
    time.sleep(600)
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--timeout", "5")
    pid = int(pidfile.read_text())
    try:
        result.assert_outcomes(failed=1)
        assert "Timeout" in result.stdout.str()
        assert f"killed: pid {pid}: sleep 300" in result.stdout.str()
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, 9)


@pytest.fixture(autouse=True)
def _importable_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inner pytest run imports this project's ``tests`` package."""
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), old) if p))
