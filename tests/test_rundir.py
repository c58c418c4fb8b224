"""Reading LibreYOLO's run directory: status.json, metrics.jsonl, weights/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent.trainer.rundir import (
    RunStatus,
    effective_state,
    epoch_snapshots,
    find_run_dir,
    is_valid_checkpoint,
    pid_alive,
    read_metrics,
    read_status,
)
from tests.fakes.scripted_trainer import write_checkpoint

# Shapes as LibreYOLO 1.6.0's TrainingStatusCallback writes them.
RUNNING_MID_TRAINING: dict[str, Any] = {
    "best_epoch": 2,
    "best_metric": 0.4211,
    "best_metric_name": "mAP50_95",
    "completed_epochs": 3,
    "current_epoch": 3,
    "current_metric": 0.4102,
    "current_metric_name": "mAP50_95",
    "elapsed_seconds": 312.5,
    "epoch_seconds": 101.2,
    "eta_seconds": 9611.4,
    "mean_epoch_seconds": 104.1,
    "metrics": {"mAP50": 0.61, "mAP50_95": 0.4102},
    "model_family": "yolox",
    "model_size": "n",
    "pid": 12345,
    "progress": 0.03,
    "save_dir": "/root/runs/run1",
    "schema_version": 1,
    "start_epoch": 1,
    "started_at": "2025-01-01T10:00:00+00:00",
    "state": "running",
    "task": "detect",
    "total_epochs": 100,
    "train_loss": 3.21,
    "updated_at": "2025-01-01T10:05:12+00:00",
    "validated": True,
}
STARTING: dict[str, Any] = {
    "completed_epochs": 0,
    "current_epoch": None,
    "elapsed_seconds": 0.0,
    "model_family": "yolox",
    "pid": 12345,
    "progress": 0.0,
    "save_dir": "/root/runs/run1",
    "schema_version": 1,
    "state": "running",
    "total_epochs": 100,
    "updated_at": "2025-01-01T10:00:00+00:00",
}
COMPLETED: dict[str, Any] = {
    "best_epoch": 97,
    "best_metric": 0.55,
    "checkpoints": {
        "best": "/root/runs/run1/weights/best.pt",
        "last": "/root/runs/run1/weights/last.pt",
    },
    "completed_epochs": 100,
    "pid": 12345,
    "progress": 1.0,
    "save_dir": "/root/runs/run1",
    "state": "completed",
    "total_epochs": 100,
    "total_seconds": 10412.0,
    "updated_at": "2025-01-01T12:53:32+00:00",
}
# A failure carries error {type, message} and, like the real one, no completed_epochs.
FAILED_OOM: dict[str, Any] = {
    "current_epoch": 4,
    "elapsed_seconds": 400.2,
    "error": {
        "type": "OutOfMemoryError",
        "message": "CUDA out of memory. Tried to allocate 2.00 GiB",
    },
    "pid": 12345,
    "progress": 0.0,
    "save_dir": "/root/runs/run1",
    "state": "failed",
    "total_epochs": 100,
    "updated_at": "2025-01-01T10:06:40+00:00",
}
FAILED_SIGINT: dict[str, Any] = {
    **FAILED_OOM,
    "error": {"type": "KeyboardInterrupt", "message": ""},
}


def write_status(run_dir: Path, doc: Any) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "status.json").write_text(json.dumps(doc, indent=2), encoding="utf-8")


def dead_pid() -> tuple[int, float]:
    """The pid and create time of a real process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    create_time = psutil.Process(proc.pid).create_time()
    proc.wait()
    return proc.pid, create_time


def test_read_status_running_mid_training(tmp_path: Path) -> None:
    write_status(tmp_path, RUNNING_MID_TRAINING)
    st = read_status(tmp_path)
    assert st is not None
    assert (st.state, st.pid, st.save_dir) == ("running", 12345, "/root/runs/run1")
    assert (st.completed_epochs, st.total_epochs, st.current_epoch) == (3, 100, 3)
    assert st.eta_seconds == 9611.4
    assert (st.best_epoch, st.best_metric) == (2, 0.4211)
    assert st.error_type is None and st.error_message is None
    assert st.updated_at == "2025-01-01T10:05:12+00:00"
    assert st.raw["metrics"]["mAP50"] == 0.61


def test_read_status_at_train_start(tmp_path: Path) -> None:
    write_status(tmp_path, STARTING)
    st = read_status(tmp_path)
    assert st is not None
    assert st.completed_epochs == 0 and st.current_epoch is None and st.best_epoch is None


def test_read_status_completed(tmp_path: Path) -> None:
    write_status(tmp_path, COMPLETED)
    st = read_status(tmp_path)
    assert st is not None
    assert (st.state, st.completed_epochs, st.best_epoch) == ("completed", 100, 97)
    assert st.eta_seconds is None


def test_read_status_failed_with_error(tmp_path: Path) -> None:
    write_status(tmp_path, FAILED_OOM)
    st = read_status(tmp_path)
    assert st is not None
    assert st.state == "failed"
    assert st.error_type == "OutOfMemoryError"
    assert st.error_message == "CUDA out of memory. Tried to allocate 2.00 GiB"
    # The failure write has no completed_epochs, only the epoch that was running: the three
    # before it are complete (regression: reading 0 looked like a fresh run and reset progress).
    assert st.completed_epochs == 3
    assert st.current_epoch == 4


