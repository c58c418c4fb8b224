"""The host side: disk, ``HF_HOME``'s volume, ``/dev/shm``, RAM and CPUs (container limits count).

These checks take milliseconds and need no torch. Estimates, and where their numbers come from:

* **Disk** (``disk.<role>``): every location must have ``(what it will hold) x 1.3`` free (the
  30 % headroom rule); locations on one file system add up. The dataset archive lands in
  ``HF_HOME``'s cache (its size is read from the Hub's file metadata) and is unpacked into
  ``dataset.dest`` (estimated as the archive size: x1.0 for ``.tar``, x1.2 for compressed
  archives, whose images are already compressed). Checkpoints land in ``job.runs_dir``:
  ``last.pt``, ``best.pt``, one ``epoch_N.pt`` every ``save_period`` epochs (LibreYOLO keeps them
  all; defaults 300 epochs, every 10) and two snapshots in flight for the uploader. One checkpoint
  is ``parameters x 16 bytes`` (fp32 weights twice, training copy and EMA, plus the optimizer
  state; measured 12.6 B/parameter for yolox-n with SGD on LibreYOLO 1.6.0, AdamW adds 4);
  parameters are guessed from the model's size letter (:data:`MODEL_PARAMS_M`).
* **/dev/shm** (``shm``): DataLoader workers pass batches through it; below 1 GiB it fails when
  workers or several GPUs use it (Docker's default is 64 MB). It warns below the batches in
  flight: ``GPUs x workers x 2 (prefetch) x per-GPU batch x 3 x imgsz^2 x 4 bytes``.
* **RAM** and **CPUs**: about 2 GiB per GPU process plus 0.5 GiB per DataLoader worker, and one
  CPU per process and per worker; container (cgroup) limits count.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from agent.config.model import Env
from agent.preflight.plan import (
    AUTO_BATCH_PER_GPU,
    DEFAULT_BATCH,
    DEFAULT_EPOCHS,
    DEFAULT_SAVE_PERIOD,
    DEFAULT_WORKERS,
    Plan,
)
from agent.preflight.report import FAIL, PASS, WARN, Check, GiB, make_check
from agent.util.disk import disk_free, nearest_existing
from agent.util.text import format_bytes

#: The 30 % headroom rule: a location needs what it will hold times this.
DISK_HEADROOM = 1.3
#: Millions of parameters guessed from a model's size letter (LibreYOLO families, rounded up).
MODEL_PARAMS_M = {"n": 3, "t": 3, "s": 10, "m": 26, "c": 26, "l": 55, "e": 60, "x": 100}
#: ... and for a model whose size cannot be read from its name.
UNKNOWN_MODEL_PARAMS_M = 60
#: Bytes one checkpoint takes per parameter (see the module docstring).
CHECKPOINT_BYTES_PER_PARAM = 16
SHM_MIN_BYTES = 1 * GiB
RAM_PER_RANK_BYTES = 2 * GiB
RAM_PER_WORKER_BYTES = GiB // 2


def disk_checks(plan: Plan, env: Env, dataset_bytes: int | None) -> list[Check]:
    """Disk for every location the job writes to and ``HF_HOME``'s volume: known as soon as the
    Hub gave the dataset's size, before the GPU probe ends, so the dataset download can start
    while the probe runs (measured before the download takes any of the room)."""
    hf_home = default_hf_home(env)
    ckpt_bytes, ckpt_note = checkpoint_estimate(plan.model, plan.epochs, plan.save_period)
    unknown = None
    if plan.dataset is not None and dataset_bytes is None:
        unknown = "dataset size unknown"
    needs = disk_needs(
        runs_dir=plan.runs_dir,
        checkpoints=(ckpt_bytes, ckpt_note),
        hf_home=hf_home if plan.dataset is not None else None,
        dataset_dest=plan.dataset.dest if plan.dataset is not None else None,
        archive_name=plan.dataset.file if plan.dataset is not None else "",
        archive_bytes=dataset_bytes,
        unknown=unknown,
    )
    mounts = read_mounts()
    usage: dict[Path, FsUsage] = {}
    unmeasured = []
    for need in needs:
        try:
            usage[need.path] = fs_usage(need.path, mounts)
        except OSError as exc:
            unmeasured.append(
                make_check(
                    f"disk.{need.role}",
                    WARN,
                    f"cannot measure {need.path}: {exc}",
                    "check that the agent can read the path (permissions, mount)",
                )
            )
    checks = evaluate_disk([n for n in needs if n.path in usage], usage, strict=not plan.generic)
    checks += unmeasured
    checks.append(evaluate_hf_home(hf_home, mounts, resolved=nearest_existing(hf_home).resolve()))
    return checks


def machine_checks(plan: Plan, ranks: int) -> list[Check]:
    """shm, RAM and CPUs for ``ranks`` training processes (one per GPU used)."""
    checks: list[Check] = []
    try:
        shm: int | None = shutil.disk_usage("/dev/shm").total
    except OSError:
        shm = None
    checks.append(
        evaluate_shm(
            shm,
            workers=plan.workers_assumed,
            ranks=ranks,
            batch=plan.batch,
            imgsz=plan.imgsz,
        )
    )
    limits = cgroup_limits()
    vm = psutil.virtual_memory()
    checks.append(
        evaluate_ram(
            vm.available,
            vm.total,
            workers=plan.workers_assumed,
            ranks=ranks,
            limit=limits.memory_bytes,
        )
    )
    cpus = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    if limits.cpus is not None:
        cpus = min(cpus, limits.cpus)
    checks.append(evaluate_cpu(cpus, workers=plan.workers, ranks=ranks))
    return checks


def default_hf_home(env: Env) -> Path:
    """``HF_HOME`` as huggingface_hub resolves it: the env value, else ``~/.cache/huggingface``."""
    if env.hf_home is not None:
        return env.hf_home.expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "huggingface"


def checkpoint_estimate(
    model: str | None, epochs: int | None, save_period: int | None
) -> tuple[int, str]:
    """Bytes the run's checkpoints will take, and how that was worked out (module docstring)."""
    params_m = UNKNOWN_MODEL_PARAMS_M
    basis = "size unknown"
    if model:
        stem = re.sub(r"\.(pt|pth|yaml|yml)$", "", Path(model).name.lower())
        m = re.search(r"(?:^|[\d_-])([ntsmclex])$", stem)
        if m:
            params_m = MODEL_PARAMS_M[m.group(1)]
            basis = f"size '{m.group(1)}'"
    per = params_m * 1_000_000 * CHECKPOINT_BYTES_PER_PARAM
    epochs = epochs or DEFAULT_EPOCHS
    period = DEFAULT_SAVE_PERIOD if save_period is None else save_period
    snapshots = epochs // period if period > 0 else 0
    count = 2 + snapshots + 2
    note = (
        f"{count} checkpoints (last, best, {snapshots} epoch_N, 2 upload snapshots) x "
        f"~{format_bytes(per)} ({basis}, ~{params_m}M params x {CHECKPOINT_BYTES_PER_PARAM} B)"
    )
    return count * per, note


