"""Start ``libreyolo train`` with experiment loggers (``[train] loggers``), one run across resumes.

LibreYOLO 1.6.0 takes ``loggers=`` in its Python API only (``model.train(loggers=[...])``), not
on its command line. Like :mod:`agent.trainer.train_entry`, this runs the real CLI in this
process (its argument parsing and checks, the model it builds, the ``json=true`` result, its
exit codes, SIGINT's clean stop with exit 130, the run dir and its checkpoints, ``resume=true``
from ``last.pt``) and only adds to the ``train()`` call of the model the CLI built: the logger
objects (:mod:`agent.trainer.trackers`, which log an epoch before its ``status.json`` is
written), and the device list when there is one.

    python -m agent.trainer.logged_entry --agent-loggers=mlflow,tensorboard \\
        --agent-run-name=JOB --agent-run-key=KEY  model=... data=... json=true

The run key (:func:`run_key`) is derived from the job's name and its sync target, so every
launch of the job (first start, restart, resume, a rebuilt box syncing to the same target)
names the same experiment run. The daemon builds the command line (:func:`logged_argv`) and
never imports LibreYOLO or a tracking client: this module imports them only in :func:`main`.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from agent.config.model import Job
from agent.trainer.train_entry import split_device

#: Exit code and ``json=true`` error when a logger cannot be set up: LibreYOLO's config error.
CONFIG_ERROR = 2
_PREFIX = "--agent-"


def run_key(job: Job) -> str:
    """The job's experiment run id: 20 hex digits of its name and sync target, the same for
    every launch of the job (wandb's run id as is; MLflow's run tag)."""
    target = job.sync.target if job.sync is not None else ""
    return hashlib.sha256(f"{job.job.name}\n{target}".encode()).hexdigest()[:20]


def logged_argv(job: Job, python: str, cli_args: Sequence[str]) -> list[str]:
    """The command that runs ``libreyolo train <cli_args>`` with the job's loggers."""
    return [
        python,
        "-m",
        "agent.trainer.logged_entry",
        f"{_PREFIX}loggers={','.join(job.train.loggers)}",
        f"{_PREFIX}run-name={job.job.name}",
        f"{_PREFIX}run-key={run_key(job)}",
        *cli_args,
    ]


def split_options(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """The leading ``--agent-NAME=VALUE`` options, and the CLI's arguments after them."""
    options: dict[str, str] = {}
    rest = list(argv)
    while rest and rest[0].startswith(_PREFIX):
        name, _, value = rest.pop(0)[len(_PREFIX) :].partition("=")
        options[name] = value
    return options, rest


def _fail(error: str, message: str, suggestion: str, code: int = CONFIG_ERROR) -> int:
    doc = {"schema_version": 1, "error": error, "message": message, "suggestion": suggestion}
    print(json.dumps(doc), flush=True)
    sys.stderr.write(f"libreyolo-agent: {message}\n")
    return code


def _with_train_kwargs(factory: Callable[..., Any], extra: dict[str, Any]) -> Callable[..., Any]:
    """``factory`` whose model's ``train()`` also gets ``extra`` (loggers, device)."""

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Any:
        model = factory(*args, **kwargs)
        train = getattr(model, "train", None) if model is not None else None
        if callable(train):
            params = inspect.signature(train).parameters
            takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            if "loggers" not in params and not takes_all:
                sys.exit(
                    _fail(
                        "loggers_unsupported",
                        f"{type(model).__name__}.train() of this LibreYOLO takes no loggers",
                        "remove train.loggers for this model",
                    )
                )

            @functools.wraps(train)
            def train_logged(*a: Any, **kw: Any) -> Any:
                kw.update(extra)
                return train(*a, **kw)

            model.train = train_logged
        return model

    return build


def main(argv: list[str] | None = None) -> int:
    options, args = split_options(sys.argv[1:] if argv is None else argv)
    names = [n for n in options.get("loggers", "").split(",") if n]
    args, devices = split_device(args)
    try:
        from agent.trainer.trackers import build_loggers

        loggers = build_loggers(
            names, run_key=options.get("run-key", ""), run_name=options.get("run-name", "")
        )
    except (ImportError, ValueError) as exc:
        return _fail(
            "logger_unavailable",
            f"cannot set up train.loggers {names}: {exc}",
            "install the agent's loggers extra: pip install 'libreyolo-agent[loggers]'",
        )
    extra: dict[str, Any] = {"loggers": loggers}
    if devices is not None:
        extra["device"] = devices  # the ranks log in processes of their own: LibreYOLO's order
    else:
        from agent.trainer.trackers import log_before_status

        extra["loggers"] = log_before_status(loggers)
    try:
        from libreyolo.cli.commands import train as train_cmd

        from agent.trainer.train_entry import _MODEL_FACTORIES

        for name in _MODEL_FACTORIES:
            setattr(train_cmd, name, _with_train_kwargs(getattr(train_cmd, name), extra))
    except (ImportError, AttributeError) as exc:
        return _fail(
            "libreyolo_api_changed",
            f"cannot pass loggers through LibreYOLO's API: {exc}",
            "use libreyolo==1.6.0, which this agent supports",
            4,
        )
    from agent.trainer.train_entry import run_cli

    return run_cli(["libreyolo", "train", *args])


if __name__ == "__main__":
    sys.exit(main())
