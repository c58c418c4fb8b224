"""The torch an interpreter sees, read from its files: never imported.

``install.sh`` decides which torch to use before the venv exists (agent/install/torchpick.py) and
checks the finished venv afterwards; both only need to know *which* torch a Python would import, its
version, its CUDA build and the cards it has kernels for. Importing torch to ask costs seconds
(and a CUDA initialisation); reading its files costs milliseconds:

- where: the interpreter is asked for ``importlib.util.find_spec("torch")`` (a top-level
  ``find_spec`` locates the package without running it) and its site-packages folders, in a child
  process that imports nothing but the standard library (:data:`_FIND`);
- the version: the ``torch-*.dist-info/METADATA`` beside the package, else ``torch/version.py``;
- the CUDA build: ``cuda = '13.0'`` in ``torch/version.py`` (``None`` for a CPU build), read as
  text;
- the cards it has kernels for: the ``sm_XY`` cubins (and ``compute_XY`` PTX) that every
  fat binary in ``torch/lib/libtorch_cuda.so``'s ``.nv_fatbin`` section holds, read from the
  fat binaries' headers (a few hundred small reads; the same list as
  ``torch._C._cuda_getArchFlags()``). Where that file cannot be read, the list is unknown and
  agent/install/torchpick.py infers it from PyTorch's own builds for that CUDA version (and says
  so).

Standard library only: it runs with the box's ``python3`` before anything is installed.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path
from typing import BinaryIO

#: Seconds the interpreter may take to say where its torch is (it imports no torch).
FIND_TIMEOUT_S = 60.0

# Run by the asked interpreter: where torch and torchvision are and its site-packages, as JSON.
# Standard library only; find_spec of a top-level name runs none of the package's code.
_FIND = r"""
import importlib.util, json, os, site, sys, sysconfig
dirs = []
try:
    dirs += site.getsitepackages()
except AttributeError:
    pass
paths = sysconfig.get_paths()
dirs += [paths["purelib"], paths["platlib"]]
out = {"site": list(dict.fromkeys(d for d in dirs if os.path.isdir(d))), "prefix": sys.prefix}
for name in ("torch", "torchvision", "libreyolo"):
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    out[name] = locations[0] if locations else None
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Found:
    """A package an interpreter would import: its folder and version (from its files)."""

    path: Path
    version: str | None


@dataclass(frozen=True)
class Seen:
    """What an interpreter sees, from :data:`_FIND` and the files it names."""

    #: Its site-packages folders, in its own order.
    site: tuple[Path, ...] = ()
    torch: Found | None = None
    #: torch's CUDA build (``"13.0"``), None for a CPU build or no torch.
    cuda: str | None = None
    #: ``sm_XY``/``compute_XY`` from libtorch_cuda.so; empty when it could not be read.
    arch_list: tuple[str, ...] = ()
    torchvision: Found | None = None
    libreyolo: Found | None = None
    #: Why nothing could be read (the interpreter failed).
    error: str | None = None

    def torch_dirs(self) -> list[Path]:
        """The folders a venv must see to import this torch and torchvision as this interpreter
        does: its site-packages, plus where torch or torchvision lives if that is elsewhere."""
        dirs = list(self.site)
        for pkg in (self.torchvision, self.torch):
            if pkg is not None and pkg.path.parent not in dirs:
                dirs.insert(0, pkg.path.parent)
        return dirs


# ------------------------------------------------------------------------------ files


def dist_version(package_dir: Path, name: str) -> str | None:
    """The ``Version:`` of ``name``'s ``.dist-info`` beside ``package_dir`` (None if none)."""
    want = re.sub(r"[-_.]+", "_", name).lower()
    for info in sorted(package_dir.parent.glob("*.dist-info")):
        stem = info.name[: -len(".dist-info")].rsplit("-", 1)[0]
        if re.sub(r"[-_.]+", "_", stem).lower() != want:
            continue
        try:
            text = (info / "METADATA").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        meta = HeaderParser().parsestr(text)
        if meta.get("Version"):
            return str(meta["Version"]).strip()
    return None


def _assigned(text: str, name: str) -> tuple[bool, str | None]:
    """``name = '...'`` / ``name: Optional[str] = None`` in a ``version.py``: (found, value)."""
    m = re.search(rf"^{name}\s*(?::[^=\n]*)?=\s*(?:(['\"])([^'\"\n]*)\1|(None))\s*$", text, re.M)
    if m is None:
        return False, None
    return True, m.group(2) if m.group(3) is None else None


def read_version_py(package_dir: Path) -> dict[str, str | None]:
    """``__version__`` and ``cuda`` from ``package_dir/version.py`` as text (absent: not set)."""
    try:
        text = (package_dir / "version.py").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    found = {}
    for name in ("__version__", "cuda"):
        present, value = _assigned(text, name)
        if present:
            found[name] = value
    return found


_FATBIN_MAGIC = 0xBA55ED50


def fatbin_arch_list(library: Path, *, max_containers: int = 100_000) -> tuple[str, ...]:
    """The kernels every fat binary in ``library``'s ``.nv_fatbin`` section holds.

    ELF64 little-endian only. A fat binary is a 16-byte header (magic ``0xBA55ED50``, version,
    header size, payload size) followed by entries, each with a header whose ``kind`` (1 PTX,
    2 cubin) and ``sm`` (``90``) say what it holds. A torch build puts one fat binary per CUDA
    source file, each with the build's full arch list; a few libraries bundled with it add extra
    ones to some files, which is why only the archs every fat binary holds count. Empty when the
    file is missing or is not laid out like that.
    """
    try:
        with library.open("rb") as f:
            return _fatbin_archs(f, max_containers)
    except (OSError, struct.error, ValueError):
        return ()