def test_read_status_keyboard_interrupt_keeps_empty_message(tmp_path: Path) -> None:
    write_status(tmp_path, FAILED_SIGINT)
    st = read_status(tmp_path)
    assert st is not None
    assert (st.error_type, st.error_message) == ("KeyboardInterrupt", "")


@pytest.mark.parametrize(
    "content",
    [
        b'{"state": "runn',
        b"",
        b"[1, 2, 3]",
        b'"running"',
        b"\xff\xfe{}",
        b"not json at all",
    ],
)
def test_read_status_of_torn_or_invalid_file_is_none(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "status.json").write_bytes(content)
    assert read_status(tmp_path) is None


def test_read_status_missing_is_none(tmp_path: Path) -> None:
    assert read_status(tmp_path / "nowhere") is None


def test_read_status_ignores_wrong_types() -> None:
    st = RunStatus.from_dict(
        {
            "state": "running",
            "pid": True,
            "completed_epochs": "3",
            "total_epochs": 10.0,
            "eta_seconds": "soon",
            "save_dir": 7,
            "error": "boom",
        }
    )
    assert st.pid is None
    assert st.completed_epochs == 0
    assert st.total_epochs is None
    assert st.eta_seconds is None
    assert st.save_dir is None
    assert st.error_type is None


def test_running_status_with_dead_pid_is_dead(tmp_path: Path) -> None:
    pid, create_time = dead_pid()
    write_status(tmp_path, {**RUNNING_MID_TRAINING, "pid": pid})
    st = read_status(tmp_path)
    assert st is not None and st.state == "running"
    assert not pid_alive(st.pid, create_time)
    assert effective_state(st, alive=pid_alive(st.pid, create_time)) == "dead"


def test_running_status_with_live_pid_is_running(tmp_path: Path) -> None:
    me = psutil.Process()
    write_status(tmp_path, {**RUNNING_MID_TRAINING, "pid": me.pid})
    st = read_status(tmp_path)
    assert st is not None
    assert effective_state(st, alive=pid_alive(st.pid, me.create_time())) == "running"


@pytest.mark.parametrize("doc", [COMPLETED, FAILED_OOM])
def test_finished_status_is_not_dead(doc: dict[str, Any]) -> None:
    st = RunStatus.from_dict(doc)
    assert effective_state(st, alive=False) == doc["state"]


def test_pid_alive_checks_create_time() -> None:
    me = psutil.Process()
    assert pid_alive(me.pid)
    assert pid_alive(me.pid, me.create_time())
    assert not pid_alive(me.pid, me.create_time() - 100.0)
    assert not pid_alive(me.pid, me.create_time() + 1.0)
    assert not pid_alive(None)
    assert not pid_alive(0)


def test_pid_alive_is_false_for_an_exited_process() -> None:
    pid, create_time = dead_pid()
    assert not pid_alive(pid, create_time)


def test_pid_alive_is_false_for_a_zombie() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "child never exited"
            time.sleep(0.01)
        assert not pid_alive(proc.pid)
    finally:
        proc.wait()


