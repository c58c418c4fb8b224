"""The restore drill (agent/sync/restore.py, agent/trainer/loadcheck*.py) and its gate on the
destroy (agent/policy/teardown.py), with ``on_success = "auto"`` (agent/policy/autoteardown.py)
decided by a real daemon from the fake Vast's figures.

A real ``libreyolo train`` (yolox-n, tiny synthetic data, CPU) makes the checkpoints; the drill
loads them with the real LibreYOLO in a child. Only the timeout case uses a stand-in loader.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent import demo
from agent.config.model import Env, TeardownSection
from agent.daemon.spine import Daemon
from agent.policy import autoteardown
from agent.policy.teardown import decide
from agent.sinks.local import LocalSink
from agent.state import Phase, Reason, StateStore
from agent.status import report
from agent.sync.restore import run_drill
from agent.trainer.loadcheck import check_loads
from tests.fakes.providers import run_fake_vast
from tests.support import tiny_job, tiny_trained_checkpoint

VAST_KEY = "vast-account-key-0123456789"

requires_libreyolo = pytest.mark.skipif(
    shutil.which("libreyolo", path=str(Path(sys.executable).parent)) is None,
    reason="the training stack (libreyolo) is not installed: run ./install.sh",
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.make_dataset(tmp_path_factory.mktemp("data") / "ds")


def run_job(
    tmp: Path, data: Path, teardown: str, monkeypatch: pytest.MonkeyPatch, vast_url: str
) -> tuple[int, Daemon]:
    """One real daemon run (1 epoch) syncing to ``file://tmp/synced``, torn down by the fake
    Vast as instance 1234."""
    monkeypatch.setenv("CONTAINER_ID", "1234")
    monkeypatch.setenv("VAST_API_KEY", VAST_KEY)
    monkeypatch.delenv("CONTAINER_API_KEY", raising=False)
    sections = (
        f'[sync]\ntarget = "file://{tmp / "synced"}"\n'
        f'[teardown]\nprovider = "vast"\napi_url = "{vast_url}"\n{teardown}\n'
        "[limits]\nprice_usd_per_hour = 3.4828\n"
    )
    job = tiny_job(tmp, data, epochs=1, sections=sections, checks=True)
    env = Env(state_dir=tmp / "state", container_id="1234", vast_api_key=VAST_KEY)
    daemon = Daemon(job, env, poll_interval_s=0.5)
    code = asyncio.run(daemon.run())
    return code, daemon


# ----------------------------------------------------------------- real daemon, real trainer


@pytest.mark.training
@requires_libreyolo
def test_a_completed_run_drills_its_checkpoints_and_auto_destroys_past_break_even(
    tmp_path: Path, dataset: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with run_fake_vast(keys={VAST_KEY}) as vast:
        vast.add_instance("1234", dph_total=3.4828, disk_space=250.0, storage_cost=0.20)
        td = 'on_success = "auto"\nexpected_gap = "8h"'
        code, daemon = run_job(tmp_path, dataset, td, monkeypatch, vast.url)
        mutations = vast.mutations()
    assert code == 0
    state = StateStore(tmp_path / "state").load()
    assert state is not None and state.phase == Phase.DONE and state.reason == Reason.COMPLETED
    record: dict[str, Any] = dict(state.teardown or {})
    drill = record["restore_drill"]
    assert drill["status"] == "ok", drill
    loaded = [f for f in drill["files"] if f["status"] == "ok"]
    assert {f["path"] for f in loaded} == {"weights/best.pt", "weights/last.pt"}
    assert all(f["family"] == "LibreYOLOX-n" and f["epoch"] == 1 for f in loaded)
    # The arithmetic, from this run's own setup time, the price and Vast's disk figures.
    setup_s = autoteardown.setup_seconds(state)
    assert setup_s is not None
    rebuild = setup_s / 60 * 3.4828 / 60
    stopped = 250.0 * 0.20 / 720
    auto = record["auto"]
    assert auto["rebuild_usd"] == pytest.approx(rebuild)
    assert auto["stopped_usd_per_hour"] == pytest.approx(stopped)
    assert auto["break_even_hours"] == pytest.approx(rebuild / stopped)
    assert rebuild / stopped < 8  # seconds of setup: far under the 8 h gap
    assert record["action"] == "destroy" and record["confirmed"] is True
    assert f"break-even {rebuild / stopped:.1f}h" in record["why"]
    assert "250 GB (provider) x $0.2/GB-month (provider)" in record["why"]
    assert [m[0] for m in mutations] == ["DELETE"]
    # The same words in the log, /status, the post-mortem (with the GPU warning).
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "teardown auto: destroy (expected gap 8h" in logged
    assert "restore drill ok: weights/best.pt (LibreYOLOX-n epoch 1)" in logged
    assert "releases its GPUs" in logged
    doc = daemon.status_dict()
    assert doc["teardown"]["auto"]["why"] == auto["why"]
    assert doc["teardown_plan"]["expected_gap_s"] == 8 * 3600
    post = report.load(tmp_path / "state")
    assert post is not None and post["restore_drill"]["status"] == "ok"
    md = (tmp_path / "state" / report.MD_NAME).read_text()
    assert "restore drill ok" in md and auto["why"] in md and "releases its GPUs" in md


@pytest.mark.training
@requires_libreyolo
def test_a_drill_that_times_out_turns_the_destroy_into_a_stop(
    tmp_path: Path, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with run_fake_vast(keys={VAST_KEY}) as vast:
        vast.add_instance("1234")
        # 0.05 s: less than the interpreter and `import torch` need, whatever the machine.
        td = 'on_success = "destroy"\nrestore_drill_timeout = 0.05'
        code, _ = run_job(tmp_path, dataset, td, monkeypatch, vast.url)
        mutations = vast.mutations()
    assert code == 0
    state = StateStore(tmp_path / "state").load()
    assert state is not None and state.teardown is not None
    assert state.teardown["restore_drill"]["status"] == "timed_out"
    assert state.teardown["action"] == "stop"
    assert state.teardown["why"].startswith("destroy downgraded to stop: restore drill TIMED OUT")
    assert [m[0] for m in mutations] == ["PUT"]  # a stop; never a DELETE


# ----------------------------------------------------------------- the drill alone


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real yolox-n checkpoint from one epoch of ``libreyolo train`` (made once a session)."""
    return tiny_trained_checkpoint(tmp_path_factory)


