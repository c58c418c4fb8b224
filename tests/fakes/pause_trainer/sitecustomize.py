"""First on a real trainer's ``PYTHONPATH`` (tests/support.py ``pause_after_epoch``): the
LibreYOLO trainer stops itself (SIGSTOP) once it has written epoch N's ``status.json``.

LibreYOLO saves an epoch's ``last.pt`` and ``epoch_N.pt`` before its epoch-end callbacks write
``status.json`` and ``metrics.jsonl``; pausing in that callback, after it ran, leaves a run
that trained exactly N epochs with every file of them whole. A test that kills or adopts the
trainer "mid-run" needs that state however fast or slow the machine trains: a SIGSTOP sent
once the agent had seen epoch N lost the race under load (the trainer had already written a
later epoch's checkpoints, or finished the run).

Python imports ``sitecustomize`` at start-up; this one only patches LibreYOLO's status
callback when its module is first imported, so a process that never trains is untouched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import signal
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

#: The epoch after which the trainer stops itself (unset: nothing is patched).
PAUSE_ENV = "LIBREYOLO_TEST_PAUSE_AFTER_EPOCH"
_MODULE = "libreyolo.training.artifacts"


def _patch(module: ModuleType) -> None:
    callback = module.TrainingStatusCallback
    original = callback.on_train_epoch_end
    pause_after = int(os.environ[PAUSE_ENV])

    def on_train_epoch_end(self: Any, event: Any) -> None:
        original(self, event)
        if event.epoch == pause_after:
            _say(f"epoch {event.epoch} ended: pausing (SIGSTOP)")
            os.kill(os.getpid(), signal.SIGSTOP)

    callback.on_train_epoch_end = on_train_epoch_end
    # In the trainer's log: a test whose trainer never paused can tell a patch that was never
    # made from an epoch that never matched (seen once in CI: the trainer ran to its end).
    _say(f"{_MODULE} patched: the trainer pauses after epoch {pause_after}")


def _say(line: str) -> None:
    print(f"pause_trainer (pid {os.getpid()}): {line}", file=sys.stderr, flush=True)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if os.environ.get(PAUSE_ENV):
    sys.meta_path.insert(0, _PatchOnImport())
