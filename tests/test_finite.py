"""Divergence detectors on crafted inputs: metrics.jsonl rows with null/NaN/inf losses, and
checkpoints written by the real ``torch.save`` with NaN or inf in one tensor, read by the
agent's check (agent/trainer/ckptscan.py, no torch) and compared with ``torch.isfinite``; the
daemon's watch over them (what is called good, what is kept as last-good.pt, the verdict that
survives a restart)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.config.jobfile import parse_job
from agent.config.model import ConfigError, TrainSection
from agent.daemon.diverge import DivergenceWatch
from agent.daemon.relaunch import resume_or_not
from agent.state import Reason, RunState, StateStore
from agent.trainer.finite import (
    check_weights,
    crash_looks_diverged,
    is_torch_checkpoint,
    loss_problem,
    scan_losses,
)
from agent.trainer.outcome import Outcome, OutcomeKind
from agent.trainer.rundir import RunStatus

torch = pytest.importorskip("torch")


def save_ckpt(path: Path, epoch: int, *, bad: str | None = None, value: float = math.nan) -> Path:
    """A LibreYOLO-shaped checkpoint (0-based ``epoch``, model/ema/optimizer); ``bad`` names
    the part (``model``, ``ema``, ``optimizer``) that gets one NaN (or ``value``)."""
    model = {"conv.weight": torch.ones(4, 3), "bn.running_var": torch.ones(4)}
    ema = {k: v.clone() for k, v in model.items()}
    optimizer = {"state": {0: {"exp_avg": torch.zeros(4, 3), "step": torch.tensor(3)}}}
    parts = {"model": model, "ema": ema, "optimizer": optimizer}
    if bad == "optimizer":
        optimizer["state"][0]["exp_avg"][1, 2] = value
    elif bad is not None:
        parts[bad]["conv.weight"][0, 0] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**parts, "epoch": epoch - 1, "loss": 1.5, "names": {0: "box"}}, path)
    return path


def write_rows(run_dir: Path, *rows: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run_dir / "metrics.jsonl").write_text(text, encoding="utf-8")


def row(epoch: int, loss: object = 1.0) -> dict[str, Any]:
    return {"epoch": epoch, "train/loss": loss, "train/cls_loss": 0.5, "lr/group0": 0.01}


# ---------------------------------------------------------------- losses


def test_null_nan_and_inf_losses_are_divergence_and_other_keys_are_not() -> None:
    assert loss_problem(row(1)) is None
    assert loss_problem(row(1, None)) == "train/loss = null"
    assert loss_problem({"epoch": 1, "train/box_loss": float("inf")}) == "train/box_loss = Infinity"
    assert loss_problem({"epoch": 1, "val/loss": "nan"}) == 'val/loss = "nan"'
    # Metrics and learning rates are no losses: a null mAP (not validated) is normal.
    assert loss_problem({"epoch": 1, "current_metric": None, "lr/group0": None}) is None
    # A huge loss is still finite: divergence is NaN/inf, not a number judged too big.
    assert loss_problem(row(1, 3.7e9)) is None


def test_scan_losses_names_the_first_bad_epoch_and_the_last_finite_one() -> None:
    # json.loads reads the NaN literal Python's json writes: the same as null.
    rows = [
        json.loads(x)
        for x in ['{"epoch": 1, "train/loss": 2.0}', '{"epoch": 2, "train/loss": NaN}']
    ]
    verdict = scan_losses([*rows, row(3, None)])
    assert (verdict.finite_through, verdict.bad_epoch) == (1, 2)
    assert verdict.problem == "train/loss = NaN"
    assert scan_losses([row(1), row(2)]).finite_through == 2
    assert scan_losses([]).finite_through is None


def test_crash_words_tell_nan_from_a_bug() -> None:
    assert crash_looks_diverged("Training failed: all elements of input should be between 0 and 1")
    assert crash_looks_diverged("RuntimeError: boom", "loss is NaN, stopping")
    assert not crash_looks_diverged("CUDA out of memory", "Traceback ... KeyError: 'boxes'")


# ---------------------------------------------------------------- the weights check


def test_check_finds_nan_in_the_ema_and_inf_in_the_optimizer(tmp_path: Path) -> None:
    good = asyncio.run(check_weights(save_ckpt(tmp_path / "good.pt", 3)))
    assert good.finite is True and good.epoch == 3 and good.bad_count == 0
    assert good.tensors == 5  # model 2, ema 2, exp_avg 1; the int step and the epoch are not
    assert good.bytes_read == 4 * (12 + 4 + 12 + 4 + 12)

    nan = asyncio.run(check_weights(save_ckpt(tmp_path / "nan.pt", 2, bad="ema")))
    assert nan.finite is False and nan.bad == ("ema.conv.weight",) and nan.bad_count == 1
    assert "holds NaN/inf in 1 of 5 tensors (ema.conv.weight)" in nan.describe()

    inf = asyncio.run(
        check_weights(save_ckpt(tmp_path / "inf.pt", 2, bad="optimizer", value=-math.inf))
    )
    assert inf.finite is False and inf.bad == ("optimizer.state.0.exp_avg",)


def test_check_cannot_tell_for_a_torn_file_and_a_read_that_never_answers(
    tmp_path: Path,
) -> None:
    torn = tmp_path / "torn.pt"
    torn.write_bytes(save_ckpt(tmp_path / "whole.pt", 1).read_bytes()[:300])
    answer = asyncio.run(check_weights(torn))
    assert answer.finite is None and answer.error
    assert "cannot tell" in answer.describe()

    # A FIFO: the read blocks as on a disk that stopped answering. The check gives up at its
    # limit, and its thread (a daemon, left to its read) does not hold the process.
    hung = tmp_path / "hung.pt"
    os.mkfifo(hung)
    answer = asyncio.run(check_weights(hung, timeout_s=0.5))
    assert answer.finite is None and "no answer in 0.5s" in (answer.error or "")
    with open(hung, "wb"):  # let the blocked open go, so the thread ends
        pass


def test_only_torch_pickles_are_worth_a_check(tmp_path: Path) -> None:
    assert is_torch_checkpoint(save_ckpt(tmp_path / "real.pt", 1))
    fake = tmp_path / "fake.pt"  # tests/fakes/scripted_trainer.py's kind: JSON in data.pkl
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr("archive/data.pkl", b'{"epoch": 1}')
    assert not is_torch_checkpoint(fake)
    (tmp_path / "text.pt").write_text("no zip")
    assert not is_torch_checkpoint(tmp_path / "text.pt")


# ---------------------------------------------------------------- the daemon's watch


@dataclass
class Ctx:
    """What :class:`DivergenceWatch` reads of the run context."""

    store: StateStore
    state: RunState
    status: RunStatus | None = None
    sync: Any = None
    events: list[Any] = field(default_factory=list)
    job: Any = field(default_factory=lambda: SimpleNamespace(train=TrainSection()))


def status(epoch: int) -> RunStatus:
    return RunStatus.from_dict({"state": "running", "completed_epochs": epoch})


def watch_at(tmp: Path, started_at: float = 1000.0) -> tuple[DivergenceWatch, Ctx, Path]:
    state = RunState(job_name="run1", job_source="test", started_at=started_at)
    ctx = Ctx(StateStore(tmp / "state"), state)
    ctx.store.root.mkdir(parents=True, exist_ok=True)
    return DivergenceWatch(ctx), ctx, tmp / "run"  # type: ignore[arg-type]


async def epoch_ends(watch: DivergenceWatch, ctx: Ctx, run: Path, epoch: int) -> None:
    ctx.status = status(epoch)
    watch.on_epoch(run)
    assert watch._task is not None
    await watch._task


def test_inf_weights_with_finite_losses_diverge_and_keep_the_previous_good(tmp_path: Path) -> None:
    watch, ctx, run = watch_at(tmp_path)

    async def scenario() -> None:
        write_rows(run, row(1))
        save_ckpt(run / "weights" / "last.pt", 1)
        await epoch_ends(watch, ctx, run, 1)
        assert watch.good_epoch == 1 and watch.verdict is None
        kept = watch.good_path.read_bytes()
        # Epoch 2: the losses are finite, the checkpoint holds inf.
        write_rows(run, row(1), row(2))
        save_ckpt(run / "weights" / "last.pt", 2, bad="model", value=math.inf)
        await epoch_ends(watch, ctx, run, 2)
        assert watch.verdict is not None and watch.verdict.epoch == 2
        assert "model.conv.weight" in watch.verdict.why
        assert watch.good_epoch == 1 and watch.good_path.read_bytes() == kept  # never overwritten
        assert watch.cause().startswith("diverged at epoch 2: epoch 2's checkpoint holds NaN/inf")
        assert "last good checkpoint: epoch 1, kept as weights/last-good.pt" in watch.cause()
        assert watch.changed.is_set()  # wakes the training loop

    asyncio.run(scenario())
    # The verdict survives the agent: a restarted one stops the trainer and never resumes.
    again, _, run = watch_at(tmp_path)
    assert asyncio.run(again.poll(run)) == watch.verdict and again.good_epoch == 1
    # The same job run again in this state directory (its state.json removed) starts afresh.
    fresh, _, run = watch_at(tmp_path, started_at=2000.0)
    assert asyncio.run(fresh.poll(run)) is None and fresh.good_epoch is None


def test_check_weights_false_reads_the_losses_only(tmp_path: Path) -> None:
    # train.check_weights = false: no child reads last.pt (a checkpoint of inf passes unseen,
    # and none is kept as good); the losses still stop a run that diverged.
    watch, ctx, run = watch_at(tmp_path)
    ctx.job = SimpleNamespace(train=TrainSection(check_weights=False))

    async def scenario() -> None:
        write_rows(run, row(1))
        save_ckpt(run / "weights" / "last.pt", 1, bad="model", value=math.inf)
        await epoch_ends(watch, ctx, run, 1)
        assert watch.verdict is None and watch.last_check is None and watch.good_epoch is None
        write_rows(run, row(1), row(2, loss=None))
        assert await watch.poll(run) is not None and watch.verdict is not None
        assert watch.verdict.epoch == 2

    asyncio.run(scenario())


def test_check_weights_is_the_agents_key_and_a_boolean() -> None:
    base = '[train]\ndata = "/d/data.yaml"\n'
    job = parse_job(base + "check_weights = false\n", source="t")
    assert job.train.check_weights is False
    assert all(k != "check_weights" for k, _ in job.train.args)  # never passed to LibreYOLO
    assert parse_job(base, source="t").train.check_weights is True
    with pytest.raises(ConfigError, match=r"train\.check_weights"):
        parse_job(base + 'check_weights = "no"\n', source="t")


def test_weights_are_not_good_before_their_epochs_losses_are_read(tmp_path: Path) -> None:
    watch, ctx, run = watch_at(tmp_path)

    async def scenario() -> None:
        write_rows(run)  # metrics.jsonl without epoch 1's row yet
        save_ckpt(run / "weights" / "last.pt", 1)
        await epoch_ends(watch, ctx, run, 1)
        assert watch.good_epoch is None and not watch.good_path.exists()
        assert watch.last_check is not None and watch.last_check.finite is True

    asyncio.run(scenario())


def test_null_losses_are_seen_on_the_next_turn_without_a_weights_check(tmp_path: Path) -> None:
    watch, _, run = watch_at(tmp_path)

    async def scenario() -> None:
        write_rows(run, row(1), row(2, None))
        verdict = await watch.poll(run)
        assert verdict is not None and verdict.epoch == 2
        assert verdict.why == "train/loss = null in metrics.jsonl"
        assert watch.last_check is None  # losses alone: no child needed to say bad

    asyncio.run(scenario())


def test_exit_0_through_nan_and_a_crash_on_nan_are_both_diverged(tmp_path: Path) -> None:
    async def after(tmp: Path, rows: list[dict[str, Any]], outcome: Outcome) -> Any:
        watch, ctx, run = watch_at(tmp)
        write_rows(run, *rows)
        save_ckpt(run / "weights" / "last.pt", len(rows))
        ctx.status = status(len(rows))
        return await watch.after_exit(run, outcome), watch

    completed = Outcome(OutcomeKind.COMPLETED, 0, "training completed")
    verdict, watch = asyncio.run(
        after(tmp_path / "a", [row(1), row(2, None), row(3, None)], completed)
    )
    assert verdict is not None and verdict.epoch == 2
    # A healthy finished run pays no child on its way to the teardown: its losses only.
    verdict, watch = asyncio.run(after(tmp_path / "d", [row(1), row(2)], completed))
    assert verdict is None and watch.last_check is None

    crash = Outcome(
        OutcomeKind.RUNTIME, 1, "Training failed: all elements of input should be between 0 and 1"
    )
    verdict, watch = asyncio.run(after(tmp_path / "b", [row(1)], crash))
    assert verdict is not None and verdict.epoch == 2 and "crashed on NaN" in verdict.why
    assert watch.good_epoch == 1  # the final last.pt was read after the exit, and is good

    bug = Outcome(OutcomeKind.RUNTIME, 1, "KeyError: 'boxes'")
    verdict, watch = asyncio.run(after(tmp_path / "c", [row(1)], bug))
    assert verdict is None and watch.good_epoch == 1  # a bug is a bug: resumed as before


def test_a_diverged_outcome_is_never_resumed() -> None:
    outcome = Outcome(OutcomeKind.DIVERGED, 0, "train/loss = null")
    # The rule comes before anything of the context is read.
    relaunch = asyncio.run(resume_or_not(None, outcome, None))  # type: ignore[arg-type]
    assert relaunch.resumed is False and relaunch.reason == Reason.DIVERGED
    stopped = Outcome(OutcomeKind.INTERRUPTED, 130, "stopped with SIGINT")
    relaunch = asyncio.run(resume_or_not(None, stopped, Reason.DIVERGED))  # type: ignore[arg-type]
    assert relaunch.resumed is False and relaunch.reason == Reason.DIVERGED


def test_record_is_written_before_the_verdict_is_acted_on(tmp_path: Path) -> None:
    watch, _, run = watch_at(tmp_path)
    write_rows(run, row(1, math.inf))
    asyncio.run(watch.poll(run))
    doc = json.loads(watch.record_path.read_text())
    assert doc["diverged"]["epoch"] == 1 and doc["good_epoch"] is None
    assert not os.path.exists(str(watch.record_path) + ".tmp")


def test_the_post_mortem_headline_says_which_epoch_diverged() -> None:
    from agent.status.report import headline

    cause = "diverged at epoch 2: train/loss = null in metrics.jsonl; last good checkpoint: epoch 1"
    line = headline({"job": "run1", "reason": "diverged", "cause": cause, "duration_s": 60})
    assert line.startswith("run1: diverged at epoch 2 in 1m"), line
