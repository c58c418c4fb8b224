"""What ``install.sh`` installs on this box, decided before the virtual environment exists.

- ``python3 -m agent.install.torchpick torch``: the torch build. On a box with ``nvidia-smi`` (one
call:
  the driver's version and each GPU's compute capability; the newest CUDA the driver runs comes
  from :data:`DRIVER_MAX_CUDA`), keep the image's torch when it runs on that driver and has
  kernels for every card (GPU images ship one: no 2 GB download), else pick the newest PyTorch
  CUDA build the driver runs that has kernels for the cards. Without ``nvidia-smi``: PyTorch's
  CPU wheels where ``$TORCH_INDEX_BASE/cpu`` answers within 5 s (agent/install/torchindex.py), else
  the default build (the CUDA one, ~3 GB). Prints the decision and its reason.
- ``python3 -m agent.install.torchpick sees --python VENV/bin/python [--expect DIR]``: which torch a
  venv would import (exit 1 with the reason when none, or another one than ``--expect``).
- ``python3 -m agent.install.torchpick extras JOB.toml``: LibreYOLO's extras the job needs
  (agent/install/extras.py); ``agent-extras JOB.toml``: the agent's (its loggers' clients).
- ``python3 -m agent.install.torchpick uptodate REPORT``: exit 0 when a ``pip install --dry-run
  --report`` of the agent has nothing left to do (pip always lists an editable install).

Standard library only and no torch import: the image's torch is read from its files
(agent/install/torchmeta.py), so it runs from the source tree with the box's ``python3`` before
anything is installed, in milliseconds rather than the seconds an ``import torch`` takes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from agent.install import torchmeta
from agent.install.extras import check_extras, read_job_agent_extras, read_job_extras
from agent.install.torchindex import IndexProbe, probe_cpu_index

#: The torch build for a machine without an NVIDIA GPU (install.sh's default ``TORCH_SPEC``).
DEFAULT_TORCH_SPEC = "torch==2.14.1 torchvision==0.29.1"
#: PyTorch's wheel indexes live under this URL, one per CUDA build (``.../cu128``).
#: Env ``TORCH_INDEX_BASE`` overrides it (a mirror).
DEFAULT_INDEX_BASE = "https://download.pytorch.org/whl"
#: The oldest torch and torchvision LibreYOLO 1.6.0 accepts (its ``Requires-Dist``).
MIN_TORCH = (2, 4)
MIN_TORCHVISION = (0, 19)
#: Seconds ``nvidia-smi`` may take.
PROBE_TIMEOUT_S = 120.0
#: What a CPU machine downloads for torch (PyTorch's CPU wheels / the default, CUDA build;
#: measured: see the README's quick start).
CPU_BUILD_COST = "about 0.2 GB"
CUDA_BUILD_COST = "about 3 GB to download, a 6 GB venv"
#: The name of the ``.pth`` file that makes a venv see the image's torch (install.sh writes it).
IMAGE_PTH = "_libreyolo_image_torch.pth"

#: Oldest Linux driver per CUDA version, newest first (NVIDIA's CUDA Toolkit release notes,
#: "CUDA Toolkit and Corresponding Driver Versions"). ``nvidia-smi --query-gpu`` has no CUDA
#: field (only its header table prints ``CUDA Version:``, which would take a second call), so the
#: newest CUDA a driver runs is read from here; a driver newer than the first row counts as that
#: row's CUDA.
DRIVER_MAX_CUDA: tuple[tuple[tuple[int, int], tuple[int, int]], ...] = (
    ((580, 65), (13, 0)),
    ((575, 51), (12, 9)),
    ((570, 26), (12, 8)),
    ((560, 28), (12, 6)),
    ((555, 42), (12, 5)),
    ((550, 54), (12, 4)),
    ((545, 23), (12, 3)),
    ((535, 54), (12, 2)),
    ((530, 30), (12, 1)),
    ((525, 60), (12, 0)),
    ((520, 61), (11, 8)),
    ((515, 43), (11, 7)),
    ((510, 39), (11, 6)),
    ((495, 29), (11, 5)),
    ((470, 42), (11, 4)),
    ((450, 36), (11, 0)),
)


@dataclass(frozen=True)
class Build:
    """One PyTorch CUDA build: its wheel index (``cu128``) and the torch it installs there."""

    cuda: tuple[int, int]
    torch: str
    torchvision: str
    #: Compute capabilities it has kernels for: ``min_cap <= cap < below_cap``.
    min_cap: tuple[int, int]
    below_cap: tuple[int, int]

    @property
    def tag(self) -> str:
        return f"cu{self.cuda[0]}{self.cuda[1]}"

    @property
    def spec(self) -> str:
        return f"torch=={self.torch} torchvision=={self.torchvision}"


#: The PyTorch CUDA builds install.sh picks from, newest first. The current torch is built for
#: CUDA 12.6, 12.8 and 13.0; an older CUDA gets the last torch PyTorch built for it (cu124:
#: 2.6.0, cu121: 2.5.1, cu118: 2.7.1; all >= LibreYOLO's floor). CUDA 12.8 builds are the first
#: with Blackwell (10.x, 12.x) kernels and drop the cards below 7.5 (Maxwell, Pascal, Volta), as
#: agent/preflight/driver.py assumes; CUDA 13.0 has no kernels below 7.5 at all.
BUILDS: tuple[Build, ...] = (
    Build((13, 0), "2.14.1", "0.29.1", (7, 5), (99, 0)),
    Build((12, 8), "2.14.1", "0.29.1", (7, 5), (99, 0)),
    Build((12, 6), "2.14.1", "0.29.1", (5, 0), (10, 0)),
    Build((12, 4), "2.6.0", "0.21.0", (5, 0), (10, 0)),
    Build((12, 1), "2.5.1", "0.20.1", (5, 0), (10, 0)),
    Build((11, 8), "2.7.1", "0.22.1", (5, 0), (10, 0)),
)

Action = Literal["keep", "install", "default"]


@dataclass(frozen=True)
class Gpu:
    name: str
    #: ``(8, 9)``; None when ``nvidia-smi`` cannot say (drivers before ~510).
    capability: tuple[int, int] | None


@dataclass(frozen=True)
class Smi:
    """What ``nvidia-smi`` said."""

    driver: str | None = None
    #: The newest CUDA the driver runs (``CUDA Version:`` in the header, else the table).
    cuda: tuple[int, int] | None = None
    gpus: tuple[Gpu, ...] = ()
    #: Why nothing could be read (nvidia-smi failed: no driver, no device).
    error: str | None = None


@dataclass(frozen=True)
class ImageTorch:
    """The torch the base interpreter already has (read from its files, never imported)."""

    version: str | None = None
    #: torch's CUDA build (``"12.4"``), None for a CPU build.
    cuda: str | None = None
    #: Its kernels (``sm_90``...) from libtorch_cuda.so; empty: unknown, inferred from
    #: :data:`BUILDS` for its CUDA version.
    arch_list: tuple[str, ...] = ()
    torchvision: str | None = None
    #: Why there is none (``no torch``, the interpreter failed).
    error: str | None = None
    #: Where torch and torchvision live (what a kept venv must import).
    packages: tuple[str, ...] = ()
    #: The folders a kept venv's ``.pth`` names (the image's site-packages).
    paths: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decision:
    #: ``keep`` the image's torch, ``install`` a CUDA build, or the CPU ``default``.
    action: Action
    #: What pip installs (empty for ``keep``).
    torch_spec: str
    #: Extra pip arguments for the torch install only (the CUDA wheel index).
    pip_args: str
    reason: str
    #: Make the venv see the image's site-packages (a ``.pth`` naming :attr:`ImageTorch.paths`).
    sees_image: bool = False
    details: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------ parsing


def version_tuple(text: str | None) -> tuple[int, int] | None:
    """``"12.4"`` -> ``(12, 4)``, ``"2.5.1+cu124"`` -> ``(2, 5)``; None when there is no number."""
    if not text:
        return None
    parts = [int(p) for p in re.findall(r"\d+", text.split("+")[0])[:2]]
    if not parts:
        return None
    return (parts[0], parts[1] if len(parts) > 1 else 0)


def driver_max_cuda(driver: str) -> tuple[int, int] | None:
    """The newest CUDA a Linux driver runs, from :data:`DRIVER_MAX_CUDA`."""
    version = version_tuple(driver)
    if version is None:
        return None
    for oldest, cuda in DRIVER_MAX_CUDA:
        if version >= oldest:
            return cuda
    return None


#: The one ``nvidia-smi`` call: the driver and each card (drivers before ~510 refuse
#: ``compute_cap``; they are asked again without it).
SMI_QUERY = ("--query-gpu=driver_version,name,compute_cap", "--format=csv,noheader")


def parse_smi(query: str) -> Smi:
    """``nvidia-smi --query-gpu=driver_version,name[,compute_cap] --format=csv,noheader``."""
    driver, gpus = None, []
    for line in query.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 2 or not re.fullmatch(r"\d+(\.\d+)+", cells[0]):
            continue
        driver = driver or cells[0]
        cap = re.fullmatch(r"(\d+)\.(\d+)", cells[-1]) if len(cells) >= 3 else None
        name = ", ".join(cells[1:-1] if cap else cells[1:])
        gpus.append(Gpu(name, (int(cap.group(1)), int(cap.group(2))) if cap else None))
    if driver is None:
        first = next((line.strip() for line in query.splitlines() if line.strip()), "")
        return Smi(error=first or "nvidia-smi printed nothing")
    return Smi(driver=driver, cuda=driver_max_cuda(driver), gpus=tuple(gpus))


def image_torch(seen: torchmeta.Seen) -> ImageTorch:
    """:class:`ImageTorch` from what the image's interpreter sees (agent/install/torchmeta.py)."""
    if seen.error:
        return ImageTorch(error=seen.error)
    if seen.torch is None or not seen.torch.version:
        return ImageTorch(error="no torch" if seen.torch is None else "torch without a version")
    packages = [str(p.path) for p in (seen.torch, seen.torchvision) if p is not None]
    return ImageTorch(
        version=seen.torch.version,
        cuda=seen.cuda,
        arch_list=seen.arch_list,
        torchvision=seen.torchvision.version if seen.torchvision else None,
        packages=tuple(packages),
        paths=tuple(str(p) for p in seen.torch_dirs()),
    )


