"""What to rent for a job, worked out on the laptop before renting (``libreyolo-agent check``).

Providers bill the disk as allocated, and it cannot shrink: rent what the job will hold plus
30 % (the preflight's own rule, :data:`agent.preflight.host.DISK_HEADROOM`), worked out from:

- **the dataset**: the archive's size from the Hub's listing (``paths-info``: the file
  ``[dataset] file`` names, the one staging downloads), kept in ``HF_HOME``'s cache, and its
  unpacked copy in ``dataset.dest``. A ``.zip``'s unpacked size is the sum of its members' sizes,
  read from its central directory at the end of the file (a few HTTP ``Range`` requests, never
  the archive). Otherwise it is an *estimate* from a factor
  (:func:`agent.preflight.host.unpack_factor`: x1.0 for a ``.tar``, whose size is its content
  plus 512-byte headers; x1.2 for a compressed tar, whose images are already compressed):
  reading every tar header over HTTP would cost one request per member, so it is not done.
- **the checkpoints the job keeps**: ``last.pt``, ``best.pt``, one ``epoch_N.pt`` every
  ``save_period`` epochs (LibreYOLO 1.6.0 keeps them all: ``training/trainer.py``; defaults 300
  epochs, every 10), and with ``[sync]`` two snapshots in flight for the uploader. One checkpoint
  is the model's parameters x 12.6 bytes with SGD (measured: yolox-n's ``last.pt`` is 11.46 MB
  for 0.91 M parameters - the EMA weights, the training weights and the momentum), x 16.6 with
  Adam/AdamW (one more fp32 moment) and for an optimizer the job leaves to the family's default.
  Parameters: :data:`FAMILY_PARAMS_M`, counted from LibreYOLO 1.6.0's model classes (80 classes,
  ``sum(p.numel() for p in model.parameters())``); a model not in it falls back on the
  preflight's guess from its size letter.
- **the install**: a venv with a CUDA torch, measured at 6.3 GB (``du -sh .venv``, README), and
  the pretrained weights the training downloads (parameters x 4 bytes).

It never imports torch (``tests/test_check_rent.py`` checks it in a subprocess). The Hub is
asked once, with short timeouts; when it cannot be reached, one line says so and the rest is
given all the same. Which teardown variables the environment holds is said by name only.
"""

from __future__ import annotations

import io
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.config.model import Env, Job

#: Millions of parameters per LibreYOLO family and size (module docstring says how counted).
FAMILY_PARAMS_M: dict[str, dict[str, float]] = {
    "yolox": {"n": 0.91, "t": 5.06, "s": 8.97, "m": 25.33, "l": 54.21, "x": 99.07},
    "yolo9": {"t": 2.04, "s": 7.23, "m": 20.12, "c": 25.5},
    "dfine": {"n": 3.78, "s": 10.32, "m": 19.59, "l": 31.24, "x": 62.62},
    "deim": {"n": 3.78, "s": 10.32, "m": 19.59, "l": 31.24, "x": 62.62},
    "deimv2": {
        "atto": 0.51,
        "femto": 0.98,
        "pico": 1.54,
        "n": 3.6,
        "s": 9.78,
        "m": 18.36,
        "l": 32.55,
        "x": 51.21,
    },
    "rtdetrv2": {"r18": 20.18, "r34": 31.44, "r50": 42.89, "r50m": 36.59, "r101": 76.56},
    "ec": {"s": 9.88, "m": 19.43, "l": 32.97, "x": 49.94},
    "yolonas": {"s": 19.05, "m": 51.18, "l": 66.98},
    "yolo7": {"b": 37.62},
    "rtmdet": {"t": 4.9, "s": 8.89, "m": 24.71, "l": 52.32, "x": 94.86},
    "picodet": {"s": 0.99, "m": 2.15, "l": 3.31},
    "ppyoloe": {"s": 8.08, "m": 24.13, "l": 54.08, "x": 102.33},
}
#: Bytes one checkpoint takes per parameter: SGD (measured), Adam/AdamW or unknown (+4 B).
BYTES_PER_PARAM_SGD = 12.6
BYTES_PER_PARAM_ADAM = 16.6
#: A venv with a CUDA torch, ``du -sh .venv`` (README, "First box").
INSTALL_BYTES = int(6.3e9)
#: LibreYOLO's train defaults (1.6.0, ``libreyolo/training/config.py``).
DEFAULT_EPOCHS = 300
DEFAULT_SAVE_PERIOD = 10
#: Seconds the Hub may take to connect, and between bytes.
HUB_CONNECT_S = 5.0
HUB_TIMEOUT_S = 10.0
#: A zip's unpacked size is read from its central directory when that costs at most this many
#: ``Range`` requests and bytes (a million members take about 80 MB: then the factor is used).
ZIP_MAX_REQUESTS = 6
ZIP_DIRECTORY_MAX_BYTES = 32 << 20

