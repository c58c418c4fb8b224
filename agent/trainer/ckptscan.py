"""NaN and inf in a torch checkpoint, read without torch.

``torch.save`` (the zip format, every torch since 1.6) writes one zip: ``PREFIX/data.pkl`` (a
pickle of the containers, where every tensor is a call to ``torch._utils._rebuild_tensor_v2``
or ``_v3`` whose storage is a persistent id ``('storage', StorageType, KEY, location,
numel)``), ``PREFIX/byteorder`` and one member ``PREFIX/data/KEY`` per storage with its raw
bytes. This module reads ``data.pkl`` with an unpickler that resolves no global at all (each
one becomes an inert marker: nothing in the file can run), learns which storage holds which
floating type (the storage's class, ``FloatStorage``..., or the dtype argument of
``_rebuild_tensor_v3`` for an ``UntypedStorage``) and which tensors use it, then reads each
floating storage in chunks and looks at the exponent bits of every element: an IEEE value is
NaN or inf exactly when its exponent bits are all ones (float32: bits 23-30; float64: 52-62;
float16: 10-14; bfloat16: 7-14; float8 e5m2: 2-6; e4m3fn has no inf and one NaN per sign,
``0x7f``; the ``fnuz`` kinds one NaN, ``0x80``). Complex storages are pairs of their float.

The byte comparisons run in C (``bytes`` slicing with a step, ``translate``, ``in``, big-int
``&``), so a 35 MB checkpoint takes tens of milliseconds on one core and the memory of one
chunk; the agent runs it in a thread instead of a child that imports torch (1 GB and seconds
of CPU for every epoch, which the box paid beside its training).

A whole storage is read, not only the part a tensor views: a NaN anywhere in a storage counts
for every tensor that uses it (LibreYOLO's tensors each own theirs).
"""

from __future__ import annotations

import pickle
import threading
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

#: Bytes read at a time from a storage (a multiple of every element size; under glibc's mmap
#: threshold, so the same few blocks of the arena serve every chunk).
CHUNK = 64 << 10
#: ``data.pkl`` of a detection checkpoint is tens of KiB; past this it is not one we read.
MAX_PICKLE = 64 << 20
#: Names of non-finite tensors given in the answer (the count is always whole).
MAX_NAMES = 5


class ScanError(Exception):
    """The file cannot be read as a torch checkpoint (the message says why)."""


class Cancelled(Exception):
    """The scan was asked to stop (the agent is exiting, or the check timed out)."""


@dataclass(frozen=True)
class Layout:
    """Where the exponent bits of one element of a floating type sit (little-endian): the
    element is NaN or inf when ``byte & mask == value`` holds for every ``(offset, mask,
    value)``."""

    itemsize: int
    rules: tuple[tuple[int, int, int], ...]


_F32 = Layout(4, ((3, 0x7F, 0x7F), (2, 0x80, 0x80)))
_F64 = Layout(8, ((7, 0x7F, 0x7F), (6, 0xF0, 0xF0)))
_F16 = Layout(2, ((1, 0x7C, 0x7C),))
_BF16 = Layout(2, ((1, 0x7F, 0x7F), (0, 0x80, 0x80)))
_E5M2 = Layout(1, ((0, 0x7C, 0x7C),))
_E4M3FN = Layout(1, ((0, 0x7F, 0x7F),))
_FNUZ = Layout(1, ((0, 0xFF, 0x80),))

#: Floating storages by their class name (typed storages) or dtype name (``_rebuild_tensor_v3``).
FLOATING: dict[str, Layout] = {
    "FloatStorage": _F32,
    "DoubleStorage": _F64,
    "HalfStorage": _F16,
    "BFloat16Storage": _BF16,
    "ComplexFloatStorage": _F32,
    "ComplexDoubleStorage": _F64,
    "ComplexHalfStorage": _F16,
    "float32": _F32,
    "float": _F32,
    "float64": _F64,
    "double": _F64,
    "float16": _F16,
    "half": _F16,
    "bfloat16": _BF16,
    "complex64": _F32,
    "cfloat": _F32,
    "complex128": _F64,
    "cdouble": _F64,
    "complex32": _F16,
    "chalf": _F16,
    "float8_e5m2": _E5M2,
    "float8_e4m3fn": _E4M3FN,
    "float8_e4m3fnuz": _FNUZ,
    "float8_e5m2fnuz": _FNUZ,
}


