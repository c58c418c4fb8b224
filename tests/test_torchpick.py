"""agent/install/torchpick.py: the torch decision from one nvidia-smi query (driver
535/550/570/580) and
the image's torch read from its files, PyTorch's CPU index on a machine without nvidia-smi,
LibreYOLO's extras for a job, and the "nothing left to install" check."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agent.install import extras as job_extras
from agent.install import torchpick
from agent.install.torchpick import Gpu, ImageTorch, Smi, decide, has_kernels, parse_smi
from tests.fakes.image_torch import image_venv
from tests.fakes.torch_index import CPU_PAGES, closed_port, cpu_index, simple_page

REPO_ROOT = Path(__file__).resolve().parent.parent


def query(driver: str, *cards: str) -> str:
    """``nvidia-smi --query-gpu=driver_version,name,compute_cap --format=csv,noheader``."""
    return "".join(f"{driver}, {card}\n" for card in cards)


SMI_535 = "535.183.01"
SMI_550 = "550.127.05"
SMI_570 = "570.133.20"
SMI_580 = "580.82.07"
ARCH_CU124 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
ARCH_CU128 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120")


def image(
    version: str, cuda: str | None, arch: tuple[str, ...], vision: str = "0.20.1"
) -> ImageTorch:
    return ImageTorch(version=version, cuda=cuda, arch_list=arch, torchvision=vision)


def test_parse_smi_reads_driver_cuda_and_cards() -> None:
    smi = parse_smi(query(SMI_550, "NVIDIA L4, 8.9", "NVIDIA L4, 8.9"))
    assert smi.driver == "550.127.05" and smi.cuda == (12, 4)
    assert smi.gpus == (Gpu("NVIDIA L4", (8, 9)), Gpu("NVIDIA L4", (8, 9)))


def test_parse_smi_reads_the_cuda_from_the_driver_table() -> None:
    assert parse_smi(query("535.54.03", "NVIDIA A10G, 8.6")).cuda == (12, 2)
    assert parse_smi(query("570.86.10", "NVIDIA H100, 9.0")).cuda == (12, 8)
    assert parse_smi(query("580.82.07", "NVIDIA H200, 9.0")).cuda == (13, 0)
    # An old driver, asked again without compute_cap: the cards' capabilities are unknown.
    smi = parse_smi("470.256.02, Tesla K80\n")
    assert smi.cuda == (11, 4) and smi.gpus == (Gpu("Tesla K80", None),)
    # A name with a comma in it stays whole.
    assert parse_smi("580.82.07, Card, Rev B, 9.0\n").gpus == (Gpu("Card, Rev B", (9, 0)),)


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
    assert d.pip_args == "" and not d.sees_image
    assert "no nvidia-smi" in d.reason


def test_driver_550_keeps_a_fitting_image_torch() -> None:
    smi = parse_smi(query(SMI_550, "NVIDIA GeForce RTX 4090, 8.9"))
    d = decide(smi, image("2.5.1+cu124", "12.4", ARCH_CU124))
    assert d.action == "keep" and d.torch_spec == "" and d.sees_image
    assert "2.5.1+cu124" in d.reason and "no download" in d.reason
    assert "(read from libtorch_cuda.so)" in d.reason


def test_driver_535_refuses_an_image_torch_built_for_newer_cuda() -> None:
    smi = parse_smi(query(SMI_535, "NVIDIA A100-SXM4-80GB, 8.0"))
    d = decide(smi, image("2.14.1+cu128", "12.8", ARCH_CU128, "0.29.1"))
    assert d.action == "install"
    assert d.torch_spec == "torch==2.5.1 torchvision==0.20.1"  # the last cu121 torch
    assert d.pip_args == f"--index-url {torchpick.DEFAULT_INDEX_BASE}/cu121"
    assert "built for CUDA 12.8" in d.reason and "CUDA <= 12.2" in d.reason


def test_driver_570_blackwell_needs_a_cu128_build() -> None:
    smi = parse_smi(query(SMI_570, "NVIDIA RTX PRO 6000 Blackwell, 12.0"))
    d = decide(smi, image("2.5.1+cu124", "12.4", ARCH_CU124))
    assert d.action == "install" and d.pip_args.endswith("/cu128")
    assert d.torch_spec == "torch==2.14.1 torchvision==0.29.1"
    assert "no kernels for NVIDIA RTX PRO 6000 Blackwell (12.0)" in d.reason


def test_driver_580_pascal_card_gets_cu126_not_cu130() -> None:
    smi = parse_smi(query(SMI_580, "Tesla P100-PCIE-16GB, 6.0"))
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
    d = decide(parse_smi(query(SMI_550, "NVIDIA H100 80GB HBM3, 9.0")), img)
    assert d.action == "install" and why in d.reason
    assert d.pip_args.endswith("/cu124") and d.torch_spec == "torch==2.6.0 torchvision==0.21.0"


def test_no_keep_installs_even_a_fitting_torch() -> None:
    smi = parse_smi(query(SMI_550, "NVIDIA L4, 8.9"))
    d = decide(smi, image("2.5.1+cu124", "12.4", ARCH_CU124), allow_keep=False)
    assert d.action == "install" and not d.sees_image


def test_a_driver_too_old_for_any_build_falls_back_with_a_reason() -> None:
    smi = parse_smi(query("470.256.02", "Tesla K80, 3.7"))
    d = decide(smi, None)
    assert d.action == "default" and "no PyTorch CUDA build fits" in d.reason


def test_a_failing_nvidia_smi_gives_the_default() -> None:
    d = decide(Smi(error="exit 9: NVIDIA-SMI has failed"), None)
    assert d.action == "default" and "failed" in d.reason


def test_the_index_base_is_settable() -> None:
    smi = parse_smi(query(SMI_570, "NVIDIA H100, 9.0"))
    d = decide(smi, None, index_base="http://127.0.0.1:9/whl/")
    assert d.pip_args == "--index-url http://127.0.0.1:9/whl/cu128"


# ---- the command, on a PATH with a fake nvidia-smi and an image venv holding a stand-in torch


def fake_box(tmp_path: Path, smi_query: str | None, **torch: object) -> dict[str, str]:
    """A PATH with an ``nvidia-smi`` answering ``smi_query`` (None: no nvidia-smi; each call is
    logged) and an image venv ``tmp_path/image`` holding the stand-in torch ``torch`` (keyword
    ``none=True``: no torch at all)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi_query is not None:
        (tmp_path / "query.txt").write_text(smi_query, encoding="utf-8")
        smi = bin_dir / "nvidia-smi"
        smi.write_text(
            f'#!/bin/sh\necho "$*" >>"{tmp_path}/smi-calls.txt"\ncat "{tmp_path}/query.txt"\n',
            encoding="utf-8",
        )
        smi.chmod(0o755)
    if torch.pop("none", False):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "image")])
    else:
        image_venv(tmp_path / "image", **torch)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)}


