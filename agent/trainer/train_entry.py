"""Start ``libreyolo train`` for a device list (``device=0,1``) through LibreYOLO's Python API.

LibreYOLO 1.6.0's CLI builds the model on ``device`` before training, and ``torch.device("0,1")``
is invalid, so ``libreyolo train device=0,1`` dies; its Python API ``model.train(device="0,1")``
works and starts a DDP coordinator in its own session that spawns one rank per GPU.

This entry point keeps everything else the CLI does (argument parsing and validation, scratch
versus pretrained model construction, the ``json=true`` result, exit codes) by running the real
CLI with ``device=cpu`` for the construction, and handing the whole list to the ``train()`` call
of the model the CLI built. The trainer runs it in a child process; the daemon never imports it:

    python -m agent.trainer.train_entry model=... data=... device=0,1 ... json=true

Tied to LibreYOLO 1.6.0's CLI module layout (``libreyolo.cli.commands.train``): the agent pins
that version; a layout change fails here loudly (exit 4, ``libreyolo_api_changed``).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

#: The two CLI helpers that return the model whose ``train()`` the CLI then calls.
_MODEL_FACTORIES = ("load_model_or_exit", "_create_explicit_task_train_model")


def split_device(argv: list[str]) -> tuple[list[str], str | None]:
    """Replace ``device=A,B,...`` by ``device=cpu`` and return the full list (or None).

    The CLI builds the model on the CPU; the ranks move their copy to their own GPU. Building
    on ``cuda:A`` instead would keep a model and a CUDA context in this coordinating parent,
    on the first GPU, for the whole run."""
    out: list[str] = []
    devices: str | None = None
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("-").replace("-", "_") == "device" and "," in value:
            devices = value
            arg = "device=cpu"
        out.append(arg)
    return out, devices


def _with_devices(factory: Callable[..., Any], devices: str) -> Callable[..., Any]:
    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Any:
        model = factory(*args, **kwargs)
        if model is not None and callable(getattr(model, "train", None)):
            train = model.train

            @functools.wraps(train)
            def train_on_all(*a: Any, **kw: Any) -> Any:
                kw["device"] = devices
                return train(*a, **kw)

            model.train = train_on_all
        return model

    return build


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    args, devices = split_device(args)
    if devices is not None:
        try:
            from libreyolo.cli.commands import train as train_cmd

            for name in _MODEL_FACTORIES:
                setattr(train_cmd, name, _with_devices(getattr(train_cmd, name), devices))
        except (ImportError, AttributeError) as exc:
            print(
                json.dumps(
                    {
                        "schema_version": 1,
                        "error": "libreyolo_api_changed",
                        "message": f"cannot launch device={devices} through LibreYOLO's API: {exc}",
                        "suggestion": "use libreyolo==1.6.0, which this agent supports",
                    }
                )
            )
            return 4
    return run_cli(["libreyolo", "train", *args])


def run_cli(argv: list[str]) -> int:
    """Run LibreYOLO's own command line (``libreyolo.cli.entrypoint``) in this process with
    ``argv`` as ``sys.argv``, as the ``libreyolo`` command would; its exit code."""
    from libreyolo.cli import entrypoint

    sys.argv = list(argv)
    try:
        entrypoint()
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