def unpack_factor(archive_name: str) -> float:
    """Unpacked size / archive size, estimated from the archive's kind (module docstring)."""
    name = archive_name.lower()
    return 1.0 if name.endswith(".tar") else 1.2


@dataclass(frozen=True)
class DiskNeed:
    """What one location will hold; the check is ``disk.<role>``."""

    role: str
    path: Path
    #: (what, bytes) pairs, e.g. ``("dataset archive", 4_000_000_000)``.
    parts: tuple[tuple[str, int], ...]
    #: Why part of the need could not be sized (then at most a warning, never a pass).
    unknown: str | None = None
    #: How an estimate was worked out (goes into the check's details).
    note: str | None = None


def disk_needs(
    *,
    runs_dir: Path,
    checkpoints: tuple[int, str],
    hf_home: Path | None,
    dataset_dest: Path | None,
    archive_name: str,
    archive_bytes: int | None,
    unknown: str | None,
) -> list[DiskNeed]:
    """The locations a job writes to, and what each will hold."""
    needs = []
    if hf_home is not None:
        parts = (("dataset archive", archive_bytes),) if archive_bytes is not None else ()
        needs.append(DiskNeed("hf_home", hf_home, parts, unknown))
    if dataset_dest is not None:
        if archive_bytes is not None:
            factor = unpack_factor(archive_name)
            what = f"unpacked (estimate: archive x{factor:g})"
            parts = ((what, int(archive_bytes * factor)),)
        else:
            parts = ()
        needs.append(DiskNeed("dataset", dataset_dest, parts, unknown))
    ckpt_bytes, note = checkpoints
    needs.append(DiskNeed("runs", runs_dir, (("checkpoints (estimate)", ckpt_bytes),), note=note))
    return needs


