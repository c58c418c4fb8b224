"""No secret ever leaves the agent: a whole job runs with a recognisable fake secret in every
variable the agent reads, and none of them may appear in what it serves or writes.

The job is real end to end but fast: the scripted stand-in trainer (a real process writing the
run directory like LibreYOLO), a ``file://`` sync target, teardown provider ``none``. A ``hold``
keeps the agent serving after the run, so every HTTP route is read with the whole story in it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from agent.config.model import Env
from agent.daemon.spine import Daemon
from agent.events import Event
from agent.state import Phase
from agent.status import report
from tests.fakes.scripted_launcher import ScriptedLauncher
from tests.fakes.scripted_trainer import SCRIPT
from tests.support import tiny_job, wait_for

#: Every variable :meth:`Env.from_environ` reads that holds a secret or an account's name,
#: each with a value no code would produce by chance. (LIBREYOLO_AGENT_STATE_DIR, HF_ENDPOINT
#: and HF_HOME are paths and a URL, not secrets: they are set to working values.)
FAKE_SECRETS = {
    "HF_TOKEN": "hf_FAKESECRET_hf_token_0123",
    "CONTAINER_API_KEY": "FAKESECRET_container_api_key_4567",
    "VAST_API_KEY": "FAKESECRET_vast_api_key_89ab",
    "RUNPOD_API_KEY": "FAKESECRET_runpod_api_key_cdef",
    "LAMBDA_API_KEY": "FAKESECRET_lambda_api_key_0246",
    "CONTAINER_ID": "FAKESECRET_container_id_1357",
    "RUNPOD_POD_ID": "FAKESECRET_runpod_pod_id_8642",
}
#: Routes read while the agent holds after the run; every one must answer.
ROUTES = ("/status", "/logs?tail=5000", "/metrics", "/events?since=0", "/history", "/")


def leaks(text: str) -> list[str]:
    """The variables whose fake secret appears in ``text`` (also as a fragment of the value)."""
    return [
        name
        for name, value in FAKE_SECRETS.items()
        if value in text or value.removeprefix("hf_").removeprefix("FAKESECRET_") in text
    ]


def http(
    method: str, url: str, token: str | None = None, *, stream_s: float = 0.0
) -> tuple[int, str]:
    """(status, body) of one request; an event stream is read for ``stream_s`` seconds."""
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=stream_s or 10) as resp:
            chunks: list[bytes] = []
            try:
                while chunk := resp.read1(65536):
                    chunks.append(chunk)
            except TimeoutError:  # an event stream never ends by itself
                pass
            return resp.status, b"".join(chunks).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def test_no_fake_secret_appears_anywhere_the_agent_serves_or_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert leaks(f"key={FAKE_SECRETS['VAST_API_KEY']}!") == ["VAST_API_KEY"]  # the probe works
    for name, value in FAKE_SECRETS.items():
        monkeypatch.setenv(name, value)  # the trainer and every child inherit them too
    monkeypatch.setenv("LIBREYOLO_AGENT_STATE_DIR", str(tmp_path / "state"))
    data = tmp_path / "data.yaml"
    data.write_text("train: images\nval: images\nnames:\n  0: box\n")
    target = tmp_path / "synced"
    job = tiny_job(
        tmp_path,
        data,
        sections=f'[sync]\ntarget = "file://{target}"\n[teardown]\nprovider = "none"\n',
    )
    env = Env.from_environ(os.environ)
    assert {n for n, _ in env.secrets()} >= {"HF_TOKEN", "VAST_API_KEY", "LAMBDA_API_KEY"}
    daemon = Daemon(job, env, launcher=ScriptedLauncher(epoch_s=0.1), poll_interval_s=0.05)
    events: list[Event] = []
    daemon.events.listen(events.append)
    served: dict[str, tuple[int, str]] = {}

    async def main() -> int:
        task = asyncio.create_task(daemon.run())
        await wait_for(lambda: (daemon.state.server or {}).get("port"), timeout=30)
        base = f"http://127.0.0.1:{daemon.state.server['port']}"  # type: ignore[index]
        token = (env.state_dir / "token").read_text().strip()
        status, body = await asyncio.to_thread(http, "POST", f"{base}/hold", token)
        assert status == 200, body
        await wait_for(lambda: daemon.state.phase == Phase.HELD, timeout=60)
        for route in ROUTES:
            stream_s = 2.0 if route.startswith("/events") else 0.0
            served[route] = await asyncio.to_thread(http, "GET", base + route, stream_s=stream_s)
        status, body = await asyncio.to_thread(http, "POST", f"{base}/release", token)
        assert status == 200, body
        return await asyncio.wait_for(task, 60)

    assert asyncio.run(main()) == 0
    assert daemon.state.phase == Phase.DONE and daemon.state.reason is not None
    assert daemon.state.reason.value == "completed"

    # The post-mortem, as the daemon makes it (written here if the daemon does not yet).
    state_dir = env.state_dir
    # The daemon wrote the post-mortem itself (before the teardown call, and again at DONE).
    assert report.load(state_dir) is not None

    assert {route: status for route, (status, _) in served.items()} == dict.fromkeys(ROUTES, 200)
    answered = {route: body for route, (_, body) in served.items()}
    assert json.loads(answered["/status"])["phase"] == "HELD"
    for route, body in answered.items():
        assert leaks(body) == [], route
    assert leaks(json.dumps([e.to_dict() for e in events], default=str)) == []

    written = [state_dir / n for n in ("state.json", "agent.log", "report.json", "report.md")]
    for path in written:
        assert path.is_file(), path
    on_target = [p for p in target.rglob("*") if p.is_file()]
    assert any(p.name == "last.pt" for p in on_target)  # the job really synced
    assert any(p.name == "agent.log" for p in on_target)
    everything = {*written, *state_dir.rglob("*"), *on_target}
    found: dict[str, Any] = {}
    for path in sorted(p for p in everything if p.is_file()):
        hit = leaks(path.read_bytes().decode("latin-1"))
        if hit:
            found[str(path)] = hit
    assert found == {}


#: The provider keys: the trainer must not have them at all.
PROVIDER_KEYS = ("CONTAINER_API_KEY", "VAST_API_KEY", "RUNPOD_API_KEY", "LAMBDA_API_KEY")

#: A trainer that shows what it was given: the names of the fake secrets in its environment and
#: the Hub token's value (a careless print), on stderr (trainer.log), then trains as the scripted
#: stand-in does.
NOSY_TRAINER = """
import os, runpy, sys
names = {names!r}
print("trainer sees:", ",".join(n for n in names if n in os.environ), file=sys.stderr, flush=True)
print("HF_TOKEN is", os.environ.get("HF_TOKEN"), file=sys.stderr, flush=True)
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