def has_kernels(capability: tuple[int, int], arch_list: Iterable[str]) -> bool:
    """Whether a build with these ``sm_XY``/``compute_XY`` entries runs on this card.

    A cubin runs on its own major version at the same or a newer minor (``sm_80`` on 8.6);
    an arch-specific one (``sm_90a``) on exactly its card; PTX (``compute_XY``) is compiled by
    the driver for any card at or above it.
    """
    for entry in arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+)([a-z]?)", entry.strip())
        if m is None:
            continue
        major, minor = divmod(int(m.group(2)), 10)
        if m.group(1) == "compute":
            if (major, minor) <= capability:
                return True
        elif m.group(3) == "a":
            if (major, minor) == capability:
                return True
        elif major == capability[0] and minor <= capability[1]:
            return True
    return False


# ------------------------------------------------------------------------------ deciding


def _show(cuda: tuple[int, int] | None) -> str:
    return f"{cuda[0]}.{cuda[1]}" if cuda else "?"


def _gpu_names(gpus: Sequence[Gpu]) -> str:
    caps = sorted({f"{g.name} ({_show(g.capability)})" for g in gpus})
    return ", ".join(caps) or "the GPU"


def keep_problem(smi: Smi, image: ImageTorch | None) -> str | None:
    """Why the image's torch cannot be kept on this box; None when it can."""
    if image is None or image.version is None:
        return "the base Python has no torch" + (f" ({image.error})" if image else "")
    label = f"the image's torch {image.version}"
    if not image.cuda:
        return f"{label} is a CPU build"
    torch_v, vision_v = version_tuple(image.version), version_tuple(image.torchvision)
    if torch_v is None or torch_v < MIN_TORCH:
        return f"{label} is older than LibreYOLO's floor {MIN_TORCH[0]}.{MIN_TORCH[1]}"
    if vision_v is None or vision_v < MIN_TORCHVISION:
        have = image.torchvision or "none"
        # pip would fetch a torchvision pinned to another torch, and that torch with it.
        return f"{label} comes with torchvision {have} (LibreYOLO needs >= 0.19)"
    built = version_tuple(image.cuda)
    if smi.cuda is not None and built is not None and built > smi.cuda:
        return f"{label} is built for CUDA {image.cuda}, the driver runs CUDA <= {_show(smi.cuda)}"
    if image.arch_list:
        missing = [
            g for g in smi.gpus if g.capability and not has_kernels(g.capability, image.arch_list)
        ]
        if missing:
            archs = " ".join(image.arch_list)
            return f"{label} has no kernels for {_gpu_names(missing)} (it has: {archs})"
        return None
    like = same_cuda_build(image.cuda)
    if like is not None:
        missing = [
            g
            for g in smi.gpus
            if g.capability and not like.min_cap <= g.capability < like.below_cap
        ]
        if missing:
            return (
                f"{label} has no kernels for {_gpu_names(missing)} (inferred: its kernels could "
                f"not be read, PyTorch's {like.tag} builds cover {_caps(like)})"
            )
    return None


