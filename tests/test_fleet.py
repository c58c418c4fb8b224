"""The fleet recipes (examples/fleet/) and the agent's side of an engine's relaunch.

The recipes are read by the engines' own code, offline: SkyPilot's task parser
(``sky.Task.from_yaml``) and dstack's configuration models (``parse_apply_configuration``), in a
subprocess with the Python of ``.venv-fleet`` (``.ci/run`` builds it: the two packages would
change the main venv's pins, click among them). The job each recipe carries goes through
``examples/fleet/run.sh`` and the agent's own ``check``. The relaunch is shaped like the
engine's: the same environment and target on a fresh box (a new HOME, so a new state dir and
runs dir), started through run.sh as the engine would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from agent.config.model import RUN_ID_VARIABLES, Env
from agent.daemon.spine import Daemon
from agent.policy import exitcode
from agent.policy.exitcode import EXIT_DO_NOT_RETRY, EXIT_RETRY, for_engine
from agent.sinks.digests import sha256_file
from agent.state import Phase, Reason, RunState
from tests.support import HANG_S, PAUSE_ENV, PAUSE_TRAINER_DIR, is_stopped, tiny_job, wait_for
from tests.test_daemon import dataset, requires_libreyolo
from tests.test_restart import kill_tree

__all__ = ["dataset"]  # the module-scoped fixture, shared with test_daemon

ROOT = Path(__file__).resolve().parents[1]
FLEET = ROOT / "examples" / "fleet"
RUN_SH = FLEET / "run.sh"
SKYPILOT = sorted(FLEET.glob("skypilot-*.yaml"))
DSTACK = sorted(FLEET.glob("dstack-*.dstack.yml"))
SHAPES = ("single", "managed", "sweep")
#: The Python that has skypilot and dstack (.ci/run builds .venv-fleet).
FLEET_PYTHON = Path(
    os.environ.get("LIBREYOLO_AGENT_FLEET_PYTHON") or ROOT / ".venv-fleet/bin/python"
)
requires_fleet = pytest.mark.skipif(
    not FLEET_PYTHON.is_file(),
    reason=f"no {FLEET_PYTHON}: SkyPilot's and dstack's parsers live in a venv of their own "
    "(they would change the main venv's packages); .ci/run builds it with "
    "`python -m venv .venv-fleet && .venv-fleet/bin/pip install skypilot dstack`",
)
#: A SkyPilot task id as its jobs controller makes them (common_utils.get_global_job_id).
TASK_ID = "sky-managed-2026-12-04-20-21-32-123456_sky-1a2b-user_7-0"

# Run in the fleet venv: each recipe through the engine's own parser, the facts the tests
# check printed as JSON. A recipe the parser refuses is {"error": ...}.
PARSE = r"""
import json, sys, yaml
engine, paths = sys.argv[1], sys.argv[2:]
out = {}
if engine == "skypilot":
    import sky
    for path in paths:
        try:
            task = sky.Task.from_yaml(path)
            config = yaml.safe_load(open(path))
            sweep = sky.Task.from_yaml_config(config, env_overrides=[("LR", "0.02")])
        except Exception as exc:
            out[path] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        res = list(task.resources)
        auto = res[0].autostop_config
        out[path] = {
            "name": task.name, "envs": dict(task.envs), "run": task.run, "setup": task.setup,
            "workdir": task.workdir, "secrets": sorted(task.secrets),
            "managed_secrets": [r.name for r in getattr(task, "managed_secret_refs", None) or []],
            "job_recovery": [r.job_recovery for r in res], "spot": [r.use_spot for r in res],
            "autostop_down": bool(auto and auto.enabled and auto.down),
            "override_lr": sweep.envs.get("LR"),
        }
else:
    from dstack._internal.core.models.configurations import parse_apply_configuration
    for path in paths:
        try:
            conf = parse_apply_configuration(yaml.safe_load(open(path)))
        except Exception as exc:
            out[path] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        retry = conf.retry if conf.retry is not True else None
        events = retry.on_events if retry else None
        out[path] = {
            "type": type(conf).__name__, "name": conf.name, "commands": conf.commands,
            "env": {k: v if isinstance(v, str) else None for k, v in conf.env.root.items()},
            "spot_policy": conf.spot_policy.value if conf.spot_policy else None,
            "retry_events": sorted(e.value for e in events) if events else None,
            "repos": [r.local_path for r in conf.repos],
        }
