"""HubSink against the fake Hub, through the real ``huggingface_hub`` client."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import close_session, get_session
from huggingface_hub.errors import HfHubHTTPError

from agent.config import Env
from agent.sinks import RemoteFile, SinkError, make_sink, sha256_file
from agent.sinks import hf as hf_sink
from agent.sinks.hf import HubSink
from tests.fakes.hub import FakeHub, overlaps, run_fake_hub

GOOD = "hf_write_token_SECRET_1234"
READ = "hf_read_token_SECRET_5678"
BAD = "hf_revoked_token_SECRET_9999"
REPO = "org/run1"
ROOT = Path(__file__).resolve().parent.parent
#: Set in the child run of this file on the oldest allowed huggingface_hub (no recursion).
OLD_HUB_RUN = "LIBREYOLO_AGENT_TEST_OLD_HUB"


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with run_fake_hub(tokens={GOOD}, read_tokens={READ}) as h:
        yield h


def sink(hub: FakeHub, token: str | None = GOOD, *, private: bool = True, **kw: str) -> HubSink:
    return HubSink(REPO, env=Env(hf_endpoint=hub.url, hf_token=token), private=private, **kw)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    # A .pt is a zip archive: binary, and LFS/Xet on the real Hub.
    p = tmp_path / "last.pt"
    p.write_bytes(b"PK\x03\x04" + hashlib.sha256(b"seed").digest() * 40_000)
    return p


@pytest.fixture
def text(tmp_path: Path) -> Path:
    p = tmp_path / "results.csv"
    p.write_text("epoch,mAP50\n1,0.12\n2,0.31\n")
    return p


def test_make_sink_builds_a_hub_sink_for_hf_targets(hub: FakeHub) -> None:
    from agent.config import SyncSection

    s = make_sink(SyncSection(target=f"hf://{REPO}"), Env(hf_endpoint=hub.url, hf_token=GOOD))
    assert isinstance(s, HubSink)
    assert s.description == f"hf://{REPO}"
    assert s.private


def test_prepare_creates_a_private_repo_and_is_safe_to_repeat(hub: FakeHub) -> None:
    s = sink(hub)
    s.prepare()
    s.prepare()
    assert hub.is_private("model", REPO)
    assert [r.status for r in hub.requests if r.route == "create_repo"] == [200, 409]
    HubSink("org/open", env=Env(hf_endpoint=hub.url, hf_token=GOOD), private=False).prepare()
    assert not hub.is_private("model", "org/open")


def test_upload_and_stat_a_checkpoint_described_as_lfs(hub: FakeHub, ckpt: Path) -> None:
    s = sink(hub)
    s.prepare()
    s.upload(ckpt, "weights/last.pt")
    assert hub.file("model", REPO, "weights/last.pt") == ckpt.read_bytes()
    desc = hub.describe("model", REPO, "weights/last.pt")
    assert desc is not None and "lfs" in desc  # read back the way the real Hub describes it
    hub.clear_requests()
    remote = s.stat("weights/last.pt")
    assert remote == RemoteFile("weights/last.pt", ckpt.stat().st_size, sha256_file(ckpt))
    # LFS: the Hub's sha256 is used; the checkpoint is not downloaded again.
    assert [r.route for r in hub.requests] == ["paths_info"]
    commit = hub.commits("model", REPO)[-1]
    assert commit.summary == "libreyolo-agent: upload weights/last.pt"


def test_upload_and_stat_a_small_regular_file(hub: FakeHub, text: Path) -> None:
    s = sink(hub)
    s.prepare()
    s.upload(text, "results.csv")
    desc = hub.describe("model", REPO, "results.csv")
    assert desc is not None and "lfs" not in desc  # its oid is a git sha1, not a sha256
    hub.clear_requests()
    remote = s.stat("results.csv")
    assert remote == RemoteFile("results.csv", text.stat().st_size, sha256_file(text))
    assert [(r.route, r.method) for r in hub.requests] == [
        ("paths_info", "POST"),
        ("resolve", "GET"),
    ]


def test_stat_of_a_missing_file_is_none(hub: FakeHub, text: Path) -> None:
    s = sink(hub)
    s.prepare()
    assert s.stat("weights/last.pt") is None
    s.upload(text, "weights/results.csv")
    assert s.stat("weights") is None  # a folder is not a file
    assert s.stat("weights/last.pt") is None


def test_accepted_then_dropped_upload_reads_back_as_missing(hub: FakeHub, ckpt: Path) -> None:
    s = sink(hub)
    s.prepare()
    hub.lose("drop")
    s.upload(ckpt, "weights/last.pt")  # the Hub said yes...
    assert s.stat("weights/last.pt") is None  # ...verification says no


@pytest.mark.parametrize("name", ["weights/last.pt", "results.csv"])
def test_accepted_then_corrupted_upload_reads_back_with_another_hash(
    hub: FakeHub, ckpt: Path, text: Path, name: str
) -> None:
    local = ckpt if name.endswith(".pt") else text
    s = sink(hub)
    s.prepare()
    hub.lose("corrupt")
    s.upload(local, name)
    remote = s.stat(name)
    assert remote is not None
    assert remote.size == local.stat().st_size  # same size: only the hash can tell
    assert remote.sha256 != sha256_file(local)


def test_reupload_after_a_lost_commit_repairs_the_file(hub: FakeHub, ckpt: Path) -> None:
    s = sink(hub)
    s.prepare()
    hub.lose("corrupt")
    s.upload(ckpt, "w.pt")
    s.upload(ckpt, "w.pt")  # the preupload oid differs from the corrupt copy: not skipped
    remote = s.stat("w.pt")
    assert remote is not None and remote.sha256 == sha256_file(ckpt)


@pytest.mark.parametrize("token", [BAD, READ, None])
def test_token_problems_are_not_retryable_and_never_show_the_token(
    hub: FakeHub, ckpt: Path, token: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    hub.add_repo("model", REPO, private=True)
    s = sink(hub, token)
    calls = [lambda: s.upload(ckpt, "w.pt")]
    if token == READ:
        # A read token may "create" a repo that exists (the Hub answers 403, the client then
        # finds the repo) and may read back: only the upload shows the problem.
        s.prepare()
        assert s.stat("w.pt") is None
    else:
        calls += [s.prepare, lambda: s.stat("w.pt")]
    for call in calls:
        with pytest.raises(SinkError) as exc:
            call()
        err = exc.value
        assert not err.retryable
        assert f"set HF_TOKEN to a token with write access to {REPO}" in str(err)
        for secret in (GOOD, READ, BAD):
            assert secret not in str(err)
            assert secret not in caplog.text
    if token is None:
        assert "HF_TOKEN is not set" in str(err)
    assert hub.file("model", REPO, "w.pt") is None


def test_missing_repo_is_not_retryable(hub: FakeHub, text: Path) -> None:
    with pytest.raises(SinkError) as exc:
        sink(hub).upload(text, "results.csv")
    assert not exc.value.retryable
    assert f"repository {REPO} was not found" in str(exc.value)


@pytest.mark.parametrize(
    ("route", "status"), [("commit", 500), ("commit", 503), ("create_repo", 502)]
)
def test_server_errors_are_retryable(hub: FakeHub, text: Path, route: str, status: int) -> None:
    hub.add_repo("model", REPO)
    hub.fail(route, status)
    s = sink(hub)
    with pytest.raises(SinkError) as exc:
        s.prepare() if route == "create_repo" else s.upload(text, "results.csv")
    assert exc.value.retryable
    assert f"HTTP {status}" in str(exc.value)


def test_rate_limit_is_retryable_and_says_how_long(hub: FakeHub) -> None:
    hub.add_repo("model", REPO)
    hub.fail("paths_info", 429, retry_after=30)
    with pytest.raises(SinkError) as exc:
        sink(hub).stat("w.pt")
    assert exc.value.retryable
    assert "wait 30 s" in str(exc.value)
    assert exc.value.retry_after_s == 30.0  # the sync queue waits at least that long


def test_failed_read_back_download_is_retryable(hub: FakeHub, text: Path) -> None:
    s = sink(hub)
    s.prepare()
    s.upload(text, "results.csv")
    hub.fail("resolve", 500, method="GET")
    with pytest.raises(SinkError) as exc:
        s.stat("results.csv")
    assert exc.value.retryable


def test_connection_reset_is_retryable(hub: FakeHub, text: Path) -> None:
    s = sink(hub)
    s.prepare()
    hub.reset("commit")
    with pytest.raises(SinkError) as exc:
        s.upload(text, "results.csv")
    assert exc.value.retryable
    assert "cannot reach" in str(exc.value)
    assert s.stat("results.csv") is None


def test_preupload_5xx_is_retried_inside_the_client(hub: FakeHub, text: Path) -> None:
    """huggingface_hub retries preupload itself (http_backoff, 1 s first): one upload call
    survives a single 503 there, and takes a second longer."""
    s = sink(hub)
    s.prepare()
    hub.fail("preupload", 503)
    s.upload(text, "results.csv")
    assert [r.status for r in hub.requests if r.route == "preupload"] == [503, 200]


def test_hung_hub_times_out_instead_of_blocking_forever(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = sink(hub)
    assert get_session().timeout.read == hf_sink.HTTP_TIMEOUT_S
    hub.add_repo("model", REPO)
    hub.delay("paths_info", 5.0)
    monkeypatch.setattr(hf_sink, "HTTP_TIMEOUT_S", 0.3)
    close_session()  # the next request builds a client with the short timeout
    try:
        started = time.monotonic()
        with pytest.raises(SinkError) as exc:
            s.stat("w.pt")
        assert time.monotonic() - started < 3
        assert exc.value.retryable
        assert "Timeout" in str(exc.value)
    finally:
        monkeypatch.undo()
        close_session()


def test_refuses_paths_outside_the_repo(hub: FakeHub, text: Path) -> None:
    for bad in ("../x.pt", "/abs.pt", "", "a//b.pt"):
        with pytest.raises(SinkError) as exc:
            sink(hub).upload(text, bad)
        assert not exc.value.retryable
    assert not hub.requests


def test_missing_local_file_is_a_sink_error(hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(SinkError, match="is not a file"):
        sink(hub).upload(tmp_path / "gone.pt", "gone.pt")


def test_branch_revision_is_created_and_used(hub: FakeHub, text: Path) -> None:
    s = sink(hub, revision="ckpts")
    assert s.description == f"hf://{REPO}@ckpts"
    s.prepare()
    s.prepare()
    s.upload(text, "results.csv")
    assert hub.file("model", REPO, "results.csv", revision="ckpts") == text.read_bytes()
    assert hub.file("model", REPO, "results.csv") is None
    remote = s.stat("results.csv")
    assert remote is not None and remote.sha256 == sha256_file(text)
    assert sink(hub).stat("results.csv") is None  # main does not have it


def test_serial_uploads_of_one_path_never_overlap(hub: FakeHub, ckpt: Path) -> None:
    s = sink(hub)
    s.prepare()
    for _ in range(2):
        s.upload(ckpt, "w.pt")
        ckpt.write_bytes(ckpt.read_bytes() + b"more")
    commits = [r for r in hub.requests if r.route == "commit" and "w.pt" in r.files]
    assert len(commits) == 2
    assert not overlaps(commits)


def test_wrapped_transfer_errors_are_classified_by_their_cause(hub: FakeHub) -> None:
    """LFS/Xet transfers (real Hub only) raise RuntimeError from the HTTP error."""
    request = hf_sink.hub_http.Request("PUT", f"{hub.url}/lfs/upload")
    for status, retryable in ((403, False), (503, True)):
        cause = HfHubHTTPError("boom", response=hf_sink.hub_http.Response(status, request=request))
        wrapped = RuntimeError("Error while uploading 'w.pt' to the Hub.")
        wrapped.__cause__ = cause
        err = sink(hub)._error("upload of w.pt", wrapped)
        assert err.retryable is retryable
        assert f"HTTP {status}" in str(err)


# ---- huggingface_hub versions ------------------------------------------------------------------


def test_installed_huggingface_hub_is_accepted() -> None:
    hf_sink.check_hub_version()
    assert hf_sink.hub_version_supported(huggingface_hub.__version__)
    expected = "httpx" if huggingface_hub.__version__.startswith("1.") else "httpx2"
    assert hf_sink.hub_http.__name__ == expected == type(get_session()).__module__.split(".")[0]


@pytest.mark.parametrize(
    ("version", "supported", "client"),
    [
        ("0.36.2", False, "httpx"),
        ("1.0.0", False, "httpx"),
        ("1.3.1", False, "httpx"),
        ("1.3.2", True, "httpx"),
        ("1.33.0", True, "httpx"),
        ("2.0.0rc1", True, "httpx2"),
        ("2.4.0", True, "httpx2"),
        ("10.0", True, "httpx2"),
    ],
)
def test_version_check_and_http_client_by_version(
    version: str, supported: bool, client: str
) -> None:
    assert hf_sink.hub_version_supported(version) is supported
    assert hf_sink.http_module_name(version) == client
    if supported:
        hf_sink.check_hub_version(version)
        return
    with pytest.raises(hf_sink.HubVersionError) as exc:
        hf_sink.check_hub_version(version)
    assert isinstance(exc.value, SinkError) and not exc.value.retryable
    assert f"huggingface_hub {version} is too old" in str(exc.value)
    assert "pip install 'huggingface_hub>=1.3.2'" in str(exc.value)


#: Folder of ``pip install --target`` trees, one per huggingface_hub version (``1.3.2/``,
#: ``1.3.1/``), prepared by .ci/run before the suite: tests never reach a package index.
HUB_SITES = "LIBREYOLO_AGENT_HUB_SITES"


def _pip_target(tmp: Path, version: str) -> Path:
    """The prepared tree of ``huggingface_hub==version`` (with its httpx), or skip."""
    root = os.environ.get(HUB_SITES)
    site = Path(root) / version if root else None
    if site is None or not (site / "huggingface_hub").is_dir():
        pytest.skip(
            f"no prepared huggingface_hub {version} tree: set {HUB_SITES} (.ci/run does: "
            f"pip install --no-deps --target DIR/{version} huggingface_hub=={version} "
            "'httpx>=0.23,<1' httpcore)"
        )
    return site


def _run_with(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}", **{OLD_HUB_RUN: "1"})
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=150
    )


@pytest.mark.skipif(bool(os.environ.get(OLD_HUB_RUN)), reason="already the old-hub run")
def test_this_file_passes_on_the_oldest_allowed_huggingface_hub(tmp_path: Path) -> None:
    """huggingface_hub 1.x builds on httpx, not httpx2 (a GPU image shipped 1.33, where this
    module could not even be imported): the whole file runs again on MIN_HUB_VERSION."""
    site = _pip_target(tmp_path, hf_sink.MIN_HUB_VERSION)
    probe = _run_with(
        site,
        "-c",
        "import huggingface_hub, agent.sinks.hf as hf; "
        "print(huggingface_hub.__version__, hf.hub_http.__name__)",
    )
    assert probe.stdout.split() == [hf_sink.MIN_HUB_VERSION, "httpx"], probe.stderr
    run = _run_with(site, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert int(summary.split(" passed")[0].split()[-1]) >= 30, summary


@pytest.mark.skipif(bool(os.environ.get(OLD_HUB_RUN)), reason="already the old-hub run")
def test_too_old_huggingface_hub_is_refused_with_the_fix(tmp_path: Path) -> None:
    """1.3.1 would fail every upload to a non-default endpoint after sending it (the fake Hub's
    is one): refused when hf:// sync is imported, with the fix."""
    site = _pip_target(tmp_path, "1.3.1")
    run = _run_with(site, "-c", "import agent.sinks.hf")
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last == (
        "agent.sinks.hf.HubVersionError: huggingface_hub 1.3.1 is too old for hf:// sync: "
        "libreyolo-agent needs huggingface_hub>=1.3.2; "
        "fix: pip install 'huggingface_hub>=1.3.2'"
    )