def same_cuda_build(cuda: str | None) -> Build | None:
    """PyTorch's build for this CUDA version (whose kernel range stands in for an image torch's
    unreadable one), None when PyTorch has none in :data:`BUILDS`."""
    wanted = version_tuple(cuda)
    return next((b for b in BUILDS if b.cuda == wanted), None)


def _caps(build: Build) -> str:
    top = "" if build.below_cap >= (99, 0) else f" below {_show(build.below_cap)}"
    return f"compute capability {_show(build.min_cap)}{top or ' and up'}"


def kernels_source(image: ImageTorch) -> str:
    """Where the kept torch's kernel list came from, for the decision's reason."""
    if image.arch_list:
        return "read from libtorch_cuda.so"
    like = same_cuda_build(image.cuda)
    if like is not None:
        return f"inferred: PyTorch's {like.tag} builds cover {_caps(like)}"
    return "unread and not inferable: assumed; the agent's preflight runs a kernel on each card"


def pick_build(smi: Smi, builds: Sequence[Build] = BUILDS) -> Build | None:
    """The newest build the driver runs that has kernels for every GPU."""
    caps = [g.capability for g in smi.gpus if g.capability]
    for build in builds:
        if smi.cuda is not None and build.cuda > smi.cuda:
            continue
        if all(build.min_cap <= cap < build.below_cap for cap in caps):
            return build
    return None


