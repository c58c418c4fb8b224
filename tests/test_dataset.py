"""Staging (agent/data/dataset.py): downloads from a fake Hub, the staging marker, finding the data
YAML, the doctor gate, and what staging does with an archive the unpacker refuses.

Downloads use the real ``huggingface_hub`` client against ``tests/fakes/hub.py`` on 127.0.0.1;
the doctor gate runs the real ``libreyolo doctor`` (a few seconds each, so only twice; marked
``training``). The unpacker itself is tested in tests/test_archive.py.
"""

from __future__ import annotations

import hashlib
import io
import logging
import random
import shutil
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError

from agent.config.model import DatasetSection, Env
from agent.data import dataset
from agent.data.archive import UnsafeArchiveError
from agent.data.dataset import (
    MARKER_NAME,
    DoctorError,
    StagingError,
    find_data_yaml,
    read_marker,
    stage_dataset,
)
from tests.fakes.hub import FakeHub, run_fake_hub
from tests.test_archive import (
    MiB,
    reg,
    small_archive,
    tar_bytes,
    write,
    zeros_archive,
    zip_bytes,
)

requires_libreyolo = pytest.mark.skipif(
    shutil.which("libreyolo", path=str(Path(sys.executable).parent)) is None
    and shutil.which("libreyolo") is None,
    reason="the training stack (libreyolo) is not installed: run ./install.sh",
)

WRITE_TOKEN = "hf_write_token_for_tests"
READ_TOKEN = "hf_read_token_for_tests"
BAD_TOKEN = "hf_not_a_real_token_0123456789"

# --------------------------------------------------------------------------------------------
# Helpers


def noise_png(rng: random.Random, size: int = 32) -> bytes:
    from PIL import Image

    im = Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def yolo_dataset(root: Path, *, broken: bool = False) -> Path:
    """A tiny YOLO detection dataset in ``root`` (3 train + 3 val noise images, one class)."""
    rng = random.Random(7)
    for split in ("train", "val"):
        for i in range(3):
            write(root / "images" / split / f"im{i}.png", noise_png(rng))
            write(root / "labels" / split / f"im{i}.txt", b"0 0.5 0.5 0.3 0.3\n")
    if broken:
        write(root / "labels" / "train" / "im1.txt", b"0 1.5 0.5\n")  # 3 fields, not 5
    yaml = "path: .\ntrain: images/train\nval: images/val\nnames:\n  0: thing\n"
    write(root / "data.yaml", yaml.encode())
    return root


def tar_of(src: Path, arcname: str, mode: str = "w:gz") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tf:
        tf.add(src, arcname=arcname)
    return buf.getvalue()


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with run_fake_hub(tokens={WRITE_TOKEN}, read_tokens={READ_TOKEN}) as h:
        yield h


def env_for(hub_url: str, tmp_path: Path, token: str | None = None) -> Env:
    return Env(
        state_dir=tmp_path / "state",
        hf_endpoint=hub_url,
        hf_home=tmp_path / "hf",
        hf_token=token,
    )


# --------------------------------------------------------------------------------------------
# Finding the data YAML


def test_find_data_yaml(tmp_path: Path) -> None:
    write(tmp_path / "d" / "ds" / "data.yaml", b"train: a\nval: b\nnames: [x]\n")
    write(tmp_path / "d" / "ds" / "hyp.yaml", b"lr0: 0.01\n")
    assert find_data_yaml(tmp_path / "d") == tmp_path / "d" / "ds" / "data.yaml"
    assert find_data_yaml(tmp_path / "d", "ds/hyp.yaml") == tmp_path / "d" / "ds" / "hyp.yaml"
    with pytest.raises(StagingError, match=r"dataset.data_yaml 'nope.yaml' is not a file .*ds\)"):
        find_data_yaml(tmp_path / "d", "nope.yaml")

    write(tmp_path / "d" / "other.yml", b"train: a\nval: b\n")
    with pytest.raises(StagingError, match=r"several data YAMLs .*\(other.yml, ds/data.yaml\)"):
        find_data_yaml(tmp_path / "d")

    write(tmp_path / "e" / "readme.txt", b"")
    assert find_data_yaml(tmp_path / "e") is None
    with pytest.raises(StagingError, match=r"no data YAML with train and val keys.*set dataset"):
        find_data_yaml(tmp_path / "e", required=True)


