"""The plan: what the checks expect, read once from the job (or the defaults when there is none).

``train.device`` is read the way LibreYOLO reads it (:func:`parse_device`); the training options
the estimates need (workers, batch, imgsz, model, epochs, save_period) fall back on LibreYOLO's
defaults when the job leaves them out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agent.config.model import DatasetSection, Job, JobSection, PreflightSection, TrainValue

#: LibreYOLO 1.6.0 training defaults the estimates fall back on.
DEFAULT_EPOCHS = 300
DEFAULT_SAVE_PERIOD = 10
DEFAULT_BATCH = 16
DEFAULT_IMGSZ = 640
#: LibreYOLO's DataLoader worker default is 4 or 8 depending on the family: assume the larger.
DEFAULT_WORKERS = 8
#: ``batch=-1`` lets LibreYOLO pick; assume this many images per GPU for the /dev/shm estimate.
AUTO_BATCH_PER_GPU = 64

#: How a job names its devices (:class:`DeviceSpec`).
DeviceKind = Literal["auto", "all", "cpu", "mps", "gpus", "invalid"]


@dataclass(frozen=True)
class DeviceSpec:
    """``train.device`` as LibreYOLO reads it (``parse_device_arg`` in LibreYOLO 1.6.0).

    ``kind`` is ``auto`` (unset, ``auto``, ``cuda``: one GPU, cuda:0, when there is one),
    ``all`` (no job: every visible GPU), ``cpu``, ``mps``, ``gpus`` (explicit indices) or
    ``invalid``.
    """

    kind: DeviceKind
    ids: tuple[int, ...] = ()
    text: str | None = None


def parse_device(value: TrainValue | None) -> DeviceSpec:
    """Read ``train.device``: ``0``, ``"0"``, ``"0,1"``, ``"cuda:1"``, ``"cpu"``, ``"auto"``."""
    text = None if value is None else str(value)
    if value is None:
        return DeviceSpec("auto")
    if isinstance(value, bool | float):
        return DeviceSpec("invalid", text=text)
    if isinstance(value, int):
        return (
            DeviceSpec("gpus", (value,), text) if value >= 0 else DeviceSpec("invalid", text=text)
        )
    s = value.strip().lower().strip("[]()")
    if s in ("", "auto", "cuda"):
        return DeviceSpec("auto", text=text)
    if s == "cpu":
        return DeviceSpec("cpu", text=text)
    if s == "mps":
        return DeviceSpec("mps", text=text)
    parts = [p.strip().removeprefix("cuda:") for p in s.split(",") if p.strip()]
    if parts and all(p.isdigit() for p in parts):
        ids = tuple(int(p) for p in parts)
        if len(set(ids)) == len(ids):
            return DeviceSpec("gpus", ids, text)
    return DeviceSpec("invalid", text=text)


@dataclass(frozen=True)
class Plan:
    """What the checks expect, read once from the job (or the defaults when there is none)."""

    #: No job: the machine is checked generically and the disk needs are a guess.
    generic: bool
    device: DeviceSpec
    #: ``preflight.allow_cpu``: a job on ``auto`` devices may train without CUDA.
    allow_cpu: bool
    #: ``preflight.timeout_s``: the probe's deadline, and the cap on the Hub and driver queries.
    timeout_s: float
    #: Import LibreYOLO's whole training stack in the probe, not only the package.
    deep_import: bool
    workers: int | None
    batch: int | None
    imgsz: int
    model: str | None
    epochs: int | None
    save_period: int | None
    runs_dir: Path
    dataset: DatasetSection | None
    sync_hf_repo: str | None

    @property
    def cpu_ok(self) -> bool:
        """Whether training may run without CUDA."""
        return self.device.kind == "cpu" or (self.allow_cpu and self.device.kind == "auto")

    def ranks(self, visible: int) -> int:
        """Training processes (one per GPU used)."""
        if self.device.kind == "gpus":
            return len(self.device.ids)
        if self.device.kind == "all":
            return max(1, visible)
        return 1

    @property
    def workers_assumed(self) -> int:
        """DataLoader workers per training process (LibreYOLO's default when unset)."""
        return DEFAULT_WORKERS if self.workers is None else self.workers

    @property
    def nccl_devices(self) -> list[int] | Literal["all"] | None:
        """The GPUs the probe all-reduces across: the job's list, every visible one, or none."""
        if self.device.kind == "gpus" and len(self.device.ids) >= 2:
            return list(self.device.ids)
        if self.device.kind == "all":
            return "all"
        return None


def plan_for(job: Job | None) -> Plan:
    """The plan for ``job``; ``None`` plans the generic check (every visible GPU, no dataset)."""
    if job is None:
        return Plan(
            generic=True,
            device=DeviceSpec("all"),
            allow_cpu=False,
            timeout_s=PreflightSection().timeout_s,
            deep_import=False,
            workers=None,
            batch=None,
            imgsz=DEFAULT_IMGSZ,
            model=None,
            epochs=None,
            save_period=None,
            runs_dir=Path.cwd() / JobSection().runs_dir,
            dataset=None,
            sync_hf_repo=None,
        )
    train = job.train

    def int_arg(key: str) -> int | None:
        v = train.get(key)
        if isinstance(v, bool):
            return None
        if isinstance(v, int):
            return v
        if isinstance(v, str) and re.fullmatch(r"-?\d+", v.strip()):
            return int(v)
        return None

    imgsz = int_arg("imgsz")
    if imgsz is None:  # "640,480" and friends: the larger side
        sides = re.findall(r"\d+", str(train.get("imgsz") or ""))
        imgsz = max((int(s) for s in sides), default=DEFAULT_IMGSZ)
    model = train.get("model")
    sync = job.sync
    return Plan(
        generic=False,
        device=parse_device(train.get("device")),
        allow_cpu=job.preflight.allow_cpu,
        timeout_s=job.preflight.timeout_s,
        deep_import=job.preflight.deep_import,
        workers=int_arg("workers"),
        batch=int_arg("batch"),
        imgsz=imgsz,
        model=None if model is None else str(model),
        epochs=train.epochs,
        save_period=int_arg("save_period"),
        runs_dir=job.job.runs_dir,
        dataset=job.dataset,
        sync_hf_repo=sync.location if sync is not None and sync.scheme == "hf" else None,
    )
