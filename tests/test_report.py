"""The post-mortem report: report.json from a synthetic run, report.md's story, the files."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest

from agent.state import Phase, Reason, RunState
from agent.status import report
from agent.sync.ledger import ItemKind, LedgerEntry, LedgerStatus
from agent.util import logutil

T0 = 1_700_000_000.0  # 2023-11-14 22:13:20Z
SHA_LAST = "a" * 64
SHA_BEST = "b" * 64


def synthetic_state() -> RunState:
    """A run of 3h12m: 2 min booting, 3 min staging, 3h training, 5 min finishing, 2 min
    teardown; one resume, one extend, destroyed and confirmed."""
    st = RunState(
        job_name="run1",
        job_source="/root/job.toml",
        phase=Phase.DONE,
        reason=Reason.COMPLETED,
        cause="trainer completed: 10/10 epochs",
        started_at=T0,
        updated_at=T0 + 11520,
    )
    st.history = [
        {"at": T0 + 120, "from": "BOOTING", "to": "PREFLIGHT"},
        {"at": T0 + 180, "from": "PREFLIGHT", "to": "STAGING"},
        {"at": T0 + 360, "from": "STAGING", "to": "TRAINING"},
        {"at": T0 + 4000, "event": "agent restarted", "was": "TRAINING"},
        {"at": T0 + 11160, "from": "TRAINING", "to": "FINISHING"},
        {"at": T0 + 11400, "from": "FINISHING", "to": "TEARDOWN", "reason": "completed"},
        {"at": T0 + 11520, "from": "TEARDOWN", "to": "DONE"},
    ]
    st.outcome = {"kind": "completed", "exit_code": 0, "message": "10/10 epochs"}
    st.resumes = [{"at": T0 + 5000, "epoch": 4, "kind": "failed", "message": "CUDA error"}]
    st.steering = [{"at": T0 + 6000, "action": "extend", "seconds": 3600.0}]
    st.teardown = {
        "provider": "vast",
        "action": "destroy",
        "why": "teardown.on_success = destroy",
        "started_at": T0 + 11410,
        "instance_id": "1234",
        "sent_at": T0 + 11411,
        "performed": True,
        "confirmed": True,
        "detail": "instance 1234 destroyed",
        "finished_at": T0 + 11520,
    }
    return st


def status_doc() -> dict[str, Any]:
    return {
        "epoch": 10,
        "total_epochs": 10,
        "best_epoch": 9,
        "best_metric": 0.512,
        "training_state": "completed",
        "run_dir": "/root/runs/run1",
        "last_synced_epoch": 10,
        "sync": {
            "target": "file:///mnt/backup/run1",
            "verified": {"sync_verified": True, "checked": 3, "missing": []},
        },
        "money": {
            "price_usd_per_hour": 3.5,
            "price_from_provider": False,
            "spent_usd": 11.2,
            "projected_usd": 11.2,
            "budget_usd": 50.0,
            "stopped_usd_per_hour": None,
        },
    }


LEDGER = [
    LedgerEntry(
        "weights/last.pt", SHA_LAST, 4096, 10, ItemKind.LAST, LedgerStatus.VERIFIED,
        queued_at=T0 + 11170, uploaded_at=T0 + 11200, verified_at=T0 + 11200, attempts=1,
    ),
    LedgerEntry(
        "weights/best.pt", SHA_BEST, 4000, 9, ItemKind.BEST, LedgerStatus.VERIFIED,
        queued_at=T0 + 11000, uploaded_at=T0 + 11050, verified_at=T0 + 11050, attempts=2,
    ),
    LedgerEntry(
        "metrics.jsonl", "c" * 64, 900, 10, ItemKind.SMALL, LedgerStatus.PENDING,
        queued_at=T0 + 11170,
    ),
]  # fmt: skip

ROWS = [
    {"epoch": e, "train/loss": round(1.0 / e, 4), "current_metric": 0.05 * e,
     "current_metric_name": "mAP50_95", "is_best": e <= 9}
    for e in range(1, 11)
]  # fmt: skip


def make() -> dict[str, Any]:
    return report.build(
        synthetic_state(), status_doc(), LEDGER, ROWS, ["stall soon", "disk low", "stall soon"]
    )


def test_the_report_has_the_runs_verdict_and_its_timeline_with_durations() -> None:
    r = make()
    assert (r["job"], r["phase"], r["reason"]) == ("run1", "DONE", "completed")
    assert r["cause"] == "trainer completed: 10/10 epochs"
    assert r["outcome"]["kind"] == "completed"
    assert (r["started_at"], r["ended_at"], r["duration_s"]) == (T0, T0 + 11520, 11520.0)
    phases = [(row["phase"], row["duration_s"]) for row in r["timeline"] if "phase" in row]
    assert phases == [
        ("BOOTING", 120.0),
        ("PREFLIGHT", 60.0),
        ("STAGING", 180.0),
        ("TRAINING", 10800.0),  # the agent restart in between is not a phase change
        ("FINISHING", 240.0),
        ("TEARDOWN", 120.0),
        ("DONE", None),
    ]
    (restart,) = [row for row in r["timeline"] if "event" in row]
    assert restart == {"event": "agent restarted", "was": "TRAINING", "at": T0 + 4000}
    assert r["timeline"][6]["reason"] == "completed"  # TEARDOWN's row says why


def test_the_report_keeps_metrics_checkpoints_money_teardown_steering_warnings() -> None:
    r = make()
    t = r["training"]
    assert (t["epochs"], t["total_epochs"], t["metric_name"]) == (10, 10, "mAP50_95")
    assert t["last"]["epoch"] == 10 and t["best"]["epoch"] == 9 and t["best"]["metric"] == 0.512
    assert t["best"]["row"]["epoch"] == 9
    assert [(c["remote_path"], c["size"], c["sha256"], c["epoch"]) for c in r["checkpoints"]] == [
        ("weights/last.pt", 4096, SHA_LAST, 10),
        ("weights/best.pt", 4000, SHA_BEST, 9),
    ]
    assert r["checkpoints"][0]["verified_at"] == T0 + 11200
    assert r["checkpoints"][0]["status"] == "verified" and r["checkpoints"][0]["kind"] == "last"
    assert [f["remote_path"] for f in r["other_files"]] == ["metrics.jsonl"]
    assert r["sync"]["target"] == "file:///mnt/backup/run1"
    assert (r["sync"]["files"], r["sync"]["pending"]) == (3, 1)
    assert r["money"]["spent_usd"] == 11.2 and r["money"]["price_usd_per_hour"] == 3.5
    assert r["teardown"]["confirmed"] is True and r["teardown"]["instance_id"] == "1234"
    assert r["steering"] == [{"at": T0 + 6000, "action": "extend", "seconds": 3600.0}]
    assert r["resumes"][0]["epoch"] == 4
    assert r["warnings"] == ["stall soon", "disk low"]  # each once, in order
    json.dumps(r)  # plain JSON all the way down


def test_the_headline_names_outcome_duration_money_and_teardown() -> None:
    assert make()["headline"] == "run1: completed in 3h12m, $11.20, destroyed (confirmed)"


@pytest.mark.parametrize(
    ("teardown", "words"),
    [
        ({"action": "stop", "performed": True, "confirmed": False}, "stopped (NOT confirmed)"),
        ({"provider": "none", "action": "destroy", "confirmed": True}, "dry run (provider none)"),
        ({"action": "keep", "performed": False, "confirmed": True}, "box kept (still billing)"),
        ({"action": "destroy", "started_at": T0}, "destroy pending"),
        (None, "no teardown"),
    ],
)
def test_the_headline_says_what_happened_to_the_box(
    teardown: dict[str, Any] | None, words: str
) -> None:
    st = synthetic_state()
    st.teardown = teardown
    assert report.build(st, status_doc(), [], [], []).get("headline", "").endswith(words)


def test_a_failed_run_without_a_price_says_so() -> None:
    st = synthetic_state()
    st.phase, st.reason, st.teardown = Phase.FAILED, Reason.AGENT_FAILED, None
    st.history[-1] = {"at": T0 + 600, "from": "TRAINING", "to": "FAILED"}
    r = report.build(st, {"money": {"spent_usd": None}}, [], [], [])
    assert r["headline"] == "run1: FAILED (agent_failed) in 10m, cost unknown, no teardown"
    assert r["training"]["best"] is None and r["checkpoints"] == []


def test_markdown_tells_the_story_on_one_page() -> None:
    md = report.markdown(make())
    lines = md.splitlines()
    assert lines[0] == "# run1: completed in 3h12m, $11.20, destroyed (confirmed)"
    for section in ("## Timeline", "## Training", "## Checkpoints", "## Money", "## Teardown"):
        assert section in lines
    assert "| 2023-11-14 22:19:20Z | TRAINING | 3h | - |" in lines
    assert "| 2023-11-14 23:20:00Z | (agent restarted) | - | TRAINING |" in lines
    assert f"| weights/last.pt | 10 | 4096 | {SHA_LAST} | 2023-11-15 01:20:00Z |" in lines
    assert "target: file:///mnt/backup/run1; final check: verified (3 files checked)" in md
    assert "- best: epoch 9, mAP50_95 0.512" in lines
    assert "- resumed 1 time(s):" in lines
    assert "- spent: $11.20 at $3.50/h" in lines and "- budget: $50.00" in lines
    assert "- destroyed (confirmed): instance 1234 destroyed" in lines
    assert "| 2023-11-14 23:53:20Z | extend | seconds 3600 |" in lines
    assert lines[-2:] == ["- stall soon", "- disk low"]


def test_every_string_is_redacted_with_the_logs_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "hf_FAKESECRET_report_0123"
    monkeypatch.setattr(logutil.redact, "secrets", (("HF_TOKEN", secret),))
    st = synthetic_state()
    st.cause = f"upload failed: 401 for token {secret}"
    r = report.build(st, status_doc(), [], [], [f"warning with {secret}"])
    text = json.dumps(r) + report.markdown(r)
    assert secret not in text
    assert "upload failed: 401 for token <HF_TOKEN>" in r["cause"]
    assert r["warnings"] == ["warning with <HF_TOKEN>"]


def test_write_puts_both_files_private_and_load_reads_json_back(tmp_path: Path) -> None:
    r = make()
    json_path, md_path = report.write(tmp_path, r)
    assert (json_path.name, md_path.name) == ("report.json", "report.md")
    for p in (json_path, md_path):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert report.load(tmp_path) == json.loads(json.dumps(r))
    assert md_path.read_text().startswith("# run1: completed in 3h12m")
    assert not list(tmp_path.glob(".*.tmp"))  # nothing left of the atomic write
    (tmp_path / "report.json").write_text("{torn")
    assert report.load(tmp_path) is None


def test_ledger_entries_as_dicts_give_the_same_checkpoints() -> None:
    from dataclasses import asdict

    as_dicts = report.build(synthetic_state(), status_doc(), [asdict(e) for e in LEDGER], [], [])
    assert as_dicts["checkpoints"] == make()["checkpoints"]


def test_the_sizing_verdict_and_projection_are_part_of_the_story() -> None:
    doc = status_doc()
    doc["sizing"] = {
        "verdict": {"bound": "dataloader", "detail": "GPU 38 %, 16/16 CPUs busy"},
        "projection": {"total_s": 25920.0, "remaining_s": 0.0, "total_usd": 25.07},
        "profile": {"message": "cannot profile: no weights file"},
    }
    doc_report = report.build(synthetic_state(), doc, [], [], [])
    assert doc_report["sizing"]["verdict"]["bound"] == "dataloader"
    md = report.markdown(doc_report)
    assert "## Was it the right box?" in md
    assert "- verdict: dataloader (GPU 38 %, 16/16 CPUs busy)" in md
    assert "- projected: 7h12m of training, $25.07 in all" in md
    assert "- profiler: cannot profile: no weights file" in md
    assert "not measured" in report.markdown(
        report.build(synthetic_state(), status_doc(), [], [], [])
    )
