"""agent/install/torchmeta.py: which torch an interpreter would import, its version, CUDA build and
kernels, read from its files (never imported): against stand-in distributions and, where this
interpreter has one, the real torch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.install import torchmeta
from tests.fakes.image_torch import fatbin_elf, write_dist, write_torch


def test_version_py_as_pytorch_writes_it(tmp_path: Path) -> None:
    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "version.py").write_text(
        "from typing import Optional\n\n"
        "__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip']\n"
        "__version__ = '2.14.1+cu130'\n"
        "debug = False\n"
        "cuda: Optional[str] = '13.0'\n"
        "git_version = '5c48869'\n"
        "hip: Optional[str] = None\n",
        encoding="utf-8",
    )
    assert torchmeta.read_version_py(pkg) == {"__version__": "2.14.1+cu130", "cuda": "13.0"}
    (pkg / "version.py").write_text('__version__ = "2.5.1"\ncuda = None\n', encoding="utf-8")
    assert torchmeta.read_version_py(pkg) == {"__version__": "2.5.1", "cuda": None}
    assert torchmeta.read_version_py(tmp_path / "missing") == {}


def test_dist_version_matches_the_normalised_name(tmp_path: Path) -> None:
    write_dist(tmp_path, "PyYAML", "6.0.4", {"yaml/__init__.py": ""})
    write_dist(tmp_path, "torchvision", "0.29.1", {"torchvision/__init__.py": ""})
    assert torchmeta.dist_version(tmp_path / "yaml", "pyyaml") == "6.0.4"
    assert torchmeta.dist_version(tmp_path / "torchvision", "torchvision") == "0.29.1"
    assert torchmeta.dist_version(tmp_path / "torch", "torch") is None  # torchvision is not it


def test_fatbin_archs_are_those_every_fat_binary_holds(tmp_path: Path) -> None:
    lib = tmp_path / "libtorch_cuda.so"
    lib.write_bytes(fatbin_elf([[(2, 80), (2, 90), (1, 90)], [(2, 80), (2, 90), (1, 90), (2, 89)]]))
    assert torchmeta.fatbin_arch_list(lib) == ("sm_80", "compute_90", "sm_90")
    lib.write_bytes(b"\x7fELF not really")
    assert torchmeta.fatbin_arch_list(lib) == ()
    lib.write_bytes(b"#!/bin/sh\n")
    assert torchmeta.fatbin_arch_list(lib) == ()
    assert torchmeta.fatbin_arch_list(tmp_path / "none.so") == ()


def test_parse_find_reads_the_files_it_names(tmp_path: Path) -> None:
    site = tmp_path / "site"
    write_torch(site, version="2.11.0+cu130", cuda="13.0", archs=(75, 90))
    found = {"site": [str(site)], "torch": str(site / "torch"), "libreyolo": None}
    found["torchvision"] = str(site / "torchvision")
    seen = torchmeta.parse_find(json.dumps(found))
    assert seen.torch is not None and seen.torch.version == "2.11.0+cu130"
    assert seen.cuda == "13.0" and seen.arch_list == ("sm_75", "sm_90")
    assert seen.torchvision is not None and seen.torchvision.version == "0.26.0+cu130"
    assert seen.torch_dirs() == [site]
    assert torchmeta.check_sees(seen, [site / "torch", site / "torchvision"]) is None
    assert "not the image's" in str(torchmeta.check_sees(seen, [tmp_path / "x" / "torch"]))
    assert torchmeta.parse_find("Traceback ...").error is not None


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="no torch here")
def test_the_real_torch_read_as_importing_it_says() -> None:
    """This interpreter's own torch: its files give what ``import torch`` gives."""
    seen = torchmeta.read_seen(sys.executable)
    assert seen.error is None and seen.torch is not None, seen
    asked = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, torchvision; print(torch.__file__); print(torch.version.cuda); "
            "print(torchvision.__version__); "
            "print(' '.join(torch._C._cuda_getArchFlags().split()) if torch.version.cuda else '')",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout.splitlines()
    torch_file, cuda, vision, archs = [*asked, ""][:4]
    assert Path(torch_file).parent == seen.torch.path
    assert seen.cuda == (cuda if cuda != "None" else None)
    assert seen.torchvision is not None and vision.startswith(str(seen.torchvision.version))
    if seen.cuda:
        assert " ".join(seen.arch_list) == archs
