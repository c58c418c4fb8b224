"""A GPU image's torch, made in a test: a stand-in ``torch`` and ``torchvision`` distribution
(``.dist-info`` with METADATA and RECORD, ``torch/version.py`` as PyTorch writes it, and a small
``libtorch_cuda.so`` whose ``.nv_fatbin`` section holds the cubins of the given archs), in an
"image" venv of its own when asked (a venv whose base interpreter holds no torch: the uv-made
images the H200 boxes boot).

Importing the stand-in works (``torch.__version__``, ``torch.version.cuda``,
``torch.cuda.get_arch_list()``); it does nothing else: install.sh and agent/install/torchpick.py
must never import it anyway.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import subprocess
import sys
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50


def fatbin_elf(containers: list[list[tuple[int, int]]]) -> bytes:
    """An ELF64 file with a ``.nv_fatbin`` section: one fat binary per list of (kind, sm)
    entries (kind 2 a cubin, 1 PTX), laid out as nvcc lays them out (64-byte entry headers)."""
    section = b""
    for entries in containers:
        body = b""
        for kind, sm in entries:
            payload = b"\0" * 16
            head = struct.pack("<HHIIIIIII", kind, 0x101, 64, len(payload), 0, 16, 0, 0, sm)
            body += head.ljust(64, b"\0") + payload
        section += struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body
    names = b"\0.shstrtab\0.nv_fatbin\0"
    names_at = 64
    fatbin_at = (names_at + len(names) + 15) // 16 * 16
    shoff = (fatbin_at + len(section) + 15) // 16 * 16
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHHHHH", header, 0x34, 64, 0, 0, 64, 3, 1)

    def sh(name: int, offset: int, size: int) -> bytes:
        return struct.pack(
            "<IIQQQQIIQQ", name, 3 if name == 1 else 1, 0, 0, offset, size, 0, 0, 1, 0
        )

    out = bytearray(header)
    out += names
    out += b"\0" * (fatbin_at - len(out)) + section
    out += b"\0" * (shoff - len(out))
    out += b"\0" * 64 + sh(1, names_at, len(names)) + sh(11, fatbin_at, len(section))
    return bytes(out)


def _record_line(site: Path, path: Path) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=")
    return f"{path.relative_to(site)},sha256={digest.decode()},{path.stat().st_size}"


def write_dist(site: Path, name: str, version: str, files: dict[str, str | bytes]) -> None:
    """A package ``name`` with ``files`` (relative to ``site``) and its ``.dist-info``."""
    written = []
    for rel, content in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        written.append(path)
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8"
    )
    (info / "INSTALLER").write_text("image\n", encoding="utf-8")
    lines = [_record_line(site, p) for p in [*written, info / "METADATA", info / "INSTALLER"]]
    lines.append(f"{info.name}/RECORD,,")
    (info / "RECORD").write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_torch(
    site: Path,
    *,
    version: str = "2.11.0+cu130",
    cuda: str | None = "13.0",
    archs: tuple[int, ...] | None = (75, 80, 86, 90, 100, 120),
    torchvision: str | None = "0.26.0+cu130",
    import_log: Path | None = None,
) -> None:
    """A stand-in torch (and torchvision) in ``site``; ``archs`` None: no libtorch_cuda.so;
    ``import_log``: each ``import torch`` appends its interpreter's path to that file."""
    cuda_text = repr(cuda)
    arch_names = [f"sm_{sm}" for sm in archs or ()] if cuda else []
    log = ""
    if import_log is not None:
        log = (
            f"import sys\nwith open({str(import_log)!r}, 'a') as _log:\n"
            "    _log.write(sys.executable + '\\n')\n"
        )
    files: dict[str, str | bytes] = {
        "torch/__init__.py": (
            log + "from torch import cuda, version\n__version__ = version.__version__\n"
        ),
        # What torch.cuda.get_arch_list() answers (asked by an install.sh that imports torch).
        "torch/cuda.py": f"def get_arch_list():\n    return {arch_names!r}\n",
        "torch/version.py": (
            "from typing import Optional\n\n"
            "__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip']\n"
            f"__version__ = '{version}'\n"
            "debug = False\n"
            f"cuda: Optional[str] = {cuda_text}\n"
            "git_version = '0000000000000000000000000000000000000000'\n"
            "hip: Optional[str] = None\n"
        ),
    }
    if archs is not None and cuda is not None:
        # Every fat binary holds the build's archs; one also holds an extra (as a bundled
        # library's kernels do), which is not the build's.
        containers = [[(2, sm) for sm in archs] for _ in range(3)]
        containers[1].append((2, 89))
        files["torch/lib/libtorch_cuda.so"] = fatbin_elf(containers)
    write_dist(site, "torch", version, files)
    if torchvision is not None:
        write_dist(
            site,
            "torchvision",
            torchvision,
            {"torchvision/__init__.py": f"__version__ = '{torchvision}'\n"},
        )


def image_venv(root: Path, **torch: object) -> Path:
    """An image venv at ``root`` (from this interpreter's base, no pip) holding the stand-in
    torch; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    write_torch(Path(site), **torch)  # type: ignore[arg-type]
    return python