def _fatbin_archs(f: BinaryIO, max_containers: int) -> tuple[str, ...]:
    head = f.read(64)
    if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return ()
    (shoff,) = struct.unpack_from("<Q", head, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
    if not shoff or shentsize < 64 or shstrndx >= shnum:
        return ()
    f.seek(shoff)
    table = f.read(shentsize * shnum)
    sections = [struct.unpack_from("<IIQQQQ", table, i * shentsize) for i in range(shnum)]
    f.seek(sections[shstrndx][4])
    names = f.read(sections[shstrndx][5])
    fatbin = None
    for sec in sections:
        end = names.find(b"\0", sec[0])
        if names[sec[0] : end] == b".nv_fatbin":
            fatbin = sec
            break
    if fatbin is None:
        return ()
    pos, end = fatbin[4], fatbin[4] + fatbin[5]
    common: set[str] | None = None
    for _ in range(max_containers):
        if pos + 16 > end:
            break
        f.seek(pos)
        magic, _version, header_size, size = struct.unpack("<IHHQ", f.read(16))
        if magic != _FATBIN_MAGIC:
            break
        archs = set()
        entry, stop = pos + header_size, pos + header_size + size
        while entry + 36 <= stop:
            f.seek(entry)
            kind, _v, entry_header, padded = struct.unpack("<HHII", f.read(12))
            f.seek(entry + 28)
            (sm,) = struct.unpack("<I", f.read(4))
            if kind in (1, 2) and sm:
                archs.add(f"{'compute' if kind == 1 else 'sm'}_{sm}")
            if entry_header <= 0:
                break
            entry += entry_header + padded
        common = archs if common is None else common & archs
        pos = stop
    return tuple(sorted(common or (), key=_arch_key))


def _arch_key(arch: str) -> tuple[int, str]:
    kind, _, number = arch.partition("_")
    return int(re.sub(r"\D", "", number) or 0), kind


def cuda_library(torch_dir: Path) -> Path | None:
    """The library holding torch's CUDA kernels (``libtorch_cuda.so``; ``_cu`` before 1.8)."""
    for name in ("libtorch_cuda.so", "libtorch_cuda_cu.so"):
        if (torch_dir / "lib" / name).is_file():
            return torch_dir / "lib" / name
    return None


# ------------------------------------------------------------------------------ the interpreter


def parse_find(text: str) -> Seen:
    """:data:`_FIND`'s JSON line, completed from the files it names."""
    try:
        data = json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Seen(error=f"it printed no answer: {text.strip()[:200]!r}")
    if not isinstance(data, dict):
        return Seen(error=f"it printed no answer: {text.strip()[:200]!r}")

    def found(name: str) -> Found | None:
        where = data.get(name)
        if not where:
            return None
        path = Path(str(where))
        version = dist_version(path, name)
        if version is None:
            version = read_version_py(path).get("__version__")
        return Found(path, version)

    torch, cuda, arch = found("torch"), None, tuple[str, ...]()
    if torch is not None:
        cuda = read_version_py(torch.path).get("cuda")
        library = cuda_library(torch.path) if cuda else None
        arch = fatbin_arch_list(library) if library is not None else ()
    return Seen(
        site=tuple(Path(str(d)) for d in data.get("site") or ()),
        torch=torch,
        cuda=cuda,
        arch_list=arch,
        torchvision=found("torchvision"),
        libreyolo=found("libreyolo"),
    )


def read_seen(python: str, *, timeout: float = FIND_TIMEOUT_S) -> Seen:
    """What ``python`` would import, asked in a child that imports no torch."""
    try:
        proc = subprocess.run(
            [python, "-c", _FIND],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Seen(error=f"{python}: {exc}")
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip()[-200:]
        return Seen(error=f"{python} exited {proc.returncode}: {tail}")
    return parse_find(proc.stdout)


def describe(seen: Seen) -> str:
    """One line: ``torch 2.14.1+cu130 (CUDA 13.0) in DIR / torchvision 0.29.1 / ...``."""
    if seen.error:
        return f"cannot tell ({seen.error})"
    if seen.torch is None:
        return "no torch"
    build = f"CUDA {seen.cuda}" if seen.cuda else "CPU build"
    parts = [f"torch {seen.torch.version or '?'} ({build}) in {seen.torch.path.parent}"]
    for name, pkg in (("torchvision", seen.torchvision), ("libreyolo", seen.libreyolo)):
        parts.append(f"{name} {pkg.version or '?'}" if pkg else f"no {name}")
    return " / ".join(parts)


def check_sees(seen: Seen, expect: Sequence[Path] = ()) -> str | None:
    """Why a finished venv is not usable (no torch, or another torch than the kept one)."""
    if seen.error:
        return f"cannot ask the venv's Python: {seen.error}"
    if seen.torch is None:
        return "the venv sees no torch"
    if seen.torchvision is None:
        return "the venv sees no torchvision"
    if expect:
        want = {p.resolve() for p in expect}
        for name, pkg in (("torch", seen.torch), ("torchvision", seen.torchvision)):
            if pkg.path.resolve() not in want:
                kept = ", ".join(str(p) for p in expect)
                return f"the venv's {name} is {pkg.path}, not the image's ({kept})"
    return None
