"""The embedded demo job: a synthetic detection dataset made on the spot, ``yolox-n`` trained from
scratch (no download), checkpoints synced to a local folder, teardown ``none``. Offline, CPU or
GPU, well under a minute of training.
"""

from __future__ import annotations

import random
import shutil
import struct
import zlib
from pathlib import Path

from .config import Job
from .jobfile import parse_job

#: Where the demo puts everything, relative to the current directory.
DEMO_DIR = Path("libreyolo-agent-demo")


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