def _table(mask: int, value: int) -> bytes:
    return bytes(1 if b & mask == value else 0 for b in range(256))


_TABLES = {
    (mask, value): _table(mask, value)
    for layout in set(FLOATING.values())
    for _, mask, value in layout.rules
}


def nonfinite_in(chunk: bytes, layout: Layout, *, big_endian: bool = False) -> bool:
    """Whether ``chunk`` (whole elements of ``layout``) holds a NaN or an inf."""
    size = layout.itemsize
    hits: int | None = None
    for offset, mask, value in layout.rules:
        at = size - 1 - offset if big_endian else offset
        marks = chunk[at::size].translate(_TABLES[(mask, value)])
        if b"\x01" not in marks:
            return False  # no element has this byte right: none is NaN or inf
        bits = int.from_bytes(marks, "little")
        hits = bits if hits is None else hits & bits
        if not hits:
            return False
    return bool(hits)


# ---------------------------------------------------------------- data.pkl, inert


@dataclass(eq=False, slots=True)
class _Storage:
    key: str
    kind: str  # the storage class's name; "UntypedStorage": the tensors' dtype says
    dtypes: set[str] = field(default_factory=set)


@dataclass(eq=False, slots=True)
class _Tensor:
    storage: _Storage


class _Opaque:
    """An object of a class the pickle named (each name becomes a subclass of this one, never
    the real class): its arguments and state, kept to be walked."""

    module = ""
    qualname = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Opaque:
        obj = object.__new__(cls)
        obj.args, obj.kwargs = args, kwargs
        obj.state = None
        obj.items = []
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    # Set by __new__ (pickle's NEWOBJ calls it without __init__).
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: Any
    items: list[Any]

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items.append((key, value))

    def append(self, value: Any) -> None:
        self.items.append(value)

    def extend(self, values: Any) -> None:
        self.items.extend(values)


def _tensor_v2(*args: Any) -> Any:
    return _tensor(args, None)


def _tensor_v3(*args: Any) -> Any:
    dtype = args[6] if len(args) > 6 else None
    return _tensor(
        args, dtype.qualname if isinstance(dtype, type) and issubclass(dtype, _Opaque) else None
    )


def _tensor(args: tuple[Any, ...], dtype: str | None) -> Any:
    storage = args[0] if args else None
    if not isinstance(storage, _Storage):
        return _Opaque(*args)
    if dtype is not None:
        storage.dtypes.add(dtype)
    return _Tensor(storage)


_REBUILD = {
    "_rebuild_tensor": _tensor_v2,
    "_rebuild_tensor_v2": _tensor_v2,
    "_rebuild_tensor_v3": _tensor_v3,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO) -> None:
        super().__init__(file)
        self.storages: dict[str, _Storage] = {}
        self.classes: dict[tuple[str, str], type[_Opaque]] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch._utils" and name in _REBUILD:
            return _REBUILD[name]
        cls = self.classes.get((module, name))
        if cls is None:
            attrs = {"module": module, "qualname": name}
            cls = self.classes[(module, name)] = type("Opaque", (_Opaque,), attrs)
        return cls

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise ScanError(f"an unknown persistent id in data.pkl: {str(pid)[:80]}")
        kind = getattr(pid[1], "qualname", None) or str(pid[1])
        key = str(pid[2])
        storage = self.storages.get(key)
        if storage is None:
            storage = self.storages[key] = _Storage(key, kind)
        return storage


@dataclass(frozen=True)
class Scan:
    """What one checkpoint holds."""

    #: Floating-point tensors (model, EMA, optimizer moments: every one).
    tensors: int
    #: Names of those holding NaN/inf (the first few) and how many.
    bad: tuple[str, ...]
    bad_count: int
    #: The epoch the checkpoint says it holds (LibreYOLO 1.6.0 stores the 0-based index: +1).
    epoch: int | None
    #: Bytes of floating storage read.
    bytes_read: int


