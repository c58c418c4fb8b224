"""The embedded demo job: a synthetic detection dataset made on the spot, ``yolox-n`` trained from
scratch (no download), checkpoints synced to a local folder, teardown ``none``. Offline, CPU or
GPU, well under a minute of training.

``run`` with no JOB (:class:`Demo`): each run starts the demo over, unless the previous demo run
has not ended (its agent was killed, or exited on SIGTERM or a second Ctrl-C): that run is
carried on like any job's (re-attached to its trainer when it still runs), never wiped under a
live trainer. Ctrl-C stops the demo *job* (``libreyolo-agent stop``: the trainer gets SIGINT, the
final sync runs, exit 0: the job ended); a second Ctrl-C (or SIGTERM) makes the agent leave before
the job ended (a trainer it is stopping is stopped first, one it is not goes on), exit
:data:`EXIT_NOT_ENDED`, and the next ``run`` carries the job on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import shutil
import signal
import struct
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from agent.config.jobfile import parse_job
from agent.config.model import Job
from agent.state import StateStore

if TYPE_CHECKING:
    from agent.daemon.spine import Daemon

log = logging.getLogger(__name__)

#: Where the demo puts everything, relative to the current directory.
DEMO_DIR = Path("libreyolo-agent-demo")
#: ``run`` with no JOB: the agent exited before the demo job ended (SIGTERM, a second Ctrl-C);
#: its trainer may still run, and the next ``run`` carries the job on. 0 means the job ended.
EXIT_NOT_ENDED = 3


class Demo:
    """The demo job's wiring for ``libreyolo-agent run`` with no JOB (agent/cli.py)."""

    def __init__(self, root: Path, *, port: int = 0) -> None:
        self.root = root.resolve()
        self.job = demo_job(self.root, port=port)
        #: The demo's state lives in its own folder, whatever LIBREYOLO_AGENT_STATE_DIR says:
        #: that variable names a real job's state, which the demo must never touch.
        self.state_dir = self.root / "state"

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        return dict(base, LIBREYOLO_AGENT_STATE_DIR=str(self.state_dir))

    def stage(self) -> None:
        make_dataset(self.root / "data")

    def fresh_start(self) -> None:
        """The daemon's ``fresh_start`` (it runs once this agent holds the demo's lock, so never
        beside another demo agent): start over, unless the previous demo run has not ended."""
        try:
            previous = StateStore(self.state_dir).load()
        except (ValueError, KeyError, TypeError):
            return  # the agent refuses an unreadable state file itself, naming it
        if previous is not None and not previous.phase.terminal:
            trainer = previous.trainer.pid if previous.trainer else None
            log.warning(
                "the previous demo run has not ended (phase %s%s): carrying it on (its trainer "
                "is re-attached if it still runs); to start over, let it end (Ctrl-C stops it) "
                "and run the demo again",
                previous.phase.value,
                f", trainer pid {trainer}" if trainer else "",
            )
            return
        reset(self.root)

    def on_ready(self, then: Callable[[Daemon], None]) -> Callable[[Daemon], None]:
        """The daemon's ``on_ready``: ``then``, and Ctrl-C made a stop of the job."""

        def ready(daemon: Daemon) -> None:
            then(daemon)
            ctrl_c_stops_the_job(daemon)

        return ready

    def exit_code(self, daemon: Daemon, code: int) -> int:
        """0 only when the job ended (:data:`EXIT_NOT_ENDED` otherwise)."""
        if code != 0 or daemon.state.phase.terminal:
            return code
        return EXIT_NOT_ENDED

    def not_ended(self, daemon: Daemon) -> str:
        """The line said when the agent exits before the job ended."""
        from agent.trainer.rundir import (
            pid_alive,  # psutil: this module stays importable without it
        )

        rec = daemon.state.trainer
        runs = (
            f"its trainer (pid {rec.pid}) keeps running"
            if rec is not None and pid_alive(rec.pid, rec.create_time)
            else "no trainer of it runs"
        )
        return (
            f"the demo job has not ended (phase {daemon.state.phase.value}): {runs}; "
            f"'libreyolo-agent run{self._dir_option()}' again carries it on"
        )

    def _dir_option(self) -> str:
        if self.root == DEMO_DIR.resolve():
            return ""
        return f" --demo-dir {self.root}"