print(json.dumps(out))
"""


def parse(engine: str, paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Each recipe through the engine's own parser, in the fleet venv."""
    done = subprocess.run(
        [str(FLEET_PYTHON), "-c", PARSE, engine, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
            "DSTACK_CLI_LOG_LEVEL": "ERROR",
        },
    )
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    return {Path(k).name: v for k, v in json.loads(last).items()}


def shape(path: Path) -> str:
    return next(s for s in SHAPES if s in path.name)


def test_every_shape_has_a_recipe_for_each_engine() -> None:
    assert [shape(p) for p in SKYPILOT] == sorted(SHAPES)
    assert [shape(p) for p in DSTACK] == sorted(SHAPES)


# ------------------------------------------------------------------------ the engines' parsers


@requires_fleet
def test_skypilot_reads_every_recipe_and_the_managed_ones_map_the_agents_exit_codes() -> None:
    parsed = parse("skypilot", SKYPILOT)
    for path in SKYPILOT:
        task = parsed[path.name]
        assert "error" not in task, (path.name, task)
        assert task["workdir"] == "."  # the repository goes to the box
        assert "./install.sh" in task["setup"]
        assert "examples/fleet/run.sh" in task["run"]
        assert "LIBREYOLO_AGENT_JOB_TOML" in task["envs"]
        # The token is a secret given at launch, never a value in the file.
        assert "HF_TOKEN" not in task["envs"]
        assert "HF_TOKEN" in task["secrets"] + task["managed_secrets"], task
        if shape(path) == "single":
            assert task["autostop_down"], "the engine takes the box down after the run"
            assert task["job_recovery"] == [None] * len(task["job_recovery"])
        else:
            assert all(task["spot"])
            for recovery in task["job_recovery"]:
                assert recovery == {
                    "strategy": "EAGER_NEXT_REGION",
                    "max_restarts_on_errors": 0,
                    "recover_on_exit_codes": [EXIT_RETRY],
                }
    assert parsed["skypilot-sweep.yaml"]["override_lr"] == "0.02"  # `--env LR=0.02`


@requires_fleet
def test_skypilot_refuses_what_it_checks_and_passes_unknown_recovery_keys_through(
    tmp_path: Path,
) -> None:
    # The parser is strict about the keys and types it knows: a misspelt field, a code that is
    # not an integer. Inside job_recovery its client passes unknown keys through to the
    # server's plugins (schemas._allow_additional_properties), so a misspelt recovery key is
    # *accepted* here: the test above therefore checks the recovery dict whole.
    text = (FLEET / "skypilot-managed.yaml").read_text()
    changes = {
        "field": ("job_recovery:", "job_recovry:"),
        "code": ("recover_on_exit_codes: [75]", "recover_on_exit_codes: [retry]"),
        "workdir": ("workdir: .", "wrkdir: ."),
        "recovery-key": ("recover_on_exit_codes", "recover_on_exit_code"),
    }
    for name, (good, wrong) in changes.items():
        (tmp_path / f"{name}.yaml").write_text(text.replace(good, wrong))
    parsed = parse("skypilot", [tmp_path / f"{name}.yaml" for name in changes])
    for name in ("field", "code", "workdir"):
        assert "error" in parsed[f"{name}.yaml"], name
    task = parsed["recovery-key.yaml"]
    assert "error" not in task and "recover_on_exit_codes" not in task["job_recovery"][0]


@requires_fleet
def test_dstack_reads_every_recipe_and_retries_only_what_it_sees_itself() -> None:
    parsed = parse("dstack", DSTACK)
    for path in DSTACK:
        conf = parsed[path.name]
        assert "error" not in conf, (path.name, conf)
        assert conf["type"] == "TaskConfiguration"
        assert conf["repos"] == ["../.."]  # this repository, relative to examples/fleet
        assert conf["commands"] == ["./install.sh && exec examples/fleet/run.sh"]
        assert "LIBREYOLO_AGENT_JOB_TOML" in conf["env"]
        assert conf["env"]["HF_TOKEN"] == "${{ secrets.hf_token }}"
        if shape(path) == "single":
            assert conf["spot_policy"] == "on-demand" and conf["retry_events"] is None
        else:
            # dstack reads an exit only as success or failure: retrying on `error` would relaunch
            # the agent's 65 (a bad job, a diverged run) as readily as its 75.
            assert conf["spot_policy"] == "spot"
            assert conf["retry_events"] == ["interruption", "no-capacity"]


