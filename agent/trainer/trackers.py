"""LibreYOLO's experiment loggers, built so that a resumed trainer goes on in the same run.

Only the launcher (:mod:`agent.trainer.logged_entry`, in the trainer's process) imports this: it
loads LibreYOLO and the tracking clients. The daemon never does.

LibreYOLO 1.6.0's loggers start a new run on every ``train()`` call. The agent's trainer is
stopped, restarted and resumed (``resume=true``) many times in one job, so each logger is given
the job's run key (:func:`agent.trainer.logged_entry.run_key`, the same for every launch of the
job) and uses it the way its backend resumes:

- TensorBoard writes into ``<run dir>/tensorboard``; a resume trains in the same run dir, so its
  event files land beside the first launch's (LibreYOLO's own default, kept).
- wandb takes its run id from ``WANDB_RUN_ID`` and ``WANDB_RESUME=allow`` (its documented
  environment; set by the launcher unless the user set them).
- MLflow has no run id of our choosing (its store makes them), so the run carries the key as a
  tag; a launch finds the run by that tag and reopens it (``start_run(run_id=...)``), or starts
  it. Parameters already logged are not logged again: MLflow refuses to change one, and a
  resume's differ (``resume``, ``model``), which would disable the logger for the whole run.
  Metric names that are the parent of others get ``/total`` (:func:`without_parent_keys`).

LibreYOLO calls the loggers after it wrote the epoch's ``status.json``, and the agent takes that
file as the epoch being done: a stop or a kill right then would leave the epoch out of the
trackers, and the resume goes on at the next one. :func:`log_before_status` moves the loggers'
epoch end just before that write (one process only: with a device list LibreYOLO's order stays).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from libreyolo.training.loggers import MLflowLogger, TensorBoardLogger, WandbLogger
from libreyolo.training.loggers.base import epoch_metrics

#: The MLflow tag that names the job's run across launches.
MLFLOW_RUN_KEY_TAG = "libreyolo_agent.run_key"
#: MLflow's key characters (others become ``_``) and longest parameter value, as LibreYOLO's
#: MLflow logger uses them.
_INVALID_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. /]")
_MAX_PARAM_VALUE_LENGTH = 500


def _sanitize_key(name: str) -> str:
    return _INVALID_KEY_CHARS.sub("_", name)


class ResumingMLflowLogger(MLflowLogger):  # type: ignore[misc]  # LibreYOLO is untyped
    """:class:`MLflowLogger` that reopens the run tagged with ``run_key`` in the active
    experiment (``MLFLOW_EXPERIMENT_NAME``/``_ID`` or MLflow's default) when there is one."""

    def __init__(self, run_key: str, run_name: str) -> None:
        super().__init__(run_name=run_name)
        self.run_key = run_key

    def _handle_start(self, event: Any) -> None:
        import mlflow

        found = mlflow.search_runs(
            filter_string=f"tags.`{MLFLOW_RUN_KEY_TAG}` = '{self.run_key}'",
            max_results=1,
            output_format="list",
        )
        if found:
            run = mlflow.start_run(run_id=found[0].info.run_id)
        else:
            run = mlflow.start_run(run_name=self.run_name, tags={MLFLOW_RUN_KEY_TAG: self.run_key})
        self._run_active = True
        logged = run.data.params
        params = {
            _sanitize_key(key): str(value)[:_MAX_PARAM_VALUE_LENGTH]
            for key, value in (event.config or {}).items()
        }
        new = {k: v for k, v in params.items() if k not in logged}
        if new:
            mlflow.log_params(new)

    def _handle_epoch_end(self, event: Any) -> None:
        if not self._run_active:
            return
        import mlflow

        metrics = {_sanitize_key(k): v for k, v in epoch_metrics(event).items()}
        mlflow.log_metrics(without_parent_keys(metrics), step=event.epoch)


def without_parent_keys(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` with every key that is the parent of another (``train/loss`` beside
    ``train/loss/iou``) renamed ``KEY/total``. MLflow's file store keeps a metric as a file at
    its key's path, so a parent key and its children cannot both exist there: LibreYOLO 1.6.0's
    own names fail at the first epoch (NotADirectoryError) and disable its logger. The same
    names on every MLflow store, so a run looks the same on a server."""
    parents = {k for k in metrics if any(o.startswith(k + "/") for o in metrics)}
    return {(f"{k}/total" if k in parents else k): v for k, v in metrics.items()}


def build_loggers(names: Sequence[str], *, run_key: str, run_name: str) -> list[Any]:
    """LibreYOLO logger callbacks for ``names`` (``tensorboard``, ``mlflow``, ``wandb``), each
    keyed to the job's run. Raises ImportError (LibreYOLO's message) when a backend package is
    missing, and sets wandb's run id in this process's environment (its ranks inherit it)."""
    out: list[Any] = []
    for name in names:
        if name == "tensorboard":
            out.append(TensorBoardLogger())
        elif name == "mlflow":
            out.append(ResumingMLflowLogger(run_key, run_name))
        elif name == "wandb":
            os.environ.setdefault("WANDB_RUN_ID", run_key)
            os.environ.setdefault("WANDB_RESUME", "allow")
            out.append(WandbLogger(name=run_name))
        else:
            raise ValueError(f"unknown logger {name!r}")
    return out


class _EpochEndElsewhere:
    """A logger as LibreYOLO's callback list sees it when :func:`log_before_status` calls its
    epoch end: everything else is passed through."""

    def __init__(self, logger: Any) -> None:
        self.logger = logger

    def on_train_start(self, event: Any) -> None:
        self.logger.on_train_start(event)

    def on_train_end(self, event: Any) -> None:
        self.logger.on_train_end(event)

    def on_train_exception(self, event: Any) -> None:
        self.logger.on_train_exception(event)


def log_before_status(loggers: list[Any]) -> list[Any]:
    """Have ``loggers`` log each epoch just before LibreYOLO writes its ``status.json`` (its
    ``TrainingStatusCallback``, in this process), so an epoch the agent has seen done is in the
    trackers; returns what to pass as ``loggers=``. Where that callback is not found (not
    LibreYOLO 1.6.0), ``loggers`` as they are, in LibreYOLO's own order."""
    try:
        from libreyolo.training.artifacts import TrainingStatusCallback

        write_status = TrainingStatusCallback.on_train_epoch_end
    except (ImportError, AttributeError):
        return loggers

    def on_train_epoch_end(self: Any, event: Any) -> None:
        for logger in loggers:
            logger.on_train_epoch_end(event)  # guarded: a failing logger disables itself
        write_status(self, event)

    TrainingStatusCallback.on_train_epoch_end = on_train_epoch_end
    return [_EpochEndElsewhere(logger) for logger in loggers]
