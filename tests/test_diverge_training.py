"""A diverged run, with the real ``libreyolo train`` diverging (tiny synthetic data, CPU).

LibreYOLO 1.6.0 on 8 synthetic 64x64 images, ``warmup_epochs=0`` (docs/DESIGN facts, checked
again here): ``yolo9-t`` at ``lr0=1e5`` has a finite epoch 1 (loss ~4e9, finite weights), then
``null`` losses and NaN weights, and would train on to exit 0; ``yolox-n`` at ``lr0=6`` has a
finite epoch 1, then crashes in epoch 2 with exit 1 ("all elements of input should be between 0
and 1"). In both the run ends ``diverged`` naming the epoch, is not resumed, and epoch 1's
checkpoint is on the target as ``weights/last-good.pt``, checked finite.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from agent import demo
from agent.config.jobfile import parse_job
from agent.config.model import Env
from agent.daemon.spine import Daemon
from agent.state import Reason
from tests.support import tiny_job_text

pytestmark = pytest.mark.training

requires_libreyolo = pytest.mark.skipif(
    shutil.which("libreyolo", path=str(Path(sys.executable).parent)) is None
    and shutil.which("libreyolo") is None,
    reason="the training stack (libreyolo) is not installed: run ./install.sh",
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.make_dataset(tmp_path_factory.mktemp("data") / "ds")


def run_job(tmp: Path, data: Path, train: str, *, epochs: int, model: str = "yolox-n") -> Daemon:
    sections = f'[sync]\ntarget = "file://{tmp / "synced"}"\n'
    text = tiny_job_text(tmp, data, epochs=epochs, train=train, sections=sections, checks=True)
    job = parse_job(
        text.replace('model = "yolox-n"', f'model = "{model}"'), source="test", base_dir=tmp
    )
    daemon = Daemon(job, Env(state_dir=tmp / "state"), poll_interval_s=0.5)
    assert asyncio.run(daemon.run()) == 0
    return daemon


def tensors_finite(path: Path) -> dict[str, object]:
    """torch's own verdict on ``path`` (``torch.load`` + ``torch.isfinite`` on every floating
    tensor), independent of the agent's torch-free scan."""
    import torch

    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    stack, bad = [ckpt], 0
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if (obj.is_floating_point() or obj.is_complex()) and not bool(
                torch.isfinite(obj).all()
            ):
                bad += 1
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple):
            stack.extend(obj)
    return {"bad_count": bad, "epoch": ckpt["epoch"] + 1}


def assert_diverged_with_the_epoch_before_kept(tmp: Path, daemon: Daemon) -> str:
    """Epoch 1 is finite and epoch 2 is not, here; on another CPU (thread count, summation
    order) NaN may come an epoch later: the rule checked is that the epoch before the one named
    is the one kept, and that it is finite."""
    state = daemon.state
    assert state.reason == Reason.DIVERGED
    cause = state.cause or ""
    found = re.match(
        r"diverged at epoch (\d+): .*last good checkpoint: epoch (\d+), kept as", cause
    )
    assert found, cause
    bad, good = int(found.group(1)), int(found.group(2))
    assert bad >= 2 and good == bad - 1, cause
    assert not state.resumes  # never resumed
    answer = tensors_finite(tmp / "synced" / "weights" / "last-good.pt")
    assert answer["bad_count"] == 0 and answer["epoch"] == good, answer
    # The target's last-good.pt is verified like any upload.
    assert daemon.sync is not None and daemon.sync.verify_result is not None
    assert daemon.sync.verify_result.sync_verified
    entry = daemon.sync.verified_remote("weights/last-good.pt")
    assert entry is not None and entry.epoch == good
    log = (tmp / "state" / "agent.log").read_text()
    assert f"diverged at epoch {bad}" in log
    # A diverged run is a failure: the box is kept (on_failure = stop), never resumed.
    assert state.teardown is not None and state.teardown["action"] == "stop"
    return log


@requires_libreyolo
def test_yolo9_null_losses_stop_the_trainer_and_keep_epoch_1_as_last_good(
    tmp_path: Path, dataset: Path
) -> None:
    daemon = run_job(
        tmp_path, dataset, "lr0 = 100000.0\nwarmup_epochs = 0", epochs=6, model="yolo9-t"
    )
    log = assert_diverged_with_the_epoch_before_kept(tmp_path, daemon)
    assert "in metrics.jsonl" in (daemon.state.cause or "")
    # The agent stopped it (SIGINT) instead of letting it train on through NaN to exit 0.
    assert "trainer stopped (SIGINT)" in log
    assert daemon.status is not None and daemon.status.completed_epochs < 6
    assert daemon.run_dir is not None
    rows = [json.loads(x) for x in (daemon.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r["train/loss"] is None for r in rows)  # the null-loss form it was meant to be


@requires_libreyolo
def test_yolox_crash_on_nan_is_diverged_not_resumed_with_epoch_1_kept(
    tmp_path: Path, dataset: Path
) -> None:
    daemon = run_job(tmp_path, dataset, "lr0 = 6.0\nwarmup_epochs = 0", epochs=4)
    assert_diverged_with_the_epoch_before_kept(tmp_path, daemon)
    assert daemon.state.outcome is not None
    assert daemon.state.outcome["kind"] == "diverged" and daemon.state.outcome["exit_code"] == 1
    assert "between 0 and 1" in (daemon.state.cause or "")
