"""The state file's records (``agent.state``'s TypedDicts) describe the file agents already
wrote: a state.json of the version before the records were typed loads, round-trips to the same
JSON, and every key its records hold is one the types declare (a key the types miss would be a
record that mypy no longer checks, or one a writer now rejects)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.state import Phase, Reason, RunState, StateStore, TrainerRecord
from agent.staterecords import (
    CrashRecord,
    HistoryEntry,
    HoldRecord,
    LaunchIntent,
    OutcomeRecord,
    PreemptionRecord,
    ResumeRecord,
    ServerRecord,
    SteeringRecord,
    TeardownRecord,
)

#: A run that trained, was preempted, resumed, crashed once, was extended and held, then torn
#: down by the guard: every record, as the agent before the TypedDicts wrote it (sorted keys,
#: indent 2: ``atomic_write_json``).
PREVIOUS_VERSION_RUN = """
{
  "agent_pid": 31337,
  "boot_id": "5f0c6e1e-9a2b-4d8e-a1c4-0b1f2e3d4c5b",
  "cause": "agent dead for 15m; guard sending stop",
  "crashes": [
    {"at": 1700000500.5, "error": "RuntimeError: sink went away", "phase": "TRAINING"}
  ],
  "extended_s": 3600.0,
  "history": [
    {"at": 1700000010.0, "from": "BOOTING", "to": "PREFLIGHT"},
    {"at": 1700000020.0, "from": "PREFLIGHT", "to": "STAGING"},
    {"at": 1700000030.0, "from": "STAGING", "note": "launched", "to": "TRAINING"},
    {"at": 1700000600.0, "event": "agent restarted", "was": "TRAINING"},
    {"at": 1700000600.5, "from": "TRAINING", "note": "agent restarted", "to": "BOOTING"},
    {"at": 1700000601.0, "event": "box rebooted"},
    {"at": 1700000602.0, "from": "BOOTING", "to": "TRAINING"},
    {"at": 1700000900.0, "from": "TRAINING", "reason": "completed", "to": "FINISHING"},
    {"at": 1700000950.0, "from": "FINISHING", "to": "TEARDOWN"},
    {"at": 1700000960.0, "from": "TEARDOWN", "to": "HELD"},
    {"at": 1700001000.0, "from": "HELD", "to": "TEARDOWN"},
    {"at": 1700001900.0, "from": "TEARDOWN", "note": "guard (pid 999) took over",
     "to": "BOOTING"},
    {"at": 1700001900.5, "from": "BOOTING", "note": "guard", "reason": "agent_failed",
     "to": "TEARDOWN"},
    {"at": 1700002000.0, "event": "teardown reopened: it was never confirmed"}
  ],
  "hold": {"at": 1700000960.0, "released_at": 1700001000.0, "until": 1700004560.0},
  "job_name": "coco-tiny",
  "job_source": "jobs/coco-tiny.toml",
  "launch": {"argv": ["libreyolo", "train", "resume=true"], "at": 1700000602.0,
             "id": "b7c1d2e3f4a5"},
  "outcome": {"exit_code": 0, "kind": "completed", "message": "trained 3/3 epochs"},
  "phase": "TEARDOWN",
  "preempted": {"at": 1700000400.0, "message": "instance-action: stop in 2m",
                "source": "aws"},
  "price_usd_per_hour": 2.49,
  "reason": "agent_failed",
  "resumes": [
    {"at": 1700000450.0, "epoch": 1, "kind": "preempted", "message": "stopped for a notice"},
    {"at": 1700000602.0, "epoch": null, "kind": "new_box",
     "message": "resumed from the sync target's last.pt"}
  ],
  "server": {"host": "127.0.0.1", "port": 38123},
  "started_at": 1700000000.0,
  "steering": [
    {"action": "extend", "at": 1700000700.0, "deadline_at": 1700011000.0,
     "seconds": 3600.0},
    {"action": "hold", "at": 1700000960.0, "renewed": false, "seconds": 3600.0,
     "until": 1700004560.0},
    {"action": "release", "at": 1700001000.0},
    {"action": "stop", "at": 1700001001.0, "phase": "TEARDOWN"}
  ],
  "teardown": {
    "action": "stop",
    "attempts": 2,
    "box_fault": null,
    "by": "agent, carried on by the guard",
    "confirmed": true,
    "detail": "instance i-0abc stopped",
    "finished_at": 1700002100.0,
    "instance_id": "i-0abc",
    "last_error": "ProviderError: 503 from the API",
    "next_attempt_at": 1700002050.0,
    "notified_open_at": 1700002000.0,
    "open": false,
    "performed": true,
    "provider": "aws",
    "rescue": {"pid": 4242, "stopped": true, "signal": "SIGINT"},
    "sent": "StopInstances accepted",
    "sent_at": 1700002010.0,
    "started_at": 1700001950.0,
    "why": "training ended: stop (checkpoints verified)"
  },
  "trainer": {"argv": ["libreyolo", "train", "resume=true"], "create_time": 1700000602.25,
              "pid": 4242, "run_dir": "runs/train/exp3", "started_at": 1700000602.0},
  "updated_at": 1700002100.0
}
"""

#: A bad job file's record (agent/daemon/badjob.py): the mark in the history, a box kept
#: because ``[teardown]`` could not be read; written before the newer fields existed (no
#: crashes, resumes, steering, hold, preempted, boot_id, extended_s).
PREVIOUS_VERSION_BAD_JOB = """
{
  "agent_pid": 77,
  "cause": "job file invalid; [teardown] cannot be read",
  "history": [
    {"at": 1700000001.0, "errors": ["train.epochs: expected an integer, got 'ten'"],
     "event": "bad job file", "judged_before": true, "sha256": "ab12cd34"},
    {"at": 1700000002.0, "from": "BOOTING", "note": "bad job file",
     "reason": "preflight_failed", "to": "FAILED"}
  ],
  "job_name": "job",
  "job_source": "jobs/broken.toml",
  "launch": null,
  "outcome": null,
  "phase": "FAILED",
  "price_usd_per_hour": null,
  "reason": "preflight_failed",
  "server": null,
  "started_at": 1700000000.0,
  "teardown": {"action": "keep", "detail": "KEPT (still billing): see cause",
               "provider": null, "started_at": 1700000002.0,
               "why": "[teardown] cannot be read"},
  "trainer": null,
  "updated_at": 1700000002.0
}
"""

#: Each record field of RunState and its TypedDict; ``list`` fields hold a list of them.
RECORDS: dict[str, Any] = {
    "history": HistoryEntry,
    "outcome": OutcomeRecord,
    "server": ServerRecord,
    "teardown": TeardownRecord,
    "launch": LaunchIntent,
    "crashes": CrashRecord,
    "resumes": ResumeRecord,
    "steering": SteeringRecord,
    "hold": HoldRecord,
    "preempted": PreemptionRecord,
}


def _records(doc: dict[str, Any], field: str) -> list[dict[str, Any]]:
    value = doc.get(field)
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


@pytest.mark.parametrize(
    "text", [PREVIOUS_VERSION_RUN, PREVIOUS_VERSION_BAD_JOB], ids=["run", "bad_job"]
)
def test_previous_version_state_file_loads_and_round_trips(tmp_path: Path, text: str) -> None:
    doc = json.loads(text)
    store = StateStore(tmp_path)
    store.state_path.write_text(text, encoding="utf-8")
    state = store.load()
    assert state is not None
    # The same JSON back, every record untouched (the fields the old file lacks get defaults).
    again = state.to_dict()
    assert {k: v for k, v in again.items() if k in doc} == doc
    assert set(again) - set(doc) <= {
        "boot_id",
        "crashes",
        "extended_s",
        "hold",
        "preempted",
        "resumes",
        "steering",
    }
    # ... and through the file: save, load, same state (save only moves updated_at on).
    store.save(state)
    reloaded = store.load()
    assert reloaded is not None
    assert reloaded.updated_at >= doc["updated_at"]
    reloaded.updated_at = state.updated_at
    assert reloaded == state


def test_previous_version_records_read_as_before() -> None:
    state = RunState.from_dict(json.loads(PREVIOUS_VERSION_RUN))
    assert state.phase is Phase.TEARDOWN and state.reason is Reason.AGENT_FAILED
    assert isinstance(state.trainer, TrainerRecord) and state.trainer.pid == 4242
    assert state.history[2]["note"] == "launched"
    assert state.history[3]["event"] == "agent restarted"
    assert state.teardown is not None and state.teardown["rescue"]["stopped"] is True
    assert state.hold is not None and state.hold["released_at"] == 1700001000.0
    assert [s["action"] for s in state.steering] == ["extend", "hold", "release", "stop"]
    assert state.resumes[1]["epoch"] is None
    assert state.crashes[0]["phase"] == "TRAINING"
    assert state.launch is not None and state.launch["id"] == "b7c1d2e3f4a5"
    assert state.outcome is not None and state.outcome["kind"] == "completed"
    assert state.server is not None and state.server["port"] == 38123
    assert state.preempted is not None and state.preempted["source"] == "aws"


@pytest.mark.parametrize(
    "text", [PREVIOUS_VERSION_RUN, PREVIOUS_VERSION_BAD_JOB], ids=["run", "bad_job"]
)
@pytest.mark.parametrize("field", sorted(RECORDS))
def test_every_key_of_a_previous_record_is_declared(text: str, field: str) -> None:
    record_type = RECORDS[field]
    declared = record_type.__required_keys__ | record_type.__optional_keys__
    for record in _records(json.loads(text), field):
        assert set(record) <= declared, (field, set(record) - declared)
        assert record_type.__required_keys__ <= set(record), field


def test_every_record_field_of_run_state_is_typed() -> None:
    # A record added to RunState as a bare dict would escape this file's checks.
    hints = RunState.__annotations__
    untyped = [name for name, hint in hints.items() if "dict[str, Any]" in str(hint)]
    assert untyped == []
    assert set(RECORDS) <= set(hints)