@requires_fleet
def test_dstack_refuses_a_misspelt_key(tmp_path: Path) -> None:
    text = (FLEET / "dstack-managed.dstack.yml").read_text()
    bad = tmp_path / "dstack-managed.dstack.yml"
    bad.write_text(text.replace("spot_policy:", "spot_polcy:"))
    assert "error" in parse("dstack", [bad])["dstack-managed.dstack.yml"]


# ------------------------------------------------------------------- the job each recipe carries


def recipe_env(path: Path) -> dict[str, str]:
    """The environment the recipe gives its run step (plain YAML: no engine needed)."""
    doc = yaml.safe_load(path.read_text())
    env = doc.get("envs") or doc.get("env") or {}
    return {k: str(v) for k, v in env.items() if v is not None and "${{" not in str(v)}


def stand_in_venv(tmp: Path) -> Path:
    """A venv whose ``libreyolo-agent`` records its argv and runs the real ``check --offline``
    on the job it was given: run.sh's hand-over, seen from the other side."""
    venv = tmp / "venv"
    (venv / "bin").mkdir(parents=True)
    agent = venv / "bin" / "libreyolo-agent"
    agent.write_text(
        "#!/bin/sh\n"
        'printf "%s\\n" "$@" > "$ARGV_FILE"\n'
        "for last; do :; done\n"
        f'exec "{sys.executable}" -m agent.cli check --offline "$last"\n'
    )
    agent.chmod(0o755)
    return venv


