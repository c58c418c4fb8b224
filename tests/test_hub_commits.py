"""How many commits a whole job makes on the Hub (issue 29, item 2): the demo's job (``yolox-n``,
3 epochs, ``save_period = 1``, ``every_epochs = 1``) trained for real, synced to the fake Hub
through the real ``huggingface_hub`` client, the commits counted on the fake and printed.

Before milestones were grouped each file was one commit: 26 sync commits for this job, 28 with
the preflight canary's two (measured with this test on the tree before the change). Now each
milestone is one commit: 5 sync commits, 7 in all.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import demo
from agent.config.model import Env
from agent.state import Phase
from tests.fakes.hub import FakeHub, run_fake_hub
from tests.test_daemon_hub import (
    GOOD_TOKEN,
    REPO,
    join_sync_threads,
    make_job,
    requires_libreyolo,
    run_daemon,
)

pytestmark = pytest.mark.training


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.make_dataset(tmp_path_factory.mktemp("data") / "ds")


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    before = set(threading.enumerate())
    with run_fake_hub(tokens={GOOD_TOKEN}) as h:
        yield h
        join_sync_threads(before)


@requires_libreyolo
def test_the_demo_job_makes_one_commit_per_milestone_on_the_hub(
    tmp_path: Path, dataset: Path, hub: FakeHub, capsys: pytest.CaptureFixture[str]
) -> None:
    epochs = 3
    # The Hub's limit, as the fake enforces it: the job must never meet it.
    hub.limit_commits(128)
    job = make_job(tmp_path, dataset, epochs=epochs, sync="")
    env = Env(state_dir=tmp_path / "state", hf_endpoint=hub.url, hf_token=GOOD_TOKEN)

    code, daemon, _ = asyncio.run(run_daemon(job, env))

    assert code == 0 and daemon.state.phase == Phase.DONE
    commits = [c for c in hub.commits("model", REPO) if c.summary.startswith("libreyolo-agent")]
    files = sum(len(c.paths) + len(c.deleted) for c in commits)
    with capsys.disabled():
        print(f"\n{len(commits)} commits to {REPO} for the demo job ({files} files)")
        for c in commits:
            print(f"  {c.summary[:100]}")
    assert hub.commits_refused.get(("model", REPO), 0) == 0
    # The canary (written, deleted: 2), one commit per epoch's milestone (3), the final sync
    # (what changed since: the agent's files), the post-mortem (report.json, report.md).
    assert len(commits) <= 2 + epochs + 2, [c.summary for c in commits]
    status = daemon.status_dict()
    assert status["sync"]["verified"]["sync_verified"] is True
    assert status["sync_cadence"]["adapted"] is False
    assert status["sync_cadence"]["limit_per_hour"] == 128
