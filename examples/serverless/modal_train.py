"""libreyolo-agent inside a Modal function (docs/recipes.md, "Modal").

On a serverless platform there is no box to tear down and the platform enforces a hard timeout,
so the job differs from a rented box's in three ways:

- ``[teardown] provider = "none"``: the container ends when the function returns (the agent only
  records what it would have done);
- ``[limits] max_runtime`` = the function's ``timeout`` minus a margin, so that the agent stops
  training early enough for the final sync to finish before Modal kills the container;
- the sink is the Hugging Face Hub (``hf://``) or a mounted Modal Volume (``file://``): a retry
  or a preemption restart (a new container, on the same input) finds this job's ``last.pt`` there
  and resumes from it (kind ``new_box``); a target whose run completed ends the job at once.

Run it on Modal (``pip install modal``, ``modal setup``, a Secret named ``huggingface`` that
holds ``HF_TOKEN``)::

    modal run examples/serverless/modal_train.py

Run the same code path locally on the CPU with the embedded demo-like job (synthetic data, a
``file://`` sink, no network, no Modal needed)::

    python examples/serverless/modal_train.py --local --demo

The Modal decorators are defined only when the ``modal`` package is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

try:  # the platform SDK is optional: --local runs without it
    import modal
except ImportError:  # pragma: no cover - depends on the environment
    modal = None

#: The checkout this file lives in (examples/serverless/ -> the repository root).
REPO_ROOT = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------- what to edit
#: ``@app.function(timeout=...)``, seconds. Modal accepts 1 s to 24 h, counted per attempt.
PLATFORM_TIMEOUT_S = 12 * 3600
#: Kept between the agent's ``max_runtime`` and the platform's timeout: the final sync of
#: ``last.pt`` and ``best.pt`` (and the agent's own stop) must fit in it.
FINAL_SYNC_MARGIN_S = 30 * 60
#: The GPU the function gets (Modal's ``gpu=`` string).
GPU = "H100"
#: Where the checkpoints go: a Hub model repo (needs ``HF_TOKEN``), or a folder of the mounted
#: Volume, e.g. ``"file:///checkpoints/run1"`` (see VOLUME_PATH).
SYNC_TARGET = "hf://my-org/yolo9s-run1"
#: The dataset: one archive in a Hugging Face dataset repo.
DATASET_REPO = "my-org/my-dataset"
DATASET_FILE = "my-dataset.tar"
DATASET_YAML = "my-dataset/data.yaml"
#: The Modal Volume mounted in the function, and where.
VOLUME_NAME = "libreyolo-checkpoints"
VOLUME_PATH = "/checkpoints"


#: Debian packages the image needs: OpenCV (imported by LibreYOLO) loads libGL and GLib, which
#: slim images lack (the agent's preflight names them when they are missing).
SYSTEM_PACKAGES = ["libgl1", "libglib2.0-0"]


def hub_cache_dir() -> Path:
    """``HF_HOME`` on the Volume: the dataset and weights downloaded from the Hub survive a
    retry or a preemption restart, which is a new container."""
    return Path(VOLUME_PATH).resolve() / "huggingface"


def use_volume_for_hub_cache() -> Path:
    """Point ``HF_HOME`` at :func:`hub_cache_dir` (an ``HF_HOME`` already set wins)."""
    os.environ.setdefault("HF_HOME", str(hub_cache_dir()))
    return Path(os.environ["HF_HOME"])


def max_runtime_s(
    timeout_s: float = PLATFORM_TIMEOUT_S, margin_s: float = FINAL_SYNC_MARGIN_S
) -> int:
    """The agent's ``max_runtime``: the platform's hard timeout minus the final-sync margin."""
    if timeout_s <= margin_s:
        raise ValueError(f"timeout {timeout_s}s leaves nothing after a {margin_s}s margin")
    return int(timeout_s - margin_s)


def _q(value: object) -> str:
    """A TOML basic string (JSON's escapes are TOML's for these values)."""
    return json.dumps(str(value))


def job_toml(work: Path, *, demo: bool, sync_target: str, runtime_s: int) -> str:
    """The job file the function runs: provider ``none``, a sink that outlives the container,
    ``max_runtime`` below the platform's timeout. ``demo``: the CPU-sized job on local data."""
    common = f"""
[job]
name = "{"serverless-demo" if demo else "run1"}"
runs_dir = {_q(work / "runs")}
# The container dies with the agent (timeout, preemption): stop the trainer cleanly with it.
stop_trainer_on_exit = true
"""
    if demo:
        train = f"""
[train]
model = "yolox-n"
pretrained = false
data = {_q(work / "data" / "data.yaml")}
epochs = 2
imgsz = 64
batch = 4
workers = 0
device = "cpu"
save_period = 1

[dataset]
doctor = false

[preflight]
allow_cpu = true
"""
    else:
        train = f"""
[train]
model = "LibreYOLO9s.pt"
epochs = 100
batch = -1
imgsz = 640
save_period = 10

[dataset]
repo = {_q(DATASET_REPO)}
file = {_q(DATASET_FILE)}
dest = {_q(work / "data")}
data_yaml = {_q(DATASET_YAML)}
"""
    rest = f"""
[sync]
target = {_q(sync_target)}
every_epochs = 1

[limits]
max_runtime = {runtime_s}
stall_timeout = "20m"

[teardown]
provider = "none"

[preemption]
# A platform stop (timeout, preemption) is a notice: save last.pt, stop the trainer, exit 0.
sigterm = true

[server]
listen = "127.0.0.1:0"
"""
    return common + train + rest


