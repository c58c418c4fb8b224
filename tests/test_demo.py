"""The demo job as a user runs it (``libreyolo-agent run`` with no JOB, agent/demo.py): real
processes, the real ``libreyolo train``, real signals.

Seen: Ctrl-C on the demo, then the demo again, gave two trainers: the second run's fresh start
deleted the folder under the still-running trainer (which then failed) and trained another one
in ``runs/demo2``; and the Ctrl-C'd agent exited 0 though its job had not ended.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.demo import EXIT_NOT_ENDED
from agent.state import Phase, Reason, StateStore
from agent.trainer.rundir import pid_alive
from tests.test_daemon import requires_libreyolo

pytestmark = pytest.mark.training

#: Generous: a loaded 2-core machine; every wait is on a condition, never on a time.
WAIT_S = 240.0


class DemoAgent:
    """``libreyolo-agent run --demo-dir ROOT`` as a real process, its stderr in a file."""

    def __init__(self, tmp: Path, root: Path, name: str) -> None:
        self.err_path = tmp / f"{name}.stderr"
        env = {k: v for k, v in os.environ.items() if k != "LIBREYOLO_AGENT_STATE_DIR"}
        with self.err_path.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agent.cli", "run", "--demo-dir", str(root)],
                stdout=subprocess.DEVNULL,
                stderr=err,
                cwd=tmp,
                env=env,
            )

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_said(self, text: str) -> None:
        end = time.monotonic() + WAIT_S
        while text not in self.stderr():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError(f"never said {text!r}:\n{self.stderr()[-3000:]}")
            time.sleep(0.1)

    def exit_code(self) -> int:
        return self.proc.wait(timeout=WAIT_S)

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_until(pred: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not in time")
        time.sleep(0.1)


@requires_libreyolo
def test_a_demo_left_training_is_reattached_by_the_next_demo_and_ctrl_c_stops_its_job(
    tmp_path: Path,
) -> None:
    root = tmp_path / "demo"
    store = StateStore(root / "state")
    first = DemoAgent(tmp_path, root, "first")
    second: DemoAgent | None = None
    trainer: int | None = None
    try:

        def training() -> bool:
            state = store.load() if (root / "state" / "state.json").exists() else None
            return (
                state is not None
                and state.trainer is not None
                and (root / "runs" / "demo" / "status.json").exists()
            )

        wait_until(training, "the first demo agent's trainer training")
        state = store.load()
        assert state is not None and state.trainer is not None
        trainer = state.trainer.pid
        # Frozen: nothing it does races with what follows (it keeps its signals pending).
        os.kill(trainer, signal.SIGSTOP)

        # The agent goes away (SIGTERM; a second Ctrl-C does the same), its trainer stays.
        first.proc.send_signal(signal.SIGTERM)
        assert first.exit_code() == EXIT_NOT_ENDED, first.stderr()[-3000:]
        assert (
            f"the demo job has not ended (phase TRAINING): its trainer (pid {trainer}) keeps "
            f"running; 'libreyolo-agent run --demo-dir {root}' again carries it on"
        ) in first.stderr()
        assert pid_alive(trainer)

        # The demo again: it carries the run on, re-attached, nothing wiped, no second trainer.
        second = DemoAgent(tmp_path, root, "second")
        second.wait_said(f"re-attached to trainer pid={trainer}")
        assert "the previous demo run has not ended (phase TRAINING" in second.stderr()
        assert sorted(p.name for p in (root / "runs").iterdir()) == ["demo"]
        assert (root / "runs" / "demo" / "status.json").exists()

        # Ctrl-C: the job stops (the trainer gets SIGINT), the final sync runs, exit 0.
        second.proc.send_signal(signal.SIGINT)
        second.wait_said(f"stopping trainer pid={trainer}: SIGINT")
        os.kill(trainer, signal.SIGCONT)
        assert second.exit_code() == 0, second.stderr()[-3000:]
        assert "Ctrl-C: stopping the demo job" in second.stderr()
        state = store.load()
        assert state is not None
        assert state.phase == Phase.DONE and state.reason == Reason.STOPPED_BY_USER, state.cause
        assert state.trainer is not None and state.trainer.pid == trainer
        assert state.outcome is not None and state.outcome["kind"] == "interrupted"
        assert not pid_alive(trainer)
        assert sorted(p.name for p in (root / "runs").iterdir()) == ["demo"]
        assert "Traceback" not in first.stderr() + second.stderr()
    finally:
        if trainer is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(trainer, signal.SIGCONT)
                os.kill(trainer, signal.SIGKILL)
        first.end()
        if second is not None:
            second.end()
