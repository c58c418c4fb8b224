"""agent/torchpick.py: the torch decision from nvidia-smi (driver 535/550/570/580 style) and the
image's torch, LibreYOLO's extras for a job, and the "nothing left to install" check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent import torchpick
from agent.torchpick import Gpu, ImageTorch, Smi, decide, has_kernels, parse_smi

REPO_ROOT = Path(__file__).resolve().parent.parent


def header(driver: str, cuda: str | None) -> str:
    """nvidia-smi's header table, as the driver of that version prints it."""
    cuda_cell = f"CUDA Version: {cuda}" if cuda else ""
    return (
        "Tue Jun  3 10:00:00 2025\n"
        "+-----------------------------------------------------------------------------------+\n"
        f"| NVIDIA-SMI {driver}     Driver Version: {driver}     {cuda_cell}       |\n"
        "|-----------------------------------------+------------------------+----------------+\n"
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile ECC   |\n"
    )


SMI_535 = header("535.183.01", "12.2")
SMI_550 = header("550.127.05", "12.4")
SMI_570 = header("570.133.20", "12.8")
SMI_580 = header("580.82.07", "13.0")
ARCH_CU124 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
ARCH_CU128 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120")


def image(
    version: str, cuda: str | None, arch: tuple[str, ...], vision: str = "0.20.1"
) -> ImageTorch:
    return ImageTorch(version=version, cuda=cuda, arch_list=arch, torchvision=vision)


def test_parse_smi_reads_driver_cuda_and_cards() -> None:
    smi = parse_smi(SMI_550, "NVIDIA L4, 8.9\nNVIDIA L4, 8.9\n")
    assert smi.driver == "550.127.05" and smi.cuda == (12, 4)
    assert smi.gpus == (Gpu("NVIDIA L4", (8, 9)), Gpu("NVIDIA L4", (8, 9)))


def test_parse_smi_without_cuda_line_uses_the_driver_table() -> None:
    assert parse_smi(header("535.54.03", None)).cuda == (12, 2)
    assert parse_smi(header("570.86.10", None)).cuda == (12, 8)
    # An old nvidia-smi refuses the compute_cap field: the cards are simply unknown.
    smi = parse_smi(SMI_535, 'Field "compute_cap" is not a valid field to query.\n')
    assert smi.gpus == ()


def test_parse_smi_of_a_broken_driver_says_why() -> None:
    text = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
    smi = parse_smi(text)
    assert smi.driver is None and smi.error is not None and "couldn't communicate" in smi.error


@pytest.mark.parametrize(
    ("cap", "arch", "expected"),
    [
        ((8, 6), ("sm_80",), True),  # same major, newer minor: binary compatible
        ((8, 0), ("sm_86",), False),
        ((9, 0), ("sm_90a",), True),
        ((9, 1), ("sm_90a",), False),  # arch-specific cubins run on their own card only
        ((12, 0), ("sm_90", "compute_90"), True),  # PTX is compiled by the driver
        ((12, 0), ARCH_CU124, False),  # Blackwell with a pre-12.8 build
        ((6, 1), ARCH_CU128, False),
    ],
)
def test_has_kernels(cap: tuple[int, int], arch: tuple[str, ...], expected: bool) -> None:
    assert has_kernels(cap, arch) is expected


def test_no_nvidia_smi_is_the_cpu_default() -> None:
    d = decide(None, None)
    assert d.action == "default" and d.torch_spec == torchpick.DEFAULT_TORCH_SPEC
    assert d.pip_args == "" and not d.system_site_packages
    assert "no nvidia-smi" in d.reason


def test_driver_550_keeps_a_fitting_image_torch() -> None:
    smi = parse_smi(SMI_550, "NVIDIA GeForce RTX 4090, 8.9\n")
    d = decide(smi, image("2.5.1+cu124", "12.4", ARCH_CU124))
    assert d.action == "keep" and d.torch_spec == "" and d.system_site_packages
    assert "2.5.1+cu124" in d.reason and "no download" in d.reason


def test_driver_535_refuses_an_image_torch_built_for_newer_cuda() -> None:
    smi = parse_smi(SMI_535, "NVIDIA A100-SXM4-80GB, 8.0\n")
    d = decide(smi, image("2.14.1+cu128", "12.8", ARCH_CU128, "0.29.1"))
    assert d.action == "install"
    assert d.torch_spec == "torch==2.5.1 torchvision==0.20.1"  # the last cu121 torch
    assert d.pip_args == "--index-url https://download.pytorch.org/whl/cu121"
    assert "built for CUDA 12.8" in d.reason and "CUDA <= 12.2" in d.reason