def run_job(text: str, work: Path) -> tuple[int, dict[str, object]]:
    """Write the job file under ``work`` and run the agent in this process (what
    ``libreyolo-agent run JOB`` does, without the guard: the platform's timeout is the safety
    net here). Returns the exit code and the final state.json."""
    from agent.config.jobfile import load_job
    from agent.config.model import Env
    from agent.daemon.spine import Daemon

    work.mkdir(parents=True, exist_ok=True)
    job_path = work / "job.toml"
    job_path.write_text(text)
    job = load_job(str(job_path))
    env = Env.from_environ(dict(os.environ, LIBREYOLO_AGENT_STATE_DIR=str(work / "state")))
    code = asyncio.run(Daemon(job, env).run())
    state = json.loads((work / "state" / "state.json").read_text())
    return code, state


def local_demo(work: Path) -> int:
    """The example that runs: the demo-like job on the CPU, synced to a ``file://`` folder."""
    from agent import demo

    work = work.resolve()
    demo.make_dataset(work / "data")
    text = job_toml(
        work,
        demo=True,
        sync_target=f"file://{work / 'synced'}",
        runtime_s=max_runtime_s(timeout_s=30 * 60, margin_s=5 * 60),
    )
    code, state = run_job(text, work)
    print(f"exit {code}: phase {state.get('phase')}, reason {state.get('reason')}")
    print(f"checkpoints in {work / 'synced'}, state in {work / 'state'}")
    return code if state.get("reason") == "completed" else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--local", action="store_true", help="run here, not on Modal")
    p.add_argument("--demo", action="store_true", help="the CPU demo job (synthetic data)")
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path("libreyolo-agent-serverless-demo") / "modal",
        help="where --local puts data, runs, synced checkpoints and state",
    )
    args = p.parse_args(argv)
    if not args.local:
        print("run it on Modal with `modal run examples/serverless/modal_train.py`, or add --local")
        return 2
    if args.demo:
        return local_demo(args.workdir)
    text = job_toml(
        args.workdir.resolve(), demo=False, sync_target=SYNC_TARGET, runtime_s=max_runtime_s()
    )
    code, state = run_job(text, args.workdir.resolve())
    print(f"exit {code}: reason {state.get('reason')}")
    return code


if modal is not None:
    app = modal.App("libreyolo-agent-train")
    image = (
        modal.Image.debian_slim(python_version="3.11")
        .apt_install(*SYSTEM_PACKAGES)
        # torch first, in the build that fits the GPU (see install.sh), then the agent.
        .pip_install("torch==2.14.1", "torchvision==0.29.1")
        .add_local_dir(
            str(REPO_ROOT),
            remote_path="/opt/libreyolo-agent",
            copy=True,
            ignore=[".venv", ".git", "libreyolo-agent-demo", "libreyolo-agent-serverless-demo"],
        )
        .run_commands("pip install '/opt/libreyolo-agent[train]'")
    )
    volume = modal.Volume.from_name(VOLUME_NAME, create_if_missing=True)

    @app.function(
        image=image,
        gpu=GPU,
        timeout=PLATFORM_TIMEOUT_S,
        volumes={VOLUME_PATH: volume},
        secrets=[modal.Secret.from_name("huggingface")],  # HF_TOKEN
    )
    def train() -> str:
        # State on the container's own disk: a retry is a new box that resumes from the sink.
        work = Path("/root/libreyolo-agent")
        use_volume_for_hub_cache()
        code, state = run_job(
            job_toml(work, demo=False, sync_target=SYNC_TARGET, runtime_s=max_runtime_s()), work
        )
        volume.commit()  # a file:// sink on the Volume is visible outside only once committed
        return f"exit {code}: reason {state.get('reason')}, cause {state.get('cause')}"

    @app.local_entrypoint()
    def modal_main() -> None:
        print(train.remote())


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing the agent
    sys.exit(main())
