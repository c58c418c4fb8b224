"""The fake Hub, driven by the real ``huggingface_hub`` client: if these pass, tests that use the
fake exercise the same requests and answers as against huggingface.co."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import CommitOperationAdd, HfApi, RepoFile, RepoFolder, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tests.fakes.hub import (
    FakeHub,
    git_blob_sha1,
    lfs_pointer,
    overlaps,
    resolve_url,
    run_fake_hub,
)

GOOD = "hf_good_token_123"
READ = "hf_read_token_456"
BAD = "hf_not_a_token"
# Binary and named like a checkpoint: LFS on the real Hub.
CKPT = bytes(range(256)) * 4096 + b"\x00tail"
TEXT = b"epoch,loss\n1,0.5\n2,0.25\n"


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with run_fake_hub(tokens={GOOD}, read_tokens={READ}) as h:
        yield h


def api(hub: FakeHub, token: str | bool = GOOD) -> HfApi:
    return HfApi(endpoint=hub.url, token=token)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- repos and commits -------------------------------------------------------------------------


def test_create_repo_records_private_and_exist_ok_answers_409_with_url(hub: FakeHub) -> None:
    url = api(hub).create_repo("org/run", private=True)
    assert url == f"{hub.url}/org/run"
    assert hub.is_private("model", "org/run")
    # exist_ok: the Hub answers 409 and the client reads the url out of the JSON body.
    again = api(hub).create_repo("org/run", private=False, exist_ok=True)
    assert again.repo_id == "org/run"
    assert hub.is_private("model", "org/run")  # an existing repo keeps its visibility
    assert [r.status for r in hub.requests if r.route == "create_repo"] == [200, 409]
    with pytest.raises(HfHubHTTPError) as exc:
        api(hub).create_repo("org/run")
    assert exc.value.response.status_code == 409
    # Like the Hub, a new repo holds .gitattributes from an initial commit.
    assert list(hub.files("model", "org/run")) == [".gitattributes"]
    assert hub.commits("model", "org/run")[0].summary == "initial commit"


def test_create_repo_needs_a_write_token(hub: FakeHub) -> None:
    with pytest.raises(HfHubHTTPError) as exc:
        api(hub, READ).create_repo("org/run")
    assert exc.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as exc:
        api(hub, False).create_repo("org/run")
    assert exc.value.response.status_code == 401
    assert not hub.has_repo("model", "org/run")


def test_upload_then_download_regular_and_lfs_files(hub: FakeHub, tmp_path: Path) -> None:
    a = api(hub)
    a.create_repo("org/run", private=True)
    info = a.upload_file(path_or_fileobj=CKPT, path_in_repo="weights/last.pt", repo_id="org/run")
    assert hub.head("model", "org/run") == info.oid
    assert info.commit_url == f"{hub.url}/org/run/commit/{info.oid}"
    a.upload_file(path_or_fileobj=TEXT, path_in_repo="results.csv", repo_id="org/run")
    assert hub.file("model", "org/run", "weights/last.pt") == CKPT

    # As on the Hub: the checkpoint went through the LFS batch API and one PUT (then verify),
    # the CSV as base64 in the NDJSON commit; each commit names its one file.
    routes = [r.route for r in hub.requests]
    assert routes == [
        *("create_repo", "preupload", "lfs_batch", "lfs_upload", "lfs_verify", "commit"),
        *("preupload", "commit"),
    ]
    put = next(r for r in hub.requests if r.route == "lfs_upload")
    assert put.auth == "none"  # the presigned URL is the credential, as on S3
    assert [c.paths for c in hub.commits("model", "org/run")[-2:]] == [
        ("weights/last.pt",),
        ("results.csv",),
    ]

    for name, data in (("weights/last.pt", CKPT), ("results.csv", TEXT)):
        path = hf_hub_download(
            "org/run", name, endpoint=hub.url, token=GOOD, cache_dir=tmp_path / "cache"
        )
        assert Path(path).read_bytes() == data
        assert f"/snapshots/{hub.head('model', 'org/run')}/" in path  # from X-Repo-Commit

    # By commit sha as well.
    old = hf_hub_download(
        "org/run",
        "weights/last.pt",
        revision=info.oid,
        endpoint=hub.url,
        token=GOOD,
        cache_dir=tmp_path / "cache2",
    )
    assert Path(old).read_bytes() == CKPT


def test_resolve_headers_describe_lfs_and_regular_files_like_the_hub(hub: FakeHub) -> None:
    hub.add_file("model", "org/run", "weights/best.pt", CKPT)
    hub.add_file("model", "org/run", "args.yaml", TEXT)
    head = hub.head("model", "org/run")
    with httpx2.Client() as c:
        r = c.head(resolve_url(hub.url, "model", "org/run", "weights/best.pt"))
        assert r.status_code == 200
        assert r.headers["X-Repo-Commit"] == head
        assert r.headers["X-Linked-Etag"] == f'"{sha256(CKPT)}"'
        assert r.headers["X-Linked-Size"] == str(len(CKPT))
        assert r.headers["Content-Length"] == str(len(CKPT))
        assert "X-Xet-Hash" not in r.headers
        r = c.get(resolve_url(hub.url, "model", "org/run", "args.yaml"))
        assert r.headers["ETag"] == f'"{git_blob_sha1(TEXT)}"'
        assert "X-Linked-Etag" not in r.headers
        assert r.content == TEXT
        r = c.get(
            resolve_url(hub.url, "model", "org/run", "args.yaml"), headers={"Range": "bytes=5-"}
        )
        assert r.status_code == 206
        assert r.content == TEXT[5:]
        assert r.headers["Content-Range"] == f"bytes 5-{len(TEXT) - 1}/{len(TEXT)}"


def test_dataset_repo_download_and_missing_entry(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_file("dataset", "org/data", "data.tar", b"tar bytes", private=True)
    path = hf_hub_download(
        "org/data",
        "data.tar",
        repo_type="dataset",
        endpoint=hub.url,
        token=READ,
        cache_dir=tmp_path,
    )
    assert Path(path).read_bytes() == b"tar bytes"
    assert "/datasets/org/data/resolve/main/data.tar" in {r.path for r in hub.requests}
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(
            "org/data",
            "nope.tar",
            repo_type="dataset",
            endpoint=hub.url,
            token=READ,
            cache_dir=tmp_path,
        )
    # A dataset is not a model: same id, other repo type.
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/data", "data.tar", endpoint=hub.url, token=GOOD, cache_dir=tmp_path)


def test_unchanged_file_is_skipped_by_the_client_through_preupload_oid(hub: FakeHub) -> None:
    a = api(hub)
    first = a.upload_file(path_or_fileobj=TEXT, path_in_repo="notes.txt", repo_id=_repo(hub))
    second = a.upload_file(path_or_fileobj=TEXT, path_in_repo="notes.txt", repo_id="org/run")
    assert second.oid == first.oid
    routes = [r.route for r in hub.requests]
    assert routes.count("commit") == 1
    assert routes[-1] == "repo_info"  # all files skipped -> the client reads the head sha


def test_parent_commit_mismatch_is_refused_with_412(hub: FakeHub) -> None:
    a = api(hub)
    old = hub.head("model", _repo(hub))
    a.upload_file(path_or_fileobj=b"1", path_in_repo="a.txt", repo_id="org/run")
    with pytest.raises(HfHubHTTPError) as exc:
        a.create_commit(
            "org/run",
            [CommitOperationAdd("b.txt", b"2")],
            commit_message="late",
            parent_commit=old,
        )
    assert exc.value.response.status_code == 412
    assert hub.file("model", "org/run", "b.txt") is None


def test_readme_goes_through_validate_yaml_and_branches_work(hub: FakeHub) -> None:
    a = api(hub)
    a.upload_file(path_or_fileobj=b"# run\n", path_in_repo="README.md", repo_id=_repo(hub))
    assert "validate_yaml" in [r.route for r in hub.requests]
    a.create_branch("org/run", branch="dev")
    a.create_branch("org/run", branch="dev", exist_ok=True)
    a.upload_file(path_or_fileobj=b"x", path_in_repo="dev.txt", repo_id="org/run", revision="dev")
    assert hub.file("model", "org/run", "dev.txt", revision="dev") == b"x"
    assert hub.file("model", "org/run", "dev.txt") is None
    with pytest.raises(RevisionNotFoundError):
        a.upload_file(path_or_fileobj=b"x", path_in_repo="y", repo_id="org/run", revision="nope")


# ---- read-back: paths-info, tree, model_info ---------------------------------------------------


def test_paths_info_describes_big_and_binary_files_as_lfs(hub: FakeHub) -> None:
    repo = _repo(hub)
    hub.add_file("model", repo, "weights/last.pt", CKPT)
    hub.add_file("model", repo, "weights/notes.txt", TEXT)
    hub.add_file("model", repo, "blob.txt", b"text\x00with a NUL")
    infos = api(hub).get_paths_info(
        repo, ["weights/last.pt", "weights/notes.txt", "blob.txt", "missing.pt", "weights"]
    )
    by_path = {i.path: i for i in infos}
    assert set(by_path) == {"weights/last.pt", "weights/notes.txt", "blob.txt", "weights"}

    ckpt = by_path["weights/last.pt"]
    assert isinstance(ckpt, RepoFile) and ckpt.lfs is not None
    assert ckpt.lfs.sha256 == sha256(CKPT)
    assert ckpt.lfs.size == ckpt.size == len(CKPT)
    assert ckpt.lfs.pointer_size == len(lfs_pointer(CKPT))
    # The git oid of an LFS file is the sha1 of its pointer: not of the content.
    assert ckpt.blob_id == git_blob_sha1(lfs_pointer(CKPT)) != git_blob_sha1(CKPT)

    notes = by_path["weights/notes.txt"]
    assert isinstance(notes, RepoFile) and notes.lfs is None
    assert notes.blob_id == git_blob_sha1(TEXT)
    assert isinstance(by_path["blob.txt"], RepoFile) and by_path["blob.txt"].lfs is not None
    assert isinstance(by_path["weights"], RepoFolder)
    # paths-info is form-encoded, as the client sends it.
    with httpx2.Client() as c:
        r = c.post(
            f"{hub.url}/api/models/{repo}/paths-info/main",
            json={"paths": ["blob.txt"]},
            headers={"Authorization": f"Bearer {GOOD}"},
        )
    assert r.status_code == 400


def test_size_threshold_makes_plain_text_lfs() -> None:
    with run_fake_hub(tokens={GOOD}, lfs_threshold=100) as hub:
        hub.add_file("model", "org/run", "big.txt", b"a" * 101)
        hub.add_file("model", "org/run", "small.txt", b"a" * 100)
        infos = {i.path: i for i in api(hub).get_paths_info("org/run", ["big.txt", "small.txt"])}
        big, small = infos["big.txt"], infos["small.txt"]
        assert isinstance(big, RepoFile) and big.lfs is not None
        assert isinstance(small, RepoFile) and small.lfs is None


def test_tree_lists_recursively_and_pages_with_link_headers() -> None:
    with run_fake_hub(tokens={GOOD}, tree_page_size=2) as hub:
        for name in ("a.txt", "w/last.pt", "w/best.pt", "w/sub/e.pt"):
            hub.add_file("model", "org/run", name, CKPT if name.endswith(".pt") else TEXT)
        a = api(hub)
        everything = list(a.list_repo_tree("org/run", recursive=True))
        assert {e.path for e in everything} == {
            ".gitattributes",
            "a.txt",
            "w",
            "w/sub",
            "w/last.pt",
            "w/best.pt",
            "w/sub/e.pt",
        }
        assert len([r for r in hub.requests if r.route == "tree"]) == 4  # 7 entries, 2 a page
        top = {e.path for e in a.list_repo_tree("org/run")}
        assert top == {".gitattributes", "a.txt", "w"}
        inner = {e.path: e for e in a.list_repo_tree("org/run", path_in_repo="w")}
        assert set(inner) == {"w/sub", "w/last.pt", "w/best.pt"}
        last = inner["w/last.pt"]
        assert isinstance(last, RepoFile) and last.lfs is not None
        assert last.lfs.sha256 == sha256(CKPT)
        with pytest.raises(EntryNotFoundError):
            list(a.list_repo_tree("org/run", path_in_repo="nope"))
        siblings = {s.rfilename: s for s in a.model_info("org/run", files_metadata=True).siblings}
        assert siblings["w/last.pt"].lfs is not None
        assert siblings["a.txt"].blob_id == git_blob_sha1(TEXT)


# ---- auth --------------------------------------------------------------------------------------


def test_private_repo_needs_a_token_and_bad_tokens_are_refused_everywhere(
    hub: FakeHub, tmp_path: Path
) -> None:
    hub.add_file("model", "org/secret", "a.txt", TEXT, private=True)
    hub.add_file("model", "org/public", "a.txt", TEXT)
    # No token on a private repo: 401 + X-Error-Code RepoNotFound -> RepositoryNotFoundError.
    with pytest.raises(RepositoryNotFoundError) as exc:
        api(hub, False).get_paths_info("org/secret", ["a.txt"])
    assert exc.value.response.status_code == 401
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/secret", "a.txt", endpoint=hub.url, token=False, cache_dir=tmp_path)
    # A valid token, missing repo: 404.
    with pytest.raises(RepositoryNotFoundError) as exc:
        api(hub).get_paths_info("org/nothing", ["a.txt"])
    assert exc.value.response.status_code == 404
    # A bad token is refused even on a public repo, and is NOT reported as "repo not found".
    with pytest.raises(HfHubHTTPError) as exc:
        api(hub, BAD).get_paths_info("org/public", ["a.txt"])
    assert exc.value.response.status_code == 401
    assert not isinstance(exc.value, RepositoryNotFoundError)
    assert "Invalid credentials in Authorization header" in str(exc.value)
    # Public repos read fine without a token; read tokens read private ones.
    assert api(hub, False).get_paths_info("org/public", ["a.txt"])
    assert api(hub, READ).get_paths_info("org/secret", ["a.txt"])
    assert {r.auth for r in hub.requests} == {"none", "valid", "invalid"}


def test_writes_need_a_write_token(hub: FakeHub) -> None:
    repo = _repo(hub)
    with pytest.raises(HfHubHTTPError) as exc:
        api(hub, READ).upload_file(path_or_fileobj=TEXT, path_in_repo="a.txt", repo_id=repo)
    assert exc.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as exc:
        api(hub, False).upload_file(path_or_fileobj=TEXT, path_in_repo="a.txt", repo_id=repo)
    assert exc.value.response.status_code == 401
    assert hub.file("model", repo, "a.txt") is None


def test_whoami(hub: FakeHub) -> None:
    me = api(hub).whoami()
    assert me["name"] == "fake-user"
    assert me["auth"]["accessToken"]["role"] == "write"
    assert api(hub, READ).whoami()["auth"]["accessToken"]["role"] == "read"
    with pytest.raises(HfHubHTTPError) as exc:
        api(hub, BAD).whoami()
    assert exc.value.response.status_code == 401


# ---- fault knobs -------------------------------------------------------------------------------


def test_fail_next_n_then_recover(hub: FakeHub) -> None:
    repo = _repo(hub)
    fault = hub.fail("commit", 503, times=2)
    for _ in range(2):
        with pytest.raises(HfHubHTTPError) as exc:
            api(hub).upload_file(path_or_fileobj=TEXT, path_in_repo="a.txt", repo_id=repo)
        assert exc.value.response.status_code == 503
    api(hub).upload_file(path_or_fileobj=TEXT, path_in_repo="a.txt", repo_id=repo)
    assert fault.hits == 2
    assert hub.file("model", repo, "a.txt") == TEXT
    assert [r.status for r in hub.requests if r.route == "commit"] == [503, 503, 200]


def test_fail_until_cleared_with_429_retry_after(hub: FakeHub) -> None:
    repo = _repo(hub)
    hub.fail("paths_info", 429, times=None, retry_after=7)
    for _ in range(3):
        with pytest.raises(HfHubHTTPError) as exc:
            api(hub).get_paths_info(repo, [".gitattributes"])
        assert exc.value.response.status_code == 429
        assert exc.value.response.headers["Retry-After"] == "7"
    hub.clear_faults()
    assert api(hub).get_paths_info(repo, [".gitattributes"])


def test_fail_on_download_head_is_retried_by_the_client(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_file("dataset", "org/data", "data.tar", b"x")
    hub.fail("resolve", 502, method="HEAD")
    path = hf_hub_download(
        "org/data", "data.tar", repo_type="dataset", endpoint=hub.url, cache_dir=tmp_path
    )
    assert Path(path).read_bytes() == b"x"
    heads = [r.status for r in hub.requests if r.method == "HEAD"]
    assert heads == [502, 200]


def test_delay_slows_answers_and_the_log_shows_overlaps(hub: FakeHub) -> None:
    repo = _repo(hub)
    hub.delay("commit", 0.4)
    errors: list[BaseException] = []

    def up(name: str) -> None:
        try:
            api(hub).upload_file(path_or_fileobj=TEXT, path_in_repo=name, repo_id=repo)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=up, args=(n,)) for n in ("a.txt", "b.txt")]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert time.monotonic() - started >= 0.4
    commits = [r for r in hub.requests if r.route == "commit"]
    assert all(r.end - r.start >= 0.4 for r in commits)
    assert len(overlaps(commits)) == 1
    assert not overlaps(r for r in commits if "a.txt" in r.files)


def test_reset_before_answering_loses_the_commit(hub: FakeHub) -> None:
    repo = _repo(hub)
    hub.reset("commit")
    with pytest.raises(httpx2.TransportError):
        api(hub).upload_file(path_or_fileobj=TEXT, path_in_repo="a.txt", repo_id=repo)
    assert hub.file("model", repo, "a.txt") is None
    assert [r.status for r in hub.requests if r.route == "commit"] == [None]


def test_reset_after_applies_the_commit_but_drops_the_answer(hub: FakeHub) -> None:
    repo = _repo(hub)
    hub.reset("commit", after=True)
    with pytest.raises(httpx2.TransportError):
        api(hub).upload_file(path_or_fileobj=TEXT, path_in_repo="a.txt", repo_id=repo)
    assert hub.file("model", repo, "a.txt") == TEXT


def test_lose_drop_answers_success_without_storing(hub: FakeHub) -> None:
    repo = _repo(hub)
    hub.lose("drop")
    info = api(hub).upload_file(path_or_fileobj=CKPT, path_in_repo="w.pt", repo_id=repo)
    assert hub.head("model", repo) == info.oid
    assert hub.file("model", repo, "w.pt") is None
    assert api(hub).get_paths_info(repo, ["w.pt"]) == []


def test_lose_corrupt_stores_other_bytes_of_the_same_size(hub: FakeHub) -> None:
    repo = _repo(hub)
    hub.lose("corrupt", path="w.pt")
    api(hub).upload_file(path_or_fileobj=TEXT, path_in_repo="ok.txt", repo_id=repo)
    api(hub).upload_file(path_or_fileobj=CKPT, path_in_repo="w.pt", repo_id=repo)
    stored = hub.file("model", repo, "w.pt")
    assert stored is not None and len(stored) == len(CKPT) and stored != CKPT
    assert hub.file("model", repo, "ok.txt") == TEXT
    (info,) = api(hub).get_paths_info(repo, ["w.pt"])
    assert isinstance(info, RepoFile) and info.lfs is not None
    assert info.lfs.sha256 != sha256(CKPT)


def test_unknown_route_and_bad_bodies_are_refused(hub: FakeHub) -> None:
    with pytest.raises(ValueError, match="unknown route"):
        hub.fail("upload", 500)
    repo = _repo(hub)
    with httpx2.Client() as c:
        r = c.post(
            f"{hub.url}/api/models/{repo}/commit/main",
            content=b'{"key": "header", "value": {"summary": "x"}}\n',
            headers={"Authorization": f"Bearer {GOOD}", "Content-Type": "application/json"},
        )
    assert r.status_code == 400
    assert r.headers["X-Error-Message"].startswith("Content-Type")


def _repo(hub: FakeHub, repo_id: str = "org/run") -> str:
    hub.add_repo("model", repo_id)
    return repo_id


def test_truncated_download_is_retried_by_the_client(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_file("dataset", "org/data", "data.tar", CKPT)
    fault = hub.truncate(fraction=0.25)
    path = hf_hub_download(
        "org/data", "data.tar", repo_type="dataset", endpoint=hub.url, cache_dir=tmp_path
    )
    assert Path(path).read_bytes() == CKPT
    assert fault.hits == 1
    # The client keeps whole 10 MB chunks only, so here it starts again from byte 0 (a
    # Range request, 206, when it had kept some).
    gets = [r.status for r in hub.requests if r.method == "GET"]
    assert gets == [None, 200]