def test_driver_570_blackwell_needs_a_cu128_build() -> None:
    smi = parse_smi(SMI_570, "NVIDIA RTX PRO 6000 Blackwell, 12.0\n")
    d = decide(smi, image("2.5.1+cu124", "12.4", ARCH_CU124))
    assert d.action == "install" and d.pip_args.endswith("/cu128")
    assert d.torch_spec == "torch==2.14.1 torchvision==0.29.1"
    assert "no kernels for NVIDIA RTX PRO 6000 Blackwell (12.0)" in d.reason


def test_driver_580_pascal_card_gets_cu126_not_cu130() -> None:
    smi = parse_smi(SMI_580, "Tesla P100-PCIE-16GB, 6.0\n")
    d = decide(smi, None)
    assert d.action == "install" and d.pip_args.endswith("/cu126")
    assert "no torch" in d.reason


@pytest.mark.parametrize(
    ("img", "why"),
    [
        (image("2.14.1", None, ()), "CPU build"),
        (image("2.1.0+cu121", "12.1", ARCH_CU124), "older than LibreYOLO's floor"),
        (ImageTorch(version="2.5.1+cu124", cuda="12.4", arch_list=ARCH_CU124), "torchvision none"),
    ],
)
def test_an_unusable_image_torch_is_replaced(img: ImageTorch, why: str) -> None:
    d = decide(parse_smi(SMI_550, "NVIDIA H100 80GB HBM3, 9.0\n"), img)
    assert d.action == "install" and why in d.reason
    assert d.pip_args.endswith("/cu124") and d.torch_spec == "torch==2.6.0 torchvision==0.21.0"


def test_no_keep_installs_even_a_fitting_torch() -> None:
    smi = parse_smi(SMI_550, "NVIDIA L4, 8.9\n")
    d = decide(smi, image("2.5.1+cu124", "12.4", ARCH_CU124), allow_keep=False)
    assert d.action == "install" and not d.system_site_packages


def test_a_driver_too_old_for_any_build_falls_back_with_a_reason() -> None:
    smi = parse_smi(header("470.256.02", "11.4"), "Tesla K80, 3.7\n")
    d = decide(smi, None)
    assert d.action == "default" and "no PyTorch CUDA build fits" in d.reason


def test_a_failing_nvidia_smi_gives_the_default() -> None:
    d = decide(Smi(error="exit 9: NVIDIA-SMI has failed"), None)
    assert d.action == "default" and "failed" in d.reason


def test_the_index_base_is_settable() -> None:
    smi = parse_smi(SMI_570, "NVIDIA H100, 9.0\n")
    d = decide(smi, None, index_base="http://127.0.0.1:9/whl/")
    assert d.pip_args == "--index-url http://127.0.0.1:9/whl/cu128"


# ---- the command, on a PATH with a fake nvidia-smi and a fake image python


def fake_box(
    tmp_path: Path, smi_header: str | None, query: str, probe: dict[str, object]
) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi_header is not None:
        (tmp_path / "header.txt").write_text(smi_header, encoding="utf-8")
        (tmp_path / "query.txt").write_text(query, encoding="utf-8")
        smi = bin_dir / "nvidia-smi"
        smi.write_text(
            f'#!/bin/sh\nif [ $# -gt 0 ]; then cat "{tmp_path}/query.txt"; '
            f'else cat "{tmp_path}/header.txt"; fi\n',
            encoding="utf-8",
        )
        smi.chmod(0o755)
    python = bin_dir / "image-python"
    (tmp_path / "probe.json").write_text(json.dumps(probe), encoding="utf-8")
    python.write_text(f'#!/bin/sh\ncat "{tmp_path}/probe.json"\n', encoding="utf-8")
    python.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)}


def pick(env: dict[str, str], tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "agent.torchpick",
            "--python",
            str(tmp_path / "bin" / "image-python"),
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )


def test_command_keeps_the_image_torch_on_a_550_box(tmp_path: Path) -> None:
    probe = {
        "version": "2.5.1+cu124",
        "cuda": "12.4",
        "arch_list": list(ARCH_CU124),
        "torchvision": "0.20.1",
    }
    env = fake_box(tmp_path, SMI_550, "NVIDIA L40S, 8.9\n", probe)
    proc = pick(env, tmp_path, "--lines")
    assert proc.returncode == 0, proc.stderr
    action, spec, pip_args, venv_flag, reason = proc.stdout.splitlines()
    assert (action, spec, pip_args, venv_flag) == ("keep", "", "", "--system-site-packages")
    assert "NVIDIA L40S (8.9)" in reason


def test_command_json_on_a_535_box_with_a_cpu_image_torch(tmp_path: Path) -> None:
    probe = {"version": "2.14.1+cpu", "cuda": None, "arch_list": [], "torchvision": "0.29.1"}
    env = fake_box(tmp_path, SMI_535, "NVIDIA A10G, 8.6\n", probe)
    proc = pick(env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["action"] == "install" and out["pip_args"].endswith("/cu121")
    assert out["details"]["driver"] == "535.183.01" and out["details"]["driver_cuda"] == "12.2"


def test_command_without_nvidia_smi_never_asks_the_image(tmp_path: Path) -> None:
    env = fake_box(tmp_path, None, "", {"error": "must not be asked"})
    proc = pick(env, tmp_path, "--lines")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "default"
    assert "must not be asked" not in proc.stdout


# ---- extras


def extras(tmp_path: Path, toml: str, *args: str) -> subprocess.CompletedProcess[str]:
    job = tmp_path / "job.toml"
    job.write_text(toml, encoding="utf-8")
    return subprocess.run(
        [sys.executable, "-m", "agent.torchpick", "extras", str(job), *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("train", "expected"),
    [
        ('model = "yolox-n"', ""),
        ('model = "LibreYOLO9s.pt"', ""),
        ('model = "rfdetr-s"', "rfdetr"),
        ('model = "/w/LibreRFDETRn.pt"\nlora = true', "lora,rfdetr"),
        ('model = "LibreDINOv2s.pt"', "rfdetr"),
        ('model = "LibreEoMT-s.pt"\nexport_check = true', "eomt,onnx"),
        ('model = "yolox-s"\nlora = false', ""),
    ],
)
def test_job_extras(tmp_path: Path, train: str, expected: str) -> None:
    proc = extras(tmp_path, f'[job]\nname = "x"\n[train]\n{train}\n')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == expected


def test_extras_also_and_unknown_names(tmp_path: Path) -> None:
    proc = extras(tmp_path, '[train]\nmodel = "yolox-n"\n', "--also", "onnx, onnx,")
    assert proc.returncode == 0 and proc.stdout.splitlines()[0] == "onnx"
    proc = extras(tmp_path, '[train]\nmodel = "yolox-n"\n', "--also", "gpu")
    assert proc.returncode == 2 and "unknown LibreYOLO extra(s) gpu" in proc.stderr


def test_every_extra_named_exists_in_the_installed_libreyolo() -> None:
    from importlib.metadata import metadata

    provided = set(metadata("libreyolo").get_all("Provides-Extra") or [])
    assert provided >= torchpick.KNOWN_EXTRAS
    assert {extra for _, extra in (*torchpick.FAMILY_EXTRAS, *torchpick.SWITCH_EXTRAS)} <= provided


# ---- nothing pending


def test_nothing_pending_only_for_the_editable_agent_from_here(tmp_path: Path) -> None:
    site = tmp_path / "site"
    info = site / "libreyolo_agent-0.1.0.dist-info"
    info.mkdir(parents=True)
    project = tmp_path / "repo"
    project.mkdir()
    direct = {"dir_info": {"editable": True}, "url": project.as_uri()}
    (info / "direct_url.json").write_text(json.dumps(direct), encoding="utf-8")
    agent = {"metadata": {"name": "libreyolo-agent", "version": "0.1.0"}}
    assert torchpick.nothing_pending({"install": [agent]}, project, [site])
    other = {"metadata": {"name": "peft", "version": "0.18.1"}}
    assert not torchpick.nothing_pending({"install": [agent, other]}, project, [site])
    assert not torchpick.nothing_pending({"install": [agent]}, tmp_path / "elsewhere", [site])
    newer = {"metadata": {"name": "libreyolo-agent", "version": "0.2.0"}}
    assert not torchpick.nothing_pending({"install": [newer]}, project, [site])
