"""The restore drill: the final checkpoints fetched back from the sync target and loaded.

"Verified" (:mod:`agent.sync.verify`) means the target holds the same bytes as the box. A
checkpoint can be those bytes and still not load: a valid zip whose pickle raises, a state dict
missing tensors, a model LibreYOLO cannot build from its metadata. So at the end of a job
(before the teardown decision) and on ``libreyolo-agent verify TARGET``, ``weights/best.pt``
and ``weights/last.pt`` are downloaded from the target into a scratch folder (the same
download a new box makes: checked against the target's size and sha256) and loaded in a child
process with LibreYOLO, CPU only, no training (:mod:`agent.trainer.loadcheck`), each within
``timeout_s`` (download and load). A file whose content the drill already loaded (``best.pt``
is often ``last.pt``) is not loaded twice.

The result gates a destroy (``teardown.require_restore_drill``, :mod:`agent.policy.teardown`):
``failed`` or ``timed_out`` turns it into a stop. ``skipped`` (no target, nothing on it) never
does: that case is the verified-sync gate's.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from agent.sinks import Sink, SinkError
from agent.trainer.loadcheck import check_loads
from agent.util.threads import in_daemon_thread

log = logging.getLogger(__name__)

#: What the drill loads, in this order.
DRILL_PATHS = ("weights/best.pt", "weights/last.pt")
#: Seconds one file's drill (download and load) may take by default
#: (``teardown.restore_drill_timeout``).
DEFAULT_TIMEOUT_S = 900.0

#: The whole drill: ``ok`` every file on the target loaded; ``failed`` one did not (or could not
#: be fetched); ``timed_out`` one took too long; ``skipped`` nothing was loaded (``why``).
DrillStatus = Literal["ok", "failed", "timed_out", "skipped"]
#: One file: as the whole, or ``missing`` (not on the target).
FileStatus = Literal["ok", "failed", "timed_out", "missing"]


@dataclass(frozen=True)
class FileDrill:
    path: str
    status: FileStatus
    #: Download and load, seconds.
    seconds: float = 0.0
    download_s: float | None = None
    size: int | None = None
    sha256: str | None = None
    #: What the loader said: the model family and size, how many tensors, the epoch.
    family: str | None = None
    epoch: int | None = None
    detail: str | None = None


@dataclass(frozen=True)
class RestoreDrill:
    status: DrillStatus
    #: One line for the log, the teardown's why and the post-mortem.
    why: str
    at: float
    seconds: float = 0.0
    files: list[FileDrill] = field(default_factory=list)

    @property
    def blocks_destroy(self) -> bool:
        """A checkpoint on the target that did not load (or not in time): destroying the box
        could leave nothing usable."""
        return self.status in ("failed", "timed_out")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def skipped(why: str, at: float) -> RestoreDrill:
    return RestoreDrill("skipped", f"restore drill skipped: {why}", at)


def _whole(files: list[FileDrill], at: float, seconds: float) -> RestoreDrill:
    tried = [f for f in files if f.status != "missing"]
    if not tried:
        return skipped(f"neither {' nor '.join(DRILL_PATHS)} is on the target", at)
    bad = next((f for f in tried if f.status == "failed"), None) or next(
        (f for f in tried if f.status == "timed_out"), None
    )
    if bad is not None:
        status: DrillStatus = "failed" if bad.status == "failed" else "timed_out"
        word = "FAILED" if status == "failed" else "TIMED OUT"
        return RestoreDrill(
            status, f"restore drill {word}: {bad.path}: {bad.detail}", at, seconds, files
        )
    names = ", ".join(
        f"{f.path} ({f.family or '?'} epoch {f.epoch if f.epoch is not None else '?'})"
        for f in tried
    )
    return RestoreDrill(
        "ok", f"restore drill ok: {names} loaded in {seconds:.0f}s", at, seconds, files
    )


async def run_drill(
    sink: Sink,
    scratch_root: Path,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    now: Callable[[], float] = time.time,
    loader_argv: Sequence[str] | None = None,
    paths: Sequence[str] = DRILL_PATHS,
) -> RestoreDrill:
    """Fetch each of ``paths`` from ``sink`` into a scratch folder under ``scratch_root``
    (removed after) and load it in a child (``loader_argv``: a stand-in loader for tests).
    Never raises for a bad target, file or child."""
    started = time.monotonic()
    files: list[FileDrill] = []
    loaded: dict[str, FileDrill] = {}  # sha256 -> the drill that loaded that content
    try:
        scratch_root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="restore-drill-", dir=scratch_root))
    except OSError as exc:
        why = f"no scratch folder in {scratch_root}: {exc.strerror or exc}"
        return RestoreDrill("failed", f"restore drill FAILED: {why}", now())
    try:
        for path in paths:
            files.append(await _one(sink, path, scratch, timeout_s, loader_argv, loaded))
    finally:
        await asyncio.to_thread(shutil.rmtree, scratch, True)
    drill = _whole(files, now(), time.monotonic() - started)
    (log.info if drill.status in ("ok", "skipped") else log.error)("%s", drill.why)
    return drill


async def _one(
    sink: Sink,
    path: str,
    scratch: Path,
    timeout_s: float,
    loader_argv: Sequence[str] | None,
    loaded: dict[str, FileDrill],
) -> FileDrill:
    started = time.monotonic()
    local = scratch / path.rpartition("/")[2]
    try:
        remote = await asyncio.wait_for(
            asyncio.wrap_future(
                in_daemon_thread(sink.download, path, local, name="restore-drill-download")
            ),
            timeout_s,
        )
    except TimeoutError:
        why = f"the download took over {timeout_s:.0f}s"
        return FileDrill(path, "timed_out", time.monotonic() - started, detail=why)
    except (SinkError, OSError) as exc:
        why = f"cannot fetch it from the target: {exc}"
        return FileDrill(path, "failed", time.monotonic() - started, detail=why)
    if remote is None:
        return FileDrill(path, "missing", detail="not on the target")
    fetched = time.monotonic()
    same = loaded.get(remote.sha256)
    if same is not None:
        local.unlink(missing_ok=True)
        return FileDrill(
            path,
            same.status,
            fetched - started,
            fetched - started,
            remote.size,
            remote.sha256,
            same.family,
            same.epoch,
            f"the same content as {same.path}: not loaded twice",
        )
    left = max(1.0, timeout_s - (fetched - started))
    check = await check_loads(local, timeout_s=left, argv=loader_argv)
    local.unlink(missing_ok=True)  # a big checkpoint does not wait for the next one's space
    answer = check.answer
    epoch = answer.get("epoch")
    size = answer.get("size")
    result = FileDrill(
        path,
        check.status,
        time.monotonic() - started,
        fetched - started,
        remote.size,
        remote.sha256,
        f"{answer.get('family')}" + (f"-{size}" if size else "") if answer.get("family") else None,
        epoch if isinstance(epoch, int) else None,
        check.error
        or f"{answer.get('tensors')} tensors loaded in {check.seconds:.1f}s "
        f"(load {answer.get('load_s')}s)",
    )
    if result.status == "ok":
        loaded[remote.sha256] = result
    return result
