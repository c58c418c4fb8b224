"""Which of LibreYOLO's extras (``libreyolo[rfdetr]``, ...) a job needs, read from its job file.

``install.sh`` asks through ``python3 -m agent.install.torchpick extras JOB.toml`` before the
virtual environment exists, so, like torchpick: standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: LibreYOLO 1.6.0's extras a job may be given (each is a ``Provides-Extra`` of 1.6.0).
KNOWN_EXTRAS = frozenset({"rfdetr", "eomt", "lora", "onnx"})
#: Model families (``train.model`` name or file name, lower case, ``Libre`` prefix, ``-`` and
#: ``_`` dropped) whose code needs an extra: RF-DETR and DINOv2 build on ``transformers``
#: (``libreyolo[rfdetr]``), EoMT as well (``libreyolo[eomt]``).
FAMILY_EXTRAS: tuple[tuple[str, str], ...] = (
    ("rfdetr", "rfdetr"),
    ("dinov2", "rfdetr"),
    ("eomt", "eomt"),
)
#: ``[train]`` switches that need an extra: LoRA needs ``peft``, the ONNX export check ``onnx``.
SWITCH_EXTRAS: tuple[tuple[str, str], ...] = (("lora", "lora"), ("export_check", "onnx"))


def _family_of(model: str) -> str:
    name = Path(model).name.lower()
    name = name.removeprefix("libre")
    return name.replace("-", "").replace("_", "")


def job_extras(train: dict[str, Any]) -> tuple[list[str], list[str]]:
    """LibreYOLO extras for a job's ``[train]`` table, and why each one."""
    extras: dict[str, str] = {}
    model = train.get("model")
    if isinstance(model, str):
        family = _family_of(model)
        for prefix, extra in FAMILY_EXTRAS:
            if family.startswith(prefix):
                extras.setdefault(extra, f"train.model = {model!r} ({prefix})")
    for key, extra in SWITCH_EXTRAS:
        if train.get(key) is True:
            extras.setdefault(extra, f"train.{key} = true")
    return sorted(extras), [f"{e}: {extras[e]}" for e in sorted(extras)]


#: The agent's own extras a job's ``[train] loggers`` asks for: one per tracking client, named
#: as the logger (pyproject.toml; agent/config/model.py's LOGGER_NAMES).
LOGGER_EXTRAS = frozenset({"tensorboard", "mlflow", "wandb"})


def job_agent_extras(train: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The agent's extras for a job's ``[train]`` table (its loggers' clients), and why each.
    Names that are not loggers are left to the job check, which names them."""
    loggers = train.get("loggers")
    names = [n for n in loggers if isinstance(n, str)] if isinstance(loggers, list) else []
    found = sorted({n for n in names if n in LOGGER_EXTRAS})
    return found, [f"{n}: train.loggers names {n!r}" for n in found]


def read_job_extras(path: Path) -> tuple[list[str], list[str]]:
    """:func:`job_extras` of a job file (Python 3.11+: ``tomllib``)."""
    return job_extras(_train_table(path))


def read_job_agent_extras(path: Path) -> tuple[list[str], list[str]]:
    """:func:`job_agent_extras` of a job file."""
    return job_agent_extras(_train_table(path))


def _train_table(path: Path) -> dict[str, Any]:
    import tomllib

    with path.open("rb") as f:
        doc = tomllib.load(f)
    train = doc.get("train")
    return train if isinstance(train, dict) else {}


def check_extras(names: Iterable[str]) -> list[str]:
    """``names`` without blanks and duplicates; ValueError naming any unknown one."""
    clean = sorted({n.strip() for n in names if n.strip()})
    unknown = [n for n in clean if n not in KNOWN_EXTRAS]
    if unknown:
        known = ", ".join(sorted(KNOWN_EXTRAS))
        raise ValueError(f"unknown LibreYOLO extra(s) {', '.join(unknown)} (known: {known})")
    return clean