#: Per provider: (variable names, any one of which will do; who provides it).
_TEARDOWN_VARS: dict[str, tuple[tuple[tuple[str, ...], str], ...]] = {
    "vast": (
        (("CONTAINER_API_KEY", "VAST_API_KEY"), "Vast sets CONTAINER_API_KEY in every instance"),
        (("CONTAINER_ID",), "Vast sets it in every instance; or teardown.instance_id"),
    ),
    "runpod": (
        (("RUNPOD_API_KEY",), "RunPod sets a pod-scoped one in every pod"),
        (("RUNPOD_POD_ID",), "RunPod sets it in every pod; or teardown.instance_id"),
    ),
    "lambda": ((("LAMBDA_API_KEY",), "yours to give the box: Lambda puts none on it"),),
}


@dataclass(frozen=True)
class Part:
    """One thing the box's disk will hold."""

    what: str
    where: str
    bytes: int | None
    basis: str


@dataclass(frozen=True)
class KeyPresence:
    names: tuple[str, ...]
    present: str | None
    provided_by: str


@dataclass
class RentEstimate:
    parts: list[Part]
    #: One line when the Hub could not be asked (or was not, ``--offline``).
    hub_problem: str | None = None
    keys: list[KeyPresence] = field(default_factory=list)
    provider: str = "none"
    notes: list[str] = field(default_factory=list)

    @property
    def known_bytes(self) -> int:
        return sum(p.bytes for p in self.parts if p.bytes is not None)

    @property
    def complete(self) -> bool:
        return all(p.bytes is not None for p in self.parts)

    @property
    def rent_gb(self) -> int:
        """Whole GB to rent: everything x 1.3, rounded up."""
        from agent.preflight.host import DISK_HEADROOM

        return max(1, math.ceil(self.known_bytes * DISK_HEADROOM / 1e9))

    def to_dict(self) -> dict[str, Any]:
        return {
            "rent_disk_gb": self.rent_gb,
            "headroom": 0.3,
            "total_bytes": self.known_bytes,
            "complete": self.complete,
            "parts": [p.__dict__ for p in self.parts],
            "hub_problem": self.hub_problem,
            "teardown": {
                "provider": self.provider,
                "variables": [
                    {"names": list(k.names), "present": k.present, "provided_by": k.provided_by}
                    for k in self.keys
                ],
            },
            "notes": self.notes,
        }