def ctrl_c_stops_the_job(daemon: Daemon) -> None:
    """SIGINT to the agent stops the *job* (as ``libreyolo-agent stop``): a person who presses
    Ctrl-C on the demo wants it to stop, trainer included; the run ends and the agent exits 0.
    A second one is the daemon's own: the agent leaves before the job ended (once a stop under
    way has stopped the trainer; else the trainer goes on)."""
    flags = daemon.flags
    if flags is None:
        return

    def on_sigint() -> None:
        if not flags.stop_job.is_set() and not flags.shutdown.is_set():
            log.warning(
                "Ctrl-C: stopping the demo job (the trainer gets SIGINT, then the final sync); "
                "Ctrl-C again makes the agent leave before the job ended, and the next "
                "'libreyolo-agent run' carries it on"
            )
            flags.stop_job.set()
            return
        if flags.shutdown.is_set():
            flags.force.set()
        flags.shutdown.set()

    # Replaces the daemon's handler (agent/daemon/signals.py), which signals.remove() takes down.
    with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, on_sigint)


def demo_job(root: Path, *, port: int = 8421, epochs: int = 3) -> Job:
    """The demo job with all its folders under ``root``."""
    root = root.resolve()
    text = f"""
[job]
name = "demo"
runs_dir = "{root / "runs"}"

[train]
model = "yolox-n"
pretrained = false
data = "{root / "data" / "data.yaml"}"
epochs = {epochs}
imgsz = 64
batch = 4
workers = 0
save_period = 1

[sync]
target = "file://{root / "synced"}"
every_epochs = 1

[preflight]
allow_cpu = true

[teardown]
provider = "none"

[server]
listen = "127.0.0.1:{port}"
"""
    return parse_job(text, source="<demo>", base_dir=root)


def reset(root: Path) -> None:
    """Start the demo over: its runs, synced copies and state (but the lock file, which the
    caller holds). Touches nothing outside ``root``."""
    for sub in ("runs", "synced"):
        shutil.rmtree(root / sub, ignore_errors=True)
    state = root / "state"
    if state.is_dir():
        for child in state.iterdir():
            if child.name == "agent.lock":
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


def _png(width: int, height: int, pixels: bytes) -> bytes:
    """A minimal RGB PNG (no imaging library needed: the agent does not depend on one)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    rows = b"".join(b"\x00" + pixels[y * width * 3 : (y + 1) * width * 3] for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows, 6))
        + chunk(b"IEND", b"")
    )


def make_dataset(
    root: Path, *, train: int = 8, val: int = 4, size: int = 64, seed: int = 0
) -> Path:
    """Write a YOLO-layout dataset of coloured boxes on plain backgrounds; returns data.yaml."""
    rng = random.Random(seed)
    if root.exists():
        shutil.rmtree(root)
    for split, count in (("train", train), ("val", val)):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for i in range(count):
            bg = rng.randint(0, 90)
            w, h = rng.randint(size // 5, size // 2), rng.randint(size // 5, size // 2)
            x0, y0 = rng.randint(0, size - w - 1), rng.randint(0, size - h - 1)
            pix = bytearray(bytes([bg]) * (size * size * 3))
            for y in range(y0, y0 + h):
                for x in range(x0, x0 + w):
                    o = (y * size + x) * 3
                    pix[o : o + 3] = b"\xe6\x28\x28"
            (root / "images" / split / f"{i:03d}.png").write_bytes(_png(size, size, bytes(pix)))
            cx, cy = (x0 + w / 2) / size, (y0 + h / 2) / size
            (root / "labels" / split / f"{i:03d}.txt").write_text(
                f"0 {cx:.6f} {cy:.6f} {w / size:.6f} {h / size:.6f}\n"
            )
    yaml = root / "data.yaml"
    yaml.write_text(
        f"path: {root.resolve()}\ntrain: images/train\nval: images/val\nnames:\n  0: box\n"
    )
    return yaml