def target_with(tmp: Path, checkpoint: Path) -> LocalSink:
    (tmp / "target" / "weights").mkdir(parents=True)
    shutil.copyfile(checkpoint, tmp / "target" / "weights" / "last.pt")
    return LocalSink(tmp / "target")


def rewrite(src: Path, dst: Path, how: str) -> None:
    """``src`` saved again by torch as ``dst``: still a valid zip, no longer a loadable model."""
    import torch

    ckpt = torch.load(src, map_location="cpu", weights_only=False)
    if how == "missing":
        for key in ("model", "ema", "train_model"):
            part = ckpt.get(key)
            if isinstance(part, dict):
                for k in list(part)[: len(part) // 2]:
                    del part[k]
        torch.save(ckpt, dst)
    else:  # a pickle that raises on a weights-only load
        torch.save(argparse.Namespace(model=ckpt["model"]), dst)


@pytest.mark.training
@requires_libreyolo
@pytest.mark.parametrize(
    ("how", "words"), [("missing", "tensors missing"), ("pickle", "torch.load: UnpicklingError")]
)
def test_a_valid_zip_that_does_not_load_fails_the_drill_and_the_destroy_becomes_a_stop(
    tmp_path: Path, checkpoint: Path, how: str, words: str
) -> None:
    bad = tmp_path / "bad.pt"
    rewrite(checkpoint, bad, how)
    import zipfile

    assert zipfile.is_zipfile(bad)  # bytes fine, a zip fine: what "verified" checks
    drill = asyncio.run(run_drill(target_with(tmp_path, bad), tmp_path / "scratch"))
    assert drill.status == "failed" and drill.blocks_destroy
    assert words in drill.why
    assert not list((tmp_path / "scratch").iterdir())  # the scratch copy is gone
    cfg = TeardownSection(provider="vast", on_success="destroy")
    decision = decide(
        Reason.COMPLETED,
        cfg,
        sync_verified=True,
        anything_to_save=True,
        restore_failure=drill.why,
    )
    assert decision.action == "stop"
    assert "teardown.require_restore_drill" in decision.why and words in decision.why
    off = TeardownSection(provider="vast", on_success="destroy", require_restore_drill=False)
    kept = decide(
        Reason.COMPLETED, off, sync_verified=True, anything_to_save=True, restore_failure=drill.why
    )
    assert kept.action == "destroy"


@pytest.mark.training
@requires_libreyolo
def test_the_real_checkpoint_passes_and_a_copy_of_it_is_not_loaded_twice(
    tmp_path: Path, checkpoint: Path
) -> None:
    sink = target_with(tmp_path, checkpoint)
    shutil.copyfile(checkpoint, tmp_path / "target" / "weights" / "best.pt")
    drill = asyncio.run(run_drill(sink, tmp_path / "scratch"))
    assert drill.status == "ok" and not drill.blocks_destroy
    best, last = drill.files
    assert best.status == "ok" and best.family == "LibreYOLOX-n" and best.epoch == 1
    assert last.status == "ok" and last.detail is not None and "not loaded twice" in last.detail


def test_an_empty_target_skips_the_drill_without_blocking(tmp_path: Path) -> None:
    (tmp_path / "target").mkdir()
    drill = asyncio.run(run_drill(LocalSink(tmp_path / "target"), tmp_path / "scratch"))
    assert drill.status == "skipped" and not drill.blocks_destroy
    assert "neither weights/best.pt nor weights/last.pt" in drill.why


def test_a_hanging_loader_is_killed_at_the_timeout(tmp_path: Path) -> None:
    hang = (
        "import os, sys, time; open(sys.argv[1] + '.pid', 'w').write(str(os.getpid()));"
        " time.sleep(3600)"
    )
    argv = [sys.executable, "-c", hang]
    ckpt = tmp_path / "x.pt"
    ckpt.write_bytes(b"not even a zip")
    result = asyncio.run(check_loads(ckpt, timeout_s=5.0, argv=argv))
    assert result.status == "timed_out"
    assert result.error is not None and "took over 5s and was killed" in result.error
    pid = int(Path(f"{ckpt}.pid").read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_timeout_gates_the_drill_through_the_sink(tmp_path: Path) -> None:
    sink = target_with(tmp_path, _fake_checkpoint(tmp_path))
    argv = [sys.executable, "-c", "import time; time.sleep(3600)"]
    drill = asyncio.run(run_drill(sink, tmp_path / "scratch", timeout_s=1.0, loader_argv=argv))
    assert drill.status == "timed_out" and drill.blocks_destroy
    assert drill.why.startswith("restore drill TIMED OUT: weights/last.pt")


def _fake_checkpoint(tmp: Path) -> Path:
    path = tmp / "ck.pt"
    path.write_bytes(json.dumps({"not": "a checkpoint"}).encode())
    return path


@pytest.mark.training
@requires_libreyolo
def test_auto_stops_for_a_gap_under_break_even_and_skips_the_drill(
    tmp_path: Path, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with run_fake_vast(keys={VAST_KEY}) as vast:
        vast.add_instance("1234", dph_total=3.4828, disk_space=250.0, storage_cost=0.20)
        td = 'on_success = "auto"\nexpected_gap = "0s"'
        code, daemon = run_job(tmp_path, dataset, td, monkeypatch, vast.url)
        mutations = vast.mutations()
    assert code == 0
    state = StateStore(tmp_path / "state").load()
    assert state is not None and state.teardown is not None
    record: dict[str, Any] = dict(state.teardown)
    assert record["action"] == "stop" and record["why"].startswith(
        "teardown.on_success = auto: stop (expected gap 0s <= break-even"
    )
    assert record["auto"]["warning"].startswith("a stopped box releases its GPUs")
    # A stop keeps the disk: the drill, which can only change a destroy, is not paid for.
    assert record["restore_drill"]["status"] == "skipped"
    assert "the teardown is stop, not a destroy" in record["restore_drill"]["why"]
    assert [m[0] for m in mutations] == ["PUT"]
    assert daemon.status_dict()["teardown"]["action"] == "stop"