class NosyLauncher(ScriptedLauncher):
    def __init__(self, wrapper: Path, **options: object) -> None:
        super().__init__(**options)
        self.wrapper = wrapper

    def _base(self) -> list[str]:
        return [sys.executable, str(self.wrapper), *super()._base()[2:]]


def test_the_trainer_gets_no_provider_key_and_its_log_leaves_redacted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in FAKE_SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "FAKESECRET_aws_secret_1111")
    monkeypatch.setenv("LIBREYOLO_AGENT_STATE_DIR", str(tmp_path / "state"))
    wrapper = tmp_path / "nosy_trainer.py"
    names = [*FAKE_SECRETS, "AWS_SECRET_ACCESS_KEY"]
    wrapper.write_text(NOSY_TRAINER.format(names=names, script=str(SCRIPT)))
    data = tmp_path / "data.yaml"
    data.write_text("train: images\nval: images\nnames:\n  0: box\n")
    target = tmp_path / "synced"
    job = tiny_job(
        tmp_path,
        data,
        sections=f'[sync]\ntarget = "file://{target}"\n[teardown]\nprovider = "none"\n',
    )
    env = Env.from_environ(os.environ)
    launcher = NosyLauncher(wrapper, epoch_s=0.1, pause_at=2)
    daemon = Daemon(job, env, launcher=launcher, poll_interval_s=0.05)
    seen: dict[str, str] = {}

    async def main() -> int:
        task = asyncio.create_task(daemon.run())
        try:
            await wait_for(lambda: daemon.run_dir and (daemon.run_dir / ".paused").exists(), 120)
            assert daemon.run_dir is not None and daemon.state.trainer is not None
            pid = daemon.state.trainer.pid
            raw = Path(f"/proc/{pid}/environ").read_bytes()
            seen.update(
                entry.decode().split("=", 1)  # type: ignore[misc]
                for entry in raw.split(b"\0")
                if b"=" in entry
            )
            (daemon.run_dir / ".go").write_text("")
        except BaseException:
            if daemon.run_dir is not None:
                (daemon.run_dir / ".go").write_text("")
            raise
        return await asyncio.wait_for(task, 120)

    assert asyncio.run(main()) == 0
    assert daemon.state.reason is not None and daemon.state.reason.value == "completed"
    # The trainer's own environment: the Hub token (weights), no key that can end the box.
    assert seen.get("HF_TOKEN") == FAKE_SECRETS["HF_TOKEN"]
    assert [k for k in (*PROVIDER_KEYS, "AWS_SECRET_ACCESS_KEY") if k in seen] == []
    assert not any(FAKE_SECRETS[k] in v for k in PROVIDER_KEYS for v in seen.values())

    # The trainer printed the token into its log on this disk...
    local = (env.state_dir / "trainer.log").read_text()
    assert f"HF_TOKEN is {FAKE_SECRETS['HF_TOKEN']}" in local
    assert "trainer sees: HF_TOKEN,CONTAINER_ID,RUNPOD_POD_ID\n" in local
    # ...and the copy on the target has it redacted, as /logs shows it.
    uploaded = (target / "agent" / "trainer.log").read_text()
    assert "HF_TOKEN is <HF_TOKEN>" in uploaded
    assert "trainer sees:" in uploaded and "epoch" in uploaded
    assert leaks(uploaded) == []
    for path in target.rglob("*"):
        if path.is_file():
            assert leaks(path.read_bytes().decode("latin-1")) == [], path
