"""``[train] loggers``: the trainer through LibreYOLO's Python API with its experiment loggers,
one run across a stop and a resume (:mod:`agent.trainer.logged_entry`, ``trainer/trackers.py``).

The training test runs the real ``libreyolo train`` (tiny synthetic data, CPU) the way the agent
launches it (:func:`agent.trainer.process.build_argv`, :func:`agent.trainer.spawn.trainer_env`,
its own session), stops it with SIGINT after epoch 1 as the agent does, resumes it from
``last.pt`` with the agent's resume command, and reads every backend back with its own library:
MLflow's local file store, TensorBoard's event files, wandb's offline run directories. No server.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agent import demo
from agent.config.jobfile import parse_job
from agent.config.jobvalues import ConfigError
from agent.config.model import Job
from agent.trainer.logged_entry import run_key, split_options
from agent.trainer.process import build_argv
from agent.trainer.spawn import trainer_env
from tests.support import HANG_S, PAUSE_ENV, is_stopped, pause_after_epoch, tiny_job_text

requires_libreyolo = pytest.mark.skipif(
    shutil.which("libreyolo", path=str(Path(sys.executable).parent)) is None
    and shutil.which("libreyolo") is None,
    reason="the training stack (libreyolo) is not installed: run ./install.sh",
)
_MISSING = [m for m in ("mlflow", "tensorboard", "wandb") if importlib.util.find_spec(m) is None]
requires_loggers = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"{', '.join(_MISSING)} not installed: pip install -e '.[loggers]'",
)

EPOCHS = 3


def job_of(tmp: Path, data: Path, loggers: str, *, target: str = "synced") -> Job:
    sections = f'[sync]\ntarget = "file://{tmp / target}"\n'
    text = tiny_job_text(tmp, data, epochs=EPOCHS, train=f"loggers = {loggers}", sections=sections)
    return parse_job(text, source="test", base_dir=tmp)


# ---------------------------------------------------------------- the job file and the argv


def test_loggers_key_takes_the_three_names_and_refuses_a_typo_with_did_you_mean(
    tmp_path: Path,
) -> None:
    job = job_of(tmp_path, tmp_path / "data.yaml", '["mlflow", "tensorboard"]')
    assert job.train.loggers == ("mlflow", "tensorboard")
    assert "loggers" not in dict(job.train.args)  # never passed to the CLI as loggers=...
    with pytest.raises(ConfigError, match=r"train\.loggers.*did you mean 'tensorboard'"):
        job_of(tmp_path, tmp_path / "data.yaml", '["tensorbaord"]')
    with pytest.raises(ConfigError, match=r"train\.loggers.*must be a list"):
        job_of(tmp_path, tmp_path / "data.yaml", '"mlflow"')
    with pytest.raises(ConfigError, match=r"train\.loggers.*listed twice"):
        job_of(tmp_path, tmp_path / "data.yaml", '["wandb", "wandb"]')


@requires_libreyolo
def test_every_launch_of_a_job_names_the_same_run_and_another_target_another(
    tmp_path: Path,
) -> None:
    job = job_of(tmp_path, tmp_path / "data.yaml", '["wandb"]')
    first = build_argv(job)
    resumed = build_argv(job, resume_dir=tmp_path / "runs" / "run1", total_epochs=EPOCHS)
    assert first[1:3] == resumed[1:3] == ["-m", "agent.trainer.logged_entry"]
    opts_first, cli_first = split_options(first[3:])
    opts_resumed, cli_resumed = split_options(resumed[3:])
    assert (
        opts_first
        == opts_resumed
        == {
            "loggers": "wandb",
            "run-name": "run1",
            "run-key": run_key(job),
        }
    )
    assert "json=true" in cli_first and "resume=true" in cli_resumed
    other = job_of(tmp_path, tmp_path / "data.yaml", '["wandb"]', target="elsewhere")
    assert run_key(other) != run_key(job)
    # A job without loggers keeps the plain command.
    plain = parse_job(
        tiny_job_text(tmp_path, tmp_path / "data.yaml"), source="t", base_dir=tmp_path
    )
    assert Path(build_argv(plain)[0]).name == "libreyolo"


@requires_libreyolo
def test_a_logger_that_cannot_be_set_up_is_a_config_error_in_the_json_result(
    tmp_path: Path,
) -> None:
    argv = [sys.executable, "-m", "agent.trainer.logged_entry", "--agent-loggers=nope"]
    out = subprocess.run(
        [*argv, "model=yolox-n", "data=missing.yaml", "json=true"],
        env=trainer_env(argv, None),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        check=False,
    )
    assert out.returncode == 2, out.stderr[-2000:]  # LibreYOLO's config error: never resumed
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["error"] == "logger_unavailable" and "nope" in doc["message"]


def test_mlflow_metric_names_that_parent_others_get_total() -> None:
    trackers = pytest.importorskip("agent.trainer.trackers", reason="needs libreyolo")
    out = trackers.without_parent_keys({"train/loss": 3.0, "train/loss/iou": 1.0, "lr/g0": 0.1})
    assert out == {"train/loss/total": 3.0, "train/loss/iou": 1.0, "lr/g0": 0.1}


# ---------------------------------------------------------------- the real trainer


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.make_dataset(tmp_path_factory.mktemp("data") / "ds")


def _env(argv: list[str], tmp: Path) -> dict[str, str]:
    env = trainer_env(argv, None)
    env.update(
        MLFLOW_TRACKING_URI=(tmp / "mlruns").as_uri(),
        # MLflow 3 keeps its file store for those who ask (its default became a database).
        MLFLOW_ALLOW_FILE_STORE="true",
        WANDB_MODE="offline",
        WANDB_DIR=str(tmp / "wandb"),
        WANDB_SILENT="true",
    )
    for key in ("WANDB_RUN_ID", "WANDB_RESUME", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        env.pop(key, None)
    return env


def _wait(proc: subprocess.Popen[bytes], done: Callable[[], bool]) -> None:
    """Wait until ``done()`` holds (or the trainer exits): a state, not a time."""
    deadline = time.monotonic() + HANG_S
    while not done() and proc.poll() is None:
        assert time.monotonic() < deadline, "the trainer never paused after epoch 1"
        time.sleep(0.1)


@pytest.mark.training
@pytest.mark.long
@requires_libreyolo
@requires_loggers
def test_a_stopped_and_resumed_trainer_is_one_run_in_mlflow_tensorboard_and_wandb(
    tmp_path: Path, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also the regression test of an epoch lost to the stop: LibreYOLO's loggers log after
    status.json, so a stop right after it (here: at it) left epoch 1 out of MLflow ([2, 3])."""
    (tmp_path / "wandb").mkdir()
    job = job_of(tmp_path, dataset, '["wandb", "tensorboard", "mlflow"]')
    key = run_key(job)
    run_dir = tmp_path / "runs" / "run1"

    # 1. First launch, paused (SIGSTOP) by the trainer itself just after epoch 1's status.json,
    # the file the agent reads as "epoch 1 done"; then stopped as the agent stops it (SIGINT to
    # the group). The loggers must have logged epoch 1 by then: the resume goes on at epoch 2.
    pause_after_epoch(monkeypatch, 1)
    argv = build_argv(job)
    with (tmp_path / "trainer.log").open("ab") as log:
        first = subprocess.Popen(
            argv,
            env=_env(argv, tmp_path),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )
        _wait(first, lambda: is_stopped(first.pid))
        os.killpg(first.pid, signal.SIGINT)
        os.killpg(first.pid, signal.SIGCONT)
        first.communicate(timeout=HANG_S)
    monkeypatch.delenv(PAUSE_ENV)
    assert first.returncode == 130, (tmp_path / "trainer.log").read_text()[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["error"]["type"] == "KeyboardInterrupt"
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in metrics] == [1]  # stopped in epoch 2
    assert (run_dir / "weights" / "last.pt").is_file()

    # 2. The agent's resume: same run dir, from last.pt, to the job's epochs.
    argv = build_argv(job, resume_dir=run_dir, total_epochs=EPOCHS)
    with (tmp_path / "trainer.log").open("ab") as log:
        done = subprocess.run(
            argv,
            env=_env(argv, tmp_path),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
            timeout=HANG_S,
            check=False,
        )
    trainer_log = (tmp_path / "trainer.log").read_text()
    assert done.returncode == 0, trainer_log[-3000:]
    result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert result["save_dir"] == str(run_dir)
    assert "disabling it for the rest of this run" not in trainer_log  # no logger gave up
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the reading client's too
    assert_one_run_with_every_epoch(tmp_path, run_dir, key)


