"""The checkpoints' and the post-mortem's links in ``/status`` (what the page links to) point at
the Hub the agent uploads to: ``HF_ENDPOINT`` (a mirror, a private Hub), not always
huggingface.co. A real daemon runs a scripted trainer and syncs to the fake Hub of
tests/fakes/hub.py on 127.0.0.1 through the real ``huggingface_hub`` client; each link then
names a file that Hub holds, with the ledger's content."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path

from agent.config.model import DEFAULT_HF_ENDPOINT, Env, SyncSection
from agent.daemon.spine import Daemon
from agent.status.document import checkpoint_list, post_mortem
from agent.sync.ledger import ItemKind, Ledger
from tests.fakes.hub import run_fake_hub
from tests.fakes.page_agent import put
from tests.fakes.scripted_launcher import ScriptedLauncher
from tests.support import tiny_job

REPO = "acme/run1"
TOKEN = "hf_links_token"


def test_links_name_the_endpoint_given_and_default_to_huggingface_co(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "sync-ledger.json")
    put(led, "weights/last.pt", 1, ItemKind.LAST, 1000.0)
    hub = SyncSection(target=f"hf://{REPO}")
    mirror = "https://hub.example.internal/"  # a trailing slash is not doubled
    got = checkpoint_list(led.entries.values(), hub, hub_endpoint=mirror)
    assert got["checkpoints"][0]["location"] == (
        f"https://hub.example.internal/{REPO}/blob/main/weights/last.pt"
    )
    report = post_mortem(led.entries.values(), hub, hub_endpoint=mirror)
    assert report is not None
    assert report["location"] == f"https://hub.example.internal/{REPO}/blob/main/agent/report.md"
    default = checkpoint_list(led.entries.values(), hub)["checkpoints"][0]["location"]
    assert default == f"{DEFAULT_HF_ENDPOINT}/{REPO}/blob/main/weights/last.pt"


def test_a_runs_links_point_at_the_hub_it_uploaded_to(tmp_path: Path) -> None:
    data = tmp_path / "data.yaml"
    data.write_text("train: images\nval: images\nnames:\n  0: box\n")
    job = tiny_job(tmp_path, data, epochs=3, sections=f'[sync]\ntarget = "hf://{REPO}"\n')
    before = set(threading.enumerate())
    with run_fake_hub(tokens={TOKEN}) as hub:
        env = Env(state_dir=tmp_path / "state", hf_endpoint=hub.url, hf_token=TOKEN)
        daemon = Daemon(job, env, launcher=ScriptedLauncher(epoch_s=0.3), poll_interval_s=0.1)
        assert asyncio.run(asyncio.wait_for(daemon.run(), 120)) == 0
        for t in set(threading.enumerate()) - before:  # uploads end before the Hub goes
            if t.name.startswith("sync-"):
                t.join(60)
        doc = daemon.status_dict()
        held = hub.files("model", REPO)
    assert hub.url.startswith("http://127.0.0.1:")
    checkpoints = doc["checkpoints"]
    assert checkpoints and all(c["status"] == "verified" for c in checkpoints)
    for c in checkpoints:
        assert c["location"] == f"{hub.url}/{REPO}/blob/main/{c['path']}"
        # The file is on that Hub, with the content the ledger verified.
        assert hashlib.sha256(held[c["path"]]).hexdigest().startswith(c["sha256"])
    assert doc["post_mortem"] == {
        "location": f"{hub.url}/{REPO}/blob/main/agent/report.md",
        "verified": True,
    }
    assert "agent/report.md" in held
    assert "huggingface.co" not in str(checkpoints) + str(doc["post_mortem"])
