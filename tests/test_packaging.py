"""The agent as a wheel (``pip install .``, not only the editable install the bootstrap makes):
it holds every file of ``agent/`` that git tracks (the folders per concern, the dashboard page,
the C NVML host's source), and the command runs from it, outside this checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_the_whole_agent_and_runs_from_it(tmp_path: Path) -> None:
    built = subprocess.run(
        [
            sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
            "--no-index", "-q", "-w", str(tmp_path / "dist"), str(ROOT),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("libreyolo_agent-*.whl")
    tracked = subprocess.run(
        ["git", "ls-files", "agent"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "agent/gpu/nvmlhost.c" in tracked and "agent/status/static/index.html" in tracked
    with zipfile.ZipFile(wheel) as z:
        held = {n for n in z.namelist() if n.startswith("agent/")}
        z.extractall(tmp_path / "site")
    assert sorted(set(tracked) - held) == []
    # Run from the unpacked wheel, away from the checkout: every module imports, the page and
    # the C source are found as the agent finds them.
    probe = (
        "import importlib, pkgutil, sys, agent, agent.gpu.nvmlhost as h\n"
        "from importlib.resources import files\n"
        "assert agent.__file__.startswith(sys.argv[1]), agent.__file__\n"
        "names = [m.name for m in pkgutil.walk_packages(agent.__path__, 'agent.')]\n"
        "for name in names:\n"
        "    if not name.endswith('__main__'):\n"
        "        importlib.import_module(name)\n"
        "assert h.C_SOURCE.is_file()\n"
        "assert files('agent.status').joinpath('static/index.html').is_file()\n"
        "print(len(names))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path / "site")
    out = subprocess.run(
        [sys.executable, "-P", "-c", probe, str(tmp_path / "site")], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) >= 100
    helped = subprocess.run(
        [sys.executable, "-P", "-m", "agent.cli", "--help"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert helped.returncode == 0 and "supervise" in helped.stdout, helped.stderr