def assert_one_run_with_every_epoch(tmp: Path, run_dir: Path, key: str) -> None:
    """Read every backend back with its own library: one run, every epoch, the job's key."""
    epochs = list(range(1, EPOCHS + 1))

    # MLflow: one run, tagged with the job's key, every epoch's metrics, finished.
    from mlflow.tracking import MlflowClient

    client = MlflowClient((tmp / "mlruns").as_uri())
    runs = client.search_runs(["0"])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    assert run.data.tags["libreyolo_agent.run_key"] == key
    assert run.info.run_name == "run1" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss/total")
    assert sorted({m.step for m in history}) == epochs
    assert run.data.params["resume"] == "False"  # the first launch's, kept (MLflow's rule)

    # TensorBoard: one log dir in the run dir, every epoch's scalars across its event files.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = run_dir / "tensorboard"
    assert len(list(tb.glob("events.out.tfevents.*"))) == 2  # one per launch
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert sorted({e.step for e in acc.Scalars("train/loss")}) == epochs

    # wandb (offline): one run id for both launches, the job's key.
    offline = sorted((tmp / "wandb" / "wandb").glob("offline-run-*"))
    assert len(offline) == 2
    assert {d.name.rsplit("-", 1)[1] for d in offline} == {key}
    assert all((d / f"run-{key}.wandb").is_file() for d in offline)


