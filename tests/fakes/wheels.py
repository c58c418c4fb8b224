"""A local wheel folder for an offline ``pip install`` (``PIP_NO_INDEX=1 PIP_FIND_LINKS=...``), made
in a test from what this interpreter already has installed: each distribution's files (as its
RECORD lists them) packed back into a wheel with the tags its WHEEL file names, plus small
stand-in wheels where a real one would be too big to repack (libreyolo: its dependency list is
what matters to pip, not its code).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import re
import zipfile
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _record_entry(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def _write_wheel(
    out: Path, name: str, version: str, tag: str, files: dict[str, bytes], info: str = ""
) -> Path:
    stem = re.sub(r"[-_.]+", "_", name)
    info = info or f"{stem}-{version}.dist-info"
    record = [_record_entry(arc, data) for arc, data in files.items()]
    record.append(f"{info}/RECORD,,")
    path = out / f"{stem}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as whl:
        for arc, data in files.items():
            whl.writestr(arc, data)
        whl.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def repack(name: str, out: Path) -> Path:
    """The installed distribution ``name`` as a wheel in ``out``."""
    dist = md.distribution(name)
    version = dist.version
    files: dict[str, bytes] = {}
    wheel_meta, info = "", ""
    for rel in dist.files or ():
        arc = str(rel).replace("\\", "/")
        if arc.startswith("..") or "__pycache__" in arc or arc.endswith(".pyc"):
            continue  # console scripts (pip writes them again) and byte code
        info_file = arc.split("/", 1)[1] if ".dist-info/" in arc else ""
        if info_file in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json"):
            continue
        located = Path(str(dist.locate_file(rel)))
        if not located.is_file():
            continue
        files[arc] = located.read_bytes()
        if info_file == "WHEEL":
            wheel_meta = files[arc].decode()
            info = arc.split("/", 1)[0]
    tags = re.findall(r"^Tag:\s*(\S+)", wheel_meta, re.M)
    if not tags:
        raise ValueError(f"{name} {version}: no WHEEL tags (not installed from a wheel)")
    return _write_wheel(out, dist.metadata["Name"], version, tags[0], files, info)


def standin(name: str, version: str, requires: Iterable[str], out: Path) -> Path:
    """A pure-Python wheel ``name==version`` with these ``Requires-Dist`` and an empty package."""
    stem = re.sub(r"[-_.]+", "_", name)
    info = f"{stem}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    wheel = "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files = {
        f"{stem.lower()}/__init__.py": f"__version__ = {version!r}\n".encode(),
        f"{info}/METADATA": metadata.encode(),
        f"{info}/WHEEL": wheel.encode(),
    }
    return _write_wheel(out, name, version, "py3-none-any", files)


def closure(requirements: Iterable[str], skip: Iterable[str] = ()) -> list[str]:
    """The installed distributions these requirements pull in (markers evaluated here, no
    extras), except ``skip`` and what they alone pull in."""
    skipped = {_norm(s) for s in skip}
    seen: dict[str, str] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        key = _norm(req.name)
        if key in seen or key in skipped:
            continue
        dist = md.distribution(req.name)
        seen[key] = dist.metadata["Name"]
        for text in dist.requires or ():
            dep = Requirement(text)
            if dep.marker is None or dep.marker.evaluate({"extra": ""}):
                todo.append(dep)
    return sorted(seen.values())