def pick(env: dict[str, str], tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "agent.install.torchpick",
            "--python",
            str(tmp_path / "image" / "bin" / "python"),
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )


def test_command_keeps_the_image_torch_of_a_venv_image(tmp_path: Path) -> None:
    env = fake_box(tmp_path, query(SMI_580, "NVIDIA H200, 9.0"))
    proc = pick(env, tmp_path, "--lines")
    assert proc.returncode == 0, proc.stderr
    action, spec, pip_args, paths, kept, reason = proc.stdout.splitlines()
    assert (action, spec, pip_args) == ("keep", "", "")
    site = Path(kept.split(":")[0]).parent
    # The image venv's own site-packages (not its base interpreter's), and the packages in it.
    assert paths.split(":") == [str(site)] and str(tmp_path / "image") in str(site)
    assert kept.split(":") == [str(site / "torch"), str(site / "torchvision")]
    assert "torch 2.11.0+cu130 (CUDA 13.0)" in reason and "NVIDIA H200 (9.0)" in reason
    assert "(read from libtorch_cuda.so)" in reason
    calls = (tmp_path / "smi-calls.txt").read_text(encoding="utf-8").splitlines()
    assert calls == [" ".join(torchpick.SMI_QUERY)]  # one nvidia-smi call


def test_command_reads_the_kernels_and_refuses_a_torch_without_the_cards(tmp_path: Path) -> None:
    # A cu126-like build without Hopper cubins (sm_89 sits in one fat binary only: not the build's)
    env = fake_box(
        tmp_path,
        query(SMI_580, "NVIDIA H200, 9.0"),
        version="2.7.0+cu126",
        cuda="12.6",
        archs=(50, 60, 70, 75, 80, 86),
        torchvision="0.22.0+cu126",
    )
    proc = pick(env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["action"] == "install" and out["pip_args"].endswith("/cu130")
    assert "has no kernels for NVIDIA H200 (9.0)" in out["reason"]
    assert "sm_89" not in out["reason"] and "sm_86" in out["reason"]


def test_command_infers_the_kernels_when_the_library_is_unreadable(tmp_path: Path) -> None:
    env = fake_box(
        tmp_path,
        query(SMI_570, "Tesla V100-SXM2-32GB, 7.0"),
        version="2.9.0+cu128",
        cuda="12.8",
        archs=None,
        torchvision="0.24.0",
    )
    proc = pick(env, tmp_path)
    out = json.loads(proc.stdout)
    assert out["action"] == "install" and out["pip_args"].endswith("/cu126")
    assert "inferred: its kernels could not be read" in out["reason"]


def test_command_json_on_a_535_box_with_a_cpu_image_torch(tmp_path: Path) -> None:
    env = fake_box(tmp_path, query(SMI_535, "NVIDIA A10G, 8.6"), version="2.14.1+cpu", cuda=None)
    proc = pick(env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["action"] == "install" and out["pip_args"].endswith("/cu121")
    assert "CPU build" in out["reason"]
    assert out["details"]["driver"] == "535.183.01" and out["details"]["driver_cuda"] == "12.2"


def test_command_without_torch_in_the_image(tmp_path: Path) -> None:
    env = fake_box(tmp_path, query(SMI_550, "NVIDIA L4, 8.9"), none=True)
    proc = pick(env, tmp_path, "--lines")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "install" and "no torch" in proc.stdout


def test_command_without_nvidia_smi_never_reads_the_image(tmp_path: Path) -> None:
    env = fake_box(tmp_path, None)
    env["TORCH_INDEX_BASE"] = f"http://127.0.0.1:{closed_port()}/whl"
    proc = pick(env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["action"] == "default" and "image_torch" not in out["details"]


def test_sees_says_which_torch_a_venv_imports(tmp_path: Path) -> None:
    python = image_venv(tmp_path / "image")
    torch_dir = Path(
        subprocess.run(
            [str(python), "-c", "import torch, os; print(os.path.dirname(torch.__file__))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )

    def sees(*expect: Path) -> subprocess.CompletedProcess[str]:
        words = [a for p in expect for a in ("--expect", str(p))]
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "agent.install.torchpick",
                "sees",
                "--python",
                str(python),
                *words,
            ],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=60,
        )

    ok = sees(torch_dir, torch_dir.parent / "torchvision")
    assert ok.returncode == 0, ok.stderr
    assert f"torch 2.11.0+cu130 (CUDA 13.0) in {torch_dir.parent}" in ok.stdout
    wrong = sees(tmp_path / "elsewhere" / "torch")
    assert wrong.returncode == 1 and "not the image's" in wrong.stderr
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    none = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent.install.torchpick",
            "sees",
            "--python",
            str(bare / "bin/python"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert none.returncode == 1 and "the venv sees no torch" in none.stderr


# ---- PyTorch's CPU wheel index, on a machine without nvidia-smi


def test_cpu_index_answering_gives_the_cpu_wheels() -> None:
    with cpu_index(CPU_PAGES) as base:
        probe = torchpick.probe_cpu_index(base, torchpick.DEFAULT_TORCH_SPEC)
    assert probe.ok, probe.why
    d = decide(None, None, index_base=base, cpu_index=probe)
    assert d.action == "install" and d.pip_args == f"--index-url {base}/cpu"
    assert d.torch_spec == "torch==2.14.1 torchvision==0.29.1"  # +cpu comes from that index
    assert "PyTorch's CPU wheels" in d.reason


def test_cpu_index_without_the_build_falls_back_saying_why() -> None:
    with cpu_index(
        {**CPU_PAGES, "/whl/cpu/torchvision/": simple_page("torchvision", "0.28.0+cpu")}
    ) as base:
        probe = torchpick.probe_cpu_index(base, torchpick.DEFAULT_TORCH_SPEC)
    assert not probe.ok and "lists no torchvision 0.29.1+cpu" in probe.why
    d = decide(None, None, index_base=base, cpu_index=probe)
    assert d.action == "default" and d.pip_args == ""
    assert "did not answer" in d.reason and "the CUDA build" in d.reason and "3 GB" in d.reason


SPEC = torchpick.DEFAULT_TORCH_SPEC


def test_cpu_index_refused_or_silent_never_waits_long() -> None:
    refused = torchpick.probe_cpu_index(f"http://127.0.0.1:{closed_port()}/whl", SPEC)
    assert not refused.ok and "refused" in refused.why.lower()
    # A server that accepts the connection and never answers: the timeout ends it.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        port = silent.getsockname()[1]
        probe = torchpick.probe_cpu_index(f"http://127.0.0.1:{port}/whl", SPEC, timeout=0.5)
    assert not probe.ok  # the socket's timeout or the deadline, whichever fires first
    assert "timed out" in probe.why or "no answer within 0.5 s" in probe.why


# ---- extras


def extras(tmp_path: Path, toml: str, *args: str) -> subprocess.CompletedProcess[str]:
    job = tmp_path / "job.toml"
    job.write_text(toml, encoding="utf-8")
    return subprocess.run(
        [sys.executable, "-m", "agent.install.torchpick", "extras", str(job), *args],
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
    assert provided >= job_extras.KNOWN_EXTRAS
    named = (*job_extras.FAMILY_EXTRAS, *job_extras.SWITCH_EXTRAS)
    assert {extra for _, extra in named} <= provided


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


def test_cpu_index_behind_a_hung_name_lookup_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Socket timeouts do not cover the name lookup; a resolver that never answers (a fault
    nothing on loopback produces, hence the patch) must not hold the install either."""
    release = threading.Event()

    def hung(*args: object, **kwargs: object) -> list[object]:
        release.wait(60)
        raise OSError("released")

    monkeypatch.setattr(socket, "getaddrinfo", hung)
    try:
        probe = torchpick.probe_cpu_index("http://index.invalid/whl", SPEC, timeout=0.3)
    finally:
        release.set()
    assert not probe.ok and "no answer within 0.3 s" in probe.why
