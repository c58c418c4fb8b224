"""How the trainer ended (agent/trainer/outcome.py): LibreYOLO's exit codes, status.json's
error and the json result, classified into one kind; the end of a real trainer is classified
in tests/test_trainer.py."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from agent.state import Reason
from agent.trainer.outcome import Outcome, OutcomeKind, classify, read_result
from agent.trainer.rundir import RunStatus

# --------------------------------------------------------------------------------------------
# Exit classification


def status(state: str, error: tuple[str, str] | None = None, **extra: Any) -> RunStatus:
    doc: dict[str, Any] = {"state": state, "pid": 4242, **extra}
    if error is not None:
        doc["error"] = {"type": error[0], "message": error[1]}
    return RunStatus.from_dict(doc)


OOM_MSG = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 23.65 GiB total capacity)"
RUNNING = status("running", completed_epochs=7, total_epochs=100)
COMPLETED = status("completed", completed_epochs=100, total_epochs=100)
FAILED_OOM = status("failed", ("OutOfMemoryError", OOM_MSG))
FAILED_RUNTIME = status("failed", ("RuntimeError", "CUDA error: an illegal memory access"))
FAILED_SIGINT = status("failed", ("KeyboardInterrupt", ""))

CLASSIFY_CASES = [
    # exit_code, status, json result, expected kind
    (0, COMPLETED, {"status": "complete", "save_dir": "/r/run1"}, "completed"),
    (0, None, None, "completed"),
    (0, FAILED_RUNTIME, None, "runtime"),
    (1, FAILED_OOM, None, "oom"),
    (1, FAILED_RUNTIME, {"error": "cuda_oom", "message": f"Training failed: {OOM_MSG}"}, "oom"),
    (1, None, {"error": "cuda_oom", "message": f"Training failed: {OOM_MSG}"}, "oom"),
    (1, status("failed", ("RuntimeError", OOM_MSG)), None, "oom"),
    (1, FAILED_RUNTIME, {"error": "io_error", "message": "Training failed: x"}, "runtime"),
    (1, None, None, "runtime"),
    (2, None, {"error": "config_type_error", "message": "Invalid train option"}, "config"),
    (3, None, {"error": "data_not_found", "message": "data.yaml not found"}, "data"),
    (4, None, {"error": "model_not_found", "message": "no such model"}, "model"),
    (130, FAILED_SIGINT, None, "interrupted"),
    (130, None, None, "interrupted"),
    (1, FAILED_SIGINT, None, "interrupted"),
    (-signal.SIGKILL, RUNNING, None, "killed"),
    (-signal.SIGTERM, RUNNING, None, "killed"),
    (77, None, None, "runtime"),
    # Re-attached: not our child, no exit code; status.json is all there is.
    (None, COMPLETED, None, "completed"),
    (None, FAILED_OOM, None, "oom"),
    (None, FAILED_RUNTIME, None, "runtime"),
    (None, FAILED_SIGINT, None, "interrupted"),
    (None, RUNNING, None, "killed"),
    (None, None, None, "lost"),
]


@pytest.mark.parametrize(("exit_code", "st", "result", "kind"), CLASSIFY_CASES)
def test_classify(
    exit_code: int | None, st: RunStatus | None, result: dict[str, Any] | None, kind: str
) -> None:
    outcome = classify(exit_code, st, result)
    assert outcome.kind == kind
    assert outcome.exit_code == exit_code
    assert outcome.message
    assert outcome.completed == (kind == "completed")


def test_classify_oom_message_comes_from_the_result() -> None:
    outcome = classify(1, None, {"error": "cuda_oom", "message": f"Training failed: {OOM_MSG}"})
    assert OOM_MSG in outcome.message


@pytest.mark.parametrize(
    ("sig", "name"),
    [(signal.SIGKILL, "SIGKILL"), (signal.SIGTERM, "SIGTERM"), (signal.SIGSEGV, "SIGSEGV")],
)
def test_classify_signal_exit_names_the_signal(sig: int, name: str) -> None:
    outcome = classify(-sig, RUNNING, None)
    assert outcome.kind == "killed"
    assert name in outcome.message
    assert ("OOM killer" in outcome.message) == (sig == signal.SIGKILL)


def test_classify_signal_exit_after_stop_request_says_so() -> None:
    outcome = classify(-signal.SIGKILL, RUNNING, None, stop_requested=True)
    assert outcome.kind == "killed"
    assert "SIGKILL" in outcome.message and "stop request" in outcome.message


def test_classify_unknown_signal_number_does_not_crash() -> None:
    outcome = classify(-200, RUNNING, None)
    assert outcome.kind == "killed" and "200" in outcome.message


def test_classify_adds_the_suggestion() -> None:
    outcome = classify(
        3,
        None,
        {"error": "data_not_found", "message": "no data", "suggestion": "Check the YAML path"},
    )
    assert outcome.message == "no data -- Check the YAML path"


def test_classify_reattached_running_says_it_died_at_its_epoch() -> None:
    outcome = classify(None, RUNNING, None)
    assert "epoch 7" in outcome.message


def test_outcome_to_dict() -> None:
    assert Outcome(OutcomeKind.OOM, 1, "m").to_dict() == {
        "kind": "oom",
        "exit_code": 1,
        "message": "m",
    }


# --------------------------------------------------------------------------------------------
# The json result and the command line


def test_read_result_takes_the_last_json_object(tmp_path: Path) -> None:
    path = tmp_path / "trainer-result.json"
    path.write_text(
        "Training yolox-n on data.yaml for 3 epochs...\n"
        '{"status": "old"}\n'
        "{not json\n"
        "[1, 2]\n"
        '  {"status": "complete", "save_dir": "/r/run12", "schema_version": 1}  \n'
        "bye\n",
        encoding="utf-8",
    )
    assert read_result(path) == {"status": "complete", "save_dir": "/r/run12", "schema_version": 1}


@pytest.mark.parametrize("content", [b"", b"no json here\n", b"{truncated", b"\xff\xfe\n"])
def test_read_result_without_a_json_object_is_none(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(content)
    assert read_result(path) is None


def test_read_result_missing_file_is_none(tmp_path: Path) -> None:
    assert read_result(tmp_path / "missing.json") is None


def test_an_outcome_names_its_kind_as_a_word_in_causes_and_logs() -> None:
    # Seen in review: a (str, Enum) formats as "OutcomeKind.KILLED" in an f-string, so causes
    # read "trainer OutcomeKind.KILLED: ...". The vocabularies are StrEnums: the word itself.
    outcome = Outcome(OutcomeKind.KILLED, -9, "killed by SIGKILL")
    reason, cause = outcome.reason(None, None)
    assert reason == Reason.TRAINING_FAILED
    assert cause == "trainer killed: killed by SIGKILL"
    assert f"{outcome.kind}" == "killed"
    _, stopped = outcome.reason(Reason.STOPPED_BY_USER, None)
    assert stopped == "stop requested; trainer killed"
