"""The unpacker on a Python whose tarfile has no PEP 706 filter (3.11.0-3.11.3, e.g. Debian 12's
3.11.2), which ``requires-python >= 3.11`` accepts.

Every test of tests/test_archive.py, tests/test_archive_plan.py and tests/test_archive_write.py runs
again here with tarfile's filter API hidden (the one thing this module patches: the absent API
that nothing else can produce on a newer Python): hostile archives are still refused with nothing
written, good ones unpack whole, modes are still made sane. And where such an old Python is on
this machine, a real unpack runs under it in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests import test_archive, test_archive_plan, test_archive_write

#: What PEP 706 added to tarfile (3.11.4, 3.12).
PEP706_NAMES = (
    "data_filter",
    "tar_filter",
    "fully_trusted_filter",
    "FilterError",
    "AbsolutePathError",
    "OutsideDestinationError",
    "SpecialFileError",
    "AbsoluteLinkError",
    "LinkOutsideDestinationError",
)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_pep706(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """tarfile as Python 3.11.0-3.11.3 has it."""
    for name in PEP706_NAMES:
        monkeypatch.delattr(tarfile, name, raising=False)
    yield


def _tests_of(*modules: ModuleType) -> dict[str, object]:
    tests: dict[str, object] = {}
    for module in modules:
        for name, obj in vars(module).items():
            if name.startswith("test_") and callable(obj):
                assert name not in tests, f"two tests named {name}"
                tests[name] = obj
    return tests


# Collected here again (with their parametrizations), so each runs under no_pep706.
globals().update(_tests_of(test_archive, test_archive_plan, test_archive_write))


def test_the_filter_api_is_hidden() -> None:
    assert not any(hasattr(tarfile, name) for name in PEP706_NAMES)


# --------------------------------------------------------------------------------------------
# A real old Python, where this machine has one

_UNPACK_SCRIPT = textwrap.dedent(
    """
    import io, json, os, stat, sys, tarfile
    from pathlib import Path
    from agent.data.archive import UnsafeArchiveError, safe_unpack

    def tar(path, members):
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
            for name, kind, data, mode, link in members:
                info = tarfile.TarInfo(name)
                info.type, info.mode, info.linkname = kind, mode, link
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
        return Path(path)

    root = Path(sys.argv[1])
    good = tar(root / "good.tar", [
        ("ds", tarfile.DIRTYPE, b"", 0o2777, ""),
        ("ds/data.yaml", tarfile.REGTYPE, b"train: images\\n", 0o666, ""),
        ("ds/run.sh", tarfile.REGTYPE, b"#!/bin/sh\\n", 0o4755, ""),
        ("ds/copy.yaml", tarfile.LNKTYPE, b"", 0o644, "ds/data.yaml"),
        ("ds/alias", tarfile.SYMTYPE, b"", 0o777, "data.yaml"),
    ])
    written = safe_unpack(good, root / "good")
    mode = lambda p: oct(stat.S_IMODE(os.lstat(root / "good" / p).st_mode))
    out = {
        "python": list(sys.version_info[:3]),
        "has_data_filter": hasattr(tarfile, "data_filter"),
        "written": written,
        "copy": (root / "good/ds/copy.yaml").read_text(),
        "alias": os.readlink(root / "good/ds/alias"),
        "modes": [mode("ds"), mode("ds/data.yaml"), mode("ds/run.sh")],
        "refused": {},
    }
    hostile = {
        "traversal": [("../sentinel", tarfile.REGTYPE, b"x", 0o644, "")],
        "absolute": [(str(root / "sentinel"), tarfile.REGTYPE, b"x", 0o644, "")],
        "symlink": [("l", tarfile.SYMTYPE, b"", 0o777, "../sentinel")],
        "hardlink": [("h", tarfile.LNKTYPE, b"", 0o644, "../sentinel")],
        "device": [("null", tarfile.CHRTYPE, b"", 0o644, "")],
    }
    for case, members in hostile.items():
        try:
            safe_unpack(tar(root / (case + ".tar"), members), root / case)
        except UnsafeArchiveError as exc:
            out["refused"][case] = [exc.members, os.path.lexists(root / case)]
    out["sentinel"] = os.path.lexists(root / "sentinel")
    print(json.dumps(out))
    """
)


def _old_pythons() -> list[str]:
    """Interpreters on this machine whose tarfile predates PEP 706 (3.11.0-3.11.3)."""
    found: list[str] = []
    for candidate in ("/usr/bin/python3.11", shutil.which("python3.11"), shutil.which("python3")):
        if not candidate or candidate in found or not os.access(candidate, os.X_OK):
            continue
        probe = subprocess.run(
            [candidate, "-c", "import sys; print((3, 11) <= sys.version_info[:3] < (3, 11, 4))"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if probe.stdout.strip() == "True":
            found.append(candidate)
    return found


def test_unpack_under_a_real_python_without_pep706(tmp_path: Path) -> None:
    olds = _old_pythons()
    if not olds:
        pytest.skip(
            "no Python 3.11.0-3.11.3 on this machine (Debian 12's /usr/bin/python3.11 is 3.11.2); "
            "the tests above hide the filter API instead"
        )
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [olds[0], "-s", "-c", _UNPACK_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert tuple(out["python"]) < (3, 11, 4) and not out["has_data_filter"], out
    assert out["written"] == 2 * len(b"train: images\n") + len(b"#!/bin/sh\n")
    assert out["copy"] == "train: images\n" and out["alias"] == "data.yaml"
    assert out["modes"] == ["0o755", "0o644", "0o755"]
    assert out["refused"] == {
        "traversal": [["../sentinel"], False],
        "absolute": [[str(tmp_path / "sentinel")], False],
        "symlink": [["l"], False],
        "hardlink": [["h"], False],
        "device": [["null"], False],
    }
    assert not out["sentinel"]
