"""The agent's build backend (PEP 517 and PEP 660, in-tree: ``backend-path = ["buildsys"]``).

pip runs a build backend in a fresh Python for each hook it calls. setuptools took about 0.8 s
for the three calls of the editable install on a box billed by the second (its own import each
time, an egg-info, a manifest), and pip had to find a setuptools new enough first (or install
one into a throwaway environment). This backend needs only the standard library, reads
``pyproject.toml``'s ``[project]`` table, and builds:

- a wheel: every file under ``agent/`` (the Python modules, the dashboard page, the C NVML
  host's source, ``py.typed``), caches and hidden files left out;
- an editable wheel: a ``.pth`` that installs a finder for the one top-level name ``agent``,
  pointing at this checkout (nothing else of the checkout becomes importable: not ``tests``,
  not ``bench``);
- an sdist: ``pyproject.toml``, ``README.md``, ``agent/`` and ``buildsys/``, with ``PKG-INFO``.

The metadata (core metadata 2.1) holds the name, version, summary, license, Python requirement,
dependencies, extras (``Provides-Extra`` and ``extra == "..."`` markers), the console scripts and
the README as the description.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tarfile
import time
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "agent"
TAG = "py3-none-any"
#: Files never shipped: caches and what editors and tools leave beside the sources.
SKIP_DIRS = {"__pycache__"}
SKIP_SUFFIXES = (".pyc", ".pyo", ".so", ".swp", "~")
#: A fixed time for the sdist's members (a build of the same tree gives the same archive).
EPOCH = 315532800  # 1980-01-01, the earliest a zip can hold too


def _project() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project: dict[str, Any] = tomllib.load(f)["project"]
    return project


def _dist_name(project: dict[str, Any]) -> str:
    """The name as wheel and sdist file names spell it (PEP 427, PEP 625)."""
    return re.sub(r"[-_.]+", "_", str(project["name"])).lower()


def _extra_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 685


def _with_extra(requirement: str, extra: str) -> str:
    spec, _, marker = requirement.partition(";")
    spec, marker = spec.strip(), marker.strip()
    condition = f'extra == "{extra}"'
    return f"{spec}; ({marker}) and {condition}" if marker else f"{spec}; {condition}"


def metadata(project: dict[str, Any]) -> str:
    """The core metadata (METADATA in a wheel, PKG-INFO in an sdist)."""
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {project['name']}",
        f"Version: {project['version']}",
    ]
    if project.get("description"):
        lines.append(f"Summary: {project['description']}")
    license_ = project.get("license")
    if isinstance(license_, dict) and license_.get("text"):
        lines.append(f"License: {license_['text']}")
    elif isinstance(license_, str):
        lines.append(f"License-Expression: {license_}")
    if project.get("requires-python"):
        lines.append(f"Requires-Python: {project['requires-python']}")
    lines += [f"Requires-Dist: {r}" for r in project.get("dependencies", [])]
    for extra, requirements in project.get("optional-dependencies", {}).items():
        name = _extra_name(extra)
        lines.append(f"Provides-Extra: {name}")
        lines += [f"Requires-Dist: {_with_extra(r, name)}" for r in requirements]
    readme = project.get("readme")
    body = ""
    if isinstance(readme, str) and (ROOT / readme).is_file():
        lines.append("Description-Content-Type: text/markdown")
        body = (ROOT / readme).read_text(encoding="utf-8")
    return "\n".join(lines) + "\n\n" + body


def _entry_points(project: dict[str, Any]) -> str:
    scripts = project.get("scripts", {})
    if not scripts:
        return ""
    return "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in scripts.items()) + "\n"


def _package_files() -> Iterator[Path]:
    for folder, dirs, files in os.walk(ROOT / PACKAGE):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if not name.startswith(".") and not name.endswith(SKIP_SUFFIXES):
                yield Path(folder) / name


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}\n"


def _dist_info(project: dict[str, Any]) -> tuple[str, dict[str, str]]:
    info = f"{_dist_name(project)}-{project['version']}.dist-info"
    files = {
        f"{info}/METADATA": metadata(project),
        f"{info}/WHEEL": (
            f"Wheel-Version: 1.0\nGenerator: {PACKAGE}_build\nRoot-Is-Purelib: true\nTag: {TAG}\n"
        ),
    }
    entry_points = _entry_points(project)
    if entry_points:
        files[f"{info}/entry_points.txt"] = entry_points
    return info, files


def _write_wheel(directory: str, members: dict[str, bytes]) -> str:
    project = _project()
    info, meta = _dist_info(project)
    name = f"{_dist_name(project)}-{project['version']}-{TAG}.whl"
    everything = {**members, **{k: v.encode() for k, v in meta.items()}}
    record = "".join(_record_line(p, d) for p, d in everything.items()) + f"{info}/RECORD,,\n"
    target = Path(directory) / name
    partial = target.with_name(name + ".part")
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for path, data in [*everything.items(), (f"{info}/RECORD", record.encode())]:
            entry = zipfile.ZipInfo(path, date_time=time.gmtime(EPOCH)[:6])
            entry.external_attr = 0o644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(entry, data)
    os.replace(partial, target)
    return name


def _write_metadata(metadata_directory: str) -> str:
    info, files = _dist_info(_project())
    for path, text in files.items():
        out = Path(metadata_directory) / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    return info


# ---------------------------------------------------------------------------- the PEP 517 hooks


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    return []


def get_requires_for_build_editable(config_settings: dict[str, Any] | None = None) -> list[str]:
    return []


def get_requires_for_build_sdist(config_settings: dict[str, Any] | None = None) -> list[str]:
    return []


def prepare_metadata_for_build_wheel(
    metadata_directory: str, config_settings: dict[str, Any] | None = None
) -> str:
    return _write_metadata(metadata_directory)


def prepare_metadata_for_build_editable(
    metadata_directory: str, config_settings: dict[str, Any] | None = None
) -> str:
    return _write_metadata(metadata_directory)


def build_wheel(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    members = {p.relative_to(ROOT).as_posix(): p.read_bytes() for p in _package_files()}
    return _write_wheel(wheel_directory, members)


#: The editable install's finder: ``agent`` (and only it) is found in the checkout.
FINDER = '''"""libreyolo-agent, installed editable: the package `agent` is found in {root!r}."""
import sys
from importlib.machinery import PathFinder

ROOT = {root!r}


class AgentFinder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != {package!r}:
            return None
        return PathFinder.find_spec(fullname, [ROOT], target)


def install():
    if not any(getattr(f, "__module__", None) == __name__ for f in sys.meta_path):
        sys.meta_path.append(AgentFinder)
'''


def build_editable(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    project = _project()
    module = f"__editable___{_dist_name(project)}_finder"
    members = {
        f"{module}.py": FINDER.format(root=str(ROOT), package=PACKAGE).encode(),
        f"__editable__.{_dist_name(project)}-{project['version']}.pth": (
            f"import {module}; {module}.install()\n".encode()
        ),
    }
    return _write_wheel(wheel_directory, members)


def build_sdist(sdist_directory: str, config_settings: dict[str, Any] | None = None) -> str:
    project = _project()
    base = f"{_dist_name(project)}-{project['version']}"
    paths = [ROOT / "pyproject.toml", *_package_files()]
    for folder, names in (("buildsys", ("agent_build.py",)), (".", ("README.md",))):
        paths += [ROOT / folder / n for n in names if (ROOT / folder / n).is_file()]
    name = f"{base}.tar.gz"
    target = Path(sdist_directory) / name
    partial = target.with_name(name + ".part")
    with tarfile.open(partial, "w:gz", format=tarfile.PAX_FORMAT) as tar:

        def add(arcname: str, data: bytes) -> None:
            entry = tarfile.TarInfo(f"{base}/{arcname}")
            entry.size, entry.mtime, entry.mode = len(data), EPOCH, 0o644
            tar.addfile(entry, io.BytesIO(data))

        add("PKG-INFO", metadata(project).encode())
        for path in sorted(set(paths)):
            add(path.relative_to(ROOT).as_posix(), path.read_bytes())
    os.replace(partial, target)
    return name
