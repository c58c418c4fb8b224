"""The supervising daemon stays small (issue 15): what only one phase needs is imported when that
phase first needs it, never when ``libreyolo-agent run`` starts. Checked in fresh interpreters
(``sys.modules``); the RSS is printed, not judged beyond a sanity bound - the figure is
bench/agent_footprint.py's. tests/test_layout.py checks the same kind of thing for torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Loaded by the phase that needs it: the Hub (staging, the hf:// sink, preflight's Hub checks)
#: with its HTTP client, ``GET /metrics``, NVML (GPU jobs), the trainer's own libraries.
PHASE_ONLY = (
    "huggingface_hub",
    "httpx",
    "httpx2",
    "hf_xet",
    "prometheus_client",
    "pynvml",
    "torch",
    "torchvision",
    "libreyolo",
    "numpy",
)
#: A generous bound on the RSS after ``import agent.daemon.spine`` (about 42 MiB when written, 53
# MiB
#: with the Hub client and prometheus_client loaded at import).
SANE_IMPORT_RSS_MIB = 150


def _child(script: str) -> dict[str, object]:
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def test_starting_the_daemon_imports_no_phase_only_library() -> None:
    got = _child(
        f"""
        import json, sys
        import agent.daemon.spine, agent.cli
        status = open("/proc/self/status").read()
        rss_kib = int(status.split("VmRSS:")[1].split()[0])
        print(json.dumps({{"rss_kib": rss_kib,
                          "loaded": [m for m in {PHASE_ONLY!r} if m in sys.modules]}}))
        """
    )
    rss_mib = int(got["rss_kib"]) / 1024  # type: ignore[call-overload]
    print(f"RSS after import agent.daemon.spine, agent.cli: {rss_mib:.1f} MiB")
    assert got["loaded"] == []
    assert rss_mib < SANE_IMPORT_RSS_MIB


def test_the_hub_client_loads_on_first_use_with_the_configured_timeouts() -> None:
    """configure() at start-up imports nothing; the first Hub client gets its timeouts."""
    got = _child(
        """
        import json, sys
        from agent import hub
        from agent.config.model import Env

        hub.configure(timeout_s=7.0, connect_timeout_s=3.0)
        before = "huggingface_hub" in sys.modules
        hub.api(Env())
        from huggingface_hub import get_session

        timeout = get_session().timeout
        print(json.dumps({"before": before, "after": "huggingface_hub" in sys.modules,
                          "timeouts": [timeout.connect, timeout.read],
                          "http": hub.hub_http.__name__,
                          "call_errors": len(hub.CALL_ERRORS)}))
        """
    )
    assert got["before"] is False
    assert got["after"] is True
    assert got["timeouts"] == [3.0, 7.0]
    assert got["http"] in ("httpx", "httpx2")
    assert got["call_errors"] == 4


def test_prometheus_client_loads_on_the_first_scrape() -> None:
    got = _child(
        """
        import json, sys
        from agent.status import server, views as metrics

        before = "prometheus_client" in sys.modules
        text = metrics.render({"phase": "TRAINING", "now": 0}).decode()
        print(json.dumps({"before": before, "after": "prometheus_client" in sys.modules,
                          "up": "libreyolo_agent_up 1.0" in text}))
        """
    )
    assert got == {"before": False, "after": True, "up": True}
