"""The trainer process: launch, attach, stop, with real processes and
real signals (the scripted stand-in in tests/fakes plays ``libreyolo train``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import psutil
import pytest

from agent.state import TrainerRecord
from agent.trainer.outcome import classify, read_result
from agent.trainer.process import Trainer, TrainerError, process_tree
from agent.trainer.rundir import RunStatus, effective_state, pid_alive, read_status
from tests.test_outcome import OOM_MSG

FAKE = Path(__file__).resolve().parent / "fakes" / "scripted_trainer.py"
T = TypeVar("T")

# --------------------------------------------------------------------------------------------
# Real processes


@pytest.fixture
def reaper() -> Iterator[list[tuple[int, float]]]:
    """Processes a test started; whatever is still alive at the end is killed."""
    started: list[tuple[int, float]] = []
    yield started
    for pid, create_time in started:
        if pid_alive(pid, create_time):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # the trainer is our child (posix_spawn): collect it


def fake_argv(runs: Path, **opts: object) -> list[str]:
    args: dict[str, object] = {"project": runs, "name": "run1", **opts}
    return [sys.executable, str(FAKE), *(f"{k}={v}" for k, v in args.items())]


async def launch(tmp_path: Path, reaper: list[tuple[int, float]], **opts: object) -> Trainer:
    runs = tmp_path / "runs"
    trainer = await Trainer.launch(
        fake_argv(runs, **opts),
        log_path=tmp_path / "state" / "trainer.log",
        result_path=tmp_path / "state" / "trainer-result.json",
        cwd=runs,
    )
    reaper.append((trainer.pid, trainer.record.create_time))
    return trainer


async def eventually(check: Callable[[], T | None], timeout: float = 60.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def started(run_dir: Path) -> RunStatus | None:
    """status.json once the trainer has written it (its signal handlers are set by then)."""
    return read_status(run_dir)


def test_launch_is_detached_and_wait_returns_exit_code(
    tmp_path: Path, reaper: list[tuple[int, float]]
) -> None:
    async def scenario() -> tuple[Trainer, int, int | None]:
        trainer = await launch(tmp_path, reaper, epochs=3, epoch_s=0.1)
        sid = os.getsid(trainer.pid)
        assert trainer.alive()
        code = await asyncio.wait_for(trainer.wait(), 30)
        return trainer, sid, code

    trainer, sid, code = asyncio.run(scenario())
    assert sid != os.getsid(0)
    assert sid == trainer.pid  # the leader of a session of its own
    assert code == 0
    assert trainer.is_child and not trainer.alive()
    assert trainer.record.argv[1] == str(FAKE)
    result = read_result(tmp_path / "state" / "trainer-result.json")
    assert result is not None and result["status"] == "complete"
    run_dir = Path(result["save_dir"])
    assert run_dir == tmp_path / "runs" / "run1"
    st = read_status(run_dir)
    assert st is not None and st.state == "completed" and st.pid == trainer.pid
    assert classify(code, st, result).kind == "completed"
    log_text = (tmp_path / "state" / "trainer.log").read_text(encoding="utf-8")
    assert "=== libreyolo-agent " in log_text and str(FAKE) in log_text


@pytest.mark.parametrize(
    ("opts", "code", "kind"),
    [
        ({"error": OOM_MSG, "exit_code": 1}, 1, "oom"),
        ({"error": "dataset images missing", "exit_code": 3}, 3, "data"),
    ],
)
def test_failed_trainer_is_classified_from_its_files(
    tmp_path: Path, reaper: list[tuple[int, float]], opts: dict[str, object], code: int, kind: str
) -> None:
    async def scenario() -> int | None:
        trainer = await launch(tmp_path, reaper, epochs=5, fail_at=2, **opts)
        return await asyncio.wait_for(trainer.wait(), 30)

    exit_code = asyncio.run(scenario())
    assert exit_code == code
    st = read_status(tmp_path / "runs" / "run1")
    assert st is not None and st.state == "failed" and st.error_type == "RuntimeError"
    result = read_result(tmp_path / "state" / "trainer-result.json")
    assert classify(exit_code, st, result).kind == kind


def test_missing_executable_fails_visibly(tmp_path: Path) -> None:
    async def scenario() -> int | None:
        trainer = await Trainer.launch(
            [str(tmp_path / "no-such-libreyolo"), "train"],
            log_path=tmp_path / "trainer.log",
            result_path=tmp_path / "result.json",
            cwd=tmp_path,
        )
        return await asyncio.wait_for(trainer.wait(), 30)

    code = asyncio.run(scenario())
    assert code not in (0, None)
    assert classify(code, None, None).kind != "completed"
    assert "no-such-libreyolo" in (tmp_path / "trainer.log").read_text(encoding="utf-8")


def test_launch_into_an_uncreatable_folder_is_a_trainer_error(tmp_path: Path) -> None:
    # The daemon turns TrainerError into a training failure and tears down as planned; any
    # other exception crashes the agent.
    blocker = tmp_path / "runs"
    blocker.write_text("a file where the runs folder should be", encoding="utf-8")

    async def scenario() -> None:
        await Trainer.launch(
            [sys.executable, str(FAKE)],
            log_path=tmp_path / "state" / "trainer.log",
            result_path=tmp_path / "state" / "result.json",
            cwd=blocker / "sub",
        )

    with pytest.raises(TrainerError):
        asyncio.run(scenario())


def test_launch_failure_does_not_leak_the_log_fd(tmp_path: Path) -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def scenario() -> None:
        await Trainer.launch(
            [sys.executable, str(FAKE)],
            log_path=tmp_path / "state" / "trainer.log",
            result_path=tmp_path / "missing-dir" / "result.json",
            cwd=tmp_path,
        )

    before = open_fds()
    with pytest.raises(TrainerError):
        asyncio.run(scenario())
    assert open_fds() == before


def test_stop_sends_sigint_first_and_trainer_exits_130(
    tmp_path: Path, reaper: list[tuple[int, float]]
) -> None:
    run_dir = tmp_path / "runs" / "run1"

    async def scenario() -> tuple[str, int | None, float]:
        trainer = await launch(tmp_path, reaper, epochs=10_000, epoch_s=0.05)
        await eventually(lambda: started(run_dir))
        t0 = time.monotonic()
        how = await trainer.stop(stop_grace_s=120.0, kill_grace_s=1.0)
        return how, trainer.exit_code, time.monotonic() - t0

    how, code, took = asyncio.run(scenario())
    assert how == "SIGINT"
    assert code == 130
    assert took < 60.0  # it did not sit out the grace period (120 s: far from a slow exit)
    st = read_status(run_dir)
    assert st is not None and st.state == "failed" and st.error_type == "KeyboardInterrupt"
    assert classify(code, st, None, stop_requested=True).kind == "interrupted"


def test_trainer_ignoring_sigint_gets_sigterm(
    tmp_path: Path, reaper: list[tuple[int, float]]
) -> None:
    run_dir = tmp_path / "runs" / "run1"

    async def scenario() -> tuple[str, int | None, bool]:
        trainer = await launch(tmp_path, reaper, epochs=10_000, epoch_s=0.05, ignore_sigint="true")
        await eventually(lambda: started(run_dir))
        how = await trainer.stop(stop_grace_s=0.5, kill_grace_s=2.0)
        return how, trainer.exit_code, trainer.alive()

    how, code, alive = asyncio.run(scenario())
    assert how == "SIGTERM"
    assert code == -signal.SIGTERM
    assert not alive
    # No SIGTERM handler: status.json is left saying running, and only the pid tells the truth.
    st = read_status(run_dir)
    assert st is not None and st.state == "running"
    assert effective_state(st, alive=pid_alive(st.pid)) == "dead"
    outcome = classify(code, st, None, stop_requested=True)
    assert outcome.kind == "killed" and "SIGTERM" in outcome.message


def test_trainer_ignoring_sigint_and_sigterm_gets_sigkill(
    tmp_path: Path, reaper: list[tuple[int, float]]
) -> None:
    run_dir = tmp_path / "runs" / "run1"

    async def scenario() -> tuple[str, int | None]:
        trainer = await launch(
            tmp_path,
            reaper,
            epochs=10_000,
            epoch_s=0.05,
            ignore_sigint="true",
            ignore_sigterm="true",
        )
        await eventually(lambda: started(run_dir))
        how = await trainer.stop(stop_grace_s=0.5, kill_grace_s=0.5)
        return how, trainer.exit_code

    how, code = asyncio.run(scenario())
    assert how == "SIGKILL"
    assert code == -signal.SIGKILL


def test_stop_kills_a_child_in_its_own_session(
    tmp_path: Path, reaper: list[tuple[int, float]]
) -> None:
    # LibreYOLO's multi-GPU coordinator runs in a session of its own: a process-group kill
    # would miss it, and it would keep holding GPUs.
    run_dir = tmp_path / "runs" / "run1"

    async def scenario() -> tuple[str, int | None, list[psutil.Process], int, int]:
        trainer = await launch(tmp_path, reaper, epochs=10_000, epoch_s=0.05, child="true")
        pid_file = run_dir / "child.pid"
        await eventually(lambda: pid_file.exists() and pid_file.read_text(encoding="utf-8"))
        child_pid = int(pid_file.read_text(encoding="utf-8"))
        child = psutil.Process(child_pid)
        reaper.append((child_pid, child.create_time()))
        tree = process_tree(trainer.pid)
        assert child_pid in {p.pid for p in tree}
        assert child_pid in trainer.pids()
        sids = os.getsid(trainer.pid), os.getsid(child_pid)
        how = await trainer.stop(stop_grace_s=5.0, kill_grace_s=1.0)
        return how, trainer.exit_code, tree, *sids

    how, code, tree, trainer_sid, child_sid = asyncio.run(scenario())
    assert trainer_sid != child_sid
    assert how == "SIGINT"
    assert code == 130
    survivors = [p.pid for p in tree if pid_alive(p.pid, p.create_time())]
    assert survivors == []


def test_stop_of_an_exited_trainer_does_nothing(
    tmp_path: Path, reaper: list[tuple[int, float]]
) -> None:
    async def scenario() -> tuple[int | None, str]:
        trainer = await launch(tmp_path, reaper, epochs=1, epoch_s=0.01)
        code = await asyncio.wait_for(trainer.wait(), 30)
        return code, await trainer.stop(stop_grace_s=1.0, kill_grace_s=1.0)

    assert asyncio.run(scenario()) == (0, "none")


# --------------------------------------------------------------------------------------------
# Re-attaching to a trainer that is not our child


def spawn_orphan(*argv: str) -> TrainerRecord:
    """Start ``argv`` through a launcher that exits at once: the process is not our child.
    SIGINT at its default, as an earlier agent starts every trainer (agent/trainer/spawn.py),
    whatever this test process inherited."""
    launcher = (
        "import signal, subprocess, sys\n"
        "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
        "p = subprocess.Popen(sys.argv[1:], start_new_session=True, stdin=subprocess.DEVNULL,"
        " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid)\n"
        "p.returncode = 0\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", launcher, *argv],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    pid = int(out)
    proc = psutil.Process(pid)
    assert proc.ppid() != os.getpid()
    return TrainerRecord(
        pid=pid, create_time=proc.create_time(), started_at=time.time(), argv=list(argv)
    )


def test_attach_to_a_live_foreign_process_and_wait_for_its_exit(
    reaper: list[tuple[int, float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A polling fallback made to look once an hour: only the pidfd can notice the exit before
    # the (hang-only) cap below, however slow the machine.
    monkeypatch.setattr("agent.trainer.exitwait.EXIT_POLL_S", 3600.0)
    record = spawn_orphan(sys.executable, "-c", "import time; time.sleep(60)")
    reaper.append((record.pid, record.create_time))

    async def scenario() -> tuple[int | None, float, bool]:
        trainer = Trainer.attach(record)
        assert trainer is not None
        assert not trainer.is_child and trainer.alive()
        assert trainer.pid in trainer.pids()
        waiter = asyncio.create_task(trainer.wait())
        await asyncio.sleep(0.3)
        assert not waiter.done()
        t0 = time.monotonic()
        os.kill(record.pid, signal.SIGTERM)
        # The pidfd wakes the loop at the exit; the fallback would wait its hour.
        code = await asyncio.wait_for(waiter, 60.0)
        return code, time.monotonic() - t0, trainer.alive()

    code, took, alive = asyncio.run(scenario())
    assert code is None  # not our child: no exit code
    assert took < 60.0
    assert not alive


def test_attach_refuses_a_reused_pid_and_a_dead_one() -> None:
    me = psutil.Process()
    wrong_time = TrainerRecord(
        pid=me.pid, create_time=me.create_time() - 1000.0, started_at=0.0, argv=[]
    )
    assert Trainer.attach(wrong_time) is None
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    create_time = psutil.Process(proc.pid).create_time()
    proc.wait()
    gone = TrainerRecord(pid=proc.pid, create_time=create_time, started_at=0.0, argv=[])
    assert Trainer.attach(gone) is None


def test_stop_an_attached_trainer_with_sigint(
    tmp_path: Path, reaper: list[tuple[int, float]]
) -> None:
    runs = tmp_path / "runs"
    run_dir = runs / "run1"
    record = spawn_orphan(*fake_argv(runs, epochs=10_000, epoch_s=0.05))
    reaper.append((record.pid, record.create_time))

    async def scenario() -> tuple[str, int | None]:
        await eventually(lambda: started(run_dir))
        trainer = Trainer.attach(record)
        assert trainer is not None
        how = await trainer.stop(stop_grace_s=10.0, kill_grace_s=1.0)
        return how, await trainer.wait()

    how, code = asyncio.run(scenario())
    assert how == "SIGINT"
    assert code is None
    assert not pid_alive(record.pid, record.create_time)
    st = read_status(run_dir)
    assert st is not None and st.error_type == "KeyboardInterrupt"
    assert classify(None, st, None).kind == "interrupted"


def test_process_tree_follows_children_across_sessions_reading_only_the_tree() -> None:
    """process_tree reads /proc/PID/task/TID/children (the tree only) and finds what psutil's
    scan of every process finds, a grandchild in its own session included."""
    from agent.trainer.process import tree_cpu_seconds

    script = (
        "import os, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "start_new_session=True)\n"
        "subprocess.Popen(['sleep', '60'])\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(["bash", "-c", f'{sys.executable} -c "$0" & wait', script])
    try:
        root = psutil.Process(parent.pid)
        deadline = time.time() + 20
        while len(root.children(recursive=True)) < 3 and time.time() < deadline:
            time.sleep(0.1)
        expected = sorted([parent.pid, *(c.pid for c in root.children(recursive=True))])
        assert len(expected) == 4
        assert sorted(p.pid for p in process_tree(parent.pid)) == expected
        # Members given beside their root are read once, not once per member.
        cpu = tree_cpu_seconds(set(expected))
        assert sorted(pid for pid, _ in cpu) == expected
    finally:
        for proc in [*psutil.Process(parent.pid).children(recursive=True), parent]:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                proc.kill()
        parent.wait()


def _ignored(pid: int) -> set[int]:
    """The signals process ``pid`` ignores (its SigIgn mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            mask = int(line.split()[1], 16)
            return {n for n in range(1, 65) if mask & (1 << (n - 1))}
    raise AssertionError(f"no SigIgn line for pid {pid}")


def test_a_trainer_started_from_a_process_that_ignores_sigint_still_takes_sigint(
    tmp_path: Path, reaper: list[tuple[int, float]]
) -> None:
    """A process started in the background by a non-interactive shell (`cmd &`, as CI runners
    and on-start scripts do) ignores SIGINT and SIGQUIT, and an ignored signal stays ignored
    across exec. The trainer must start with them at their defaults, or the agent's stop
    (SIGINT: LibreYOLO saves and exits 130) is ignored until the grace period ends."""
    run_dir = tmp_path / "runs" / "run1"
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGQUIT)}
    try:

        async def launched() -> Trainer:
            trainer = await launch(tmp_path, reaper, epochs=10_000, epoch_s=0.05)
            await eventually(lambda: started(run_dir))
            return trainer

        trainer = asyncio.run(launched())
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    assert signal.SIGINT not in _ignored(trainer.pid)
    assert signal.SIGQUIT not in _ignored(trainer.pid)

    async def stop() -> str:
        return await trainer.stop(stop_grace_s=60.0, kill_grace_s=1.0)

    assert asyncio.run(stop()) == "SIGINT"
    assert trainer.exit_code == 130
