"""The Hub side (agent/preflight/hub_access.py): dataset size and access, HF_TOKEN, against a tiny
real HTTP server on loopback that the real ``huggingface_hub`` client talks to."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agent import preflight as pf
from agent.preflight import FAIL, PASS, WARN, PreflightReport, format_table, run_preflight
from tests.test_preflight import (
    FAKE_TORCH_ENV,
    NO_GPU,
    STANDIN,
    check,
    make_env,
    make_job,
    run,
)


class TinyHub:
    """The two Hub endpoints preflight calls, over real HTTP on loopback."""

    def __init__(self, *, size: int = 50 * pf.MiB, private: bool = False) -> None:
        self.size = size
        self.private = private
        self.tokens = {"hf_good": "write", "hf_readonly": "read"}
        self.auth_seen: list[str] = []
        self.url = ""

    def _token(self, request: web.Request) -> str | None:
        auth = request.headers.get("Authorization", "")
        self.auth_seen.append(auth)
        return auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None

    async def whoami(self, request: web.Request) -> web.Response:
        token = self._token(request)
        if token not in self.tokens:
            return web.json_response(
                {"error": "Invalid credentials in Authorization header"}, status=401
            )
        role = self.tokens[token]
        return web.json_response(
            {"type": "user", "name": "alice", "auth": {"accessToken": {"role": role}}}
        )

    async def paths_info(self, request: web.Request) -> web.Response:
        token = self._token(request)
        repo = f"{request.match_info['ns']}/{request.match_info['name']}"
        if repo != "org/ds" or (self.private and token not in self.tokens):
            return web.json_response(
                {"error": "Repository not found"},
                status=401,
                headers={"X-Error-Code": "RepoNotFound"},
            )
        if request.match_info["rev"] != "main":
            return web.json_response(
                {"error": "Invalid rev id"},
                status=404,
                headers={"X-Error-Code": "RevisionNotFound"},
            )
        form = await request.post()
        found = [p for p in form.getall("paths") if p == "ds.tar"]
        return web.json_response(
            [{"type": "file", "path": p, "size": self.size, "oid": "0" * 40} for p in found]
        )

    async def serve(self, body: Callable[[str], Awaitable[PreflightReport]]) -> PreflightReport:
        app = web.Application()
        app.router.add_get("/api/whoami-v2", self.whoami)
        app.router.add_post("/api/datasets/{ns}/{name}/paths-info/{rev}", self.paths_info)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            host, port = runner.addresses[0][:2]
            return await body(f"http://{host}:{port}")
        finally:
            await runner.cleanup()


def hub_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hub: TinyHub,
    *,
    token: str | None,
    file: str = "ds.tar",
    revision: str = "main",
    sync: str | None = "hf://org/run1",
) -> PreflightReport:
    sections: dict[str, dict[str, Any]] = {
        "dataset": {"repo": "org/ds", "file": file, "revision": revision, "dest": "data"},
        "preflight": {"allow_cpu": True},
    }
    if sync:
        sections["sync"] = {"target": sync}
    job = make_job(tmp_path, **sections)
    monkeypatch.setenv(FAKE_TORCH_ENV, json.dumps(NO_GPU))

    async def body(url: str) -> PreflightReport:
        env = make_env(tmp_path, endpoint=url, token=token)
        return await run_preflight(job, env, extra_pythonpath=[STANDIN])

    return asyncio.run(hub.serve(body))


def test_hub_dataset_size_and_valid_write_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = TinyHub(private=True)
    report = hub_run(tmp_path, monkeypatch, hub, token="hf_good")
    remote = check(report, "dataset.remote")
    assert remote.status == PASS and remote.value == "org/ds@main: ds.tar, 50.0 MiB"
    token = check(report, "hf_token")
    assert token.status == PASS and token.value == "valid (user alice, role write)"
    disk = check(report, "disk.dataset")
    assert disk.status == PASS and "unpacked (estimate: archive x1) 50.0 MiB" in disk.value
    assert report.ok, format_table(report)
    assert "Bearer hf_good" in hub.auth_seen  # it really went over HTTP with the token
    assert "hf_good" not in json.dumps(report.to_dict()) + format_table(report)


def test_hub_huge_dataset_fails_the_disk_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = TinyHub(size=10 * 1024**5)  # 10 PiB
    report = hub_run(tmp_path, monkeypatch, hub, token=None, sync=None)
    assert check(report, "dataset.remote").status == PASS
    for name in ("disk.hf_home", "disk.dataset"):
        disk = check(report, name)
        assert disk.status == FAIL and "dataset archive 10240.0 TiB" in disk.value
    assert check(report, "hf_token").value == "not set, not needed (dataset is public)"


def test_hub_private_dataset_without_token_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = hub_run(tmp_path, monkeypatch, TinyHub(private=True), token=None, sync=None)
    remote = check(report, "dataset.remote")
    assert remote.status == FAIL
    assert remote.value == "org/ds not found or private (HF_TOKEN is not set)"
    token = check(report, "hf_token")
    assert token.status == FAIL and token.fix is not None and "HF_TOKEN" in token.fix
    assert check(report, "disk.dataset").status == WARN  # size unknown


@pytest.mark.parametrize(
    ("token", "value"),
    [
        (None, "HF_TOKEN is not set; sync to hf://org/run1 needs a write token"),
        ("hf_bad", "rejected by"),
        ("hf_readonly", "valid but read-only (user alice); sync to hf://org/run1 needs write"),
    ],
)
def test_hub_token_problems_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, token: str | None, value: str
) -> None:
    report = hub_run(tmp_path, monkeypatch, TinyHub(), token=token)
    check_ = check(report, "hf_token")
    assert check_.status == FAIL and check_.value.startswith(value)
    assert "hf_bad" not in json.dumps(report.to_dict())


@pytest.mark.parametrize(
    ("file", "revision", "value"),
    [
        ("other.tar", "main", "no file 'other.tar' in org/ds@main"),
        ("ds.tar", "v9", "no revision 'v9' in org/ds"),
    ],
)
def test_hub_missing_file_or_revision_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file: str, revision: str, value: str
) -> None:
    report = hub_run(
        tmp_path, monkeypatch, TinyHub(), token=None, file=file, revision=revision, sync=None
    )
    remote = check(report, "dataset.remote")
    assert remote.status == FAIL and remote.value == value


def test_hub_unreachable_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = make_job(
        tmp_path,
        dataset={"repo": "org/ds", "file": "ds.tar"},
        sync={"target": "hf://org/run1"},
        preflight={"allow_cpu": True},
    )
    env = make_env(tmp_path, endpoint="http://127.0.0.1:9", token="hf_secret")  # nothing there
    report = run(monkeypatch, job, env, NO_GPU)
    remote = check(report, "dataset.remote")
    assert remote.status == WARN and remote.value.startswith(
        "Hub unreachable at http://127.0.0.1:9"
    )
    assert check(report, "hf_token").status == WARN
    assert {check(report, n).status for n in ("disk.hf_home", "disk.dataset")} == {WARN}
    assert report.ok
    assert "hf_secret" not in json.dumps(report.to_dict()) + format_table(report)
