"""agent.util.record, the supervisor's dataclasses without ``dataclasses`` (issue 26), held side
by side with the standard library's: the same class declared with both must build, show,
compare, hash, refuse and copy out the same way."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any

import pytest

from agent.util import record as rec

ROOT = Path(__file__).resolve().parents[1]


class Colour(enum.StrEnum):
    RED = "red"


def declare(decorate: Any, field: Any, *, frozen: bool) -> tuple[type, type]:
    """The same two classes (an inner one and one holding it), with one implementation."""

    @decorate(frozen=frozen)
    class Inner:
        pid: int
        argv: list[str]
        run_dir: str | None = None

    @decorate(frozen=frozen)
    class Outer:
        name: str
        colour: Colour = Colour.RED
        inner: Inner | None = None
        history: list[dict[str, Any]] = field(default_factory=list)
        secret: str = field(default_factory=lambda: "s3cret", repr=False)
        pair: tuple[int, ...] = (1, 2)

    return Inner, Outer


BOTH = [
    pytest.param((dataclasses.dataclass, dataclasses.field, dataclasses.asdict), id="dataclasses"),
    pytest.param((rec.record, rec.field, rec.plain), id="record"),
]


def outcome(fn: Any) -> tuple[str, Any]:
    """What calling ``fn`` gives: its value, or the kind of exception it raised."""
    try:
        return "value", fn()
    except Exception as exc:  # the kind is compared, not the words
        kind = "AttributeError" if isinstance(exc, AttributeError) else type(exc).__name__
        return "raised", kind


def behaviour(impl: tuple[Any, Any, Any], frozen: bool) -> list[Any]:
    decorate, field, asdict = impl
    Inner, Outer = declare(decorate, field, frozen=frozen)
    a = Outer("job", inner=Inner(4242, ["libreyolo", "train"]))
    b = Outer(name="job", inner=Inner(pid=4242, argv=["libreyolo", "train"]))
    c = Outer("other")
    seen: list[Any] = [
        repr(a).replace(Outer.__qualname__, "Outer").replace(Inner.__qualname__, "Inner"),
        a == b,
        a != c,
        a == "job",
        a.history is not b.history,  # a factory called for each instance
        a.secret,
        asdict(a),
        outcome(lambda: Outer()),
        outcome(lambda: Outer("x", name="y")),
        outcome(lambda: Outer("x", nope=1)),
        outcome(lambda: Outer("a", Colour.RED, None, [], "s", (1,), "extra")),
        outcome(lambda: hash(b)),
    ]
    copied = asdict(a)
    copied["inner"]["argv"].append("changed")
    copied["history"].append({"at": 1.0})
    seen += [a.inner.argv, a.history]  # asdict copies all the way down
    setting = outcome(lambda: setattr(a, "name", "renamed"))
    seen += [setting, a.name]
    Point = decorate(frozen=frozen)(type("Point", (), {"__annotations__": {"x": "int"}}))
    seen.append(outcome(lambda: hash(Point(1)) == hash(Point(1))))  # frozen: hashable
    nan = float("nan")
    one = Point(nan)
    # Python 3.13's dataclasses compare field by field (the same NaN object differs from
    # itself), 3.11 and 3.12's as tuples (it does not): a record does as this Python does.
    seen += [Point(nan) == Point(nan), Point(float("nan")) == Point(float("nan")), one == one]
    Sub = type("Sub", (Point,), {})  # a plain subclass shows its own name
    seen.append(repr(Sub(3)))
    return seen


@pytest.mark.parametrize("frozen", [False, True], ids=["mutable", "frozen"])
def test_a_record_behaves_as_the_same_dataclass(frozen: bool) -> None:
    theirs = behaviour((dataclasses.dataclass, dataclasses.field, dataclasses.asdict), frozen)
    ours = behaviour((rec.record, rec.field, rec.plain), frozen)
    assert ours == theirs


def test_a_record_with_a_missing_field_names_it() -> None:
    @rec.record
    class Two:
        first: int
        second: str

    with pytest.raises(TypeError, match="missing 2 required arguments: 'first' and 'second'"):
        Two()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="got an unexpected keyword argument 'third'"):
        Two(1, "2", third=3)  # type: ignore[call-arg]


def test_what_a_record_does_not_support_is_refused_at_once() -> None:
    with pytest.raises(TypeError, match="non-default argument 'b' follows default argument"):

        @rec.record
        class Order:
            a: int = 0
            b: int

    @rec.record
    class Base:
        a: int

    with pytest.raises(TypeError, match="no record base"):

        @rec.record
        class Child(Base):
            b: int

    with pytest.raises(TypeError, match="no __post_init__"):

        @rec.record
        class Post:
            a: int

            def __post_init__(self) -> None:
                pass

    with pytest.raises(TypeError, match="record instances"):
        rec.plain(Base)
