"""The /status document's parts for people (agent/status/document.py): the checkpoint list from
the sync ledger, where the post-mortem is, and which actions the agent acts on now
(agent/daemon/control.py's rules, checked against the requests' own answers)."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import pytest

from agent.config.jobvalues import MAX_STEERING_S
from agent.config.model import SyncSection
from agent.daemon.control import available_actions, gpu_summary, stop_refusal
from agent.policy import steering
from agent.state import Phase, RunState
from agent.status.document import MAX_CHECKPOINTS, checkpoint_list, post_mortem
from agent.sync.ledger import ItemKind, Ledger
from tests.fakes.page_agent import TOKEN, make_scene, put

HUB = SyncSection(target="hf://acme/run")
FOLDER = SyncSection(target="file:///srv/ckpt")


def ledger(tmp: Path, n_epochs: int) -> Ledger:
    led = Ledger(tmp / "sync-ledger.json")
    for e in range(1, n_epochs + 1):
        put(led, f"weights/epoch_{e}.pt", e, ItemKind.EPOCH, 1000.0 + e)
        put(led, "weights/last.pt", e, ItemKind.LAST, 1000.5 + e)
        put(led, "metrics.jsonl", e, ItemKind.SMALL, 1000.7 + e)
    put(led, "agent/agent.log", n_epochs, ItemKind.AGENT, 2000.0)
    return led


def test_checkpoints_are_the_ledgers_pt_files_newest_first_with_their_hub_pages(
    tmp_path: Path,
) -> None:
    led = ledger(tmp_path, 3)
    got = checkpoint_list(led.entries.values(), HUB)
    assert [c["path"] for c in got["checkpoints"]] == [
        "weights/last.pt",
        "weights/epoch_3.pt",
        "weights/epoch_2.pt",
        "weights/epoch_1.pt",
    ]
    assert got["checkpoints_more"] == 0
    last = got["checkpoints"][0]
    entry = led.entries["weights/last.pt"]
    assert last == {
        "path": "weights/last.pt",
        "location": "https://huggingface.co/acme/run/blob/main/weights/last.pt",
        "epoch": 3,
        "kind": "last",
        "size": entry.size,
        "sha256": entry.sha256[:12],
        "status": "verified",
        "verified_at": entry.verified_at,
    }
    assert len(last["sha256"]) == 12


def test_checkpoints_in_a_folder_name_the_file_and_a_long_run_is_capped(tmp_path: Path) -> None:
    led = ledger(tmp_path, MAX_CHECKPOINTS + 7)
    got = checkpoint_list(led.entries.values(), FOLDER)
    assert len(got["checkpoints"]) == MAX_CHECKPOINTS
    # last.pt plus MAX_CHECKPOINTS + 7 epoch files: the oldest are counted, not listed.
    assert got["checkpoints_more"] == 8
    assert got["checkpoints"][1]["location"] == (
        f"/srv/ckpt/weights/epoch_{MAX_CHECKPOINTS + 7}.pt"
    )
    assert got["checkpoints"][-1]["path"] == "weights/epoch_9.pt"


def test_post_mortem_is_report_md_under_agent_on_the_target(tmp_path: Path) -> None:
    led = ledger(tmp_path, 1)
    assert post_mortem(led.entries.values(), HUB) == {
        "location": "https://huggingface.co/acme/run/blob/main/agent/report.md",
        "verified": False,
    }
    put(led, "agent/report.md", 1, ItemKind.AGENT, 3000.0)
    assert post_mortem(led.entries.values(), FOLDER) == {
        "location": "/srv/ckpt/agent/report.md",
        "verified": True,
    }
    assert post_mortem(led.entries.values(), None) is None


def test_status_serves_checkpoints_actions_and_where_the_token_is(tmp_path: Path) -> None:
    scene = make_scene(tmp_path, "held")
    (scene.state_dir / "token").write_text(TOKEN + "\n")
    doc = scene.document()
    assert [c["path"] for c in doc["checkpoints"]][:2] == ["weights/last.pt", "weights/best.pt"]
    assert doc["token_file"] == str(scene.state_dir / "token")
    assert TOKEN not in json.dumps(doc)  # where it is, never what it is
    assert doc["teardown_preview"] == "destroy: teardown.on_success = destroy"
    assert doc["actions"]["extend"]["ok"] is False
    assert "held" in doc["actions"]["extend"]["reason"]
    assert doc["actions"]["release"] == {"ok": True}


# ---- the actions the page offers are the ones the agent acts on -------------------------------

NOW = 1_000_000.0
HOLDS = {
    "none": None,
    "active": {"at": NOW - 10, "until": NOW + 600, "released_at": None},
    "released": {"at": NOW - 10, "until": NOW + 600, "released_at": NOW - 5},
    "lapsed": {"at": NOW - 900, "until": NOW - 1, "released_at": None},
}


def run_state(phase: Phase, hold: str, decided: bool, extended_s: float) -> RunState:
    st = RunState(job_name="j", job_source="t", started_at=NOW - 3600)
    st.phase = phase
    st.hold = copy.deepcopy(HOLDS[hold])  # type: ignore[assignment]
    st.extended_s = extended_s
    if decided:
        st.teardown = {"action": "destroy", "why": "teardown.on_success = destroy"}
    return st


def refused(fn: object) -> str | None:
    """The 409 reason ``fn()`` answers, None when it acts (a 400 is the body's fault)."""
    try:
        fn()  # type: ignore[operator]
    except steering.SteeringError as exc:
        return str(exc) if exc.status == steering.CONFLICT else None
    return None


@pytest.mark.parametrize(
    ("phase", "hold", "decided", "stopping", "max_runtime_s", "extended_s"),
    [
        combo
        for combo in itertools.product(
            list(Phase),
            list(HOLDS),
            [False, True],
            [None, "a stop was requested"],
            [None, 7200.0],
            [0.0, MAX_STEERING_S],
        )
        # A decided teardown exists from TEARDOWN on; the cap only matters where extend could act.
        if (not combo[2] or combo[0] in (Phase.TEARDOWN, Phase.DONE, Phase.FAILED, Phase.HELD))
        and (combo[5] == 0.0 or combo[0] is Phase.TRAINING)
    ],
)
def test_available_actions_agree_with_what_the_requests_answer(
    phase: Phase,
    hold: str,
    decided: bool,
    stopping: str | None,
    max_runtime_s: float | None,
    extended_s: float,
) -> None:
    st = run_state(phase, hold, decided, extended_s)
    got = available_actions(st, NOW, max_runtime_s=max_runtime_s, stopping=stopping, exiting=False)

    def fresh() -> RunState:
        return copy.deepcopy(st)

    def stop() -> None:
        s = fresh()
        if s.phase is Phase.HELD:
            steering.stop_held(s, now=NOW, teardown="destroy")
            return
        why = stop_refusal(s, NOW, stopping=stopping, exiting=False)
        if why:
            raise steering.SteeringError(why, status=steering.CONFLICT)

    answers = {
        "stop": refused(stop),
        "extend": refused(
            lambda: steering.extend(
                fresh(), 3600.0, now=NOW, max_runtime_s=max_runtime_s, stopping=stopping
            )
        ),
        "hold": refused(lambda: steering.hold(fresh(), now=NOW, timeout_s=3600.0)),
        "release": refused(lambda: steering.release(fresh(), now=NOW)),
    }
    for name, why in answers.items():
        assert got[name]["ok"] is (why is None), (name, why, got[name])
        if why is not None:
            assert got[name]["reason"]  # the page shows it beside the disabled button


def test_history_gpu_figures_are_the_mean_utilisation_and_the_total_power_and_memory() -> None:
    gib = 1 << 30
    gpus = [
        {
            "index": 0,
            "util_pct": 90.0,
            "power_w": 600.0,
            "power_limit_w": 700.0,
            "memory_used_bytes": 30 * gib,
            "memory_total_bytes": 141 * gib,
        },
        {
            "index": 1,
            "util_pct": 70.0,
            "power_w": None,
            "power_limit_w": 700.0,
            "memory_used_bytes": 20 * gib,
            "memory_total_bytes": 141 * gib,
        },
    ]
    assert gpu_summary(gpus) == {
        "gpu/util_pct": 80.0,
        "gpu/power_w": 600.0,
        "gpu/memory_used_bytes": 50 * gib,
        "gpu/memory_total_bytes": 282 * gib,
    }
    # A figure NVML did not give is left out, never a 0.
    assert gpu_summary([{"index": 0, "util_pct": None, "power_w": None}]) == {}
    assert gpu_summary([]) == {}