def size_text(n: float) -> str:
    """Decimal units, as providers bill disks: ``4.10 GB``, ``36 MB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GB" else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def model_params(model: str | None) -> tuple[float | None, str]:
    """Millions of parameters of ``model`` (``yolox-s``, ``yolo9-t``, ``LibreYOLOXs.pt``...)
    from :data:`FAMILY_PARAMS_M`, and how it was found; None when not in the table."""
    if not model:
        return None, "no train.model"
    stem = re.sub(r"\.(pt|pth|yaml|yml)$", "", Path(model).name.lower())
    stem = re.sub(r"^libre", "", stem)
    for family in sorted(FAMILY_PARAMS_M, key=len, reverse=True):
        sizes = FAMILY_PARAMS_M[family]
        m = re.fullmatch(rf"{re.escape(family)}[-_]?([a-z0-9]+)", stem)
        if m and m.group(1) in sizes:
            return sizes[m.group(1)], f"{family}-{m.group(1)}: {sizes[m.group(1)]:g} M parameters"
    return None, f"{model!r} is not in the table of LibreYOLO families"


def checkpoints(job: Job) -> Part:
    from agent.preflight.host import checkpoint_estimate

    model = job.train.get("model")
    model_name = str(model) if model is not None else None
    params_m, basis = model_params(model_name)
    epochs = job.train.get("epochs")
    n_epochs = epochs if isinstance(epochs, int) and not isinstance(epochs, bool) else None
    period_raw = job.train.get("save_period")
    period = (
        period_raw if isinstance(period_raw, int) and not isinstance(period_raw, bool) else None
    )
    if params_m is None:
        guessed, note = checkpoint_estimate(model_name, n_epochs, period)
        return Part("checkpoints", "job.runs_dir", guessed, f"guess: {note} ({basis})")
    optimizer = str(job.train.get("optimizer") or "").lower()
    per_param = BYTES_PER_PARAM_SGD if optimizer == "sgd" else BYTES_PER_PARAM_ADAM
    opt_word = "SGD" if optimizer == "sgd" else (optimizer or "the family's default optimizer")
    per = int(params_m * 1e6 * per_param)
    total_epochs = n_epochs or DEFAULT_EPOCHS
    every = DEFAULT_SAVE_PERIOD if period is None else period
    numbered = total_epochs // every if every > 0 else 0
    in_flight = 2 if job.sync is not None else 0
    count = 2 + numbered + in_flight
    what = f"last, best, {numbered} epoch_N" + (", 2 upload snapshots" if in_flight else "")
    return Part(
        "checkpoints",
        "job.runs_dir",
        count * per,
        f"{count} files ({what}) x {size_text(per)} ({basis} x {per_param:g} B, {opt_word})",
    )


def _dataset_bytes(job: Job, env: Env) -> int:
    """The archive's size from the Hub's listing; raises what the client raises."""
    from agent import hub

    assert job.dataset is not None
    ds = job.dataset
    hub.configure(env, timeout_s=HUB_TIMEOUT_S, connect_timeout_s=HUB_CONNECT_S)
    infos = hub.api(env).get_paths_info(
        ds.repo, [ds.file], repo_type="dataset", revision=ds.revision
    )
    for info in infos:
        size = getattr(info, "size", None)
        if info.path == ds.file and isinstance(size, int):
            return size
    raise FileNotFoundError(f"the Hub lists no file {ds.file!r} in {ds.repo}@{ds.revision}")


class _RangeFile(io.RawIOBase):
    """A Hub file read through HTTP ``Range`` requests, one per read: what :mod:`zipfile` needs
    to list a zip from its end (the end record, then the central directory in one read)."""

    def __init__(self, url: str, size: int, headers: dict[str, str]) -> None:
        self.url, self.size, self.headers = url, size, headers
        self.pos = 0
        self.requests = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        from huggingface_hub import get_session, hf_raise_for_status

        want = min(len(buffer), self.size - self.pos)
        if want <= 0:
            return 0
        if want > ZIP_DIRECTORY_MAX_BYTES or self.requests >= ZIP_MAX_REQUESTS:
            raise OSError("the zip's central directory is too large to read cheaply")
        headers = dict(self.headers, Range=f"bytes={self.pos}-{self.pos + want - 1}")
        self.requests += 1
        response = get_session().get(self.url, headers=headers)
        hf_raise_for_status(response)
        data = response.content[:want]
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _zip_unpacked(job: Job, env: Env, size: int) -> int:
    """The unpacked size of a zip on the Hub, from its central directory (a few ``Range``
    requests, never the whole archive); raises when it cannot be read cheaply."""
    import zipfile

    from huggingface_hub import hf_hub_url

    from agent import __version__

    assert job.dataset is not None
    ds = job.dataset
    url = hf_hub_url(
        ds.repo, ds.file, repo_type="dataset", revision=ds.revision, endpoint=env.hf_endpoint
    )
    headers = {"user-agent": f"libreyolo-agent/{__version__}"}
    if env.hf_token:
        headers["authorization"] = f"Bearer {env.hf_token}"
    with zipfile.ZipFile(_RangeFile(url, size, headers)) as archive:
        return sum(info.file_size for info in archive.infolist())


def _hub_problem(exc: BaseException, env: Env) -> str:
    from agent import hub

    failure = hub.classify(exc, token=env.hf_token)
    return hub.redact(f"{failure.kind}: {failure.detail}", env.hf_token)[:300]


def estimate(job: Job, env: Env, *, offline: bool = False) -> RentEstimate:
    """What the box's disk must hold for ``job`` (module docstring)."""
    from agent.preflight.host import default_hf_home, unpack_factor

    parts: list[Part] = []
    hub_problem = None
    hf_home = str(default_hf_home(env))
    ds = job.dataset
    if ds is not None:
        size: int | None = None
        if offline:
            hub_problem = "was not asked (--offline)"
        else:
            try:
                size = _dataset_bytes(job, env)
            except Exception as exc:
                hub_problem = f"did not give the dataset's size ({_hub_problem(exc, env)})"
        source = f"{ds.repo}/{ds.file}@{ds.revision}"
        packed_basis = f"{source}, from the Hub's listing" if size is not None else source
        parts.append(Part("dataset archive", f"HF_HOME ({hf_home})", size, packed_basis))
        factor = unpack_factor(ds.file)
        kind = ".tar: its content plus headers" if factor == 1.0 else "compressed archive"
        unpacked = None if size is None else int(size * factor)
        basis = f"estimate: archive x{factor:.1f} ({kind})"
        if size is not None and ds.file.lower().endswith(".zip"):
            try:
                unpacked = _zip_unpacked(job, env, size)
                basis = (
                    "the sum of the zip's member sizes (its central directory, read from the Hub)"
                )
            except Exception as exc:
                basis += f"; the zip's directory could not be read ({type(exc).__name__})"
        parts.append(Part("dataset unpacked", f"dataset.dest ({ds.dest})", unpacked, basis))
    else:
        data = job.train.get("data")
        parts.append(
            Part(
                "dataset",
                "train.data",
                None,
                f"local {data!r}: not on the Hub, not sized here; add its size",
            )
        )
    ckpt = checkpoints(job)
    parts.append(ckpt)
    params_m, _ = model_params(str(job.train.get("model") or "") or None)
    if job.train.get("pretrained") is not False and params_m is not None:
        parts.append(
            Part(
                "pretrained weights",
                "the download cache",
                int(params_m * 1e6 * 4),
                f"{params_m:g} M parameters x 4 B",
            )
        )
    parts.append(
        Part("install", "the venv", INSTALL_BYTES, "a venv with a CUDA torch, measured (README)")
    )
    est = RentEstimate(parts, hub_problem=hub_problem, provider=job.teardown.provider)
    est.keys = teardown_keys(job, os.environ)
    if (job.sync is not None and job.sync.scheme == "hf") or ds is not None:
        present = "HF_TOKEN" if os.environ.get("HF_TOKEN") else None
        est.notes.append(
            "HF_TOKEN is "
            + ("set here" if present else "not set here")
            + " (needed for hf:// sync and private datasets: give it to the box as a secret)"
        )
    if job.teardown.provider == "command":
        est.notes.append("teardown.command is resolved on the box by the preflight")
    return est


