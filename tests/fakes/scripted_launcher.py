"""The real launcher (detached process, own session, launch id, pidfd wait) starting the scripted
stand-in trainer (:mod:`tests.fakes.scripted_trainer`) instead of ``libreyolo train``.

Only the command lines differ from :class:`agent.trainer.process.ProcessLauncher`, so the daemon's
whole training phase (launch, follow, stop, classify, resume) runs against a real process::

    launcher = ScriptedLauncher(epoch_s=0.2, fail_once_at=3)
    Daemon(job, env, launcher=launcher, ...)

The options are the scripted trainer's ``key=value`` arguments (booleans as ``true``/``false``);
every launch and resume gets the same ones. ``launched`` records each command line started.
"""

from __future__ import annotations

import sys
from pathlib import Path

from agent.config.model import Job
from agent.trainer.process import ProcessLauncher, TrainerProcess
from tests.fakes.scripted_trainer import SCRIPT


def _arg(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class ScriptedLauncher(ProcessLauncher):
    """``ProcessLauncher`` whose trainer is ``python scripted_trainer.py <options> ...``."""

    #: The scripted trainer is not ``libreyolo train``: never started warm.
    warm_start = False

    def __init__(self, **options: object) -> None:
        self.options = {k: _arg(v) for k, v in options.items()}
        #: Every command line launched, in order (first launch, then each resume).
        self.launched: list[list[str]] = []

    def _base(self) -> list[str]:
        return [sys.executable, str(SCRIPT), *(f"{k}={v}" for k, v in self.options.items())]

    def argv(self, job: Job) -> list[str]:
        epochs = job.train.epochs
        return [
            *self._base(),
            *([f"epochs={epochs}"] if epochs is not None else []),
            f"project={job.job.runs_dir}",
            f"name={job.job.name}",
        ]

    def resume_argv(self, job: Job, run_dir: Path, total_epochs: int | None) -> list[str]:
        """What :mod:`agent.daemon.training` runs to resume ``run_dir`` from its ``last.pt``, like
        :func:`agent.trainer.process.build_argv` with ``resume_dir``."""
        epochs = total_epochs or job.train.epochs
        return [
            *self._base(),
            f"model={run_dir / 'weights' / 'last.pt'}",
            "resume=true",
            *([f"epochs={epochs}"] if epochs is not None else []),
            f"project={run_dir.parent}",
            f"name={run_dir.name}",
            "exist_ok=true",
        ]

    async def launch(
        self, argv: list[str], *, log_path: Path, result_path: Path, cwd: Path, launch_id: str
    ) -> TrainerProcess:
        self.launched.append(list(argv))
        return await super().launch(
            argv, log_path=log_path, result_path=result_path, cwd=cwd, launch_id=launch_id
        )
