"""Preflight imports what ``run`` imports: LibreYOLO's training imports ``cv2``, whose system
libraries (libGL, libglib) a bare image lacks. The real probe runs in a child against the
stand-in ``torch`` and a stand-in ``cv2`` placed first on its path."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.preflight import FAIL, PASS, format_table
from tests.test_preflight import H100, STANDIN, check, make_env, make_job, run

LIBGL = "libGL.so.1: cannot open shared object file: No such file or directory"


def standin_cv2(tmp_path: Path, body: str) -> str:
    """A folder holding a ``cv2`` package with ``body`` as its ``__init__``."""
    root = tmp_path / "cv2-standin"
    (root / "cv2").mkdir(parents=True)
    (root / "cv2" / "__init__.py").write_text(body)
    return str(root)


@pytest.mark.parametrize("deep", [False, True])
def test_a_cv2_missing_its_system_library_fails_preflight_naming_the_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deep: bool
) -> None:
    broken = standin_cv2(tmp_path, f"raise ImportError({LIBGL!r})\n")
    job = make_job(tmp_path, preflight={"deep_import": deep})
    scenario = {"devices": [H100]}
    report = run(monkeypatch, job, make_env(tmp_path), scenario, extra_pythonpath=[broken, STANDIN])
    assert not report.ok
    lib = check(report, "libreyolo")
    assert lib.status == FAIL, format_table(report)
    assert "libGL.so.1" in lib.value and "cv2" in lib.value
    assert lib.fix is not None
    assert "apt-get install -y libgl1 libglib2.0-0" in lib.fix
    assert "opencv-python-headless" in lib.fix


def test_no_cv2_at_all_says_which_package_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = standin_cv2(
        tmp_path, "raise ModuleNotFoundError(\"No module named 'cv2'\", name='cv2')\n"
    )
    report = run(
        monkeypatch,
        make_job(tmp_path),
        make_env(tmp_path),
        {"devices": [H100]},
        extra_pythonpath=[missing, STANDIN],
    )
    lib = check(report, "libreyolo")
    assert lib.status == FAIL and lib.fix is not None
    assert lib.fix.startswith("pip install opencv-python-headless")


def test_a_working_cv2_passes_and_its_import_is_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = standin_cv2(tmp_path, '__version__ = "4.99.0"\n')
    report = run(
        monkeypatch,
        make_job(tmp_path),
        make_env(tmp_path),
        {"devices": [H100]},
        extra_pythonpath=[good, STANDIN],
    )
    lib = check(report, "libreyolo")
    assert lib.status == PASS, format_table(report)
    assert lib.value == "1.6.0"
    assert lib.details["opencv"] == "4.99.0"
    assert lib.details["opencv_import_s"] >= 0