def teardown_keys(job: Job, environ: Any) -> list[KeyPresence]:
    """Which of the provider's variables the environment holds: names only, never values."""
    out = []
    for names, who in _TEARDOWN_VARS.get(job.teardown.provider, ()):
        if names[-1].endswith("_ID") and job.teardown.instance_id:
            out.append(KeyPresence(names, "teardown.instance_id", who))
            continue
        present = next((n for n in names if environ.get(n)), None)
        out.append(KeyPresence(names, present, who))
    return out


def format_text(est: RentEstimate) -> str:
    total = size_text(est.known_bytes)
    head = f"rent: {est.rent_gb} GB of disk ({total} + 30 %"
    head += ")" if est.complete else "; more: a part below is not sized)"
    lines = [head]
    width = max(len(p.what) for p in est.parts)
    for p in est.parts:
        size = size_text(p.bytes) if p.bytes is not None else "?"
        lines.append(f"  {p.what:<{width}}  {size:>9}  {p.where}: {p.basis}")
    if est.hub_problem is not None:
        lines.append(f"the Hub {est.hub_problem}: the dataset is not counted, the rest stands")
    if est.keys:
        said = []
        for k in est.keys:
            names = " or ".join(k.names)
            state = f"{k.present} is set" if k.present else f"{names}: not set here"
            said.append(f"{state} ({k.provided_by})")
        lines.append(f"teardown {est.provider}: " + "; ".join(said))
    elif est.provider == "none":
        lines.append("teardown none: nothing stops the box; it bills until you stop it")
    lines += est.notes
    return "\n".join(lines)