def decide(
    smi: Smi | None,
    image: ImageTorch | None,
    *,
    default_spec: str = DEFAULT_TORCH_SPEC,
    index_base: str = DEFAULT_INDEX_BASE,
    allow_keep: bool = True,
    cpu_index: IndexProbe | None = None,
) -> Decision:
    """The torch to install. ``smi`` None: no ``nvidia-smi`` on this box; then ``cpu_index``
    says whether PyTorch's CPU wheel index answered (None: not asked, the default build).

    ``allow_keep`` False: never keep the image's torch (the venv exists without its packages).
    """
    if smi is None:
        cpu = f"{index_base.rstrip('/')}/cpu"
        if cpu_index is not None and cpu_index.ok:
            return Decision(
                "install",
                default_spec,
                f"--index-url {cpu}",
                f"no nvidia-smi: a CPU machine; PyTorch's CPU wheels from {cpu} "
                f"({CPU_BUILD_COST} instead of the CUDA build's {CUDA_BUILD_COST})",
            )
        why = f"; PyTorch's CPU wheel index did not answer ({cpu_index.why})" if cpu_index else ""
        return Decision(
            "default",
            default_spec,
            "",
            f"no nvidia-smi: a CPU machine{why}: the default build from the usual index, which "
            f"is the CUDA build ({CUDA_BUILD_COST}; set TORCH_INDEX_BASE to a mirror of "
            "PyTorch's wheel indexes for the CPU wheels)",
        )
    details: dict[str, Any] = {
        "driver": smi.driver,
        "driver_cuda": _show(smi.cuda) if smi.cuda else None,
        "gpus": [{"name": g.name, "capability": _show(g.capability)} for g in smi.gpus],
    }
    if image is not None:
        details["image_torch"] = asdict(image)
    if smi.error is not None:
        return Decision(
            "default",
            default_spec,
            "",
            f"nvidia-smi is here but failed ({smi.error}): the default build; the agent's "
            "preflight checks the GPU",
            details=details,
        )
    driver = f"driver {smi.driver} (CUDA <= {_show(smi.cuda)})"
    problem = keep_problem(smi, image) if allow_keep else "the venv exists without them"
    if problem is None:
        assert image is not None
        unknown = any(g.capability is None for g in smi.gpus) or not smi.gpus
        cards = "compute capability unknown" if unknown else f"kernels for {_gpu_names(smi.gpus)}"
        return Decision(
            "keep",
            "",
            "",
            f"the image's torch {image.version} (CUDA {image.cuda}) runs on {driver} and has "
            f"{cards} ({kernels_source(image)}): no download",
            sees_image=True,
            details=details,
        )
    build = pick_build(smi)
    if build is None:
        return Decision(
            "default",
            default_spec,
            "",
            f"{problem}; no PyTorch CUDA build fits {driver} and {_gpu_names(smi.gpus)}: the "
            "default build (update the driver; the agent's preflight will say why it fails)",
            details=details,
        )
    return Decision(
        "install",
        build.spec,
        f"--index-url {index_base.rstrip('/')}/{build.tag}",
        f"{problem}; torch {build.torch} for {build.tag}: the newest build {driver} runs with "
        f"kernels for {_gpu_names(smi.gpus)}",
        details=details,
    )


