"""The ``[profile]`` pre-run: the argv built from the job, the checkpoint metadata read without
torch, the fallback messages (never a fake verdict), and the real ``libreyolo profile`` on the
CPU with weights from a 1-epoch CPU train."""

from __future__ import annotations

import asyncio
import io
import json
import os
import pickle
import shutil
import stat
import sys
import zipfile
from pathlib import Path

import pytest

from agent import demo
from agent.config.jobfile import parse_job
from agent.config.model import Job
from agent.watch.profiling import (
    CannotProfile,
    checkpoint_meta,
    online_allowed,
    plan_profile,
    run_profile,
)
from tests.support import tiny_trained_checkpoint

LIBREYOLO = shutil.which("libreyolo", path=str(Path(sys.executable).parent)) or shutil.which(
    "libreyolo"
)
#: ``0`` runs the real-profiler tests on GPU 0 (the H200 check); default: the CPU.
DEVICE = os.environ.get("LIBREYOLO_AGENT_PROFILE_DEVICE", "cpu")
requires_libreyolo = pytest.mark.skipif(
    LIBREYOLO is None, reason="the training stack (libreyolo) is not installed: run ./install.sh"
)


def make_job(model: str, *, data: str = "/d/data.yaml", extra: str = "", profile: str = "") -> Job:
    train = f'[train]\ndata = "{data}"\nmodel = "{model}"\n{extra}\n'
    return parse_job(train + f"[profile]\nenabled = true\n{profile}\n")


def fake_checkpoint(path: Path, meta: dict[str, object]) -> Path:
    """A zip laid out like a torch checkpoint (``<name>/data.pkl``) holding ``meta``."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{path.stem}/data.pkl", pickle.dumps(meta))
        z.writestr(f"{path.stem}/byteorder", "little")
    return path


def fake_libreyolo(tmp: Path, script: str) -> str:
    """A stand-in ``libreyolo`` command (a Python script) for the failure paths."""
    exe = tmp / "libreyolo"
    exe.write_text(f"#!{sys.executable}\nimport sys, json, time\n{script}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


# ------------------------------------------------------------------------ the checkpoint


def test_checkpoint_meta_reads_family_and_size(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "last.pt", {"model_family": "yolox", "size": "n", "nc": 1})
    assert checkpoint_meta(ckpt) == {"family": "yolox", "size": "n"}


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch pwned",))


def test_checkpoint_meta_never_runs_code_from_the_pickle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    raw = io.BytesIO()
    pickle.dump({"x": _Evil(), "model_family": "yolox", "size": "s"}, raw)
    with zipfile.ZipFile(tmp_path / "e.pt", "w") as z:
        z.writestr("e/data.pkl", raw.getvalue())
    assert checkpoint_meta(tmp_path / "e.pt")["size"] == "s"
    assert not (tmp_path / "pwned").exists()


def test_checkpoint_without_size_cannot_be_profiled(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "raw.pt", {"state_dict": {}})
    with pytest.raises(CannotProfile, match="does not say its model size"):
        checkpoint_meta(ckpt)
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    with pytest.raises(CannotProfile, match="cannot read"):
        checkpoint_meta(tmp_path / "junk.pt")


# ------------------------------------------------------------------------------ the plan


def test_argv_from_a_checkpoint_job(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "best.pt", {"model_family": "yolo9", "size": "t"})
    job = make_job(
        str(ckpt),
        extra='batch = 32\nimgsz = 320\nworkers = 6\ndevice = "0"\namp = false',
        profile="steps = 7\nwarmup = 2",
    )
    plan = asyncio.run(plan_profile(job, work_dir=tmp_path / "w", online=False, exe="/x/libreyolo"))
    assert list(plan.argv) == [
        "/x/libreyolo",
        "profile",
        "run",
        "/d/data.yaml",
        "--weights",
        str(ckpt),
        "--size",
        "t",
        "--steps",
        "7",
        "--warmup",
        "2",
        "--batch",
        "32",
        "--imgsz",
        "320",
        "--workers",
        "6",
        "--no-amp",
        "--device",
        "0",
        "--project",
        str(tmp_path / "w"),
        "--json",
    ]
    assert plan.family == "yolo9"


def test_multi_gpu_job_is_profiled_on_one_gpu_with_its_share_of_the_batch(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "best.pt", {"model_family": "yolox", "size": "s"})
    job = make_job(str(ckpt), extra='batch = 64\ndevice = "0,1"')
    plan = asyncio.run(plan_profile(job, work_dir=tmp_path, online=False, exe="libreyolo"))
    argv = list(plan.argv)
    assert argv[argv.index("--batch") + 1] == "32"
    assert argv[argv.index("--device") + 1] == "0"
    assert any("profiled on GPU 0 alone" in n for n in plan.notes)
    assert any("train.imgsz not set" in n for n in plan.notes)


def test_online_allowed_reads_hf_hub_offline() -> None:
    assert online_allowed({}) is True
    assert online_allowed({"HF_HUB_OFFLINE": "1"}) is False
    assert online_allowed({"HF_HUB_OFFLINE": "0"}) is True


# -------------------------------------------------------------- fallbacks, never a verdict


def test_offline_model_name_falls_back_with_the_reason(tmp_path: Path) -> None:
    result = asyncio.run(
        run_profile(make_job("yolox-n"), work_dir=tmp_path, online=False, exe="libreyolo")
    )
    assert not result.ran and result.verdict is None
    assert result.message.startswith("cannot profile: train.model 'yolox-n' is a model name")
    assert "checkpoint of the same family and size" in result.message
    assert result.message.endswith("the first epochs' samples judge the box instead")


def test_missing_checkpoint_path_falls_back(tmp_path: Path) -> None:
    job = make_job(str(tmp_path / "nope" / "best.pt"))
    result = asyncio.run(run_profile(job, work_dir=tmp_path, online=True, exe="libreyolo"))
    assert result.verdict is None
    assert "does not exist" in result.message


def test_profiler_crash_falls_back_with_its_error_line(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "best.pt", {"model_family": "yolox", "size": "n"})
    exe = fake_libreyolo(
        tmp_path,
        "print('│ ❱ 538 │   raise FileNotFoundError(   │', file=sys.stderr)\n"
        "print('FileNotFoundError: Model weights file not found: x.pt', file=sys.stderr)\n"
        "print('Auto-download failed: no URL', file=sys.stderr)\nsys.exit(1)",
    )
    result = asyncio.run(run_profile(make_job(str(ckpt)), work_dir=tmp_path / "w", exe=exe))
    assert result.verdict is None and not result.ran
    assert (
        "the profiler failed (exit 1): FileNotFoundError: Model weights file not found: x.pt"
        in (result.message)
    )
    assert "Auto-download failed" in result.message


def test_size_mismatch_is_named(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "best.pt", {"model_family": "yolox", "size": "n"})
    exe = fake_libreyolo(
        tmp_path,
        "print('RuntimeError: Error(s) in loading state_dict for LibreYOLOXModel:', "
        "file=sys.stderr)\n"
        "print('        size mismatch for head.stems.1.bn.weight: copying a param', "
        "file=sys.stderr)\nsys.exit(1)",
    )
    result = asyncio.run(run_profile(make_job(str(ckpt)), work_dir=tmp_path / "w", exe=exe))
    assert result.verdict is None
    assert f"the weights {ckpt} do not match --size n" in result.message


def test_hung_profiler_is_killed_at_the_timeout(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "best.pt", {"model_family": "yolox", "size": "n"})
    exe = fake_libreyolo(tmp_path, "time.sleep(600)")
    job = make_job(str(ckpt), profile='timeout = "1s"')
    result = asyncio.run(run_profile(job, work_dir=tmp_path / "w", exe=exe))
    assert result.verdict is None
    assert "did not finish within [profile] timeout (1 s); killed" in result.message


def test_no_json_is_no_verdict(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "best.pt", {"model_family": "yolox", "size": "n"})
    exe = fake_libreyolo(tmp_path, "print('img/s: 5.5  |  host / launch')")
    result = asyncio.run(run_profile(make_job(str(ckpt)), work_dir=tmp_path / "w", exe=exe))
    assert result.verdict is None and not result.ran
    assert result.message.startswith("cannot profile: the profiler failed (exit 0)")


# ------------------------------------------------------------------ the real profiler, CPU


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny dataset and the ``last.pt`` of a 1-epoch yolox-n CPU train from scratch (the
    checkpoint made once a session, the dataset this module's own)."""
    assert LIBREYOLO is not None
    data = demo.make_dataset(tmp_path_factory.mktemp("prof") / "ds")
    return data, tiny_trained_checkpoint(tmp_path_factory)


