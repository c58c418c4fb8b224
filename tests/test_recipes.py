"""docs/recipes.md and its examples: every job file passes the real `libreyolo-agent check`,
every shell snippet parses, every cloud-init block is valid YAML holding the job file it names,
and the two serverless examples run their embedded CPU job to completion."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import HANG_S

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "docs" / "recipes.md"
JOBS = sorted((ROOT / "examples" / "jobs").glob("*.toml"))
SERVERLESS = ROOT / "examples" / "serverless"
BASH = shutil.which("bash")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", RECIPES.read_text(), flags=re.S | re.M)


def _bash_n(script: str) -> subprocess.CompletedProcess[str]:
    assert BASH is not None
    return subprocess.run([BASH, "-n"], input=script, capture_output=True, text=True, timeout=30)


def _inner_bash_c(script: str) -> list[str]:
    """The scripts of ``bash -c '...'`` one-liners (bash -n of the outer line skips them)."""
    inner = []
    for line in script.splitlines():
        words = shlex.split(line, comments=True) if line.lstrip().startswith("bash -c") else []
        if len(words) >= 3 and words[:2] == ["bash", "-c"]:
            inner.append(words[2])
    return inner


def test_every_provider_has_a_job_file() -> None:
    assert {p.stem for p in JOBS} >= {"vast", "runpod", "lambda", "aws", "gcp"}


@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.name)
def test_job_file_passes_check(job: Path, tmp_path: Path) -> None:
    # check asks the Hub for the dataset's size (agent/policy/rent.py): test traffic stays local.
    env = dict(
        os.environ,
        LIBREYOLO_AGENT_STATE_DIR=str(tmp_path / "state"),
        HF_ENDPOINT="http://127.0.0.1:9",
    )
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli", "check", str(job)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{job}: ok" in out.stdout


def test_job_files_hold_no_secret() -> None:
    for job in JOBS:
        text = job.read_text()
        assert not re.search(r"hf_[A-Za-z0-9]{20,}|rpa_[A-Za-z0-9]{20,}|secret_[a-z0-9]{20,}", text)
        # No TOML key that would carry one (the job format has none; keys come from the env).
        assert not re.search(r"(?im)^\s*\w*(token|api_key|secret|password)\w*\s*=", text), job


def test_bash_blocks_parse() -> None:
    blocks = _blocks("bash")
    assert len(blocks) >= 8  # every recipe has at least one
    for block in blocks:
        for script in (block, *_inner_bash_c(block)):
            result = _bash_n(script)
            assert result.returncode == 0, f"{result.stderr}\n---\n{script}"


def test_runpod_start_command_is_one_line_that_forwards_sigterm() -> None:
    (start,) = [b for b in _blocks("bash") if "/start.sh" in b]
    assert start.count("\n") == 1  # RunPod's field: one line
    (inner,) = _inner_bash_c(start)
    assert "trap fwd TERM" in inner and "supervisor.pid" in inner


def test_cloud_init_blocks_are_valid_and_embed_their_job_file() -> None:
    blocks = _blocks("yaml")
    assert len(blocks) == 2  # Lambda and AWS
    embedded = []
    for block in blocks:
        assert block.startswith("#cloud-config\n")
        doc = yaml.safe_load(block)
        files = {f["path"]: f for f in doc["write_files"]}
        job = files["/etc/libreyolo-agent/job.toml"]["content"]
        embedded.append(job)
        (runcmd,) = doc["runcmd"]
        assert runcmd[:2] == ["bash", "-c"]
        result = _bash_n(runcmd[2])
        assert result.returncode == 0, result.stderr
        assert "secrets.env" in runcmd[2] and "bootstrap.sh" in runcmd[2]
    # The pasted job is exactly the checked example file, not a stale copy.
    assert embedded[0] == (ROOT / "examples" / "jobs" / "lambda.toml").read_text()
    assert embedded[1] == (ROOT / "examples" / "jobs" / "aws.toml").read_text()


def test_beam_image_lists_the_agents_requirements() -> None:
    import tomllib

    sys.path.insert(0, str(SERVERLESS))
    try:
        import beam_train
    finally:
        sys.path.remove(str(SERVERLESS))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["train"]]
    assert wanted == beam_train.AGENT_REQUIREMENTS
    assert beam_train.max_runtime_s() == beam_train.PLATFORM_TIMEOUT_S - 30 * 60


@pytest.mark.training
@pytest.mark.long
@pytest.mark.parametrize("example", ["modal_train.py", "beam_train.py"])
def test_serverless_example_runs_the_demo_job(example: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    out = subprocess.run(
        [sys.executable, str(SERVERLESS / example), "--local", "--demo", "--workdir", str(work)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    state = json.loads((work / "state" / "state.json").read_text())
    assert state["reason"] == "completed"
    assert state["phase"] == "DONE"
    # The job it ran is the serverless shape: no teardown provider, a max_runtime, and the
    # checkpoints went to the sink.
    job = (work / "job.toml").read_text()
    assert 'provider = "none"' in job and "max_runtime = 1500" in job
    assert (work / "synced" / "weights" / "last.pt").is_file()


# ---- secrets never copied to disk with the environment (issue 24, item 6)

#: A write of the whole environment to a file: `env`, `printenv`, `export -p`, `declare -p/-x`
#: or `set` whose output is redirected or tee'd, or anything written into /etc/environment.
ENV_DUMP = re.compile(
    r"(?:^|[;&|(`$]\s*)(?:env|printenv|export\s+-p|declare\s+-[px]+|set)\b(?!\s+[-+][a-z])"
    r"[^;&\n]*?(?:>|\btee\b)"
    r"|(?:>>?|\btee\b(?:\s+-a)?)\s*[\"']?/etc/(?:environment|profile)"
)
DOC_FILES = sorted(
    {
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(p for p in (ROOT / "examples").rglob("*") if p.is_file()),
        *(ROOT / "scripts").glob("*.sh"),
    }
)


@pytest.mark.parametrize(
    "line",
    [
        "env | grep _ >> /etc/environment",
        "env >> /etc/environment",
        "printenv > /root/box.env",
        "export -p > /tmp/env.sh",
        "declare -px > /root/vars",
        "(set -o posix; set) > /tmp/all",
        "env | tee /root/env.txt",
        "echo HF_TOKEN=$HF_TOKEN >> /etc/environment",
        "  cmd; env|grep TOKEN>/x",
    ],
)
def test_the_env_dump_pattern_catches_a_dump(line: str) -> None:
    assert ENV_DUMP.search(line), line


@pytest.mark.parametrize(
    "line",
    [
        "set -a; . /etc/libreyolo-agent/agent.env; . /etc/libreyolo-agent/secrets.env; set +a",
        "printf 'HF_TOKEN=%s\\n' \"$HF_TOKEN\" | ssh ubuntu@IP 'sudo install -D -m 600 "
        "/dev/stdin /etc/libreyolo-agent/secrets.env'",
        "attr libreyolo-agent-job > /etc/libreyolo-agent/job.toml",
        "set -euo pipefail",
    ],
)
def test_the_env_dump_pattern_leaves_the_recipes_own_lines(line: str) -> None:
    assert not ENV_DUMP.search(line), line


def test_no_doc_recipe_or_example_writes_the_environment_to_a_file() -> None:
    assert ROOT / "docs" / "recipes.md" in DOC_FILES
    found = []
    for path in DOC_FILES:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if ENV_DUMP.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


# ---- the serverless images (issue 24, item 8)


class _Sdk:
    """A stand-in platform SDK (``modal`` or ``beam``) that records what an example builds:
    every call on it, by its dotted name; decorators hand the function back unchanged."""

    def __init__(self, log: list[tuple[str, tuple[object, ...], dict[str, object]]], name: str):
        self._log, self._name = log, name

    def __getattr__(self, attr: str) -> _Sdk:
        return _Sdk(self._log, f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> object:
        if len(args) == 1 and not kwargs and inspect.isfunction(args[0]):
            return args[0]  # used as a decorator
        self._log.append((self._name, args, kwargs))
        return _Sdk(self._log, f"{self._name}()")


def _load_with_sdk(
    example: str, sdk: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, list[tuple[str, tuple[object, ...], dict[str, object]]]]:
    log: list[tuple[str, tuple[object, ...], dict[str, object]]] = []
    monkeypatch.setitem(sys.modules, sdk, _Sdk(log, sdk))
    spec = importlib.util.spec_from_file_location(f"_example_{sdk}", SERVERLESS / example)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, log


OPENCV_LIBS = {"libgl1", "libglib2.0-0"}


def test_modal_image_installs_opencvs_libraries_and_hf_home_is_on_the_volume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module, log = _load_with_sdk("modal_train.py", "modal", monkeypatch)
    apt = [args for name, args, _ in log if name.endswith(".apt_install")]
    assert apt and set(apt[0]) >= OPENCV_LIBS, log
    _check_hub_cache(module, monkeypatch)


def test_beam_image_installs_opencvs_libraries_and_hf_home_is_on_the_volume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module, log = _load_with_sdk("beam_train.py", "beam", monkeypatch)
    (image,) = [kw for name, _, kw in log if name == "beam.Image"]
    commands = " ".join(str(c) for c in image.get("commands", []))  # type: ignore[attr-defined]
    assert "apt-get install -y" in commands
    assert set(commands.split()) >= OPENCV_LIBS, commands
    _check_hub_cache(module, monkeypatch)


def _check_hub_cache(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    volume = Path(module.VOLUME_PATH).resolve()
    monkeypatch.setenv("HF_HOME", "x")
    monkeypatch.delenv("HF_HOME")
    home = module.use_volume_for_hub_cache()
    assert home == Path(os.environ["HF_HOME"]) and home.is_relative_to(volume)
    # The platform's function sets it before the agent runs.
    assert "use_volume_for_hub_cache()" in inspect.getsource(module.train)
    monkeypatch.setenv("HF_HOME", "/elsewhere")  # one the user set wins
    assert module.use_volume_for_hub_cache() == Path("/elsewhere")


# ---- `check` on a laptop: no torch needed (README, "First box")

BLOCK_TRAINING_STACK = """
import importlib.abc, sys
BLOCKED = {"torch", "torchvision", "libreyolo", "cv2", "numpy"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, Block())
from agent.cli import main
codes = [main(["check", job]) for job in sys.argv[1:]]
assert not BLOCKED & {m.split(".")[0] for m in sys.modules}, "imported the training stack"
sys.exit(max(codes))
"""


def test_check_works_without_torch_or_libreyolo(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        LIBREYOLO_AGENT_STATE_DIR=str(tmp_path / "state"),
        HF_ENDPOINT="http://127.0.0.1:9",  # check asks the Hub for the dataset's size
    )
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_TRAINING_STACK, *map(str, JOBS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for job in JOBS:
        assert f"{job}: ok" in out.stdout
    assert "not checked against LibreYOLO" in out.stdout  # it says what it could not check
