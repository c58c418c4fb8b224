"""The installed LibreYOLO as the agent sees it without importing it: its ``libreyolo`` command
(:func:`find_libreyolo`) and its own list of ``libreyolo train`` options, read from its source.

The options are the parameters of ``train_cmd`` in ``libreyolo/cli/commands/train.py`` (1.6.0),
each a ``typer.Option(default, *flags)``. LibreYOLO's CLI turns ``key=value`` into ``--key value``
with ``_`` read as ``-``, so option ``--save-period`` is the job file's ``save_period``.

Importing that module imports torch (about 5 s and hundreds of MB), which the agent process never
does; parsing its source with :mod:`ast` takes about 10 ms. The result is kept for the life of the
process only, never on disk: a reinstalled LibreYOLO is read afresh at the next start.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

#: Where the ``train`` command lives inside the ``libreyolo`` package.
TRAIN_MODULE = Path("cli", "commands", "train.py")
#: The function whose parameters are the options.
TRAIN_FUNCTION = "train_cmd"
#: Options any LibreYOLO train command has; a parse that misses one read the wrong thing.
_SANITY = frozenset({"data", "model", "epochs", "batch", "imgsz", "device"})


@dataclass(frozen=True)
class TrainOptions:
    """The train options of the installed LibreYOLO, or why they are unknown."""

    #: Option names as job-file keys (``save_period``); empty when ``reason`` is set.
    names: frozenset[str] = frozenset()
    #: LibreYOLO's version ("" when unknown).
    version: str = ""
    #: Why the options could not be read (LibreYOLO not installed, unexpected layout); None
    #: when ``names`` is the real list.
    reason: str | None = None

    @property
    def available(self) -> bool:
        return self.reason is None

    @property
    def label(self) -> str:
        """``LibreYOLO 1.6.0``, for messages."""
        return f"LibreYOLO {self.version}".strip()

    def close_matches(self, key: str) -> list[str]:
        """The valid options nearest to a misspelt ``key``, best first."""
        return difflib.get_close_matches(key, sorted(self.names), n=3, cutoff=0.6)


def read_train_options(source: str, *, version: str = "") -> TrainOptions:
    """The options declared by ``train_cmd`` in the text of LibreYOLO's ``train.py``."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        return TrainOptions(version=version, reason=f"cannot parse its train command ({exc})")
    func = next(
        (
            node
            for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.name == TRAIN_FUNCTION
        ),
        None,
    )
    if func is None:
        return TrainOptions(version=version, reason=f"no {TRAIN_FUNCTION}() in its train command")
    names: set[str] = set()
    a = func.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [
        *([None] * (len(positional) - len(a.defaults))),
        *a.defaults,
    ]
    for arg, default in [
        *zip(positional, defaults, strict=True),
        *zip(a.kwonlyargs, a.kw_defaults, strict=True),
    ]:
        names.update(_option_keys(arg, default))
    missing = _SANITY - names
    if missing:
        return TrainOptions(
            version=version,
            reason=f"its train command does not declare {', '.join(sorted(missing))}",
        )
    return TrainOptions(names=frozenset(names), version=version)


def _option_keys(arg: ast.arg, default: ast.expr | None) -> set[str]:
    """The ``key=value`` keys one parameter of the command accepts (typer's naming rules)."""
    if default is None or _is_call_to(default, "Argument"):
        return set()  # a positional argument, not a key=value option
    flags: list[str] = []
    if isinstance(default, ast.Call) and _is_call_to(default, "Option"):
        for decl in default.args[1:]:
            if isinstance(decl, ast.Constant) and isinstance(decl.value, str):
                for flag in decl.value.split("/"):
                    flag = flag.strip()
                    if flag.startswith("--"):
                        flags.append(flag[2:])
    if flags:
        return {f.replace("-", "_") for f in flags}
    # No flags given: typer names the option after the parameter, and gives a bool both forms.
    keys = {arg.arg}
    if isinstance(arg.annotation, ast.Name) and arg.annotation.id == "bool":
        keys.add(f"no_{arg.arg}")
    return keys


def _is_call_to(node: ast.expr, name: str) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr == name) or (
        isinstance(func, ast.Name) and func.id == name
    )


def find_libreyolo() -> str | None:
    """The ``libreyolo`` command next to this Python (the venv's), else the one on PATH; None
    when there is neither."""
    beside = Path(sys.executable).parent / "libreyolo"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("libreyolo")


@functools.cache
def installed_train_options() -> TrainOptions:
    """The options of the LibreYOLO this Python would train with (the one ``libreyolo`` beside
    it runs). Never imports LibreYOLO; cached for the life of the process."""
    try:
        # For a top-level name this asks the import system's finders only: nothing is imported.
        spec = importlib.util.find_spec("libreyolo")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        return TrainOptions(reason="libreyolo is not installed for this Python")
    package = Path(locations[0])
    version = _version(package)
    path = package / TRAIN_MODULE
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return TrainOptions(version=version, reason=f"cannot read {path} ({exc})")
    return read_train_options(source, version=version)


def _version(package: Path) -> str:
    """The version from the ``libreyolo-X.Y.Z.dist-info`` beside the package (importlib.metadata
    would scan every installed distribution: 30 ms)."""
    try:
        infos = sorted(package.parent.glob("libreyolo-*.dist-info"))
    except OSError:
        return ""
    if len(infos) != 1:
        return ""
    return infos[0].name.removeprefix("libreyolo-").removesuffix(".dist-info")
