"""libreyolo-agent inside a Beam task queue (docs/recipes.md, "Beam").

On a serverless platform there is no box to tear down and the platform enforces a hard timeout,
so the job differs from a rented box's in three ways:

- ``[teardown] provider = "none"``: the container ends when the task returns (the agent only
  records what it would have done);
- ``[limits] max_runtime`` = the task's ``timeout`` minus a margin, so that the agent stops
  training early enough for the final sync to finish before Beam kills the container;
- the sink is the Hugging Face Hub (``hf://``) or a mounted Beam Volume (``file://``): Beam
  retries a task whose container crashed (``retries``, default 3) in a new container, which
  finds this job's ``last.pt`` on the sink and resumes from it (kind ``new_box``); a target whose
  run completed ends the job at once.

Run it on Beam (``pip install beam-client``, ``beam config create``, ``beam secret create
HF_TOKEN ...``), from the repository root so that the uploaded code holds ``agent/``::

    beam deploy examples/serverless/beam_train.py:train   # then enqueue one task (API or .put())

Run the same code path locally on the CPU with the embedded demo-like job (synthetic data, a
``file://`` sink, no network, no Beam needed)::

    python examples/serverless/beam_train.py --local --demo

The Beam decorators are defined only when the ``beam`` package is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

try:  # the platform SDK is optional: --local runs without it
    import beam
except ImportError:  # pragma: no cover - depends on the environment
    beam = None

#: The checkout this file lives in (examples/serverless/ -> the repository root).
REPO_ROOT = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------- what to edit
#: ``@task_queue(timeout=...)``, seconds (Beam's default is 3600; -1 disables it: never do that
#: here, a hung job with no timeout keeps billing).
PLATFORM_TIMEOUT_S = 12 * 3600
#: Kept between the agent's ``max_runtime`` and the platform's timeout: the final sync of
#: ``last.pt`` and ``best.pt`` (and the agent's own stop) must fit in it.
FINAL_SYNC_MARGIN_S = 30 * 60
#: The GPU the task gets (Beam's ``gpu=`` string).
GPU = "H100"
#: Where the checkpoints go: a Hub model repo (needs ``HF_TOKEN``), or a folder of the mounted
#: Volume, e.g. ``"file:///volumes/libreyolo-checkpoints/run1"`` (see VOLUME_NAME).
SYNC_TARGET = "hf://my-org/yolo9s-run1"
#: The dataset: one archive in a Hugging Face dataset repo.
DATASET_REPO = "my-org/my-dataset"
DATASET_FILE = "my-dataset.tar"
DATASET_YAML = "my-dataset/data.yaml"
#: The Beam Volume mounted in the task, and where (Beam also shows it at /volumes/NAME).
VOLUME_NAME = "libreyolo-checkpoints"
VOLUME_PATH = "./libreyolo-checkpoints"
#: The agent's own requirements (pyproject.toml ``dependencies`` and the ``train`` extra), for
#: the image: Beam uploads the working directory (the checkout, with ``agent/``) as the code.
AGENT_REQUIREMENTS = [
    "aiohttp>=3.9",
    "watchdog>=4",
    "psutil>=5.9",
    "huggingface_hub>=1.3.2",
    "pyyaml>=6",
    "prometheus-client>=0.20",
    "libreyolo==1.6.0",
]


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
    p.add_argument("--local", action="store_true", help="run here, not on Beam")
    p.add_argument("--demo", action="store_true", help="the CPU demo job (synthetic data)")
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path("libreyolo-agent-serverless-demo") / "beam",
        help="where --local puts data, runs, synced checkpoints and state",
    )
    args = p.parse_args(argv)
    if not args.local:
        print(
            "deploy it with `beam deploy examples/serverless/beam_train.py:train`, or add --local"
        )
        return 2
    if args.demo:
        return local_demo(args.workdir)
    text = job_toml(
        args.workdir.resolve(), demo=False, sync_target=SYNC_TARGET, runtime_s=max_runtime_s()
    )
    code, state = run_job(text, args.workdir.resolve())
    print(f"exit {code}: reason {state.get('reason')}")
    return code


if beam is not None:
    image = beam.Image(
        python_version="python3.11",
        # torch first, in the build that fits the GPU (see install.sh), then the agent's needs.
        python_packages=["torch==2.14.1", "torchvision==0.29.1", *AGENT_REQUIREMENTS],
        commands=[f"apt-get update && apt-get install -y {' '.join(SYSTEM_PACKAGES)}"],
    )

    @beam.task_queue(
        name="libreyolo-agent-train",
        image=image,
        gpu=GPU,
        cpu=8,
        memory="32Gi",
        timeout=PLATFORM_TIMEOUT_S,
        retries=3,  # a crashed container is retried: the new one resumes from the sink
        volumes=[beam.Volume(name=VOLUME_NAME, mount_path=VOLUME_PATH)],
        secrets=["HF_TOKEN"],
    )
    def train() -> str:
        # State on the container's own disk: a retry is a new box that resumes from the sink.
        work = Path("/tmp/libreyolo-agent")
        use_volume_for_hub_cache()
        code, state = run_job(
            job_toml(work, demo=False, sync_target=SYNC_TARGET, runtime_s=max_runtime_s()), work
        )
        return f"exit {code}: reason {state.get('reason')}, cause {state.get('cause')}"


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing the agent
    sys.exit(main())
