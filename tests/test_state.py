"""Phases, the one transition function, and the persisted state file."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from agent.state import (
    ALLOWED,
    Phase,
    Reason,
    RunState,
    StateStore,
    TrainerRecord,
    TransitionError,
    atomic_write_json,
    atomic_write_text,
    transition,
)

ALLOWED_PAIRS = [(src, dst) for dst, sources in ALLOWED.items() for src in sorted(sources)]
ILLEGAL_PAIRS = [(src, dst) for dst in Phase for src in Phase if src not in ALLOWED[dst]]


def test_every_phase_has_an_entry_in_allowed() -> None:
    assert set(ALLOWED) == set(Phase)
    assert ALLOWED_PAIRS and ILLEGAL_PAIRS
    assert len(ALLOWED_PAIRS) + len(ILLEGAL_PAIRS) == len(Phase) ** 2


@pytest.mark.parametrize(("src", "dst"), ALLOWED_PAIRS, ids=lambda p: p.value)
def test_allowed_transition_changes_phase_and_is_recorded(src: Phase, dst: Phase) -> None:
    state = RunState(job_name="j", job_source="job.toml", phase=src)
    transition(state, dst, reason=Reason.COMPLETED, note="because")
    assert state.phase is dst
    assert state.reason is Reason.COMPLETED
    entry = state.history[-1]
    assert (entry["from"], entry["to"]) == (src.value, dst.value)
    assert entry["reason"] == "completed"
    assert entry["note"] == "because"
    assert entry["at"] == state.updated_at


@pytest.mark.parametrize(("src", "dst"), ILLEGAL_PAIRS, ids=lambda p: p.value)
def test_illegal_transition_raises_and_changes_nothing(src: Phase, dst: Phase) -> None:
    state = RunState(job_name="j", job_source="job.toml", phase=src)
    before = state.to_dict()
    with pytest.raises(TransitionError) as info:
        transition(state, dst, reason=Reason.TIMEOUT)
    assert f"{src.value} -> {dst.value}" in str(info.value)
    assert state.to_dict() == before


def test_terminal_phases_are_done_and_failed_and_have_no_way_out() -> None:
    assert {p for p in Phase if p.terminal} == {Phase.DONE, Phase.FAILED}
    for target, sources in ALLOWED.items():
        assert Phase.DONE not in sources, target
        assert Phase.FAILED not in sources, target


def test_every_non_terminal_phase_can_fail() -> None:
    assert {p for p in Phase if not p.terminal} == set(ALLOWED[Phase.FAILED])


def test_transition_without_reason_keeps_the_previous_reason() -> None:
    state = RunState(job_name="j", job_source="s", phase=Phase.FINISHING)
    state.reason = Reason.STALLED
    transition(state, Phase.TEARDOWN)
    assert state.reason is Reason.STALLED
    assert "reason" not in state.history[-1]
    assert "note" not in state.history[-1]


def test_happy_path_history_reads_like_the_lifecycle() -> None:
    state = RunState(job_name="j", job_source="s")
    path = [
        Phase.PREFLIGHT,
        Phase.STAGING,
        Phase.TRAINING,
        Phase.FINISHING,
        Phase.TEARDOWN,
        Phase.HELD,
        Phase.TEARDOWN,
        Phase.DONE,
    ]
    for phase in path:
        transition(state, phase)
    assert [h["to"] for h in state.history] == [p.value for p in path]
    assert state.history[0]["from"] == "BOOTING"


def test_transition_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    state = RunState(job_name="j", job_source="s", phase=Phase.TRAINING)
    with caplog.at_level(logging.INFO, logger="agent.state"):
        transition(state, Phase.FINISHING, reason=Reason.BUDGET)
    assert "phase TRAINING -> FINISHING reason=budget" in caplog.text


def full_state() -> RunState:
    state = RunState(job_name="run1", job_source="/jobs/job.toml")
    transition(state, Phase.PREFLIGHT)
    transition(state, Phase.STAGING)
    transition(state, Phase.TRAINING, note="launched")
    state.trainer = TrainerRecord(
        pid=4242,
        create_time=1700000000.25,
        started_at=1700000001.5,
        argv=["libreyolo", "train", "data=/d.yaml", "json=true"],
        run_dir="/root/runs/run12",
    )
    state.outcome = {"kind": "oom", "exit_code": 1, "message": "CUDA out of memory"}
    state.server = {"host": "127.0.0.1", "port": 38123}
    state.teardown = {"action": "stop", "started_at": 1700000002.0}
    state.cause = "trainer oom"
    transition(state, Phase.FINISHING, reason=Reason.TRAINING_FAILED)
    return state


def test_state_file_round_trips(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    assert store.load() is None
    state = full_state()
    store.save(state)
    loaded = store.load()
    assert loaded == state
    assert loaded is not None
    assert loaded.phase is Phase.FINISHING and loaded.reason is Reason.TRAINING_FAILED
    assert isinstance(loaded.trainer, TrainerRecord)
    on_disk = json.loads(store.state_path.read_text(encoding="utf-8"))
    assert on_disk["phase"] == "FINISHING"
    assert on_disk["reason"] == "training_failed"


def test_state_file_round_trips_without_optional_parts(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    state = RunState(job_name="j", job_source="s")
    store.save(state)
    assert store.load() == state


def test_state_save_leaves_no_temp_files(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    for _ in range(3):
        store.save(full_state())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    assert stat.S_IMODE(store.state_path.stat().st_mode) == 0o600  # private: paths, errors, pids


def test_failed_write_leaves_old_file_and_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    atomic_write_json(path, {"phase": "TRAINING"})
    with pytest.raises(UnicodeEncodeError):
        # A lone surrogate cannot be encoded: the write fails half way through.
        atomic_write_text(path, '{"phase": "\ud800"}')
    assert json.loads(path.read_text(encoding="utf-8")) == {"phase": "TRAINING"}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_atomic_write_replaces_the_inode_not_the_content(tmp_path: Path) -> None:
    # A reader holding the old file keeps seeing the old, whole content.
    path = tmp_path / "f.json"
    atomic_write_text(path, "old\n")
    with open(path, encoding="utf-8") as reader:
        atomic_write_text(path, "new\n")
        assert reader.read() == "old\n"
    assert path.read_text(encoding="utf-8") == "new\n"


def test_token_is_mode_0600_and_stable(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    token = store.token()
    assert len(token) >= 32
    path = tmp_path / "state" / "token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert store.token() == token
    assert StateStore(tmp_path / "state").token() == token
    assert path.read_text(encoding="utf-8").strip() == token


def test_token_differs_between_state_dirs(tmp_path: Path) -> None:
    assert StateStore(tmp_path / "a").token() != StateStore(tmp_path / "b").token()


def test_empty_token_file_is_replaced_by_a_fresh_token(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("\n", encoding="utf-8")
    token = StateStore(tmp_path).token()
    assert token
    assert (tmp_path / "token").read_text(encoding="utf-8").strip() == token
    assert stat.S_IMODE(os.stat(tmp_path / "token").st_mode) == 0o600
