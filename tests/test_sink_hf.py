"""HubSink against the fake Hub, through the real ``huggingface_hub`` client."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import get_session
from huggingface_hub.errors import HfHubHTTPError

from agent import hub as agent_hub
from agent.config.model import Env
from agent.sinks import RemoteFile, SinkError
from agent.sinks.digests import sha256_file
from agent.sinks.hf import HubSink
from agent.sinks.target import make_sink
from tests.fakes.hub import FakeHub, overlaps, run_fake_hub

GOOD = "hf_write_token_SECRET_1234"
READ = "hf_read_token_SECRET_5678"
BAD = "hf_revoked_token_SECRET_9999"
REPO = "org/run1"


@pytest.fixture(autouse=True)
def _configured() -> None:
    """The daemon sets the Hub client up at start-up, before it builds a sink."""
    agent_hub.configure()


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
    from agent.config.model import SyncSection

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


def test_hung_hub_times_out_instead_of_blocking_forever(hub: FakeHub) -> None:
    s = sink(hub)
    assert get_session().timeout.read == agent_hub.HTTP_TIMEOUT_S
    hub.add_repo("model", REPO)
    hub.delay("paths_info", 10.0)
    agent_hub.configure(timeout_s=0.3)  # replaces the shared client: the next request uses it
    try:
        started = time.monotonic()
        with pytest.raises(SinkError) as exc:
            s.stat("w.pt")
        assert time.monotonic() - started < 8  # the 0.3 s timeout, not the Hub's 10 s
        assert exc.value.retryable
        assert "Timeout" in str(exc.value)
    finally:
        agent_hub.configure()


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
    http = agent_hub.hub_http
    hub_call = http.Request("POST", f"{hub.url}/api/complete_multipart")
    storage_put = http.Request("PUT", f"{hub.url}/presigned/upload")
    for request, status, retryable in (
        (hub_call, 403, False),
        (hub_call, 503, True),
        (storage_put, 403, True),  # an expired presigned URL: the next attempt gets a new one
    ):
        cause = HfHubHTTPError("boom", response=http.Response(status, request=request))
        wrapped = RuntimeError("Error while uploading 'w.pt' to the Hub.")
        wrapped.__cause__ = cause
        err = sink(hub)._error("upload of w.pt", wrapped)
        assert err.retryable is retryable
        assert f"HTTP {status}" in str(err)


# ---- download (resume from the target) ---------------------------------------------------------


def test_download_fetches_a_checkpoint_and_checks_it(
    hub: FakeHub, ckpt: Path, tmp_path: Path
) -> None:
    s = sink(hub)
    s.prepare()
    s.upload(ckpt, "weights/last.pt")
    dest = tmp_path / "fresh" / "weights" / "last.pt"
    got = s.download("weights/last.pt", dest)
    assert got is not None and got.sha256 == sha256_file(ckpt)
    assert dest.read_bytes() == ckpt.read_bytes()
    assert s.download("weights/missing.pt", tmp_path / "m.pt") is None
    assert not (tmp_path / "m.pt").exists()


def test_a_truncated_download_is_refused_and_leaves_nothing(
    hub: FakeHub, ckpt: Path, tmp_path: Path
) -> None:
    s = sink(hub)
    s.prepare()
    s.upload(ckpt, "weights/last.pt")
    hub.truncate(fraction=0.5, times=None)
    dest = tmp_path / "w" / "last.pt"
    with pytest.raises(SinkError):
        s.download("weights/last.pt", dest)
    assert not dest.exists()
    assert [p.name for p in dest.parent.iterdir()] == []
    hub.clear_faults()
    assert s.download("weights/last.pt", dest) is not None
    assert sha256_file(dest) == sha256_file(ckpt)


# ---- Git LFS transfers (what the real Hub asks for checkpoints) --------------------------------


def test_a_checkpoint_goes_up_through_the_lfs_batch_api_with_the_snapshot_digest(
    hub: FakeHub, ckpt: Path
) -> None:
    """The Hub answers preupload "lfs" for a .pt: batch, one PUT to the presigned URL (no
    token on it), verify, then a commit that names the object; a second upload of the same
    bytes sends nothing but preupload and batch (the Hub already has the object)."""
    s = sink(hub)
    s.prepare()
    hub.clear_requests()
    s.upload(ckpt, "weights/last.pt")
    routes = [r.route for r in hub.requests]
    assert routes == ["preupload", "lfs_batch", "lfs_upload", "lfs_verify", "commit"]
    put = hub.requests[2]
    assert put.auth == "none" and put.files == (sha256_file(ckpt),)
    assert hub.file("model", REPO, "weights/last.pt") == ckpt.read_bytes()
    hub.clear_requests()
    s.upload(ckpt, "weights/last.pt")
    assert "lfs_upload" not in [r.route for r in hub.requests]


def test_a_big_checkpoint_goes_up_in_parts(tmp_path: Path) -> None:
    data = hashlib.sha256(b"big").digest() * 40_000  # 1.28 MB, over a 256 KiB part size
    local = tmp_path / "best.pt"
    local.write_bytes(data)
    with run_fake_hub(tokens={GOOD}, lfs_chunk_size=256 * 1024) as h:
        s = sink(h)
        s.prepare()
        s.upload(local, "weights/best.pt")
        puts = [r for r in h.requests if r.route == "lfs_upload"]
        assert len(puts) == -(-len(data) // (256 * 1024))
        assert [r.route for r in h.requests].count("lfs_complete") == 1
        assert h.file("model", REPO, "weights/best.pt") == data
        assert s.stat("weights/best.pt") == RemoteFile(
            "weights/best.pt", len(data), sha256_file(local)
        )


@pytest.mark.parametrize("status", [403, 400])
def test_a_refused_storage_put_is_retryable_and_the_next_attempt_lands(
    hub: FakeHub, ckpt: Path, status: int
) -> None:
    """S3 answers 403 to an expired presigned URL and 400 to a timed-out socket: neither is
    about the token, and a new attempt gets a new URL."""
    s = sink(hub)
    s.prepare()
    hub.fail("lfs_upload", status)
    with pytest.raises(SinkError) as exc:
        s.upload(ckpt, "weights/last.pt")
    assert exc.value.retryable
    assert f"HTTP {status}" in str(exc.value)
    assert GOOD not in str(exc.value)
    assert s.stat("weights/last.pt") is None  # nothing committed
    s.upload(ckpt, "weights/last.pt")
    assert hub.file("model", REPO, "weights/last.pt") == ckpt.read_bytes()


def test_a_commit_naming_an_object_never_uploaded_is_refused(hub: FakeHub) -> None:
    """The fake, like the Hub, will not commit an LFS pointer to bytes it does not have."""
    import json

    hub.add_repo("model", REPO)
    body = "\n".join(
        json.dumps(line)
        for line in (
            {"key": "header", "value": {"summary": "s"}},
            {
                "key": "lfsFile",
                "value": {"path": "w.pt", "algo": "sha256", "oid": "0" * 64, "size": 3},
            },
        )
    )
    r = get_session().post(
        f"{hub.url}/api/models/{REPO}/commit/main",
        content=body.encode(),
        headers={"Authorization": f"Bearer {GOOD}", "Content-Type": "application/x-ndjson"},
    )
    assert r.status_code == 422
    assert hub.file("model", REPO, "w.pt") is None


def test_a_connection_dropped_mid_put_is_retried_and_nothing_half_written_is_committed(
    hub: FakeHub, ckpt: Path
) -> None:
    """The Hub (its storage) goes away in the middle of the checkpoint's PUT: the client's own
    retry or the next attempt lands it whole; no commit ever names a partial object."""
    s = sink(hub)
    s.prepare()
    hub.reset("lfs_upload")
    try:
        s.upload(ckpt, "weights/last.pt")
    except SinkError as exc:
        assert exc.retryable
        s.upload(ckpt, "weights/last.pt")
    assert hub.file("model", REPO, "weights/last.pt") == ckpt.read_bytes()
    puts = [r for r in hub.requests if r.route == "lfs_upload"]
    assert len(puts) >= 2 and puts[0].status is None  # the first one was dropped
    assert s.stat("weights/last.pt") == RemoteFile(
        "weights/last.pt", ckpt.stat().st_size, sha256_file(ckpt)
    )


def test_delete_removes_a_file_and_a_missing_one_is_fine(hub: FakeHub, text: Path) -> None:
    s = sink(hub)
    s.prepare()
    s.upload(text, "agent/.canary")
    assert hub.file("model", REPO, "agent/.canary") is not None
    s.delete("agent/.canary")
    assert hub.file("model", REPO, "agent/.canary") is None
    assert s.stat("agent/.canary") is None
    s.delete("agent/.canary")  # already gone: nothing to do, no error


def test_delete_with_a_read_token_says_it_needs_write_access(hub: FakeHub, text: Path) -> None:
    sink(hub).prepare()
    sink(hub).upload(text, "agent/.canary")
    with pytest.raises(SinkError) as info:
        sink(hub, READ).delete("agent/.canary")
    assert "write access" in str(info.value) and READ not in str(info.value)
    assert hub.file("model", REPO, "agent/.canary") is not None