# ------------------------------------------------------------------------------ the box


def _run(argv: Sequence[str]) -> tuple[int, str]:
    try:
        proc = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, f"{argv[0]}: {exc}"
    return proc.returncode, proc.stdout + proc.stderr


def read_smi() -> Smi | None:
    """``nvidia-smi`` on this box, one call (two on drivers that refuse ``compute_cap``); None
    when there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    code, out = _run([smi, *SMI_QUERY])
    if code != 0 and "compute_cap" in out:
        code, out = _run([smi, "--query-gpu=driver_version,name", SMI_QUERY[1]])
    if code != 0:
        return Smi(error=f"exit {code}: " + (out.strip().splitlines() or ["no output"])[0])
    return parse_smi(out)


def read_image_torch(python: str) -> ImageTorch:
    """The torch ``python`` would import (the image's), read from its files."""
    return image_torch(torchmeta.read_seen(python))


# ------------------------------------------------------------------------------ pending


def nothing_pending(report: dict[str, Any], project: Path, site_dirs: Iterable[Path]) -> bool:
    """Whether a ``pip install --dry-run --report`` of the editable agent has nothing to do:
    pip lists only the agent itself, and it is installed editable from ``project`` already."""
    install = report.get("install") or []
    if len(install) != 1:
        return False
    meta = install[0].get("metadata") or {}
    name, version = str(meta.get("name", "")), str(meta.get("version", ""))
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for site in site_dirs:
        info = site / f"{stem}-{version}.dist-info" / "direct_url.json"
        try:
            direct = json.loads(info.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        editable = (direct.get("dir_info") or {}).get("editable") is True
        return editable and direct.get("url") == project.resolve().as_uri()
    return False


# ------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m agent.install.torchpick", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("torch", help="decide the torch build for this box")
    t.add_argument("--python", default=sys.executable, help="the interpreter whose torch to ask")
    t.add_argument("--no-keep", action="store_true", help="never keep the image's torch")
    t.add_argument(
        "--lines",
        action="store_true",
        help="lines: action, spec, pip args, the .pth's folders and the kept packages (each "
        "joined by ':'), reason",
    )
    t.add_argument(
        "--no-index-probe", action="store_true", help="never ask PyTorch's CPU wheel index"
    )
    v = sub.add_parser("sees", help="which torch a venv's Python would import (no import)")
    v.add_argument("--python", required=True)
    v.add_argument("--expect", type=Path, action="append", default=[], help="the kept packages")
    e = sub.add_parser("extras", help="LibreYOLO extras a job needs (one line, comma-separated)")
    e.add_argument("job", nargs="?", type=Path, help="job file (TOML)")
    e.add_argument("--also", default="", help="more extras, comma-separated")
    a = sub.add_parser("agent-extras", help="the agent's extras a job needs (its loggers)")
    a.add_argument("job", type=Path, help="job file (TOML)")
    d = sub.add_parser("uptodate", help="exit 0 when pip has nothing left to do, else 1")
    d.add_argument("report", type=Path)
    d.add_argument("--project", type=Path, required=True)
    d.add_argument("--site", type=Path, action="append", default=[])
    words = list(sys.argv[1:] if argv is None else argv)
    if not words or (words[0].startswith("-") and words[0] not in ("-h", "--help")):
        words.insert(0, "torch")  # the default command: plain `python3 -m agent.install.torchpick`
    args = p.parse_args(words)

    if args.command == "extras":
        try:
            found, why = read_job_extras(args.job) if args.job else ([], [])
            extras = check_extras([*found, *args.also.split(",")])
        except (OSError, ValueError) as exc:  # tomllib.TOMLDecodeError is a ValueError
            print(f"torchpick: {exc}", file=sys.stderr)
            return 2
        print(",".join(extras))
        for line in why:
            print(line)
        return 0
    if args.command == "agent-extras":
        try:
            found, why = read_job_agent_extras(args.job)
        except (OSError, ValueError) as exc:
            print(f"torchpick: {exc}", file=sys.stderr)
            return 2
        print(",".join(found))
        for line in why:
            print(line)
        return 0
    if args.command == "uptodate":
        report = json.loads(args.report.read_text(encoding="utf-8"))
        return 0 if nothing_pending(report, args.project, args.site) else 1

    if args.command == "sees":
        seen = torchmeta.read_seen(args.python)
        problem = torchmeta.check_sees(seen, args.expect)
        if problem is not None:
            print(f"torchpick: {problem}", file=sys.stderr)
            return 1
        print(torchmeta.describe(seen))
        return 0

    index_base = os.environ.get("TORCH_INDEX_BASE") or DEFAULT_INDEX_BASE
    smi = read_smi()
    image = read_image_torch(args.python) if smi is not None and smi.error is None else None
    cpu_index = None
    if smi is None and not args.no_index_probe:
        cpu_index = probe_cpu_index(index_base, DEFAULT_TORCH_SPEC)
    decision = decide(
        smi, image, index_base=index_base, allow_keep=not args.no_keep, cpu_index=cpu_index
    )
    if args.lines:
        kept = image if decision.sees_image and image is not None else ImageTorch()
        fields = (decision.action, decision.torch_spec, decision.pip_args)
        folders = (os.pathsep.join(kept.paths), os.pathsep.join(kept.packages))
        print("\n".join([*fields, *folders, decision.reason]))
    else:
        print(json.dumps(asdict(decision), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