@dataclass(frozen=True)
class FsUsage:
    """The file system a path lives on: locations with the same ``device`` share ``free``."""

    device: int
    mount: str
    free: int


@dataclass(frozen=True)
class MountInfo:
    """One line of the mount table."""

    mountpoint: str
    fstype: str
    device: str = ""


def read_mounts() -> list[MountInfo]:
    """The mount table (``psutil.disk_partitions(all=True)``)."""
    try:
        parts = psutil.disk_partitions(all=True)
    except OSError:
        return []
    return [MountInfo(p.mountpoint, p.fstype, p.device) for p in parts]


def mount_of(path: Path, mounts: Sequence[MountInfo]) -> MountInfo | None:
    """The mount ``path`` lives on (the longest mount point above it)."""
    best: MountInfo | None = None
    text = str(path)
    for m in mounts:
        mp = m.mountpoint.rstrip("/") or "/"
        if (text == mp or text.startswith(mp.rstrip("/") + "/")) and (
            best is None or len(mp) >= len(best.mountpoint.rstrip("/") or "/")
        ):
            best = m
    return best


def fs_usage(path: Path, mounts: Sequence[MountInfo] = ()) -> FsUsage:
    """Free space where ``path`` is (or will be created: its nearest existing parent)."""
    p = nearest_existing(path).resolve()
    st = os.stat(p)
    m = mount_of(p, mounts)
    return FsUsage(st.st_dev, m.mountpoint if m else str(p), disk_free(p))


def evaluate_disk(
    needs: Sequence[DiskNeed], usage: Mapping[Path, FsUsage], *, strict: bool = True
) -> list[Check]:
    """One check per location: free >= (everything on its file system) x 1.3.

    ``strict=False`` (no job, so the needs are a guess) turns failures into warnings.
    """
    checks = []
    for need in needs:
        fs = usage[need.path]
        sharing = [n for n in needs if usage[n.path].device == fs.device]
        total = sum(b for n in sharing for _, b in n.parts)
        required = int(total * DISK_HEADROOM)
        others = [f"disk.{n.role}" for n in sharing if n is not need]
        unknown = next((n.unknown for n in sharing if n.unknown), None)
        parts = " + ".join(f"{what} {format_bytes(b)}" for n in sharing for what, b in n.parts)
        value = (
            f"{format_bytes(fs.free)} free on {fs.mount}; needs {format_bytes(required)} = "
            f"({parts or 'nothing known'}) x {DISK_HEADROOM:g}"
        )
        if others:
            value += f" (shared with {', '.join(others)})"
        if unknown:
            value += f"; {unknown}"
        details = {
            "path": str(need.path),
            "mount": fs.mount,
            "free_bytes": fs.free,
            "required_bytes": required,
            "parts": {what: b for n in sharing for what, b in n.parts},
            "shared_with": others,
            "estimates": [n.note for n in sharing if n.note],
        }
        if fs.free < required:
            status = FAIL if strict else WARN
            fix = (
                f"free {format_bytes(required - fs.free)} on {fs.mount}, put the {need.role} "
                "directory on a bigger volume, or rent a bigger disk (data + checkpoints + 30 %); "
                "a larger train.save_period keeps fewer epoch_N.pt"
            )
        elif unknown:
            status, fix = WARN, "the estimate misses the dataset: see dataset.remote"
        else:
            status, fix = PASS, None
        checks.append(make_check(f"disk.{need.role}", status, value, fix, **details))
    return checks


#: File systems that are never a persistent data volume.
_NOT_VOLUMES = frozenset(
    {
        "autofs", "aufs", "binfmt_misc", "bpf", "cgroup", "cgroup2", "configfs", "debugfs",
        "devpts", "devtmpfs", "efivarfs", "fuse-overlayfs", "fuse.lxcfs", "fusectl", "hugetlbfs",
        "mqueue", "nfsd", "nsfs", "overlay", "proc", "pstore", "ramfs", "rpc_pipefs",
        "securityfs", "selinuxfs", "squashfs", "sysfs", "tmpfs", "tracefs",
    }
)  # fmt: skip
_SYSTEM_PREFIXES = (
    "/proc", "/sys", "/dev", "/run", "/var/run", "/etc", "/boot", "/usr", "/lib", "/lib64",
    "/bin", "/sbin", "/snap", "/var/lib/docker", "/var/lib/containerd",
)  # fmt: skip
_OVERLAYS = frozenset({"overlay", "aufs", "fuse-overlayfs"})


