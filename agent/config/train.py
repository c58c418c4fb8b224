"""The job file's ``[train]`` table: LibreYOLO's own options, passed through to its trainer.

Kept apart from the agent's sections (:mod:`agent.config.jobfile`) because its keys are not the
agent's: any option name is taken as given, refused only when the agent sets it itself
(:data:`RESERVED_TRAIN_KEYS`), when it would end the command without training, or when the
installed LibreYOLO does not have it (:func:`check_train_options`, with "did you mean").
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import math
import re
from pathlib import Path

from agent.config.jobvalues import ConfigError, ErrorList, parse_duration, refuse_unprintable, show
from agent.config.model import (
    LOGGER_NAMES,
    DatasetSection,
    LoggerName,
    TrainSection,
    TrainValue,
)
from agent.install.libreyolo import TrainOptions

#: ``[train]`` keys the agent sets itself; a job may not set them.
RESERVED_TRAIN_KEYS = frozenset({"project", "name", "json"})
#: ``[train]`` keys whose relative values name files beside the job file.
_PATH_TRAIN_KEYS = frozenset({"data", "model"})
#: LibreYOLO train options that end the command without training: the agent would read the
#: exit as a finished run and tear the box down with nothing trained.
_NON_TRAINING_KEYS = {
    "dry_run": "validates the options and exits without training",
    "help_json": "prints the option list and exits without training",
}


def load_train(
    raw: object, dataset: DatasetSection | None, base: Path, errors: ErrorList
) -> TrainSection:
    """The ``[train]`` table as a :class:`TrainSection`; mistakes go to ``errors``. Relative
    ``data``/``model`` paths that exist beside the job file (``base``) are made absolute."""
    defaults = TrainSection()
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        errors.add(ConfigError("train", f"{show(raw)} must be a table ([train])"))
        return defaults
    args: list[tuple[str, TrainValue]] = []
    stop_grace = defaults.stop_grace_s
    kill_grace = defaults.kill_grace_s
    loggers: tuple[LoggerName, ...] = ()
    check_weights = defaults.check_weights
    for k, v in raw.items():
        key = f"train.{k}"
        if k == "loggers":
            with errors.catch():
                loggers = parse_loggers(v)
            continue
        if k == "check_weights":  # the agent's, not LibreYOLO's: agent/daemon/diverge.py
            if isinstance(v, bool):
                check_weights = v
            else:
                errors.add(ConfigError(key, f"{show(v)} must be true or false"))
            continue
        if k in ("stop_grace", "kill_grace"):
            with errors.catch():
                seconds = parse_duration(key, v)
                if k == "stop_grace":
                    stop_grace = seconds
                else:
                    kill_grace = seconds
            continue
        if k in RESERVED_TRAIN_KEYS:
            errors.add(
                ConfigError(
                    key,
                    "is set by the agent; use job.name / job.runs_dir instead"
                    if k != "json"
                    else "is set by the agent (it always reads LibreYOLO's json result)",
                )
            )
        elif k in _NON_TRAINING_KEYS:
            errors.add(
                ConfigError(
                    key, f"{_NON_TRAINING_KEYS[k]}; the agent would read that as a finished run"
                )
            )
        elif not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            errors.add(ConfigError(key, "is not a valid LibreYOLO option name"))
        elif isinstance(v, bool | int | str) or (isinstance(v, float) and math.isfinite(v)):
            if isinstance(v, str):
                try:
                    refuse_unprintable(key, v, lax=True)
                except ConfigError as exc:
                    errors.add(exc)
                    continue
            if k in _PATH_TRAIN_KEYS and isinstance(v, str) and not Path(v).is_absolute():
                # The trainer runs in runs_dir: a file beside the job file is made absolute,
                # while names LibreYOLO resolves itself ("coco8.yaml", "yolox-n") stay as given.
                with contextlib.suppress(OSError, RuntimeError, ValueError):
                    if (base / v).exists():
                        v = str(base / v)
            args.append((k, v))
        else:
            errors.add(ConfigError(key, f"{show(v)} must be a string, number or boolean"))
    if not any(k == "data" for k, _ in args) and not errors.named("train.data"):
        if dataset is not None and dataset.data_yaml is not None:
            args.append(("data", str(dataset.dest / dataset.data_yaml)))
        elif not errors.named("dataset", "dataset.data_yaml"):
            errors.add(
                ConfigError(
                    "train.data",
                    "is required (the dataset YAML), or set dataset.data_yaml to take it from "
                    "the staged dataset",
                )
            )
    section = TrainSection(
        args=tuple(args),
        stop_grace_s=stop_grace,
        kill_grace_s=kill_grace,
        loggers=loggers,
        check_weights=check_weights,
    )
    epochs = section.get("epochs")
    if epochs is not None and (
        isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1
    ):
        errors.add(ConfigError("train.epochs", f"{show(epochs)} must be an integer >= 1"))
    return section


def parse_loggers(value: object) -> tuple[LoggerName, ...]:
    """``train.loggers``: a list of :data:`LOGGER_NAMES`, each at most once; a misspelt name
    gets the closest valid one. :class:`ConfigError` otherwise."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(
            "train.loggers", f'{show(value)} must be a list of names, like ["tensorboard"]'
        )
    out: list[LoggerName] = []
    for name in value:
        match = next((n for n in LOGGER_NAMES if n == name), None)
        if match is None:
            close = difflib.get_close_matches(name.lower(), LOGGER_NAMES, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                "train.loggers",
                f"unknown logger {show(name)}; {hint}(expected one of: {', '.join(LOGGER_NAMES)})",
            )
        if match in out:
            raise ConfigError("train.loggers", f"{show(name)} is listed twice")
        out.append(match)
    return tuple(out)


def missing_logger_packages(loggers: tuple[LoggerName, ...]) -> list[str]:
    """The loggers of ``loggers`` whose package this Python cannot import (found without
    importing it: the agent never loads a tracking client itself). Each logger's package has
    the logger's name (``mlflow-skinny`` installs ``mlflow``)."""
    return [n for n in loggers if importlib.util.find_spec(n) is None]


def check_train_options(train: TrainSection, options: TrainOptions) -> None:
    """Refuse every ``[train]`` key that the installed LibreYOLO's ``train`` command does not
    have, naming the closest valid ones, and every value its option's type refuses (one
    :class:`ConfigError`, or :class:`ConfigErrors` for several); nothing to check (no error)
    when ``options`` are unknown, e.g. an agent-only install. The agent's own
    ``stop_grace``/``kill_grace`` never get here."""
    if not options.available:
        return
    errors = ErrorList()
    missing = missing_logger_packages(train.loggers)
    if missing:
        errors.add(
            ConfigError(
                "train.loggers",
                f"{', '.join(missing)} not installed beside {options.label}; install the "
                "agent's loggers extra (pip install 'libreyolo-agent[loggers]')",
            )
        )
    for k, v in train.args:
        if k in options.names:
            problem = options.value_problem(k, v)
            if problem is not None:
                errors.add(ConfigError(f"train.{k}", problem))
            continue
        close = options.close_matches(k)
        hint = (
            f"did you mean {' or '.join(close)}?"
            if close
            else "`libreyolo train --help` lists them"
        )
        errors.add(
            ConfigError(
                f"train.{k}",
                f"unknown option (value {show(v)}): `libreyolo train` of {options.label} has no "
                f"{k!r}; {hint}",
            )
        )
    errors.raise_if_any()
