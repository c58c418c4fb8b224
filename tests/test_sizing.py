"""Is this the right box? The verdict from recorded samples (an injected sampler), the
projection arithmetic against hand-computed cases, and the words of the log line."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from agent.config.jobfile import parse_job
from agent.config.model import Job, ProfileSection
from agent.gpu.health import GpuSample
from agent.trainer.rundir import RunStatus
from agent.watch.sampling import TreeCpu
from agent.watch.sizing import (
    Projection,
    SizingWatch,
    Verdict,
    advice,
    job_gpu_indices,
    profile_seconds_per_epoch,
    profiler_verdict,
    project,
    sizing_status,
    stop_reason,
    summary_line,
    train_images,
)


def job(extra: str = "") -> Job:
    return parse_job(f'[train]\ndata = "/d/data.yaml"\nepochs = 100\n{extra}\n')


@dataclass
class Recorded:
    """A :class:`agent.watch.sampling.Sampler` that replays recorded readings, one per turn: GPU
    (util %, watts) per GPU, CPU cores the tree used during the turn, processes in the tree."""

    gpu: list[tuple[float | None, float | None]]
    cores: float
    procs: int
    limit_w: float = 700.0
    cpu_s: float = 0.0
    turns: list[float] = field(default_factory=list)

    def gpus(self) -> Sequence[GpuSample]:
        return [GpuSample(i, u, w, self.limit_w) for i, (u, w) in enumerate(self.gpu)]

    def tree_cpu_s(self) -> float | None:
        self.cpu_s += self.cores * 10.0  # one turn is 10 s
        return self.cpu_s

    def processes(self) -> int | None:
        return self.procs


def replay(
    sampler: Recorded, *, turns: int = 12, cpu_count: int = 16, watch: SizingWatch | None = None
) -> Verdict:
    w = watch or SizingWatch()
    for i in range(turns):
        w.observe(
            i * 10.0,
            sampler.gpus(),
            sampler.tree_cpu_s(),
            cpu_count,
            processes=sampler.processes(),
        )
    return w.verdict()


def test_gpu_bound_when_the_card_is_saturated() -> None:
    v = replay(Recorded(gpu=[(96.0, 620.0)], cores=2.0, procs=9))
    assert v.bound == "gpu"
    assert v.gpu_util == pytest.approx(96.0)
    assert v.cpu_busy == pytest.approx(2.0)
    assert not v.wrong_box
    assert "GPU 96 % at 620 W of 700 W" in v.detail


def test_dataloader_bound_when_the_cpu_workers_are_saturated() -> None:
    v = replay(Recorded(gpu=[(38.0, 210.0)], cores=15.6, procs=17))
    assert v.bound == "dataloader"
    assert v.wrong_box
    assert "16/16 CPUs busy" in v.detail
    # Every CPU of the box is busy: more workers cannot help.
    assert "more workers cannot help" in advice(v, job("workers = 16"))


def test_dataloader_bound_with_cpus_to_spare_suggests_more_workers() -> None:
    # workers=4: five processes, each at a full core, on a 16-CPU box.
    v = replay(Recorded(gpu=[(30.0, 200.0)], cores=4.8, procs=5))
    assert v.bound == "dataloader"
    assert advice(v, job("workers = 4")) == "try workers=8 or cache=ram, or a cheaper GPU"


def test_launch_bound_when_the_card_is_underused_with_cpu_to_spare() -> None:
    v = replay(Recorded(gpu=[(41.0, 150.0)], cores=1.3, procs=9))
    assert v.bound == "host / launch"
    assert v.wrong_box
    assert advice(v, job("batch = 16")).startswith("try batch=32 or a cheaper GPU")


def test_idle_gpu() -> None:
    v = replay(Recorded(gpu=[(0.0, 80.0)], cores=0.02, procs=3))
    assert v.bound == "idle gpu"
    assert "nothing runs on the card" in v.detail


def test_idle_gpu_with_a_busy_cpu_asks_whether_it_trains_on_the_cpu() -> None:
    v = replay(Recorded(gpu=[(1.0, 80.0)], cores=12.0, procs=13))
    assert v.bound == "idle gpu"
    assert "training on the CPU" in v.detail
    assert "train.device" in advice(v, job('device = "cpu"'))


def test_no_gpu_reading_is_unknown_not_a_guess() -> None:
    v = replay(Recorded(gpu=[], cores=4.0, procs=5))
    assert v.bound == "unknown"
    assert "no GPU reading" in v.detail
    assert not v.wrong_box


def test_too_few_samples_is_unknown() -> None:
    v = replay(Recorded(gpu=[(99.0, 650.0)], cores=1.0, procs=2), turns=3)
    assert v.bound == "unknown"
    assert "not enough samples" in v.detail


def test_only_the_jobs_gpus_count() -> None:
    # GPU 1 sits idle on an 2-GPU box: a job on GPU 0 is still GPU bound.
    w = SizingWatch(gpu_indices=job_gpu_indices(job('device = "0"')))
    v = replay(Recorded(gpu=[(95.0, 600.0), (0.0, 70.0)], cores=2.0, procs=9), watch=w)
    assert v.bound == "gpu"
    assert v.gpu_util == pytest.approx(95.0)


def test_old_samples_leave_the_window() -> None:
    w = SizingWatch(window_s=100.0)
    starting = Recorded(gpu=[(0.0, 80.0)], cores=0.0, procs=2)
    for i in range(20):  # start-up: an idle card
        w.observe(i * 10.0, starting.gpus(), starting.tree_cpu_s(), 16, processes=2)
    busy = Recorded(gpu=[(97.0, 640.0)], cores=2.0, procs=9, cpu_s=starting.cpu_s)
    for i in range(20, 40):
        w.observe(i * 10.0, busy.gpus(), busy.tree_cpu_s(), 16, processes=9)
    assert w.verdict().bound == "gpu"


def test_seconds_per_epoch_leaves_out_the_first_epoch() -> None:
    w = SizingWatch()

    def status(done: int, last: float) -> RunStatus:
        return RunStatus.from_dict(
            {
                "state": "running",
                "completed_epochs": done,
                "total_epochs": 100,
                "epoch_seconds": last,
                "mean_epoch_seconds": 999.0,
            }
        )

    w.observe(0.0, [], None, 16, status(1, 400.0))
    assert w.seconds_per_epoch() == pytest.approx(400.0)  # the only one so far
    w.observe(10.0, [], None, 16, status(1, 400.0))  # the same epoch seen again
    w.observe(20.0, [], None, 16, status(2, 250.0))
    w.observe(30.0, [], None, 16, status(3, 270.0))
    assert w.seconds_per_epoch() == pytest.approx(260.0)
    assert w.completed_epochs == 3 and w.total_epochs == 100


def test_tree_cpu_counts_a_real_busy_child_and_never_goes_down() -> None:
    # The child burns 0.3 s of CPU, says so, then waits to be told to exit.
    code = (
        "import sys, time\nt = time.process_time()\n"
        "while time.process_time() - t < 0.3: pass\nprint('done', flush=True)\nsys.stdin.read()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == b"done"
        counter = TreeCpu()
        first = counter.total([proc.pid])
        assert first >= 0.25
        assert counter.processes == 1
        proc.stdin.close()
        proc.wait(timeout=60)
        # The child is gone: its CPU time stays counted, the total does not drop.
        assert counter.total([proc.pid]) == first


# ----------------------------------------------------------------------------- projection


def test_projection_hand_computed() -> None:
    # 100 epochs of 259.2 s = 25,920 s = 7.2 h; 99 to go at $3.4828/h after $0.50 spent:
    # 99 x 259.2 = 25,660.8 s = 7.128 h; 7.128 x 3.4828 = 24.8253984; + 0.50 = 25.3253984.
    p = project(100, 1, 259.2, 3.4828, 0.5)
    assert p.total_s == pytest.approx(25920.0)
    assert p.remaining_s == pytest.approx(25660.8)
    assert p.total_usd == pytest.approx(25.3253984)


def test_projection_without_a_price_has_no_cost() -> None:
    p = project(10, 4, 60.0, None)
    assert (p.total_s, p.remaining_s, p.total_usd) == (600.0, 360.0, None)


def test_projection_of_a_finished_job_costs_what_was_spent() -> None:
    assert project(10, 12, 60.0, 2.0, 3.0).total_usd == pytest.approx(3.0)


def test_profile_speed_to_seconds_per_epoch() -> None:
    # 118,287 COCO train images at 650 img/s: 181.98 s per epoch (training steps only).
    assert profile_seconds_per_epoch(650.0, 118287) == pytest.approx(181.98, abs=0.01)
    assert profile_seconds_per_epoch(0.0, 100) is None
    report = {"stats": {"splits": {"train": {"images": 8}}}}
    assert train_images(report) == 8
    assert train_images({"stats": {}}) is None


# ---------------------------------------------------------------------------------- words


def test_summary_line_matches_the_issue() -> None:
    v = Verdict("dataloader", "", 38.0, 16.0, 259.2, cpu_count=16)
    line = summary_line(v, project(100, 1, 259.2, 3.4828, 0.5), job("workers = 16"))
    assert line.startswith(
        "this job: ~7.2 h, ~$25 on this box; "
        "verdict: dataloader bound (GPU 38 %, 16/16 CPUs busy): "
    )


def test_summary_line_without_a_price() -> None:
    v = Verdict("gpu", "", 97.0, 2.0, 60.0, cpu_count=16)
    line = summary_line(v, project(30, 1, 60.0, None), job(), price_known=False)
    assert line == (
        "this job: ~30m (no price: cost unknown) on this box; verdict: gpu bound "
        "(GPU 97 %, 2/16 CPUs busy): the box fits the job: only a faster GPU would shorten it"
    )


def test_profiler_verdict_maps_libreyolo_words() -> None:
    doc = {"bound": "compute", "gpu_util": 0.91, "img_per_s": 812.5, "bound_why": "saturated"}
    v = profiler_verdict(doc)
    assert (v.bound, v.source) == ("gpu", "profiler")
    assert v.gpu_util == pytest.approx(91.0)
    assert "812.5 img/s" in v.detail
    assert profiler_verdict({"bound": "memory-pressure"}).bound == "unknown"
    assert profiler_verdict({"bound": "host / launch", "gpu_util": 0.2}).wrong_box


def test_stop_reason_only_with_stop() -> None:
    wrong = Verdict("host / launch", "", 30.0, 1.0, None, source="profiler")
    over = Projection(10 * 3600.0, 9 * 3600.0, 60.0)
    assert stop_reason(wrong, over, ProfileSection(on_verdict="warn"), 50.0) is None
    stop = ProfileSection(on_verdict="stop")
    budget = stop_reason(wrong, over, stop, 50.0)
    assert budget is not None and "over limits.budget_usd $50.00" in budget
    why = stop_reason(wrong, Projection(1.0, 1.0, 5.0), stop, 50.0)
    assert why is not None and why.startswith("wrong box: host / launch bound (GPU 30 %")
    unknown = Verdict("unknown", "", None, None, None)
    assert stop_reason(unknown, None, stop, None) is None
    fits = Verdict("gpu", "", 95.0, 2.0, None)
    assert stop_reason(fits, Projection(1.0, 1.0, 5.0), stop, 50.0) is None


def test_status_key_shape() -> None:
    v = Verdict("gpu", "d", 95.0, 2.0, 60.0)
    doc = sizing_status(v, project(10, 1, 60.0, 2.0), {"ran": False, "message": "cannot profile"})
    assert set(doc) == {"verdict", "projection", "profile"}
    assert doc["verdict"]["bound"] == "gpu" and doc["verdict"]["wrong_box"] is False
    assert doc["projection"]["total_s"] == 600.0
    assert sizing_status(None, None, None) == {"verdict": None, "projection": None, "profile": None}


@pytest.mark.parametrize(
    ("device", "expected"),
    [("0", (0,)), ("0,1", (0, 1)), ("cuda:1", (1,)), ("cpu", ()), (None, None)],
)
def test_job_gpu_indices(device: str | None, expected: tuple[int, ...] | None) -> None:
    extra = "" if device is None else f'device = "{device}"'
    assert job_gpu_indices(job(extra)) == expected
