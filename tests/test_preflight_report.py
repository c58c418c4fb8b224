"""agent/preflight/report.py and plan.py: the report, its JSON and table; ``train.device``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent import preflight as pf
from agent.preflight import FAIL, PASS, WARN, Check, DeviceSpec, PreflightReport, format_table

# --------------------------------------------------------------------------------------------
# The report


def test_report_ok_failures_json_and_table() -> None:
    report = PreflightReport(
        (
            Check("shm", PASS, "16.0 GiB at /dev/shm"),
            Check("cpu", WARN, "2 CPUs", "set train.workers=1"),
            Check("gpu0.matmul", FAIL, "CUDA error: no kernel image", "install torch", {"n": 2}),
        ),
        wall_s=1.25,
    )
    assert not report.ok
    assert [c.name for c in report.failures()] == ["gpu0.matmul"]
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is False and data["wall_s"] == 1.25
    assert data["checks"][2] == {
        "name": "gpu0.matmul",
        "status": "fail",
        "value": "CUDA error: no kernel image",
        "fix": "install torch",
        "details": {"n": 2},
    }
    table = format_table(report)
    assert "FAIL  gpu0.matmul  CUDA error: no kernel image" in table
    assert "fix: install torch" in table
    assert "fix: set train.workers=1" in table
    assert table.splitlines()[-1].startswith("preflight FAILED: 1 of 3 checks failed (gpu0.matmul)")
    ok = PreflightReport((Check("shm", PASS, "x"),), wall_s=0.1)
    assert ok.ok and format_table(ok).splitlines()[-1].startswith("preflight passed")


# --------------------------------------------------------------------------------------------
# The plan: what the job asks for


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, DeviceSpec("auto")),
        ("auto", DeviceSpec("auto", text="auto")),
        ("cpu", DeviceSpec("cpu", text="cpu")),
        (0, DeviceSpec("gpus", (0,), "0")),
        ("0,1,2,3", DeviceSpec("gpus", (0, 1, 2, 3), "0,1,2,3")),
        ("cuda:1", DeviceSpec("gpus", (1,), "cuda:1")),
        ("[0, 1]", DeviceSpec("gpus", (0, 1), "[0, 1]")),
        ("gpu", DeviceSpec("invalid", text="gpu")),
        ("0,0", DeviceSpec("invalid", text="0,0")),
    ],
)
def test_parse_device_reads_libreyolo_forms(value: Any, expected: DeviceSpec) -> None:
    assert pf.parse_device(value) == expected
