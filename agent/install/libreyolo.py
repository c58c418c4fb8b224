"""The installed LibreYOLO as the agent sees it without importing it: its ``libreyolo`` command
(:func:`find_libreyolo`) and its own list of ``libreyolo train`` options, read from its source.

The options are the parameters of ``train_cmd`` in ``libreyolo/cli/commands/train.py`` (1.6.0),
each a ``typer.Option(default, *flags)``. LibreYOLO's CLI turns ``key=value`` into ``--key value``
with ``_`` read as ``-``, so option ``--save-period`` is the job file's ``save_period``.

Each option's type is its annotation (``int``, ``float``, ``bool``, ``str``, ``Optional[...]`` of
one) and its bounds the Option's ``min=``/``max=``: :meth:`TrainOptions.value_problem` says why a
``[train]`` value would be refused by the command (``batch = "big"``), so that ``check`` refuses it
before a box is paid for. The rules follow how the command reads the text it is given: an
``int`` takes ``16``, ``"16"`` or ``16.0``; a ``float`` anything Python's ``float()`` reads; a
``bool`` (a flag: ``amp=true`` becomes ``--amp``) only ``true``/``false``/``1``/``0``; a ``str``
anything. Where the two could disagree the value is let through: the check never refuses what
LibreYOLO would take.

Importing that module imports torch (about 5 s and hundreds of MB), which the agent process never
does; parsing its source with :mod:`ast` takes about 10 ms. The result is kept for the life of the
process only, never on disk: a reinstalled LibreYOLO is read afresh at the next start.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import math
import os
import re
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agent.util.text import show

#: Where the ``train`` command lives inside the ``libreyolo`` package.
TRAIN_MODULE = Path("cli", "commands", "train.py")
#: The function whose parameters are the options.
TRAIN_FUNCTION = "train_cmd"
#: Options any LibreYOLO train command has; a parse that misses one read the wrong thing.
_SANITY = frozenset({"data", "model", "epochs", "batch", "imgsz", "device"})


Kind = Literal["int", "float", "bool", "str"]
#: The annotations the check understands; any other (a list, a Path, an enum) is not checked.
_KINDS: dict[str, Kind] = {"int": "int", "float": "float", "bool": "bool", "str": "str"}
_KIND_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean (true or false)",
    "str": "text",
}
#: What the command's bool flags read (LibreYOLO's ``rewrite_known_bool_flags``); anything else
#: after ``amp=`` becomes an extra argument and the command exits 2.
_BOOL_TEXT = frozenset({"true", "false", "1", "0"})
#: An integer as text: digits (``_`` between them), an optional sign, an optional ``.0``.
_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")


@dataclass(frozen=True)
class OptionType:
    """What one train option takes: its kind, its bounds (``min=``/``max=``) and its default."""

    kind: Kind
    minimum: float | None = None
    maximum: float | None = None
    #: The option's default when it is a literal (an example for messages); None otherwise.
    default: bool | int | float | str | None = None

    def problem(self, value: object) -> str | None:
        """Why the command would refuse ``value`` (a job file's value), or None."""
        number: float | None = None
        if self.kind == "bool":
            ok = isinstance(value, bool) or (
                isinstance(value, int | str) and str(value).lower() in _BOOL_TEXT
            )
            return None if ok else f"{show(value)} is not {_KIND_WORDS['bool']}"
        if self.kind == "str":
            return None
        if isinstance(value, bool):
            return f"{show(value)} is not {_KIND_WORDS[self.kind]}"
        if self.kind == "int":
            if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
                number = value
            elif isinstance(value, str) and _INT_TEXT.fullmatch(value.strip()):
                number = float(value.strip().replace("_", ""))
        elif isinstance(value, int | float):
            number = value
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = None
        if number is None:
            return f"{show(value)} is not {_KIND_WORDS[self.kind]}"
        low, high = self.minimum, self.maximum
        if (low is not None and number < low) or (high is not None and number > high):
            return f"{show(value)} is out of range"
        return None

    def expected(self, key: str) -> str:
        """``an integer, e.g. batch = 16``: what the option takes, for messages."""
        words = _KIND_WORDS[self.kind]
        low, high = self.minimum, self.maximum
        if low is not None and high is not None:
            words += f" from {low:g} to {high:g}"
        elif low is not None:
            words += f" of at least {low:g}"
        elif high is not None:
            words += f" of at most {high:g}"
        example = _toml(self.default)
        return f"{words}, e.g. {key} = {example}" if example is not None else words


def _toml(value: object) -> str | None:
    """``value`` as a job file would write it; None when it makes no example."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float) and math.isfinite(value):
        return repr(value)
    if isinstance(value, str) and value and value.isprintable():
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return None


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
    #: What each option takes, by job-file key; an option of a type not understood is absent.
    types: Mapping[str, OptionType] = field(default_factory=dict, compare=False, hash=False)

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

    def value_problem(self, key: str, value: object) -> str | None:
        """Why ``libreyolo train`` would refuse ``key=value`` for its type or bounds: one line
        naming the value and what the option takes; None when it would take it (or the option's
        type is unknown)."""
        kind = self.types.get(key)
        problem = kind.problem(value) if kind is not None else None
        if problem is None or kind is None:
            return None
        return f"{problem}: `libreyolo train` of {self.label} takes {kind.expected(key)}"


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
    types: dict[str, OptionType] = {}
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
        keys = _option_keys(arg, default)
        names.update(keys)
        kind = _option_type(arg, default) if keys else None
        if kind is not None:
            types.update(dict.fromkeys(keys, kind))
    missing = _SANITY - names
    if missing:
        return TrainOptions(
            version=version,
            reason=f"its train command does not declare {', '.join(sorted(missing))}",
        )
    return TrainOptions(names=frozenset(names), version=version, types=types)


def _option_type(arg: ast.arg, default: ast.expr | None) -> OptionType | None:
    """What the parameter takes: its annotation's kind, the Option's ``min``/``max`` and its
    literal default; None for an annotation the check does not understand."""
    kind = _annotation_kind(arg.annotation)
    if kind is None:
        return None
    value: ast.expr | None = default
    bounds: dict[str, float] = {}
    if isinstance(default, ast.Call) and _is_call_to(default, "Option"):
        value = default.args[0] if default.args else None
        for kw in default.keywords:
            if kw.arg in ("min", "max"):
                bound = _literal(kw.value)
                if isinstance(bound, int | float) and not isinstance(bound, bool):
                    bounds[kw.arg] = float(bound)
    literal = _literal(value) if value is not None else None
    return OptionType(
        kind=kind,
        minimum=bounds.get("min"),
        maximum=bounds.get("max"),
        default=literal if isinstance(literal, bool | int | float | str) else None,
    )


def _annotation_kind(node: ast.expr | None) -> Kind | None:
    """``int``, ``Optional[int]``, ``int | None`` -> ``"int"``; None for anything else."""
    if isinstance(node, ast.Name):
        return _KINDS.get(node.id)
    if isinstance(node, ast.Subscript):
        outer = node.value
        name = outer.attr if isinstance(outer, ast.Attribute) else getattr(outer, "id", None)
        if name == "Optional":
            return _annotation_kind(node.slice)
        return None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        sides = [node.left, node.right]
        rest = [n for n in sides if not (isinstance(n, ast.Constant) and n.value is None)]
        return _annotation_kind(rest[0]) if len(rest) == 1 else None
    return None


def _literal(node: ast.expr) -> object:
    """The value of a literal expression (``16``, ``-1.0``, ``"640"``); None otherwise."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


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
