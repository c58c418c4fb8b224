"""Job files for tests that run the daemon on the real ``libreyolo train``: a tiny CPU run."""

from __future__ import annotations

from pathlib import Path

from agent.config import Job, parse_job


def tiny_job(tmp: Path, data: Path, *, epochs: int = 3, train: str = "", sections: str = "") -> Job:
    """yolox-n from scratch at 64x64 on the CPU, preflight off, HTTP on a free port.

    ``train`` adds lines to [train]; ``sections`` adds whole sections (e.g. a [sync] table)."""
    text = f"""
[job]
name = "run1"
runs_dir = "{tmp / "runs"}"
[train]
model = "yolox-n"
pretrained = false
data = "{data}"
epochs = {epochs}
imgsz = 64
batch = 4
workers = 0
device = "cpu"
stop_grace = "30s"
kill_grace = "5s"
{train}
[preflight]
enabled = false
[server]
listen = "127.0.0.1:0"
{sections}
"""
    return parse_job(text, source="test", base_dir=tmp)
