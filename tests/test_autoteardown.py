"""``on_success = "auto"`` (agent/policy/autoteardown.py): the guide's rule on this box's
figures, its gates, and the job file's keys (``expected_gap``, ``require_restore_drill``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.config.jobfile import parse_job
from agent.config.jobvalues import ConfigError
from agent.config.model import TeardownSection
from agent.policy.autoteardown import AutoInputs, decide_auto, setup_seconds, staged_gb
from agent.policy.teardown import decide
from agent.state import Reason, RunState

#: The guide's 8x4090: 15 minutes of setup at $3.4828/h, 43 GB staged, 250 GB at $0.20/GB-month.
GUIDE = AutoInputs(
    gap_s=8 * 3600.0,
    setup_s=15 * 60.0,
    price_usd_per_hour=3.4828,
    data_gb=43.0,
    disk_gb=250.0,
    storage_usd_per_gb_month=0.20,
    disk_source="provider",
    storage_source="provider",
)


def with_(**changes: object) -> AutoInputs:
    return AutoInputs(**{**GUIDE.__dict__, **changes})  # type: ignore[arg-type]


def test_the_guides_box_breaks_even_at_14_4_hours_and_an_8h_gap_stops() -> None:
    d = decide_auto(GUIDE)
    assert d.rebuild_usd == pytest.approx(0.8707 + 0.129, abs=1e-3)
    assert d.stopped_usd_per_hour == pytest.approx(0.0694, abs=1e-4)
    assert d.break_even_hours == pytest.approx(14.4, abs=0.05)
    assert d.action == "stop"
    assert d.why.startswith("auto: stop (expected gap 8h <= break-even 14.4h; rebuild $1.00")
    assert "15.0 min setup x $3.4828/h + 43.0 GB staged" in d.why
    assert "releases its GPUs" in d.warning


def test_a_gap_past_break_even_destroys() -> None:
    d = decide_auto(with_(gap_s=20 * 3600.0))
    assert d.action == "destroy" and "expected gap 20h > break-even 14.4h" in d.why


@pytest.mark.parametrize(
    ("missing", "words"),
    [
        ("disk_gb", "the disk size"),
        ("storage_usd_per_gb_month", "the storage price"),
        ("price_usd_per_hour", "the price"),
        ("setup_s", "the setup time"),
    ],
)
def test_an_unknown_figure_stops(missing: str, words: str) -> None:
    d = decide_auto(with_(**{missing: None}, gap_s=1000 * 3600.0))
    assert d.action == "stop"
    assert words in d.why and "unknown -> stop" in d.why


def test_a_provider_that_cannot_stop_destroys() -> None:
    assert decide_auto(with_(can_stop=False)).action == "destroy"


def test_auto_passes_the_verified_sync_gate_like_any_destroy() -> None:
    cfg = TeardownSection(provider="vast", on_success="auto", expected_gap_s=20 * 3600.0)
    auto = decide_auto(with_(gap_s=20 * 3600.0))
    ok = decide(Reason.COMPLETED, cfg, sync_verified=True, anything_to_save=True, auto=auto)
    assert ok.action == "destroy" and ok.why.startswith("teardown.on_success = auto: destroy")
    gated = decide(Reason.COMPLETED, cfg, sync_verified=False, anything_to_save=True, auto=auto)
    assert gated.action == "stop" and "require_verified_sync" in gated.why
    # Not completed: on_failure, auto plays no part.
    failed = decide(Reason.TRAINING_FAILED, cfg, sync_verified=True, anything_to_save=True)
    assert failed.action == "stop" and "on_failure" in failed.why


def test_setup_is_the_first_start_to_the_first_training() -> None:
    state = RunState(job_name="j", job_source="t", started_at=1000.0)
    assert setup_seconds(state) is None
    state.history = [
        {"at": 1100.0, "from": "BOOTING", "to": "PREFLIGHT"},
        {"at": 1900.0, "from": "STAGING", "to": "TRAINING"},
        {"at": 5000.0, "from": "BOOTING", "to": "TRAINING"},
    ]
    assert setup_seconds(state) == 900.0


def test_staged_gb_reads_the_marker_of_the_staged_folder(tmp_path: Path) -> None:
    from agent.data import dataset

    marker = tmp_path / dataset.MARKER_NAME
    marker.write_text(json.dumps({"archive_bytes": 43e9}))
    assert staged_gb({"dest": str(tmp_path), "unpacked_bytes": 50e9}) == pytest.approx(43.0)
    assert staged_gb({"unpacked_bytes": 50e9}) == pytest.approx(50.0)
    assert staged_gb(None) == 0.0


JOB = '[job]\nname = "a"\n[train]\nmodel = "yolox-n"\ndata = "/d/data.yaml"\n[teardown]\n'


def errors(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_job(JOB + text, source="t", base_dir=Path("/"))
    return [str(e) for e in info.value.errors]


def test_the_job_file_keys() -> None:
    job = parse_job(
        JOB + 'on_success = "auto"\nexpected_gap = "8h"\nrestore_drill_timeout = "2m"\n',
        source="t",
        base_dir=Path("/"),
    )
    td = job.teardown
    assert (td.on_success, td.expected_gap_s, td.restore_drill_timeout_s) == ("auto", 28800, 120)
    assert td.require_restore_drill is True
    assert errors('on_success = "auto"') == [
        'teardown.expected_gap: is required with on_success = "auto" (e.g. "8h")'
    ]
    assert errors('expected_gap = "8h"') == [
        "teardown.expected_gap: is only used by on_success = \"auto\" (it is 'destroy')"
    ]
    assert "auto" in errors('on_success = "maybe"')[0]
    assert errors("require_restore_drill = 1")[0].startswith("teardown.require_restore_drill")


def test_before_the_figures_are_read_auto_previews_as_a_stop() -> None:
    cfg = TeardownSection(provider="vast", on_success="auto", expected_gap_s=3600.0)
    preview = decide(Reason.COMPLETED, cfg, sync_verified=True, anything_to_save=True)
    assert preview.action == "stop" and "decided at the teardown" in preview.why