def _walk(root: Any, *, names: bool) -> list[tuple[str, _Tensor]]:
    """Every tensor reachable from ``root``, each once, without recursion (no depth limit to
    hit); with ``names``, each with its name (``ema.conv.weight``, ``optimizer.state.0.exp_avg``),
    sorted by it; without, ``""`` (the first pass: a checkpoint of thousands of tensors needs
    no name unless one is bad)."""
    found: list[tuple[str, _Tensor]] = []
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, str | bytes | int | float | bool | type(None) | type):
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, _Tensor):
            found.append((path, obj))
        elif isinstance(obj, dict):
            for key, value in obj.items():
                stack.append((value, (f"{path}.{key}" if path else str(key)) if names else ""))
        elif isinstance(obj, list | tuple):
            for i, value in enumerate(obj):
                stack.append((value, f"{path}[{i}]" if names else ""))
        elif isinstance(obj, set | frozenset):
            stack.extend((value, path) for value in obj)
        elif isinstance(obj, _Opaque):
            stack.extend((part, path) for part in (obj.args, obj.kwargs, obj.state, obj.items))
    if names:
        found.sort(key=lambda item: _natural(item[0]))
    return found


def _natural(name: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in name.replace("[", ".").split("."))


def _layout_of(storage: _Storage) -> Layout | str | None:
    """The storage's floating layout; None for an integer or bool one; a string for a kind
    this module does not know (the answer is then "cannot tell", never "finite")."""
    if storage.kind != "UntypedStorage":
        if storage.kind in FLOATING:
            return FLOATING[storage.kind]
        return None if storage.kind.endswith("Storage") else storage.kind
    kinds = {FLOATING.get(d) for d in storage.dtypes}
    if not storage.dtypes:
        return "UntypedStorage without a dtype"
    if None in kinds:
        unknown = sorted(d for d in storage.dtypes if d not in FLOATING)
        if all(_integral(d) for d in unknown) and len(kinds) == 1:
            return None
        return f"dtype {', '.join(unknown)}"
    if len(kinds) != 1:
        return "a storage viewed as two floating types"
    return kinds.pop()


def _integral(dtype: str) -> bool:
    return dtype.startswith(("int", "uint", "bool", "long", "short", "qint", "quint", "bits"))


def scan(path: Path, *, cancel: threading.Event | None = None) -> Scan:
    """Read the checkpoint at ``path``. Raises :class:`ScanError` for a file that is not a
    whole torch zip checkpoint, :class:`Cancelled` once ``cancel`` is set, OSError as read."""
    try:
        with zipfile.ZipFile(path) as zf:
            return _scan_zip(zf, cancel)
    except zipfile.BadZipFile as exc:
        raise ScanError(f"not a zip checkpoint: {exc}") from None


def _scan_zip(zf: zipfile.ZipFile, cancel: threading.Event | None) -> Scan:
    names = zf.namelist()
    pkl = next((n for n in names if n.rpartition("/")[2] == "data.pkl"), None)
    if pkl is None:
        raise ScanError("no data.pkl: not a torch checkpoint")
    prefix = pkl[: -len("data.pkl")]
    if zf.getinfo(pkl).file_size > MAX_PICKLE:
        raise ScanError(f"data.pkl is over {MAX_PICKLE >> 20} MiB")
    big = False
    if f"{prefix}byteorder" in names:
        big = zf.read(f"{prefix}byteorder").strip() == b"big"
    with zf.open(pkl) as f:
        unpickler = _Unpickler(f)  # type: ignore[arg-type]
        try:
            root = unpickler.load()
        except ScanError:
            raise
        except Exception as exc:  # a torn or foreign pickle: whatever pickle raises
            raise ScanError(f"data.pkl cannot be read: {type(exc).__name__}: {exc}") from None
    count = 0
    layouts: dict[str, Layout] = {}
    for _, tensor in _walk(root, names=False):
        layout = _layout_of(tensor.storage)
        if isinstance(layout, str):
            raise ScanError(f"{layout} is not a floating type this check reads")
        if layout is not None:
            count += 1
            layouts[tensor.storage.key] = layout
    bad_keys: set[str] = set()
    read = 0
    for key, layout in layouts.items():
        member = f"{prefix}data/{key}"
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ScanError(f"the checkpoint lacks {member}") from None
        if info.file_size % layout.itemsize:
            raise ScanError(f"{member}: {info.file_size} bytes, not whole elements")
        with zf.open(info) as f:
            while chunk := f.read(CHUNK):
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                read += len(chunk)
                if nonfinite_in(chunk, layout, big_endian=big):
                    bad_keys.add(key)
                    break
    bad = []
    if bad_keys:
        bad = [name for name, t in _walk(root, names=True) if t.storage.key in bad_keys]
    epoch = root.get("epoch") if isinstance(root, dict) else None
    return Scan(
        tensors=count,
        bad=tuple(bad[:MAX_NAMES]),
        bad_count=len(bad),
        epoch=epoch + 1 if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
        bytes_read=read,
    )
