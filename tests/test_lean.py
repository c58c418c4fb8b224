"""What the agent's process keeps out (agent/util/lean.py): httpx's command-line client (with
``rich``, ``click`` and ``pygments`` where an image has them) and ``sqlite3``, each import run in
a fresh interpreter as the agent runs it, the Hub client and file locks working without them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Stand-ins for the CLI's packages, as a GPU image may hold them: each records that something
# imported it (then refuses, so nothing else changes).
STAND_IN = """
import os
with open(os.environ["LEAN_MARKS"], "a") as f:
    f.write(__name__ + "\\n")
raise ImportError("stand-in " + __name__)
"""

PROBE = """
import json, sys
if sys.argv[1] == "agent":
    from agent.util.lean import keep_out
    blocked = keep_out()
else:
    blocked = []
import httpx
import filelock
from agent import hub  # the Hub client the agent imports, with its HTTP stack
import huggingface_hub.hf_api
with filelock.FileLock(sys.argv[2]):
    locked = True
print(json.dumps({
    "blocked": blocked,
    "httpx_main": repr(sys.modules.get("httpx._main", "absent")),
    "sqlite3": repr(sys.modules.get("sqlite3", "absent")),
    "main_callable": callable(httpx.main),
    "locked": locked,
    "api": hasattr(huggingface_hub.hf_api, "HfApi"),
}))
"""


def _probe(tmp_path: Path, who: str) -> tuple[dict[str, object], list[str]]:
    site = tmp_path / f"site-{who}"
    for name in ("click", "rich", "pygments"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(STAND_IN)
    marks = tmp_path / f"marks-{who}.txt"
    marks.touch()
    out = subprocess.run(
        [sys.executable, "-c", PROBE, who, str(tmp_path / f"{who}.lock")],
        cwd=ROOT,
        env={
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": f"{site}:{ROOT}",
            "LEAN_MARKS": str(marks),
            "HF_HUB_DISABLE_TELEMETRY": "1",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1]), marks.read_text().split()


def test_the_agent_keeps_httpx_cli_and_sqlite3_out_and_the_hub_client_still_works(
    tmp_path: Path,
) -> None:
    plain, plain_marks = _probe(tmp_path, "plain")
    agent, agent_marks = _probe(tmp_path, "agent")
    # Without the block, importing httpx reaches its CLI's packages (here the stand-ins).
    assert plain_marks, "httpx no longer imports its CLI at import: agent/util/lean.py can go"
    assert plain["httpx_main"] != "None"
    # The agent's process: neither the CLI's packages nor sqlite3; httpx.main is httpx's own
    # stand-in, file locks and HfApi work.
    assert agent_marks == []
    assert agent["blocked"] == ["httpx._main", "sqlite3"]
    assert agent["httpx_main"] == "None" and agent["sqlite3"] == "None"
    assert agent["main_callable"] and agent["locked"] and agent["api"]


def test_a_module_already_imported_is_left_alone() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys\n"
            "from agent.util.lean import keep_out\n"
            "print(keep_out(), sys.modules['sqlite3'] is sqlite3)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['httpx._main']", "True"]