@requires_libreyolo
def test_real_profiler_without_usable_weights_says_so(tmp_path: Path) -> None:
    # CI's case: a from-scratch job by model name on a box that may not download.
    data = demo.make_dataset(tmp_path / "ds")
    job = make_job("yolox-n", data=str(data), extra='pretrained = false\ndevice = "cpu"')
    result = asyncio.run(run_profile(job, work_dir=tmp_path / "w", online=False))
    assert result.verdict is None and result.bound is None and result.img_per_s is None
    assert result.message.startswith("cannot profile: ")


@pytest.mark.training
@requires_libreyolo
@pytest.mark.timeout(900)
def test_real_profiler_gives_libreyolos_verdict(trained: tuple[Path, Path], tmp_path: Path) -> None:
    data, weights = trained
    job = make_job(
        str(weights),
        data=str(data),
        extra=f'device = "{DEVICE}"\nimgsz = 64\nbatch = 4\nworkers = 0',
        profile='steps = 3\nwarmup = 1\ntimeout = "12m"',
    )
    result = asyncio.run(run_profile(job, work_dir=tmp_path / "w", online=False))
    assert result.ran, result.message
    assert result.verdict is not None and result.verdict.source == "profiler"
    # LibreYOLO's own word, from its own JSON (its profile.json written by this run).
    assert result.bound in ("compute", "dataloader", "host / launch", "memory-pressure")
    profile_json = json.loads((tmp_path / "w" / "prof" / "profile.json").read_text())
    assert result.bound == profile_json["bound"]
    assert result.img_per_s is not None and result.img_per_s > 0
    assert result.img_per_s == profile_json["img_per_s"]
    assert result.summary is not None and result.summary["bound"] == result.bound
    assert "--size" in result.argv and result.argv[result.argv.index("--size") + 1] == "n"
    assert any("profiled on the CPU" in n for n in result.notes) == (DEVICE == "cpu")
