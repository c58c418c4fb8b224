""".ci/oldest-python: CI builds its venv from the oldest Python the project accepts
(requires-python >= 3.11) that the machine has, so an API newer than the floor (like tarfile's
PEP 706 filters, 3.11.4) fails in CI, not on a user's Debian 12 box (3.11.2). Stand-in
interpreters answer the script's version question as a real one does: a version line, or a
failing exit when older than 3.11.
"""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / ".ci" / "oldest-python"


def _python(path: Path, version: str | None) -> Path:
    """A stand-in interpreter reporting ``version`` (None: older than 3.11, the check fails)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    answer = f"echo {version}" if version else "exit 1"
    path.write_text(f"#!/bin/sh\n{answer}\n")
    path.chmod(0o755)
    return path


def _pick(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_the_oldest_accepted_interpreter_is_picked(tmp_path: Path) -> None:
    newer = _python(tmp_path / "a" / "python3.12", "3.12.1")
    patch_10 = _python(tmp_path / "b" / "python3.11", "3.11.10")
    patch_9 = _python(tmp_path / "c" / "python3.11", "3.11.9")
    too_old = _python(tmp_path / "d" / "python3", None)
    missing = tmp_path / "e" / "python3.11"
    out = _pick(*(str(p) for p in (newer, patch_10, too_old, missing, patch_9)))
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{patch_9}\n"  # 3.11.9 < 3.11.10: versions, not strings, compared


def test_no_accepted_interpreter_is_an_exit_1(tmp_path: Path) -> None:
    out = _pick(str(_python(tmp_path / "python3", None)), str(tmp_path / "absent"))
    assert (out.returncode, out.stdout) == (1, "")


def test_by_default_every_python3_11_and_python3_on_path_is_considered(tmp_path: Path) -> None:
    # python3 later on PATH is older than everything this machine can have (Debian 12's
    # /usr/bin/python3.11, always a candidate, is 3.11.2).
    _python(tmp_path / "first" / "python3.11", "3.11.20")
    _python(tmp_path / "first" / "python3", "3.11.20")
    oldest = _python(tmp_path / "second" / "python3", "3.11.1")
    path = os.pathsep.join([str(tmp_path / "first"), str(tmp_path / "second"), os.environ["PATH"]])
    out = _pick(env=dict(os.environ, PATH=path))
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{oldest}\n"


def test_the_floor_it_checks_is_the_projects() -> None:
    # Raising the floor in pyproject.toml means raising it here (and in install.sh) too.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    assert "sys.version_info >= (3, 11)" in SCRIPT.read_text()
    assert "sys.version_info < (3, 11)" in (REPO / "install.sh").read_text()


def test_newest_picks_the_newest_accepted_interpreter(tmp_path: Path) -> None:
    old = _python(tmp_path / "a" / "python3.11", "3.11.2")
    minor_9 = _python(tmp_path / "b" / "python3.13", "3.13.9")
    minor_10 = _python(tmp_path / "c" / "python3.13", "3.13.10")
    too_old = _python(tmp_path / "d" / "python3", None)
    out = _pick("--newest", *(str(p) for p in (old, minor_10, too_old, minor_9)))
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{minor_10}\n"  # 3.13.10 > 3.13.9: versions, not strings
    none = _pick("--newest", str(too_old), str(tmp_path / "absent"))
    assert (none.returncode, none.stdout) == (1, "")


def test_newest_by_default_looks_on_path_and_in_pyenvs_versions(tmp_path: Path) -> None:
    on_path = _python(tmp_path / "bin" / "python3.12", "3.12.4")
    pyenv = tmp_path / "pyenv"
    in_pyenv = _python(pyenv / "versions" / "3.13.0" / "bin" / "python3", "3.13.0")
    _python(pyenv / "versions" / "3.10.1" / "bin" / "python3", None)
    path = os.pathsep.join([str(tmp_path / "bin"), "/usr/bin", "/bin"])
    env = dict(os.environ, PATH=path, PYENV_ROOT=str(pyenv))
    out = _pick("--newest", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{in_pyenv}\n"
    in_pyenv.unlink()
    out = _pick("--newest", env=env)
    assert out.stdout == f"{on_path}\n"


def test_every_file_the_newest_leg_leaves_out_exists() -> None:
    # .ci/run passes each as --ignore, which pytest takes silently for a path that is gone.
    listed = [
        line
        for line in (REPO / ".ci" / "needs-training-stack").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert listed and all((REPO / line).is_file() for line in listed), listed
    assert "--ignore" in (REPO / ".ci" / "run").read_text()