@pytest.mark.training
@pytest.mark.long
@requires_libreyolo
@requires_loggers
def test_the_agent_resumes_a_killed_trainer_into_the_same_tracker_runs(
    tmp_path: Path, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the daemon: the trainer SIGKILLed just after epoch 1's status.json, resumed by
    the agent (kind ``killed``) from last.pt, to the end; the trackers see one run."""
    import asyncio

    from agent.config.model import Env
    from agent.daemon.spine import Daemon
    from tests.test_daemon import run_daemon, wait_for

    (tmp_path / "wandb").mkdir()
    for key, value in _env([], tmp_path).items():
        if key.startswith(("MLFLOW_", "WANDB_")):
            monkeypatch.setenv(key, value)
    for key in ("WANDB_RUN_ID", "WANDB_RESUME", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(key, raising=False)
    sections = (
        f'[sync]\ntarget = "file://{tmp_path / "synced"}"\n[limits]\nrestart_backoff = "1s"\n'
    )
    text = tiny_job_text(
        tmp_path,
        dataset,
        epochs=EPOCHS,
        train='loggers = ["wandb", "tensorboard", "mlflow"]',
        sections=sections,
    )
    job = parse_job(text, source="test", base_dir=tmp_path)
    pause_after_epoch(monkeypatch, 1)

    async def during(daemon: Daemon, *_: object) -> None:
        await wait_for(lambda: daemon.trainer is not None and is_stopped(daemon.trainer.pid))
        assert daemon.trainer is not None
        monkeypatch.delenv(PAUSE_ENV)  # the resumed trainer runs through
        os.killpg(os.getpgid(daemon.trainer.pid), signal.SIGKILL)

    code, daemon, _ = asyncio.run(run_daemon(job, Env(state_dir=tmp_path / "state"), during))
    assert code == 0
    state = daemon.state
    assert state.reason is not None and state.reason.value == "completed", state.cause
    assert [r["kind"] for r in state.resumes] == ["killed"]
    assert daemon.run_dir is not None and daemon.run_dir == tmp_path / "runs" / "run1"
    assert_one_run_with_every_epoch(tmp_path, daemon.run_dir, run_key(job))
