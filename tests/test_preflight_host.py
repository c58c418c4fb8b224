"""The host side (agent/preflight/host.py): disk, HF_HOME's volume, /dev/shm, RAM, CPUs, cgroups."""

from __future__ import annotations

import os
from pathlib import Path

from agent import preflight as pf
from agent.preflight import FAIL, PASS, WARN, DiskNeed, FsUsage, MountInfo


def test_checkpoint_estimate_reads_the_size_letter() -> None:
    small, note = pf.checkpoint_estimate("LibreYOLO9s.pt", 100, 10)
    assert small == (2 + 10 + 2) * 10_000_000 * pf.CHECKPOINT_BYTES_PER_PARAM
    assert "size 's'" in note and "10 epoch_N" in note
    nano, _ = pf.checkpoint_estimate("yolox-n", 100, 0)
    assert nano == 4 * 3_000_000 * pf.CHECKPOINT_BYTES_PER_PARAM  # save_period=0: no epoch_N
    unknown, note = pf.checkpoint_estimate("runs/x/weights/last.pt", None, None)
    assert "size unknown" in note
    assert unknown == (4 + pf.DEFAULT_EPOCHS // 10) * 60_000_000 * pf.CHECKPOINT_BYTES_PER_PARAM


def _needs(archive: int | None, ckpt: int, unknown: str | None = None) -> list[DiskNeed]:
    return pf.disk_needs(
        runs_dir=Path("/r"),
        checkpoints=(ckpt, "note"),
        hf_home=Path("/h"),
        dataset_dest=Path("/d"),
        archive_name="ds.tar",
        archive_bytes=archive,
        unknown=unknown,
    )


def test_disk_needs_add_up_on_a_shared_file_system_with_30_percent_headroom() -> None:
    gib = pf.GiB
    needs = _needs(archive=10 * gib, ckpt=5 * gib)  # 10 archive + 10 unpacked + 5 = 25 GiB
    one_fs = {p: FsUsage(1, "/", int(25 * gib * 1.3)) for p in (Path("/r"), Path("/h"), Path("/d"))}
    assert {c.status for c in pf.evaluate_disk(needs, one_fs)} == {PASS}
    short = {p: FsUsage(1, "/", int(25 * gib * 1.3) - 1) for p in one_fs}
    checks = pf.evaluate_disk(needs, short)
    assert [c.name for c in checks] == ["disk.hf_home", "disk.dataset", "disk.runs"]
    assert {c.status for c in checks} == {FAIL}
    assert "shared with disk.dataset, disk.runs" in checks[0].value
    assert checks[2].details["required_bytes"] == int(25 * gib * 1.3)
    # On separate file systems each location only needs its own share.
    split = {
        Path("/h"): FsUsage(1, "/", 14 * gib),
        Path("/d"): FsUsage(2, "/data", 12 * gib),
        Path("/r"): FsUsage(3, "/runs", 6 * gib),
    }
    statuses = {c.name: c.status for c in pf.evaluate_disk(needs, split)}
    assert statuses == {"disk.hf_home": PASS, "disk.dataset": FAIL, "disk.runs": FAIL}


def test_disk_with_unknown_dataset_size_warns_and_guesses_only_warn() -> None:
    needs = _needs(archive=None, ckpt=pf.GiB, unknown="dataset size unknown (Hub down)")
    big = {p: FsUsage(1, "/", 100 * pf.GiB) for p in (Path("/r"), Path("/h"), Path("/d"))}
    checks = pf.evaluate_disk(needs, big)
    assert {c.status for c in checks} == {WARN}
    assert "dataset size unknown" in checks[0].value
    tiny = {p: FsUsage(1, "/", 1) for p in big}
    assert {c.status for c in pf.evaluate_disk(needs, tiny, strict=False)} == {WARN}


def test_disk_check_on_a_real_directory(tmp_path: Path) -> None:
    where = tmp_path / "not" / "yet" / "created"
    usage = pf.fs_usage(where)
    assert usage.free > 0 and usage.device == os.stat(tmp_path).st_dev
    fits = [DiskNeed("runs", where, (("checkpoints", 1),))]
    huge = [DiskNeed("runs", where, (("checkpoints", usage.free * 2),))]
    assert pf.evaluate_disk(fits, {where: usage})[0].status == PASS
    failed = pf.evaluate_disk(huge, {where: usage})[0]
    assert failed.status == FAIL and failed.fix is not None and "30 %" in failed.fix


OVERLAY_BOX = [
    MountInfo("/", "overlay", "overlay"),
    MountInfo("/proc", "proc", "proc"),
    MountInfo("/dev/shm", "tmpfs", "shm"),
    MountInfo("/etc/hosts", "ext4", "/dev/nvme0n1p1"),  # Docker's single-file bind mount
    MountInfo("/usr/bin/nvidia-smi", "ext4", "/dev/nvme0n1p1"),
    MountInfo("/workspace", "ext4", "/dev/nvme1n1"),
]


def test_hf_home_on_overlay_while_a_volume_exists_warns() -> None:
    def is_dir(path: str) -> bool:
        return path == "/workspace"

    warn = pf.evaluate_hf_home(Path("/root/.cache/huggingface"), OVERLAY_BOX, is_dir=is_dir)
    assert warn.status == WARN and "/workspace is a volume" in warn.value
    assert warn.fix == "export HF_HOME=/workspace/huggingface so downloads survive a restart"
    on_volume = pf.evaluate_hf_home(Path("/workspace/hf"), OVERLAY_BOX, is_dir=is_dir)
    assert on_volume.status == PASS and "persistent volume" in on_volume.value
    no_volume = [m for m in OVERLAY_BOX if m.mountpoint != "/workspace"]
    alone = pf.evaluate_hf_home(Path("/root/.cache/huggingface"), no_volume, is_dir=is_dir)
    assert alone.status == PASS and "no separate volume" in alone.value
    # The file bind mounts above are not volumes even where they are directories.
    assert [m.mountpoint for m in pf.find_volumes(OVERLAY_BOX, lambda p: True)] == ["/workspace"]


def test_shm_docker_default_fails_with_workers() -> None:
    docker = 64 * pf.MiB
    failed = pf.evaluate_shm(docker, workers=8, ranks=1, batch=16, imgsz=640)
    assert failed.status == FAIL and "64.0 MiB" in failed.value
    assert failed.fix is not None and "--shm-size" in failed.fix
    assert pf.evaluate_shm(docker, workers=0, ranks=1, batch=16, imgsz=640).status == WARN
    nccl = pf.evaluate_shm(docker, workers=0, ranks=2, batch=16, imgsz=640)
    assert nccl.status == FAIL and "NCCL" in nccl.value
    assert pf.evaluate_shm(None, workers=4, ranks=1, batch=16, imgsz=640).status == FAIL
    # 8 GPUs x 8 workers x 2 batches of 64 images at 640 px: about 60 GiB in flight.
    tight = pf.evaluate_shm(2 * pf.GiB, workers=8, ranks=8, batch=512, imgsz=640)
    assert tight.status == WARN and "may be short" in tight.value
    assert pf.evaluate_shm(64 * pf.GiB, workers=8, ranks=1, batch=-1, imgsz=640).status == PASS


def test_ram_and_cpu_verdicts() -> None:
    gib = pf.GiB
    assert pf.evaluate_ram(64 * gib, 128 * gib, workers=8, ranks=1).status == PASS
    assert pf.evaluate_ram(5 * gib, 128 * gib, workers=8, ranks=1).status == WARN
    failed = pf.evaluate_ram(64 * gib, 128 * gib, workers=8, ranks=4, limit=6 * gib)
    assert failed.status == FAIL and "container limit 6.0 GiB" in failed.value
    assert pf.evaluate_cpu(16, workers=8, ranks=1).status == PASS
    warn = pf.evaluate_cpu(16, workers=8, ranks=4)
    assert (
        warn.status == WARN and warn.fix == "set train.workers=3 to avoid oversubscribing the CPUs"
    )
    assert "LibreYOLO's default" in pf.evaluate_cpu(4, workers=None, ranks=1).value


def test_cgroup_limits_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "kubepods" / "pod1").mkdir(parents=True)
    (v2 / "kubepods" / "cpu.max").write_text("800000 100000\n")
    (v2 / "kubepods" / "pod1" / "cpu.max").write_text("max 100000\n")
    (v2 / "kubepods" / "pod1" / "memory.max").write_text(f"{8 * pf.GiB}\n")
    (tmp_path / "self-v2").write_text("0::/kubepods/pod1\n")
    limits = pf.cgroup_limits(v2, tmp_path / "self-v2")
    assert limits == pf.CgroupLimits(cpus=8.0, memory_bytes=8 * pf.GiB)

    v1 = tmp_path / "v1"
    (v1 / "cpu" / "docker").mkdir(parents=True)
    (v1 / "cpu" / "docker" / "cpu.cfs_quota_us").write_text("250000\n")
    (v1 / "cpu" / "docker" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "memory").mkdir()
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
    (tmp_path / "self-v1").write_text("4:memory:/docker\n3:cpu,cpuacct:/docker\n0::/\n")
    assert pf.cgroup_limits(v1, tmp_path / "self-v1") == pf.CgroupLimits(cpus=2.5)
    assert pf.cgroup_limits(tmp_path / "none", tmp_path / "missing") == pf.CgroupLimits()