def find_volumes(
    mounts: Sequence[MountInfo], is_dir: Callable[[str], bool] = os.path.isdir
) -> list[MountInfo]:
    """Mounts that look like persistent data volumes (``/workspace``, ``/mnt/data``...).

    Not the root, not pseudo or overlay file systems, not system directories, and not the single
    files Docker bind-mounts (``/etc/hosts``, the NVIDIA libraries).
    """
    out = []
    seen = set()
    for m in mounts:
        mp = m.mountpoint
        if mp == "/" or mp in seen or m.fstype in _NOT_VOLUMES:
            continue
        if any(mp == p or mp.startswith(p + "/") for p in _SYSTEM_PREFIXES):
            continue
        if not is_dir(mp):
            continue
        seen.add(mp)
        out.append(m)
    return out


def evaluate_hf_home(
    hf_home: Path,
    mounts: Sequence[MountInfo],
    *,
    resolved: Path | None = None,
    is_dir: Callable[[str], bool] = os.path.isdir,
) -> Check:
    """Warn when ``HF_HOME`` sits on the container's ephemeral overlay while a volume exists.

    ``resolved`` is where ``hf_home`` really is (symlinks resolved, or its nearest existing
    parent); this function touches the file system only through ``is_dir`` on mount points.
    """
    mount = mount_of(resolved or hf_home, mounts)
    volumes = find_volumes(mounts, is_dir)
    fstype = mount.fstype if mount else "unknown"
    where = f"{hf_home} is on {mount.mountpoint if mount else '?'} ({fstype})"
    details = {
        "hf_home": str(hf_home),
        "mount": mount.mountpoint if mount else None,
        "fstype": fstype,
        "volumes": [v.mountpoint for v in volumes],
    }
    if mount is not None and mount.fstype in _OVERLAYS and volumes:
        vol = volumes[0].mountpoint
        return make_check(
            "hf_home.volume",
            WARN,
            f"{where}: the container's ephemeral layer, while {vol} is a volume",
            f"export HF_HOME={vol.rstrip('/')}/huggingface so downloads survive a restart",
            **details,
        )
    if mount is not None and mount in volumes:
        return make_check("hf_home.volume", PASS, f"{where}, a persistent volume", **details)
    note = "; no separate volume mounted" if not volumes else ""
    return make_check("hf_home.volume", PASS, where + note, **details)


def evaluate_shm(
    total_bytes: int | None,
    *,
    workers: int,
    ranks: int,
    batch: int | None,
    imgsz: int,
) -> Check:
    """``/dev/shm`` against what DataLoader workers (and NCCL, with several GPUs) put there."""
    if batch is None:
        per_rank = math.ceil(DEFAULT_BATCH / ranks)
    elif batch <= 0:  # batch=-1: LibreYOLO picks the largest that fits
        per_rank = AUTO_BATCH_PER_GPU
    else:
        per_rank = math.ceil(batch / ranks)
    batch_bytes = per_rank * 3 * imgsz * imgsz * 4
    in_flight = ranks * workers * 2 * batch_bytes
    needed = max(SHM_MIN_BYTES, in_flight)
    uses_shm = workers > 0 or ranks > 1
    details = {
        "total_bytes": total_bytes,
        "estimated_need_bytes": needed,
        "workers": workers,
        "ranks": ranks,
        "batch_per_gpu": per_rank,
        "imgsz": imgsz,
    }
    fix = "restart the container with --shm-size=16g (or --ipc=host)"
    if total_bytes is None:
        return make_check("shm", FAIL if uses_shm else WARN, "/dev/shm is missing", fix, **details)
    value = f"{format_bytes(total_bytes)} at /dev/shm"
    if total_bytes < SHM_MIN_BYTES:
        if uses_shm:
            who = f"{workers} DataLoader workers" if workers else "NCCL"
            return make_check(
                "shm",
                FAIL,
                f"{value}: too small for {who} (Docker's default is 64 MB)",
                fix + ", or train.workers=0 (slow)",
                **details,
            )
        return make_check("shm", WARN, f"{value}: small (fine with workers=0)", fix, **details)
    if total_bytes < needed:
        return make_check(
            "shm",
            WARN,
            f"{value}: may be short for {ranks} x {workers} workers x 2 batches of "
            f"{per_rank} x {imgsz}px (~{format_bytes(needed)})",
            fix,
            **details,
        )
    return make_check("shm", PASS, value, **details)