@pytest.mark.parametrize("recipe", [*SKYPILOT, *DSTACK], ids=lambda p: p.name)
def test_run_sh_hands_each_recipes_job_to_the_agent_and_the_job_is_valid(
    recipe: Path, tmp_path: Path
) -> None:
    env = {**os.environ, **recipe_env(recipe)}
    if "LR" in env:
        env["LR"] = "0.02"  # as `--env LR=0.02` / `-e LR=0.02` gives it
    env.update(
        HOME=str(tmp_path / "home"),
        VENV=str(stand_in_venv(tmp_path)),
        ARGV_FILE=str(tmp_path / "argv"),
    )
    env.pop("LIBREYOLO_AGENT_STATE_DIR", None)
    done = subprocess.run(
        [str(RUN_SH)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr  # `check`: the job is valid
    box = tmp_path / "home" / "libreyolo-agent"
    job = box / "job.toml"
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv == ["run", "--exit-codes", "engine", str(job)]
    assert f"state {box / 'state'}" in done.stdout
    text = job.read_text()
    assert "${" not in text, "every ${NAME} of LIBREYOLO_AGENT_JOB_VARS is filled in"
    assert 'provider = "none"' in text  # the engine owns the box
    if shape(recipe) == "sweep":
        assert 'target = "hf://my-org/yolox-s-sweep-lr0.02"' in text
        assert "lr0 = 0.02" in text
    assert oct(job.stat().st_mode & 0o777) == "0o600"


def test_run_sh_without_a_job_or_with_a_bad_one_exits_do_not_retry(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBREYOLO_AGENT_")}
    env.update(HOME=str(tmp_path / "home"), VENV=str(Path(sys.executable).parent.parent))
    done = subprocess.run([str(RUN_SH)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_DO_NOT_RETRY
    assert "no job" in done.stderr
    env["LIBREYOLO_AGENT_JOB_TOML"] = '[job]\nname = "x"\n[trian]\n'
    done = subprocess.run([str(RUN_SH)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_DO_NOT_RETRY, done.stderr  # the agent's bad job (2)
    assert "did you mean [train]" in done.stderr
    env.update(LIBREYOLO_AGENT_JOB_TOML="x = ${LR}", LIBREYOLO_AGENT_JOB_VARS="LR")
    done = subprocess.run([str(RUN_SH)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_DO_NOT_RETRY
    assert "names LR, which is not set" in done.stderr


# ---------------------------------------------------------------------------------- exit codes


def ended(reason: Reason, **extra: Any) -> RunState:
    state = RunState(job_name="j", job_source="j.toml", phase=Phase.DONE, reason=reason)
    for key, value in extra.items():
        setattr(state, key, value)
    return state


@pytest.mark.parametrize("reason", list(Reason), ids=lambda r: r.value)
def test_every_ending_has_an_engine_code(reason: Reason) -> None:
    # A reason added later (issue 29's `diverged`) gets the do-not-retry code unless it is
    # named a box failure: a new box must not be paid for a job that would end the same way.
    expected = {Reason.COMPLETED: 0, Reason.PREEMPTED: EXIT_RETRY}.get(reason, EXIT_DO_NOT_RETRY)
    assert for_engine(0, ended(reason)) == expected


def test_a_box_fault_asks_for_another_box_and_the_agents_own_codes_stay() -> None:
    faulty = ended(Reason.TRAINING_FAILED, teardown={"action": "stop", "box_fault": "Xid 79"})
    assert for_engine(0, faulty) == EXIT_RETRY
    for phase in (Phase.TRAINING, Phase.FINISHING, Phase.HELD, Phase.PREFLIGHT):
        # The agent left before the job ended (asked to exit, a SIGTERM notice): elsewhere.
        left = RunState(job_name="j", job_source="j.toml", phase=phase)
        assert for_engine(0, left) == EXIT_RETRY
    assert for_engine(2, None) == EXIT_DO_NOT_RETRY  # a bad job file
    assert for_engine(1, ended(Reason.COMPLETED)) == 1  # the agent crashed: a person looks
    assert for_engine(3, ended(Reason.COMPLETED)) == 3  # a teardown not confirmed
    assert exitcode.from_state_dir(0, Path("/nonexistent/state")) == EXIT_DO_NOT_RETRY


# ------------------------------------------------------------------------------------ run id


def test_the_run_id_comes_from_the_engine_that_launched_the_box() -> None:
    assert RUN_ID_VARIABLES == ("LIBREYOLO_AGENT_RUN_ID", "SKYPILOT_TASK_ID", "DSTACK_RUN_NAME")
    assert Env.from_environ({}).run_id is None
    assert Env.from_environ({}).run_name("run1") == "run1"
    dstack = Env.from_environ({"DSTACK_RUN_NAME": "yolox-spot"})
    assert (dstack.run_id, dstack.run_id_from) == ("yolox-spot", "DSTACK_RUN_NAME")
    both = Env.from_environ({"DSTACK_RUN_NAME": "yolox-spot", "SKYPILOT_TASK_ID": TASK_ID})
    assert (both.run_id, both.run_id_from) == (TASK_ID, "SKYPILOT_TASK_ID")
    ours = Env.from_environ({"SKYPILOT_TASK_ID": TASK_ID, "LIBREYOLO_AGENT_RUN_ID": " r7\n"})
    assert (ours.run_id, ours.run_id_from) == ("r7", "LIBREYOLO_AGENT_RUN_ID")
    assert ours.run_name("run1") == "run1 [r7]"


def test_notices_name_the_run_by_the_engines_run_id(tmp_path: Path) -> None:
    job = tiny_job(
        tmp_path, tmp_path / "data.yaml", sections='[notify]\nwebhook = "http://127.0.0.1:9/h"\n'
    )
    env = Env.from_environ({"LIBREYOLO_AGENT_STATE_DIR": str(tmp_path), "DSTACK_RUN_NAME": "r-7"})
    notifier = Daemon(job, env).ctx.notifier
    assert notifier is not None and notifier.job == "run1 [r-7]"
    plain = Daemon(job, Env(state_dir=tmp_path)).ctx.notifier
    assert plain is not None and plain.job == "run1"


# ------------------------------------------------------------------ the relaunch, engine-shaped


def fleet_job(data: Path, synced: Path, epochs: int) -> str:
    """The tiny CPU job as a recipe carries it: relative runs_dir (each box has its own),
    the target shared by every box, teardown none (the engine owns the box)."""
    return f"""
[job]
name = "run1"
runs_dir = "runs"
[train]
model = "yolox-n"
pretrained = false
data = "{data}"
epochs = {epochs}
imgsz = 64
batch = 4
workers = 0
device = "cpu"
save_period = 1
stop_grace = "30s"
kill_grace = "5s"
[dataset]
doctor = false
[preflight]
enabled = false
[server]
listen = "127.0.0.1:0"
[sync]
target = "file://{synced}"
[teardown]
provider = "none"
"""


def launch(env: dict[str, str], home: Path) -> subprocess.Popen[str]:
    """The engine's run step on a box whose HOME is ``home``: run.sh, the same env."""
    return subprocess.Popen(
        [str(RUN_SH)],
        env={**env, "HOME": str(home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def box_processes(state_dir: Path, runs: Path) -> list[psutil.Process]:
    """Every process of a box: its trainer (project=RUNS) and its guard (STATE_DIR)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if f"project={runs}" in cmd or (str(state_dir) in cmd and "agent.guard" in cmd):
            found.append(p)
    # And the trainer as the agent recorded it, with its children: a warm start's command line
    # names no run directory.
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, psutil.Error):
        pid = int(json.loads((state_dir / "state.json").read_text())["trainer"]["pid"])
        trainer = psutil.Process(pid)
        known = {p.pid for p in found}
        found += [t for t in (trainer, *trainer.children(recursive=True)) if t.pid not in known]
    return found


@pytest.mark.training
@pytest.mark.long
@requires_libreyolo
def test_a_relaunch_on_a_fresh_box_resumes_from_the_targets_last_pt_under_one_run_id(
    tmp_path: Path, dataset: Path
) -> None:
    epochs = 4
    synced = tmp_path / "synced"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBREYOLO_AGENT_")}
    env.update(
        LIBREYOLO_AGENT_JOB_TOML=fleet_job(dataset, synced, epochs),
        SKYPILOT_TASK_ID=TASK_ID,
        VENV=str(Path(sys.executable).parent.parent),
    )
    box1, box2, box3 = (tmp_path / name for name in ("box1", "box2", "box3"))
    # Box 1: its trainer stops itself once epoch 2 is written (tests/fakes/pause_trainer), then
    # the box vanishes with epoch 2 on the target: the agent, the trainer and the guard at once.
    paused = {
        **env,
        PAUSE_ENV: "2",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(PAUSE_TRAINER_DIR), os.environ.get("PYTHONPATH")) if p
        ),
    }
    state1, runs1 = box1 / "libreyolo-agent" / "state", box1 / "libreyolo-agent" / "runs"
    first = launch(paused, box1)
    try:

        def remote_epoch() -> int:
            with contextlib.suppress(OSError, ValueError):
                return int(json.loads((synced / "status.json").read_text())["completed_epochs"])
            return 0

        def paused_at_two() -> bool:
            # The trainer as the agent recorded it (a warm start's command line names no run).
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                pid = json.loads((state1 / "state.json").read_text())["trainer"]["pid"]
                return remote_epoch() >= 2 and is_stopped(int(pid))
            return False

        asyncio.run(wait_for(paused_at_two))
        # The engine stops the run step (a cancel, the box shutting down): the agent leaves
        # with the job unfinished, which the engine reads as "relaunch it elsewhere".
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=HANG_S)
        assert first.returncode == EXIT_RETRY, out[-3000:]
    finally:
        # Then the box vanishes with whatever still runs on it: the trainer and the guard.
        victims = box_processes(state1, runs1)
        kill_tree(first.pid)
        for p in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(victims, timeout=10)
        first.wait(timeout=60)
    assert remote_epoch() == 2

    # Box 2: a fresh box, the same environment (without the test's pause), the same target.
    second = launch(env, box2)
    out, _ = second.communicate(timeout=HANG_S)
    assert second.returncode == 0, out[-3000:]  # the engine reads: succeeded
    state = json.loads((box2 / "libreyolo-agent" / "state" / "state.json").read_text())
    assert state["reason"] == "completed", state.get("cause")
    assert [r["kind"] for r in state["resumes"]] == ["new_box"]
    status = json.loads((box2 / "libreyolo-agent" / "runs" / "run1" / "status.json").read_text())
    assert status["start_epoch"] > 1, "resumed from the target, not trained from scratch"
    # Every epoch is off the box, and the target's last.pt is the final one.
    weights = box2 / "libreyolo-agent" / "runs" / "run1" / "weights"
    assert {f"epoch_{n}.pt" for n in range(1, epochs + 1)} <= {
        p.name for p in (synced / "weights").glob("*.pt")
    }
    assert sha256_file(synced / "weights" / "last.pt") == sha256_file(weights / "last.pt")
    # One run id on both boxes: SkyPilot's task id, the same on every recovery.
    for box in (box1, box2):
        log = (box / "libreyolo-agent" / "state" / "agent.log").read_text()
        assert f"run id {TASK_ID} (from SKYPILOT_TASK_ID)" in log

    # Box 3: the engine relaunches a job whose target says it completed: nothing is trained.
    third = launch(env, box3)
    out, _ = third.communicate(timeout=HANG_S)
    assert third.returncode == 0, out[-3000:]
    assert not (box3 / "libreyolo-agent" / "runs" / "run1" / "weights").exists()