# --------------------------------------------------------------------------------------------
# Staging from the fake Hub


def test_stage_downloads_unpacks_and_writes_the_marker(
    hub: FakeHub, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = small_archive()
    commit = hub.add_file("dataset", "org/ds", "ds.tar", data)
    ds = DatasetSection(repo="org/ds", file="ds.tar", dest=tmp_path / "data")
    caplog.set_level(logging.INFO, logger="agent.data.dataset")

    result = stage_dataset(ds, env_for(hub.url, tmp_path))

    assert result.downloaded and result.unpacked
    assert result.commit == commit
    assert result.archive_sha256 == hashlib.sha256(data).hexdigest()
    assert result.dest == tmp_path / "data"
    assert result.doctor is None and result.warnings == [] and result.data_yaml is None
    assert (tmp_path / "data" / "ds" / "sub" / "b.txt").read_bytes() == b"beta\n"
    # HF_HOME/hub is the download cache.
    assert list((tmp_path / "hf" / "hub").glob("datasets--org--ds/snapshots/*/ds.tar"))
    marker = read_marker(tmp_path / "data")
    assert marker is not None
    assert {k: marker[k] for k in ("format", "repo", "file", "revision", "commit")} == {
        "format": 1,
        "repo": "org/ds",
        "file": "ds.tar",
        "revision": "main",
        "commit": commit,
    }
    assert marker["archive_sha256"] == result.archive_sha256
    assert marker["entries"] == ["ds"]
    assert marker["files"] == 2 and marker["unpacked_bytes"] == 11
    assert "staging: downloaded ds.tar" in caplog.text
    assert "staging: unpacked 2 files" in caplog.text


def test_restart_with_the_same_settings_does_not_download_or_unpack(
    hub: FakeHub, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hub.add_file("dataset", "org/ds", "ds.tar", small_archive())
    ds = DatasetSection(repo="org/ds", file="ds.tar", dest=tmp_path / "data")
    env = env_for(hub.url, tmp_path)
    first = stage_dataset(ds, env)
    # A file the user (or training) added must survive: the tree is not unpacked again.
    write(tmp_path / "data" / "ds" / "labels.cache", b"cache")
    hub.clear_requests()
    caplog.set_level(logging.INFO, logger="agent.data.dataset")

    second = stage_dataset(ds, env)

    assert hub.requests == []
    assert not second.downloaded and not second.unpacked
    assert (second.commit, second.archive_sha256) == (first.commit, first.archive_sha256)
    assert (tmp_path / "data" / "ds" / "labels.cache").exists()
    assert "already staged" in caplog.text and "skipping download" in caplog.text


def test_offline_restart_works(tmp_path: Path) -> None:
    ds = DatasetSection(repo="org/ds", file="ds.tar", dest=tmp_path / "data")
    with run_fake_hub() as hub:
        hub.add_file("dataset", "org/ds", "ds.tar", small_archive())
        stage_dataset(ds, env_for(hub.url, tmp_path))
        url = hub.url
    # The Hub is gone (connection refused): an intact staging needs no network at all.
    again = stage_dataset(ds, env_for(url, tmp_path))
    assert not again.downloaded and not again.unpacked


def test_changed_settings_stage_again(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_file("dataset", "org/ds", "v1.tar", small_archive())
    hub.add_file("dataset", "org/ds", "v2.zip", zip_bytes(("v2/new.txt", b"new\n")))
    env = env_for(hub.url, tmp_path)
    stage_dataset(DatasetSection(repo="org/ds", file="v1.tar", dest=tmp_path / "data"), env)
    write(tmp_path / ".data.unpacking-leftover" / "junk", b"from a crash")

    result = stage_dataset(
        DatasetSection(repo="org/ds", file="v2.zip", dest=tmp_path / "data"), env
    )

    assert result.downloaded and result.unpacked
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [MARKER_NAME, "v2"]
    assert (tmp_path / "data" / "v2" / "new.txt").read_bytes() == b"new\n"
    marker = read_marker(tmp_path / "data")
    assert marker is not None and marker["file"] == "v2.zip"
    assert not list(tmp_path.glob(".data.*"))  # the leftover and the old tree are gone


def test_broken_staging_is_redone(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_file("dataset", "org/ds", "ds.tar", small_archive())
    ds = DatasetSection(repo="org/ds", file="ds.tar", dest=tmp_path / "data")
    env = env_for(hub.url, tmp_path)
    stage_dataset(ds, env)
    shutil.rmtree(tmp_path / "data" / "ds")  # the marker is there, the data is not
    result = stage_dataset(ds, env)
    assert result.unpacked
    assert (tmp_path / "data" / "ds" / "a.txt").exists()


def test_symlinked_dest_is_refused(hub: FakeHub, tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "data").symlink_to(tmp_path / "real")
    ds = DatasetSection(repo="org/ds", file="ds.tar", dest=tmp_path / "data")
    with pytest.raises(StagingError, match=r"is a symlink; set dataset.dest to the real path"):
        stage_dataset(ds, env_for(hub.url, tmp_path))


def test_foreign_dest_is_refused_before_any_download(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_file("dataset", "org/ds", "ds.tar", small_archive())
    write(tmp_path / "data" / "mine.txt", b"not ours")
    ds = DatasetSection(repo="org/ds", file="ds.tar", dest=tmp_path / "data")
    hub.clear_requests()
    with pytest.raises(StagingError, match="is not empty and was not staged by libreyolo-agent"):
        stage_dataset(ds, env_for(hub.url, tmp_path))
    assert hub.requests == []
    assert (tmp_path / "data" / "mine.txt").read_bytes() == b"not ours"


def test_hostile_archive_from_the_hub_is_refused(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_file("dataset", "org/ds", "evil.tar", tar_bytes(reg("../../sentinel.txt")))
    ds = DatasetSection(repo="org/ds", file="evil.tar", dest=tmp_path / "w" / "data")
    with pytest.raises(StagingError, match=r"'\.\./\.\./sentinel\.txt': leaves") as info:
        stage_dataset(ds, env_for(hub.url, tmp_path))
    assert not info.value.retryable  # the same bytes fail the same way: never retried
    assert isinstance(info.value.__cause__, UnsafeArchiveError)
    assert info.value.__cause__.members == ["../../sentinel.txt"]
    assert not (tmp_path / "sentinel.txt").exists()
    assert not (tmp_path / "w" / "data").exists()


def test_bomb_from_the_hub_is_refused_and_the_earlier_staging_kept(
    hub: FakeHub, tmp_path: Path
) -> None:
    hub.add_file("dataset", "org/ds", "v1.tar", small_archive())
    hub.add_file("dataset", "org/ds", "v2.tar.gz", zeros_archive(".tar.gz", 32 * MiB))
    env = env_for(hub.url, tmp_path)
    stage_dataset(DatasetSection(repo="org/ds", file="v1.tar", dest=tmp_path / "data"), env)

    with pytest.raises(StagingError, match=r"^archive v2\.tar\.gz expands past 200 times"):
        stage_dataset(DatasetSection(repo="org/ds", file="v2.tar.gz", dest=tmp_path / "data"), env)

    marker = read_marker(tmp_path / "data")
    assert marker is not None and marker["file"] == "v1.tar"  # refused before touching it
    assert (tmp_path / "data" / "ds" / "a.txt").read_bytes() == b"alpha\n"
    assert not list(tmp_path.glob(".data.*"))


def test_private_repo_with_a_read_token(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_file("dataset", "org/secret", "ds.tar", small_archive(), private=True)
    ds = DatasetSection(repo="org/secret", file="ds.tar", dest=tmp_path / "data")
    result = stage_dataset(ds, env_for(hub.url, tmp_path, token=READ_TOKEN))
    assert result.downloaded
    assert {r.auth for r in hub.requests} == {"valid"}


def stage_error(hub: FakeHub, tmp_path: Path, token: str | None, **kw: str) -> StagingError:
    ds = DatasetSection(
        repo=kw.get("repo", "org/ds"),
        file=kw.get("file", "ds.tar"),
        revision=kw.get("revision", "main"),
        dest=tmp_path / "data",
    )
    with pytest.raises(StagingError) as info:
        stage_dataset(ds, env_for(hub.url, tmp_path, token=token))
    err = info.value
    assert "\n" not in str(err)
    assert not (tmp_path / "data").exists()
    return err


def test_private_repo_without_a_token_says_set_hf_token(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_file("dataset", "org/secret", "ds.tar", small_archive(), private=True)
    err = stage_error(hub, tmp_path, None, repo="org/secret")
    assert str(err) == (
        f"dataset repo 'org/secret' was not found on {hub.url}, or it is private and HF_TOKEN "
        "is not set; check dataset.repo, or set HF_TOKEN to a read token that can see it"
    )
    assert not err.retryable


def test_bad_token_is_named_and_never_shown(
    hub: FakeHub, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hub.add_file("dataset", "org/ds", "ds.tar", small_archive())
    caplog.set_level(logging.DEBUG)
    err = stage_error(hub, tmp_path, BAD_TOKEN)
    assert str(err) == (
        f"HF_TOKEN was rejected by {hub.url} (401); create a read token at "
        f"{hub.url}/settings/tokens and set HF_TOKEN to it"
    )
    assert not err.retryable
    assert BAD_TOKEN not in str(err) and BAD_TOKEN not in caplog.text
    assert BAD_TOKEN not in repr(env_for(hub.url, tmp_path, BAD_TOKEN))


def test_missing_file(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_file("dataset", "org/ds", "ds.tar", small_archive())
    err = stage_error(hub, tmp_path, None, file="nope.tar")
    assert str(err) == (
        "file 'nope.tar' was not found in dataset repo 'org/ds' at revision 'main'; check "
        "dataset.file (the archive's path inside the repo)"
    )
    assert "ds.tar" not in str(err)


def test_missing_repo_with_a_token(hub: FakeHub, tmp_path: Path) -> None:
    err = stage_error(hub, tmp_path, READ_TOKEN, repo="org/missing")
    assert str(err) == (
        f"dataset repo 'org/missing' was not found on {hub.url}, or HF_TOKEN has no access to "
        "it; check dataset.repo and the token's permissions"
    )


def test_missing_revision(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_file("dataset", "org/ds", "ds.tar", small_archive())
    err = stage_error(hub, tmp_path, None, revision="v9")
    assert str(err) == (
        "revision 'v9' was not found in dataset repo 'org/ds'; check dataset.revision "
        "(a branch, tag or commit)"
    )


def test_unsupported_file_fails_before_contacting_the_hub(hub: FakeHub, tmp_path: Path) -> None:
    err = stage_error(hub, tmp_path, None, file="ds.rar")
    assert "not a supported archive" in str(err)
    assert hub.requests == []


# The client itself retries connection errors and 5xx for about 23 s before giving up, too slow
# for this suite: the mapping of what it finally raises is checked directly.
def _http_error(status: int, cls: type[HfHubHTTPError] = HfHubHTTPError) -> HfHubHTTPError:
    request = httpx2.Request("HEAD", "http://127.0.0.1:9/datasets/org/ds/resolve/main/ds.tar")
    return cls(f"{status} error", response=httpx2.Response(status, request=request))


def _no_connection() -> LocalEntryNotFoundError:
    exc = LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub")
    exc.__cause__ = httpx2.ConnectError("[Errno 111] Connection refused")
    return exc


@pytest.mark.parametrize(
    ("exc", "retryable", "text"),
    [
        (
            _no_connection(),
            True,
            "cannot reach the Hugging Face Hub at http://hub.test while downloading 'ds.tar' "
            "(ConnectError",
        ),
        (
            httpx2.ReadTimeout("timed out"),
            True,
            "cannot reach the Hugging Face Hub at http://hub.test while downloading 'ds.tar' "
            "(ReadTimeout",
        ),
        (_http_error(503), True, "answered 503 for dataset repo 'org/ds'; it is busy or down"),
        (_http_error(429), True, "answered 429"),
        (_http_error(403), False, "HF_TOKEN may not read dataset repo 'org/ds' (403)"),
        (OSError(28, "No space left on device"), False, "no space left while downloading"),
        (
            _http_error(403, GatedRepoError),
            False,
            "is gated and HF_TOKEN's account has no access; request access at "
            "http://hub.test/datasets/org/ds",
        ),
    ],
    ids=["unreachable", "timeout", "503", "429", "403", "disk_full", "gated"],
)
def test_hub_error_mapping(exc: BaseException, retryable: bool, text: str) -> None:
    ds = DatasetSection(repo="org/ds", file="ds.tar")
    env = Env(hf_endpoint="http://hub.test", hf_token="hf_secret")
    err = dataset._hub_error(exc, ds, env, None)
    assert err.retryable is retryable
    assert text in str(err)
    assert "hf_secret" not in str(err)


# --------------------------------------------------------------------------------------------
# The doctor gate (real `libreyolo doctor`, a few seconds each)


@requires_libreyolo
def test_doctor_gate_passes_a_healthy_dataset_with_warnings(hub: FakeHub, tmp_path: Path) -> None:
    src = yolo_dataset(tmp_path / "src")
    hub.add_file("dataset", "org/ds", "ds.tar.gz", tar_of(src, "my-ds"))
    ds = DatasetSection(repo="org/ds", file="ds.tar.gz", dest=tmp_path / "data", doctor=True)

    result = stage_dataset(ds, env_for(hub.url, tmp_path))

    assert result.data_yaml == tmp_path / "data" / "my-ds" / "data.yaml"  # found one level down
    assert result.doctor is not None and result.doctor["exit_code"] == 0
    assert result.doctor["summary"]["errors"] == 0
    assert any(w.startswith("balance.class_few_instances: ") for w in result.warnings)


@requires_libreyolo
def test_doctor_gate_stops_a_broken_dataset(hub: FakeHub, tmp_path: Path) -> None:
    src = yolo_dataset(tmp_path / "src", broken=True)
    hub.add_file("dataset", "org/ds", "ds.tar", tar_of(src, ".", mode="w"))
    ds = DatasetSection(
        repo="org/ds", file="ds.tar", dest=tmp_path / "data", doctor=True, data_yaml="data.yaml"
    )

    with pytest.raises(DoctorError) as info:
        stage_dataset(ds, env_for(hub.url, tmp_path))

    err = info.value
    assert not err.retryable
    msg = str(err)
    assert msg.startswith(
        f"libreyolo doctor found 1 error(s) in {tmp_path / 'data' / 'data.yaml'}: "
    )
    assert "labels.syntax: 1 malformed label line(s)" in msg
    assert msg.endswith("or set dataset.doctor = false to train anyway")
    assert [f["check_id"] for f in err.findings if f["severity"] == "error"] == ["labels.syntax"]
    assert err.report["exit_code"] == 1
    # The data stays staged: a fixed doctor setting must not download it again.
    assert read_marker(tmp_path / "data") is not None
