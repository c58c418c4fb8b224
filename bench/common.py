"""Shared pieces of bench/run.py, and the small processes it starts (``python bench/common.py
MODE ...``): the timed scripted trainer and the three naive anchors.

Modes (each a real process, so its memory and CPU are its own):

``trainer KEY=VALUE...``
    tests/fakes/scripted_trainer.py, unchanged, with ``write_checkpoint`` wrapped to append
    ``{"name", "epoch", "t", "write_s"}`` (``time.time()`` once the file is closed, and how long
    the write took) to the JSON-lines file named by ``bench_log=PATH``, and ``{"exit": t}`` when
    ``main`` returns (the process exits right after). With ``torch_save=1`` the checkpoints are
    written by the real ``torch.save``, as LibreYOLO's are: a dict with the epoch and float32
    tensors of ``ckpt_kb`` KiB in all (seeded by the epoch, so each epoch's bytes differ), which
    torch writes in place, a write call per tensor, as a zip with data descriptors; otherwise
    by the scripted trainer's own writer (a zip written in one go). ``cuda=1`` makes a CUDA
    context first (torch on the GPU, as a real trainer holds one until it exits);
    ``linger_s=S`` sleeps S seconds after ``main`` returned (the ``exit`` row), before the
    process ends: an interpreter's shutdown, during which the last epoch's uploads finish. The
    scripted trainer ignores the extra keys.
``poll RUNS_DIR EVERY_S LOG``
    P1's anchor: every EVERY_S seconds, read the run's status.json and hash its weights/last.pt
    (the same reads the agent does), until status.json says the run ended.
``sync RUNS_DIR TARGET EVERY_S FIRST_S LOG``
    P2's anchor: FIRST_S seconds after it starts, then every EVERY_S seconds, copy each
    ``weights/*.pt`` whose size or mtime changed to TARGET, logging when each copy started and
    the epoch inside the copy.
``idle PID EVERY_S FIRST_S LOG``
    P3's anchor: FIRST_S seconds after it starts, then every EVERY_S seconds, check whether the
    trainer process PID is still there; log when it first finds it gone, then exit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

THIS = Path(__file__).resolve()

# --------------------------------------------------------------------------------- figures
# (Imports are local where they can be: the anchors below are bare loops, and their memory is
# the figure the agent is compared with.)


def spread(values: list[float]) -> tuple[float, float, float] | None:
    """(median, min, max), or None for no values."""
    import statistics

    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def fmt_spread(values: list[float], unit: str = "s", digits: int = 2) -> str:
    s = spread(values)
    if s is None:
        return "-"
    med, lo, hi = s
    unit = f" {unit}" if unit else ""
    return f"{med:.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f}, n={len(values)})"


def version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, str]:
    """What the figures were measured on (read without importing torch)."""
    import platform

    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem = "?"
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    load = "?"
    with contextlib.suppress(OSError):
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return {
        "cpu": f"{cpu}, {os.cpu_count()} cores ({usable} usable)",
        "ram": mem,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": version("torch"),
        "libreyolo": version("libreyolo"),
        "huggingface_hub": version("huggingface_hub"),
        "libreyolo-agent": version("libreyolo-agent"),
        "psutil": version("psutil"),
        "load average (1/5/15 min)": load,
    }


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of ``pid`` in bytes, from /proc/PID/status ({} if gone)."""
    out: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` itself (not its children), or None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick  # utime, stime


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def _log(path: Path, **row: Any) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


# --------------------------------------------------------------------------------- processes


#: Tensors in a ``torch_save=1`` checkpoint. torch.save writes each tensor's record with a
#: write call of its own (one tensor: the whole payload in a single writev); LibreYOLO's
#: checkpoints hold hundreds (model, EMA and optimizer state), whatever the model's size.
CKPT_TENSORS = 256


def torch_checkpoints() -> Callable[[Path, int, int], float]:
    """A checkpoint writer that is the real ``torch.save`` (torch is imported here): it writes
    ``{"epoch": epoch, "model": {name: tensor}}``, :data:`CKPT_TENSORS` float32 tensors of
    ``payload_kb`` KiB in all, drawn from a generator seeded by the epoch (made once per epoch:
    best.pt and last.pt of one epoch hold the same bytes, like LibreYOLO's). Returns the
    seconds ``torch.save`` itself took."""
    import torch

    made: dict[tuple[int, int], dict[str, Any]] = {}

    def save(path: Path, epoch: int, payload_kb: int) -> float:
        n = max(1, payload_kb * 1024 // 4)
        if (epoch, n) not in made:
            made.clear()  # one epoch's tensors alive at a time
            gen = torch.Generator().manual_seed(epoch)
            parts = min(CKPT_TENSORS, n)
            made[epoch, n] = {
                f"layer{i}.weight": torch.randn(n // parts + (i < n % parts), generator=gen)
                for i in range(parts)
            }
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        torch.save({"epoch": epoch, "model": made[epoch, n]}, path)
        return time.time() - t0

    return save


def timed_trainer(argv: list[str]) -> int:
    from tests.fakes import scripted_trainer as st

    opts = dict(a.partition("=")[::2] for a in argv)
    log = Path(opts["bench_log"])
    plain = st.write_checkpoint
    # Imported before the first epoch, so that torch's import is not in any epoch's figures.
    save = torch_checkpoints() if st.truthy(opts.get("torch_save", "0")) else None

    def write_checkpoint(path: Path, epoch: int, *, payload_kb: int = 4) -> None:
        if save is not None:
            took = save(path, epoch, payload_kb)
        else:
            t0 = time.time()
            plain(path, epoch, payload_kb=payload_kb)
            took = time.time() - t0
        _log(log, name=path.name, epoch=epoch, t=time.time(), write_s=round(took, 4))

    if st.truthy(opts.get("cuda", "0")):
        # A CUDA context, as LibreYOLO's on a GPU: the process's exit then tears it down.
        import torch

        torch.zeros(1, device="cuda")
    st.write_checkpoint = write_checkpoint  # type: ignore[assignment]
    try:
        return st.main(argv)
    finally:
        _log(log, exit=time.time())
        # The interpreter's shutdown after the last status.json (torch's, CUDA's): the agent
        # cannot see an exit before it ends.
        time.sleep(float(opts.get("linger_s", "0")))


class _Stub:
    """Whatever a checkpoint's pickle would build from torch (a tensor, a storage type, a
    dtype): takes any arguments and any state, and is nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


#: The real classes a checkpoint's pickle may name; anything else (torch.*) is a _Stub.
_PICKLE_SAFE = {
    ("builtins", name)
    for name in (
        "dict",
        "list",
        "tuple",
        "set",
        "frozenset",
        "int",
        "float",
        "complex",
        "bool",
        "str",
        "bytes",
        "bytearray",
        "slice",
        "range",
    )
} | {("collections", "OrderedDict")}


def checkpoint_epoch(path: Path) -> int | None:
    """The epoch stored in a checkpoint, or None where it cannot be read (a torn copy): the
    scripted trainer's (its data.pkl is JSON) or one written by ``torch.save`` (a dict with
    ``"epoch"``), read without importing torch: the tensors' storages (persistent ids) are
    None and torch's classes and functions are :class:`_Stub`."""
    import io
    import pickle
    import zipfile

    from tests.fakes.scripted_trainer import read_checkpoint_epoch

    epoch = read_checkpoint_epoch(path)
    if epoch is not None:
        return epoch

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> None:
            return None

        def find_class(self, module: str, name: str) -> Any:
            if (module, name) in _PICKLE_SAFE:
                return super().find_class(module, name)
            return _Stub

    try:
        with zipfile.ZipFile(path) as zf:
            pkl = min((n for n in zf.namelist() if n.endswith("/data.pkl")), key=len)
            data = Unpickler(io.BytesIO(zf.read(pkl))).load()
        value = data["epoch"]
    except Exception:  # torn, not a zip, no data.pkl, not a dict: nothing to read
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _run_dir(runs: Path) -> Path | None:
    found = sorted(runs.glob("*/status.json"))
    return found[0].parent if found else None


def anchor_poll(runs: Path, every_s: float, log: Path) -> int:
    """Every ``every_s``: status.json read and parsed, last.pt hashed; ends with the run."""
    while True:
        run = _run_dir(runs)
        state = None
        if run is not None:
            with contextlib.suppress(OSError, ValueError):
                state = json.loads((run / "status.json").read_text()).get("state")
            digest = hashlib.sha256()
            with contextlib.suppress(OSError), open(run / "weights" / "last.pt", "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            _log(log, t=time.time(), state=state, sha256=digest.hexdigest()[:12])
        if state in ("completed", "failed"):
            return 0
        time.sleep(every_s)


def anchor_sync(runs: Path, target: Path, every_s: float, first_s: float, log: Path) -> int:
    """Every ``every_s``: copy each changed checkpoint (size or mtime) to ``target``."""
    seen: dict[str, tuple[int, int]] = {}
    target.mkdir(parents=True, exist_ok=True)
    time.sleep(first_s)
    while True:
        run = _run_dir(runs)
        if run is not None:
            for src in sorted((run / "weights").glob("*.pt")):
                try:
                    st = src.stat()
                except OSError:
                    continue
                key = (st.st_size, st.st_mtime_ns)
                if seen.get(src.name) == key:
                    continue
                started = time.time()
                dest = target / src.name
                with contextlib.suppress(OSError):
                    shutil.copyfile(src, dest)
                    seen[src.name] = key
                    # Not part of the naive loop: which epoch it caught (None: a torn copy).
                    _log(log, name=src.name, t=started, epoch=checkpoint_epoch(dest))
        time.sleep(every_s)


def anchor_idle(pid: int, every_s: float, first_s: float, log: Path) -> int:
    """A periodic idle check: is the trainer still there? Logs the first time it is not."""
    time.sleep(first_s)
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            _log(log, gone=time.time())
            return 0
        except PermissionError:
            pass
        time.sleep(every_s)


def main(argv: list[str]) -> int:
    mode, rest = argv[0], argv[1:]
    if mode == "trainer":
        return timed_trainer(rest)
    if mode == "poll":
        return anchor_poll(Path(rest[0]), float(rest[1]), Path(rest[2]))
    if mode == "sync":
        return anchor_sync(
            Path(rest[0]), Path(rest[1]), float(rest[2]), float(rest[3]), Path(rest[4])
        )
    if mode == "idle":
        return anchor_idle(int(rest[0]), float(rest[1]), float(rest[2]), Path(rest[3]))
    raise SystemExit(f"bench/common.py: unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