def test_find_run_dir_finds_renamed_run_by_pid(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    other_pid, _ = dead_pid()
    # An older run that took the name run1; ours became run12.
    write_status(runs / "run1", {**COMPLETED, "pid": other_pid, "save_dir": str(runs / "run1")})
    write_status(runs / "run12", {**STARTING, "pid": os.getpid(), "save_dir": str(runs / "run12")})
    (runs / "run2").mkdir()  # no status.json yet
    (runs / "stray-file").write_text("x", encoding="utf-8")
    assert find_run_dir(runs, {os.getpid()}) == runs / "run12"
    assert find_run_dir(runs, {os.getpid() + 1_000_000}) is None


def test_find_run_dir_finds_run12_of_a_real_second_run(tmp_path: Path) -> None:
    # Two trainers asked for name=run1: the second one writes into run12.
    runs = tmp_path / "runs"
    fake = Path(__file__).resolve().parent / "fakes" / "scripted_trainer.py"
    pids = []
    for _ in range(2):
        argv = [sys.executable, str(fake), f"project={runs}", "name=run1", "epochs=2", "epoch_s=0"]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        assert proc.wait(timeout=60) == 0
        pids.append(proc.pid)
    assert sorted(p.name for p in runs.iterdir()) == ["run1", "run12"]
    assert find_run_dir(runs, {pids[1]}) == runs / "run12"
    assert find_run_dir(runs, {pids[0]}) == runs / "run1"
    st = read_status(runs / "run12")
    assert st is not None and (st.state, st.completed_epochs, st.best_epoch) == ("completed", 2, 2)
    assert [row["epoch"] for row in read_metrics(runs / "run12")] == [1, 2]
    assert is_valid_checkpoint(runs / "run12" / "weights" / "last.pt")


def test_find_run_dir_matches_any_pid_of_the_tree(tmp_path: Path) -> None:
    # With several GPUs, status.json carries a rank's pid, not the launcher's.
    runs = tmp_path / "runs"
    write_status(runs / "run1", {**STARTING, "pid": 777, "save_dir": str(runs / "run1")})
    assert find_run_dir(runs, {100, 777}) == runs / "run1"


def test_find_run_dir_ignores_runs_older_than_the_launch(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    write_status(runs / "run1", {**STARTING, "pid": os.getpid(), "save_dir": str(runs / "run1")})
    old = time.time() - 3600
    os.utime(runs / "run1" / "status.json", (old, old))
    assert find_run_dir(runs, {os.getpid()}, newer_than=time.time() - 60) is None
    assert find_run_dir(runs, {os.getpid()}) == runs / "run1"


def test_find_run_dir_prefers_save_dir_from_status(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    real = tmp_path / "elsewhere" / "run1"
    write_status(runs / "run1", {**STARTING, "pid": os.getpid(), "save_dir": str(real)})
    assert find_run_dir(runs, {os.getpid()}) == real


def test_find_run_dir_without_runs_dir_is_none(tmp_path: Path) -> None:
    assert find_run_dir(tmp_path / "missing", {os.getpid()}) is None


def test_read_metrics_skips_a_torn_last_line(tmp_path: Path) -> None:
    rows = [{"epoch": i, "train/loss": 1.0 / i} for i in (1, 2, 3)]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"epoch": 4, "train/lo'
    (tmp_path / "metrics.jsonl").write_text(text, encoding="utf-8")
    assert read_metrics(tmp_path) == rows


def test_read_metrics_skips_blank_and_non_object_lines(tmp_path: Path) -> None:
    text = '{"epoch": 1}\n\n[1, 2]\n"x"\n{"epoch": 2}\n'
    (tmp_path / "metrics.jsonl").write_text(text, encoding="utf-8")
    assert read_metrics(tmp_path) == [{"epoch": 1}, {"epoch": 2}]


def test_read_metrics_missing_is_empty(tmp_path: Path) -> None:
    assert read_metrics(tmp_path) == []


def test_epoch_snapshots(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    for name in ("epoch_5.pt", "epoch_10.pt", "last.pt", "best.pt", "epoch_x.pt", "epoch_3.pt.tmp"):
        write_checkpoint(weights / name, 1)
    assert epoch_snapshots(tmp_path) == {5: weights / "epoch_5.pt", 10: weights / "epoch_10.pt"}
    assert epoch_snapshots(tmp_path / "missing") == {}


def test_is_valid_checkpoint_on_real_and_truncated_zip(tmp_path: Path) -> None:
    good = tmp_path / "last.pt"
    write_checkpoint(good, 7, payload_kb=64)
    assert zipfile.is_zipfile(good)
    assert is_valid_checkpoint(good)
    data = good.read_bytes()
    truncated = tmp_path / "torn.pt"
    truncated.write_bytes(data[: len(data) // 2])
    assert not is_valid_checkpoint(truncated)


def test_is_valid_checkpoint_detects_corrupt_member_data(tmp_path: Path) -> None:
    # The central directory is intact but the member bytes were damaged: CRC mismatch.
    path = tmp_path / "last.pt"
    write_checkpoint(path, 3, payload_kb=16)
    data = bytearray(path.read_bytes())
    marker = data.find(b"epoch=3;")
    assert marker > 0
    data[marker : marker + 8] = b"XXXXXXXX"
    path.write_bytes(bytes(data))
    assert not is_valid_checkpoint(path)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04", b"not a zip at all" * 100])
def test_is_valid_checkpoint_rejects_non_zips(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.pt"
    path.write_bytes(content)
    assert not is_valid_checkpoint(path)


def test_is_valid_checkpoint_missing_file(tmp_path: Path) -> None:
    assert not is_valid_checkpoint(tmp_path / "nope.pt")


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"completed_epochs": 1, "total_epochs": 3, "eta_seconds": 125.4}, " (eta 2m5s)"),
        ({"completed_epochs": 3, "total_epochs": 3, "eta_seconds": None}, " (the last)"),
        ({"completed_epochs": 3, "total_epochs": 3, "eta_seconds": 0.0}, " (the last)"),
        ({"completed_epochs": 1, "total_epochs": 3, "eta_seconds": None}, ""),
        ({"completed_epochs": 1, "total_epochs": None, "eta_seconds": None}, ""),
        # A hand-written or broken status.json: no estimate rather than "nan" or a crash.
        ({"completed_epochs": 1, "total_epochs": 3, "eta_seconds": float("nan")}, ""),
        ({"completed_epochs": 1, "total_epochs": 3, "eta_seconds": float("inf")}, ""),
        ({"completed_epochs": 1, "total_epochs": 3, "eta_seconds": -4.0}, ""),
    ],
)
def test_the_epoch_line_says_the_eta_the_last_epoch_or_nothing(
    doc: dict[str, Any], words: str
) -> None:
    from agent.daemon.training import epoch_eta

    assert epoch_eta(RunStatus.from_dict({"state": "running", **doc})) == words
