"""Dataclasses for the supervisor, without the standard library's ``dataclasses``, which imports
``inspect`` (and with it ``ast`` and ``dis``): 1.0 MiB that the supervisor, alive for the whole
job, would hold for nothing (issue 26: every process of ours together under 80 MiB PSS).

For mypy these *are* dataclasses: a module the supervisor imports writes ::

    TYPE_CHECKING = False
    if TYPE_CHECKING:
        from dataclasses import asdict as plain, dataclass as record, field
    else:
        from agent.util.record import field, plain, record

so every check mypy makes of a dataclass (the fields, their types, ``frozen``) is made. At run
time :func:`record` gives a class what the agent uses of a dataclass, the same way: ``__init__``
from the annotated fields in order (positional or by name; a default, or ``field(default_factory=
...)`` called for each instance), ``__repr__``, ``__eq__`` (same class, same fields), and with
``frozen=True`` no assignment after ``__init__`` and a ``__hash__``. :func:`plain` is
``dataclasses.asdict`` for these: records, lists, tuples and dicts copied all the way down.
tests/test_record.py holds each side by side with ``dataclasses``.

Not supported (a record that needs them is a real dataclass): ``ClassVar``/``InitVar``
fields, ``__post_init__``, inheritance between records, ``field()`` with anything but
``default_factory`` and ``repr``.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    T = TypeVar("T")

#: A field without a default.
_MISSING = object()
#: ``__eq__`` as this Python's dataclasses: field by field from 3.13 (with ``self is other``
#: first), as tuples before.
FIELD_BY_FIELD = sys.version_info >= (3, 13)


class FrozenRecordError(AttributeError):
    """An assignment to a field of a frozen record (``dataclasses.FrozenInstanceError`` is an
    AttributeError too)."""


class Field:
    """``field(default_factory=..., repr=...)``: a field's default made anew for each instance."""

    __slots__ = ("default_factory", "repr")

    def __init__(self, default_factory: Callable[[], Any], repr: bool) -> None:
        self.default_factory = default_factory
        self.repr = repr


def field(*, default_factory: Callable[[], Any], repr: bool = True) -> Any:
    """As ``dataclasses.field`` with those two arguments."""
    return Field(default_factory, repr)


def record(cls: type[T] | None = None, /, *, frozen: bool = False) -> Any:
    """As ``@dataclasses.dataclass`` or ``@dataclasses.dataclass(frozen=True)``, for the
    subset the module docstring names."""

    def wrap(cls: type[T]) -> type[T]:
        return _make(cls, frozen)

    return wrap if cls is None else wrap(cls)


def _make(cls: type[T], frozen: bool) -> type[T]:
    inherited = any(hasattr(base, "__record_fields__") for base in cls.__mro__[1:])
    if "__post_init__" in cls.__dict__ or inherited:
        raise TypeError(f"{cls.__qualname__}: a record has no __post_init__ and no record base")
    names = tuple(cls.__annotations__)  # its own: a record has no record base
    defaults: dict[str, Any] = {}
    shown = []
    for name in names:
        value = cls.__dict__.get(name, _MISSING)
        if isinstance(value, Field):
            defaults[name] = value
            if value.repr:
                shown.append(name)
            delattr(cls, name)  # as dataclasses does: no class attribute for a factory default
            continue
        if value is not _MISSING:
            defaults[name] = value
        elif defaults:
            raise TypeError(f"non-default argument {name!r} follows default argument")
        shown.append(name)
    qualname = cls.__qualname__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(names):
            raise TypeError(
                f"{qualname}.__init__() takes {len(names) + 1} positional arguments but "
                f"{len(args) + 1} were given"
            )
        values = dict(zip(names, args, strict=False))
        for key, value in kwargs.items():
            if key not in names:
                raise TypeError(f"{qualname}.__init__() got an unexpected keyword argument {key!r}")
            if key in values:
                raise TypeError(f"{qualname}.__init__() got multiple values for argument {key!r}")
            values[key] = value
        for name in names:
            if name in values:
                value = values[name]
            elif name in defaults:
                default = defaults[name]
                value = default.default_factory() if isinstance(default, Field) else default
            else:
                missing = [n for n in names if n not in values and n not in defaults]
                listed = " and ".join(repr(n) for n in missing)
                raise TypeError(
                    f"{qualname}.__init__() missing {len(missing)} required "
                    f"argument{'s' if len(missing) > 1 else ''}: {listed}"
                )
            object.__setattr__(self, name, value)

    def __repr__(self: Any) -> str:
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in shown)
        return f"{type(self).__qualname__}({inner})"

    if FIELD_BY_FIELD:

        def __eq__(self: Any, other: object) -> bool:
            if self is other:
                return True
            if other.__class__ is not self.__class__:
                return NotImplemented
            # Field by field, as Python 3.13's dataclasses (``a == b and c == d``): a NaN
            # differs from itself here, unless it is the same record.
            same: bool = True
            for n in names:
                same = getattr(self, n) == getattr(other, n)
                if not same:
                    break
            return same

    else:

        def __eq__(self: Any, other: object) -> bool:
            if other.__class__ is not self.__class__:
                return NotImplemented
            # As tuples, as dataclasses compares up to 3.12: the same NaN object is equal to
            # itself.
            return tuple(getattr(self, n) for n in names) == tuple(getattr(other, n) for n in names)

    cls.__init__ = __init__  # type: ignore[method-assign]
    cls.__repr__ = __repr__  # type: ignore[method-assign]
    cls.__eq__ = __eq__  # type: ignore[method-assign]
    cls.__record_fields__ = names  # type: ignore[attr-defined]
    if frozen:

        def __setattr__(self: Any, name: str, value: Any) -> None:
            raise FrozenRecordError(f"cannot assign to field {name!r}")

        def __delattr__(self: Any, name: str) -> None:
            raise FrozenRecordError(f"cannot delete field {name!r}")

        def __hash__(self: Any) -> int:
            return hash(tuple(getattr(self, n) for n in names))

        cls.__setattr__ = __setattr__  # type: ignore[method-assign]
        cls.__delattr__ = __delattr__  # type: ignore[method-assign]
        cls.__hash__ = __hash__  # type: ignore[method-assign]
    else:
        cls.__hash__ = None  # type: ignore[assignment]  # mutable and compared by value
    return cls


def plain(obj: Any) -> dict[str, Any]:
    """``dataclasses.asdict`` for a record: its fields by name, copied all the way down."""
    if not hasattr(obj, "__record_fields__") or isinstance(obj, type):
        raise TypeError("plain() should be called on record instances")
    return {name: _copy(getattr(obj, name)) for name in obj.__record_fields__}


def _copy(value: Any) -> Any:
    if hasattr(value, "__record_fields__") and not isinstance(value, type):
        return plain(value)
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, tuple):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return type(value)((_copy(k), _copy(v)) for k, v in value.items())
    return value
