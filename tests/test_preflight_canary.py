"""What preflight proves even when it is off: the provider and its key, the ``command``
provider's executables, and a canary write + read-back + delete on the sync target. Driven
through the real daemon (scripted stand-in trainer, a real process) against the fake providers
and the fake Hub on 127.0.0.1; ``[preflight] enabled = false`` in every job (``tiny_job``).

A failure ends the job as ``preflight_failed`` before any trainer starts; the teardown that
follows is the usual one (``keep`` where the provider itself is what failed, so that the test
ends: a box whose key is refused cannot be torn down by the agent either)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from agent.config.model import Env
from agent.daemon.spine import Daemon
from agent.state import Phase, Reason
from tests.fakes.hub import run_fake_hub
from tests.fakes.providers import run_fake_runpod, run_fake_vast
from tests.fakes.scripted_launcher import ScriptedLauncher
from tests.support import tiny_job

VAST_KEY = "vast-instance-key-abcdefghij"
RUNPOD_KEY = "runpod-key-0123456789"
HF_WRITE = "hf_canary_write_token_0123"
HF_READ = "hf_canary_read_token_4567"
REPO = "org/canary-run"


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "data.yaml"
    path.write_text("train: images\nval: images\nnames:\n  0: box\n")
    return path


def run_job(
    tmp_path: Path, data: Path, sections: str, env: Env
) -> tuple[int, Daemon, list[list[str]]]:
    launcher = ScriptedLauncher(epoch_s=0.05)
    job = tiny_job(tmp_path, data, sections=sections)
    daemon = Daemon(job, env, launcher=launcher, poll_interval_s=0.05)
    code = asyncio.run(asyncio.wait_for(daemon.run(), 240))
    return code, daemon, launcher.launched


def failed_before_training(daemon: Daemon, launched: list[list[str]], check: str) -> dict[str, Any]:
    """The job ended as preflight_failed on ``check``, no trainer ever started, and the check
    is in preflight.json; returns that check."""
    assert daemon.state.phase == Phase.DONE
    assert daemon.state.reason == Reason.PREFLIGHT_FAILED, daemon.state.cause
    assert daemon.state.cause is not None and check in daemon.state.cause
    assert launched == []
    assert daemon.state.trainer is None
    report = json.loads((daemon.env.state_dir / "preflight.json").read_text())
    [found] = [c for c in report["checks"] if c["name"] == check]
    assert found["status"] == "fail", found
    return dict(found)


def state_env(tmp_path: Path, **kw: Any) -> Env:
    return Env(state_dir=tmp_path / "state", hf_home=tmp_path / "hf", **kw)


# ------------------------------------------------------------------------------------ file://


def test_a_file_target_under_a_file_fails_before_training(tmp_path: Path, data: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    sections = f'[sync]\ntarget = "file://{blocker}/sub"\n[teardown]\nprovider = "none"\n'
    code, daemon, launched = run_job(tmp_path, data, sections, state_env(tmp_path))
    assert code == 0
    check = failed_before_training(daemon, launched, "target.canary")
    assert "cannot write there" in check["value"] and str(blocker) in check["value"]
    assert blocker.read_text() == "x"


def test_a_writable_file_target_passes_and_keeps_no_canary(tmp_path: Path, data: Path) -> None:
    target = tmp_path / "synced"
    sections = f'[sync]\ntarget = "file://{target}"\n[teardown]\nprovider = "none"\n'
    code, daemon, launched = run_job(tmp_path, data, sections, state_env(tmp_path))
    assert code == 0 and daemon.state.reason == Reason.COMPLETED, daemon.state.cause
    assert len(launched) == 1
    report = json.loads((daemon.env.state_dir / "preflight.json").read_text())
    [check] = [c for c in report["checks"] if c["name"] == "target.canary"]
    assert check["status"] == "pass" and "read back and deleted" in check["value"]
    assert not (target / "agent" / ".canary").exists()
    assert (target / "weights" / "last.pt").is_file()


# ------------------------------------------------------------------------------------ hf://


@pytest.mark.parametrize(
    ("token", "works"), [(HF_READ, False), ("hf_revoked_token_89ab", False), (HF_WRITE, True)]
)
def test_an_hf_target_is_written_read_back_and_cleaned_with_the_job_token(
    tmp_path: Path, data: Path, token: str, works: bool
) -> None:
    with run_fake_hub(tokens={HF_WRITE}, read_tokens={HF_READ}) as hub:
        hub.add_repo("model", REPO, private=True)
        env = state_env(tmp_path, hf_endpoint=hub.url, hf_token=token)
        sections = f'[sync]\ntarget = "hf://{REPO}"\n[teardown]\nprovider = "none"\n'
        code, daemon, launched = run_job(tmp_path, data, sections, env)
        assert code == 0
        canary_commits = [
            c for c in hub.commits("model", REPO) if "agent/.canary" in (*c.paths, *c.deleted)
        ]
        assert hub.file("model", REPO, "agent/.canary") is None  # nothing left behind
        if works:
            assert daemon.state.reason == Reason.COMPLETED, daemon.state.cause
            assert len(canary_commits) == 2  # written, then deleted
            assert hub.file("model", REPO, "weights/last.pt") is not None
        else:
            check = failed_before_training(daemon, launched, "target.canary")
            assert "set HF_TOKEN to a token with write access" in check["value"]
            assert token not in check["value"]
            assert canary_commits == []
        text = (daemon.env.state_dir / "agent.log").read_text()
        assert token not in text and token not in json.dumps(daemon.state.to_dict())


def test_an_hf_target_without_a_token_fails_the_canary_and_the_box_is_destroyed_at_once(
    tmp_path: Path, data: Path
) -> None:
    """No HF_TOKEN: the canary's create is refused (401), the job ends as preflight_failed,
    nothing more is offered to the Hub (the reports cannot leave), and the destroy goes ahead
    and is confirmed."""
    with (
        run_fake_hub(tokens={HF_WRITE}) as hub,
        run_fake_vast(keys=set(), instance_keys={VAST_KEY: "1234"}) as vast,
    ):
        hub.add_repo("model", REPO, private=True)
        vast.add_instance("1234")
        env = state_env(
            tmp_path,
            hf_endpoint=hub.url,
            hf_token=None,
            container_id="1234",
            container_api_key=VAST_KEY,
        )
        sections = (
            f'[sync]\ntarget = "hf://{REPO}"\n'
            f'[teardown]\nprovider = "vast"\napi_url = "{vast.url}"\n'
        )
        code, daemon, launched = run_job(tmp_path, data, sections, env)
        assert code == 0
        check = failed_before_training(daemon, launched, "target.canary")
        assert "HF_TOKEN is not set" in check["value"]
        td = daemon.state.teardown
        assert td is not None and td["action"] == "destroy" and td["confirmed"] is True
        # The canary's one refused create; nothing of the reports was offered to the Hub after
        # it: no second create, no preupload, no commit, no LFS batch.
        writes = [(r.route, r.status) for r in hub.requests if r.method == "POST"]
        assert writes == [("create_repo", 401)], writes
        assert (daemon.env.state_dir / "report.json").is_file()


# ------------------------------------------------------------------------------------ providers


def test_a_missing_teardown_command_fails_before_training(tmp_path: Path, data: Path) -> None:
    sections = (
        "[teardown]\n"
        'provider = "command"\n'
        'command = ["true"]\n'
        'stop_command = ["libreyolo-no-such-stop-command", "--now"]\n'
    )
    code, daemon, launched = run_job(tmp_path, data, sections, state_env(tmp_path))
    assert code == 0
    check = failed_before_training(daemon, launched, "provider.command")
    assert "teardown.stop_command" in check["value"]
    assert "libreyolo-no-such-stop-command" in check["value"]
    # The destroy itself ("true") could run: the teardown went ahead and was confirmed.
    assert daemon.state.teardown is not None and daemon.state.teardown["confirmed"] is True


def test_a_wrong_key_fails_before_training_with_preflight_off(tmp_path: Path, data: Path) -> None:
    with run_fake_vast(keys=set(), instance_keys={VAST_KEY: "1234"}) as vast:
        vast.add_instance("1234")
        wrong = "wrong-vast-key-9876543210"
        env = state_env(tmp_path, container_id="1234", container_api_key=wrong)
        sections = (
            f'[teardown]\nprovider = "vast"\napi_url = "{vast.url}"\n'
            'on_preflight_failure = "keep"\n'
        )
        code, daemon, launched = run_job(tmp_path, data, sections, env)
        assert code == 0
        check = failed_before_training(daemon, launched, "provider.vast")
        assert "CONTAINER_API_KEY" in check["value"] and wrong not in check["value"]
        reads = vast.calls("show")
        assert reads and all(c.status == 401 for c in reads)
        assert vast.mutations() == []
        for path in daemon.env.state_dir.rglob("*"):
            if path.is_file():
                assert wrong not in path.read_text(errors="replace"), path


# ------------------------------------------------------------------------------------ RunPod


@pytest.mark.parametrize(("fields", "price"), [(("cost",), 0.74), ((), None)])
def test_runpod_auto_price_trains_with_the_pods_cost_or_without_a_price(
    tmp_path: Path, data: Path, fields: tuple[str, ...], price: float | None
) -> None:
    with run_fake_runpod(keys={RUNPOD_KEY}) as runpod:
        runpod.add_instance("pod0abc", cost=0.74, price_fields=fields)
        env = state_env(tmp_path, runpod_pod_id="pod0abc", runpod_api_key=RUNPOD_KEY)
        sections = (
            f'[sync]\ntarget = "file://{tmp_path / "synced"}"\n'
            '[limits]\nprice_usd_per_hour = "auto"\nbudget_usd = 50\n'
            f'[teardown]\nprovider = "runpod"\napi_url = "{runpod.url}"\n'
            # The scripted trainer's checkpoints are bytes: a restore drill would fail them.
            "require_restore_drill = false\n"
        )
        code, daemon, launched = run_job(tmp_path, data, sections, env)
        assert code == 0
        # Never a preflight failure that destroys: the job trained to its end, then the pod
        # was terminated as a completed job is.
        assert daemon.state.reason == Reason.COMPLETED, daemon.state.cause
        assert len(launched) == 1
        assert daemon.state.price_usd_per_hour == (
            pytest.approx(price) if price is not None else None
        )
        report = json.loads((daemon.env.state_dir / "preflight.json").read_text())
        [check] = [c for c in report["checks"] if c["name"] == "provider.runpod"]
        assert check["status"] == ("pass" if price is not None else "warn"), check
        assert [m for m, _, _ in runpod.mutations()] == ["DELETE"]
        assert runpod.instance("pod0abc") is None