def evaluate_ram(
    available: int, total: int, *, workers: int, ranks: int, limit: int | None = None
) -> Check:
    """Available RAM (and the container's limit) against the training processes' needs."""
    effective = min(available, limit) if limit is not None else available
    floor = ranks * RAM_PER_RANK_BYTES
    needed = ranks * (RAM_PER_RANK_BYTES + workers * RAM_PER_WORKER_BYTES)
    details = {
        "available_bytes": available,
        "total_bytes": total,
        "cgroup_limit_bytes": limit,
        "estimated_need_bytes": needed,
    }
    value = f"{format_bytes(effective)} available of {format_bytes(total)}"
    if limit is not None and limit < total:
        value += f" (container limit {format_bytes(limit)})"
    if effective < floor:
        return make_check(
            "ram",
            FAIL,
            f"{value}: not enough for {ranks} training process{'es' * (ranks != 1)}",
            "stop what uses the memory, or rent a box with more RAM",
            **details,
        )
    if effective < needed:
        return make_check(
            "ram",
            WARN,
            f"{value}: tight for {ranks} x ({workers} workers) (~{format_bytes(needed)})",
            "lower train.workers, or set train.cache=false/disk",
            **details,
        )
    return make_check("ram", PASS, value, **details)


def evaluate_cpu(cpus: float, *, workers: int | None, ranks: int) -> Check:
    """CPUs against one per training process plus one per DataLoader worker."""
    w = DEFAULT_WORKERS if workers is None else workers
    needed = ranks * (w + 1)
    shown = f"{cpus:g} CPU{'s' * (cpus != 1)}"
    wtext = f"{w} workers" + (", LibreYOLO's default" if workers is None else "")
    details = {"cpus": cpus, "workers": w, "ranks": ranks, "needed": needed}
    if cpus < needed:
        fit = max(0, int(cpus // ranks) - 1)
        return make_check(
            "cpu",
            WARN,
            f"{shown}; training wants {needed}: {ranks} process{'es' * (ranks != 1)} x "
            f"(1 + {wtext})",
            f"set train.workers={fit} to avoid oversubscribing the CPUs",
            **details,
        )
    return make_check(
        "cpu", PASS, f"{shown}; training wants {needed}: {ranks} x (1 + {wtext})", **details
    )


@dataclass(frozen=True)
class CgroupLimits:
    """The container's limits (None: unlimited or unknown)."""

    cpus: float | None = None
    memory_bytes: int | None = None


def cgroup_limits(
    root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")
) -> CgroupLimits:
    """CPU quota and memory limit of this process's cgroup and its ancestors (v2 and v1)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    v2 = "/"
    v1: dict[str, str] = {}
    for line in lines:
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if hid == "0" and not ctrls:
            v2 = path or "/"
        for c in ctrls.split(","):
            if c:
                v1[c] = path
    cpus: list[float] = []
    mems: list[int] = []

    def read(p: Path) -> str | None:
        try:
            return p.read_text().strip()
        except OSError:
            return None

    for d in _cgroup_dirs(root, v2):
        cpu_max = read(d / "cpu.max")
        if cpu_max:
            quota, _, period = cpu_max.partition(" ")
            if quota.isdigit() and period.isdigit() and int(period) > 0:
                cpus.append(int(quota) / int(period))
        mem = read(d / "memory.max")
        if mem and mem.isdigit():
            mems.append(int(mem))
    for name in ("cpu", "cpu,cpuacct"):
        for d in _cgroup_dirs(root / name, v1.get("cpu", "/")):
            quota_s, period_s = read(d / "cpu.cfs_quota_us"), read(d / "cpu.cfs_period_us")
            # cfs_quota_us is -1 when there is no quota: isdigit() refuses it.
            if quota_s and period_s and quota_s.isdigit() and period_s.isdigit():
                cpus.append(int(quota_s) / max(1, int(period_s)))
    for d in _cgroup_dirs(root / "memory", v1.get("memory", "/")):
        mem = read(d / "memory.limit_in_bytes")
        if mem and mem.isdigit() and int(mem) < 2**60:  # v1 says "unlimited" with a huge number
            mems.append(int(mem))
    return CgroupLimits(min(cpus) if cpus else None, min(mems) if mems else None)


def _cgroup_dirs(base: Path, path: str) -> Iterable[Path]:
    """``base/path`` and its parents up to ``base``, those that exist."""
    seen = set()
    d = base / path.strip("/")
    while True:
        if d not in seen and d.is_dir():
            seen.add(d)
            yield d
        if d == base or base not in d.parents:
            break
        d = d.parent
