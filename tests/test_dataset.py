"""Staging: safe unpack, the staging marker, the doctor gate, and downloads from a fake Hub.

Downloads use the real ``huggingface_hub`` client against ``tests/fakes/hub.py`` on 127.0.0.1;
the doctor gate runs the real ``libreyolo doctor`` (a few seconds each, so only twice; marked
``training``).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import random
import shutil
import stat
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError

from agent import dataset
from agent.config import DatasetSection, Env
from agent.dataset import (
    MARKER_NAME,
    DoctorError,
    StagingError,
    UnsafeArchiveError,
    find_data_yaml,
    read_marker,
    run_doctor,
    safe_unpack,
    stage_dataset,
)
from tests.fakes.hub import FakeHub, run_fake_hub

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


def snapshot(root: Path) -> set[str]:
    """Every path under ``root`` (links not followed), to prove nothing was written."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def tar_bytes(*members: tuple[tarfile.TarInfo, bytes | None], mode: str = "w") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode, format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            if data is None:
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def reg(name: str, data: bytes = b"data\n", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.mode = mode
    return info, data


def special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info, None


def zip_bytes(*entries: tuple[zipfile.ZipInfo | str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for info, data in entries:
            zf.writestr(info, data)
    return buf.getvalue()


def zip_symlink(name: str, target: str) -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(name)
    info.create_system = 3
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info, target.encode()


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


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


def small_archive() -> bytes:
    return tar_bytes(
        special("ds", tarfile.DIRTYPE),
        reg("ds/a.txt", b"alpha\n"),
        reg("ds/sub/b.txt", b"beta\n"),
    )


# --------------------------------------------------------------------------------------------
# Safe unpack: hostile archives are refused before anything is written


def _outside(tmp_path: Path) -> str:
    return str(tmp_path / "sentinel.txt")


HOSTILE_TARS = {
    "traversal": lambda t: [reg("ok.txt"), reg("../sentinel.txt")],
    "traversal_nested": lambda t: [reg("a/b/../../../sentinel.txt")],
    "absolute": lambda t: [reg(_outside(t))],
    "symlink_escape": lambda t: [special("link", tarfile.SYMTYPE, "../sentinel.txt")],
    "symlink_absolute": lambda t: [special("link", tarfile.SYMTYPE, _outside(t))],
    # Lexically "deep/er/up/../.." is "deep", but the kernel follows deep/er/up (-> dest) first.
    "symlink_chain_escape": lambda t: [
        special("deep/er", tarfile.DIRTYPE),
        special("deep/er/up", tarfile.SYMTYPE, "../.."),
        special("link", tarfile.SYMTYPE, "deep/er/up/../.."),
    ],
    "write_through_symlink": lambda t: [
        special("dir", tarfile.DIRTYPE),
        special("l", tarfile.SYMTYPE, "dir"),
        reg("l/file.txt"),
    ],
    "hardlink_escape": lambda t: [special("h", tarfile.LNKTYPE, "../sentinel.txt")],
    "hardlink_absolute": lambda t: [special("h", tarfile.LNKTYPE, _outside(t))],
    "hardlink_to_symlink": lambda t: [
        special("s", tarfile.SYMTYPE, "x"),
        special("h", tarfile.LNKTYPE, "s"),
    ],
    "char_device": lambda t: [special("dev/null", tarfile.CHRTYPE)],
    "block_device": lambda t: [special("dev/sda", tarfile.BLKTYPE)],
    "fifo": lambda t: [special("pipe", tarfile.FIFOTYPE)],
}


@pytest.mark.parametrize("case", sorted(HOSTILE_TARS))
def test_hostile_tar_is_refused_and_nothing_is_written(tmp_path: Path, case: str) -> None:
    members = HOSTILE_TARS[case](tmp_path)
    archive = write(tmp_path / "in" / "evil.tar", tar_bytes(*members))
    dest = tmp_path / "work" / "data"
    before = snapshot(tmp_path)

    with pytest.raises(UnsafeArchiveError) as info:
        safe_unpack(archive, dest)

    err = info.value
    assert not err.retryable
    assert "nothing was unpacked" in str(err)
    assert "\n" not in str(err)
    assert err.members, err
    for name in err.members:
        assert repr(name)[:40] in str(err)
    assert not (tmp_path / "sentinel.txt").exists()
    assert not os.path.lexists(dest)
    assert snapshot(tmp_path) == before  # no dest, no temporary sibling, nothing anywhere


def test_every_unsafe_member_is_named(tmp_path: Path) -> None:
    archive = write(
        tmp_path / "evil.tar",
        tar_bytes(
            reg("good.txt"),
            reg("../up.txt"),
            special("pipe", tarfile.FIFOTYPE),
            special("esc", tarfile.SYMTYPE, "../../x"),
            special("dev", tarfile.CHRTYPE),
        ),
    )
    with pytest.raises(UnsafeArchiveError) as info:
        safe_unpack(archive, tmp_path / "data")
    msg = str(info.value)
    assert info.value.members == ["../up.txt", "pipe", "esc", "dev"]
    assert "4 unsafe member(s)" in msg
    assert "'../up.txt': leaves the destination" in msg
    assert "'pipe': is a FIFO" in msg
    assert "'esc': is a symlink that points outside the destination" in msg
    assert "'dev': is a character device" in msg
    assert "good.txt" not in msg


@pytest.mark.parametrize(
    "entry",
    [
        ("../sentinel.txt", b"x"),
        ("a/../../sentinel.txt", b"x"),
        ("/abs/sentinel.txt", b"x"),
        zip_symlink("link", "../sentinel.txt"),
    ],
    ids=["traversal", "traversal_nested", "absolute", "symlink_escape"],
)
def test_hostile_zip_is_refused(tmp_path: Path, entry: tuple[zipfile.ZipInfo | str, bytes]) -> None:
    archive = write(tmp_path / "evil.zip", zip_bytes(("ok.txt", b"fine"), entry))
    dest = tmp_path / "work" / "data"
    before = snapshot(tmp_path)
    with pytest.raises(UnsafeArchiveError, match="unsafe member"):
        safe_unpack(archive, dest)
    assert snapshot(tmp_path) == before


def test_zip_fifo_member_is_refused(tmp_path: Path) -> None:
    info = zipfile.ZipInfo("pipe")
    info.create_system = 3
    info.external_attr = (stat.S_IFIFO | 0o644) << 16
    archive = write(tmp_path / "evil.zip", zip_bytes((info, b"")))
    with pytest.raises(UnsafeArchiveError, match="'pipe': is a FIFO"):
        safe_unpack(archive, tmp_path / "data")


# --------------------------------------------------------------------------------------------
# Safe unpack: good archives


def good_tree_tar(mode: str) -> bytes:
    return tar_bytes(
        special("./", tarfile.DIRTYPE),
        special("ds", tarfile.DIRTYPE),
        reg("ds/images/a.txt", b"alpha\n"),
        reg("ds/run.sh", b"#!/bin/sh\n", mode=0o4755),  # setuid must not survive
        special("ds/labels", tarfile.SYMTYPE, "images"),
        special("ds/same.txt", tarfile.LNKTYPE, "ds/images/a.txt"),
        mode=mode,
    )


@pytest.mark.parametrize(
    ("suffix", "mode"),
    [
        (".tar", "w"),
        (".tar.gz", "w:gz"),
        (".tgz", "w:gz"),
        (".tar.bz2", "w:bz2"),
        (".tar.xz", "w:xz"),
    ],
)
def test_good_tar_unpacks(tmp_path: Path, suffix: str, mode: str) -> None:
    archive = write(tmp_path / f"good{suffix}", good_tree_tar(mode))
    dest = tmp_path / "data"
    written = safe_unpack(archive, dest)
    # The hardlink is written as a copy: its bytes count too.
    assert written == 2 * len(b"alpha\n") + len(b"#!/bin/sh\n")
    assert (dest / "ds/images/a.txt").read_bytes() == b"alpha\n"
    assert os.readlink(dest / "ds/labels") == "images"
    assert (dest / "ds/labels/a.txt").read_bytes() == b"alpha\n"
    assert (dest / "ds/same.txt").read_bytes() == b"alpha\n"
    assert (dest / "ds/same.txt").stat().st_ino != (dest / "ds/images/a.txt").stat().st_ino
    run_mode = (dest / "ds/run.sh").stat().st_mode
    assert run_mode & 0o100 and not run_mode & stat.S_ISUID  # filter="data" was applied
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([archive.name, "data"])


def test_good_zip_unpacks(tmp_path: Path) -> None:
    exe = zipfile.ZipInfo("ds/run.sh")
    exe.create_system = 3
    exe.external_attr = (stat.S_IFREG | 0o755) << 16
    archive = write(
        tmp_path / "good.zip",
        zip_bytes(
            ("ds/", b""),
            ("ds/images/a.txt", b"alpha\n" * 100),
            (exe, b"#!/bin/sh\n"),
            zip_symlink("ds/labels", "images"),
        ),
    )
    dest = tmp_path / "data"
    assert safe_unpack(archive, dest) == 600 + 10
    assert (dest / "ds/images/a.txt").read_bytes() == b"alpha\n" * 100
    assert (dest / "ds/run.sh").stat().st_mode & 0o100
    assert os.readlink(dest / "ds/labels") == "images"


def test_unpack_fills_an_existing_empty_dest(tmp_path: Path) -> None:
    archive = write(tmp_path / "a.tar", small_archive())
    (tmp_path / "data").mkdir()
    assert safe_unpack(archive, tmp_path / "data") == 11
    assert (tmp_path / "data" / "ds" / "a.txt").read_bytes() == b"alpha\n"


def test_unpack_refuses_a_non_empty_dest(tmp_path: Path) -> None:
    archive = write(tmp_path / "a.tar", small_archive())
    write(tmp_path / "data" / "mine.txt", b"keep me")
    with pytest.raises(StagingError, match="not an empty directory"):
        safe_unpack(archive, tmp_path / "data")
    assert (tmp_path / "data" / "mine.txt").read_bytes() == b"keep me"


def test_unsupported_format_is_refused(tmp_path: Path) -> None:
    archive = write(tmp_path / "a.rar", b"Rar!")
    with pytest.raises(StagingError, match=r"not a supported archive; pack the dataset as \.tar"):
        safe_unpack(archive, tmp_path / "data")


def test_truncated_archive_is_a_clear_error(tmp_path: Path) -> None:
    data = tar_bytes(reg("a.txt", os.urandom(50_000)), mode="w:gz")
    archive = write(tmp_path / "a.tar.gz", data[: len(data) // 2])
    before = snapshot(tmp_path)
    with pytest.raises(StagingError, match=r"a\.tar\.gz is not a readable tar archive"):
        safe_unpack(archive, tmp_path / "data")
    assert snapshot(tmp_path) == before


def test_failed_unpack_leaves_nothing_half_written(tmp_path: Path) -> None:
    # The listing is fine; the second member's data is corrupt, found only while extracting.
    raw = bytearray(zip_bytes(("ds/a.txt", b"a" * 1000), ("ds/b.txt", b"payload-" * 500)))
    i = raw.rfind(b"ds/b.txt", 0, raw.find(b"PK\x01\x02")) + len("ds/b.txt") + 5
    raw[i] ^= 0xFF
    archive = write(tmp_path / "bad.zip", bytes(raw))
    before = snapshot(tmp_path)
    with pytest.raises(StagingError, match=r"bad\.zip is not a readable zip archive"):
        safe_unpack(archive, tmp_path / "data")
    assert snapshot(tmp_path) == before  # ds/a.txt was written to the temp dir, then removed


def test_disk_check_refuses_before_writing(tmp_path: Path) -> None:
    # A GNU sparse member (PAX 0.1) claims 1 PB of content in a 10 KiB tar: a real disk check
    # on the real file system, no monkeypatching. (With the default expansion cap it is refused
    # as a decompression bomb first: see test_dataset_bombs.py.)
    big = tarfile.TarInfo("ds/big.bin")
    big.pax_headers = {
        "GNU.sparse.map": "0,0",
        "GNU.sparse.size": str(10**15),
        "GNU.sparse.name": "ds/big.bin",
    }
    archive = write(tmp_path / "huge.tar", tar_bytes(reg("ds/a.txt"), (big, b"")))
    dest = tmp_path / "work" / "data"
    before = snapshot(tmp_path)
    with pytest.raises(StagingError) as info:
        safe_unpack(archive, dest, max_ratio=math.inf)
    msg = str(info.value)
    assert msg.startswith(f"not enough disk space to unpack huge.tar into {dest}: needs ")
    assert "1,000,000,000,00" in msg  # needed bytes, in full
    free = int(msg.split("but only ")[1].split(" bytes")[0].replace(",", ""))
    assert 0 < free < 10**15
    assert "free some space or rent a bigger disk" in msg
    assert snapshot(tmp_path) == before


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
    caplog.set_level(logging.INFO, logger="agent.dataset")

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
    caplog.set_level(logging.INFO, logger="agent.dataset")

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
    with pytest.raises(UnsafeArchiveError, match=r"'\.\./\.\./sentinel\.txt': leaves"):
        stage_dataset(ds, env_for(hub.url, tmp_path))
    assert not (tmp_path / "sentinel.txt").exists()
    assert not (tmp_path / "w" / "data").exists()


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
            "cannot reach the Hugging Face Hub at http://hub.test (ConnectError",
        ),
        (httpx2.ReadTimeout("timed out"), True, "network error while downloading 'ds.tar'"),
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


@pytest.mark.training
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


@pytest.mark.training
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


@pytest.mark.training
@requires_libreyolo
def test_run_doctor_on_a_missing_yaml(tmp_path: Path) -> None:
    with pytest.raises(StagingError, match=r"libreyolo doctor could not check .* \(exit 3\)"):
        run_doctor(tmp_path / "nope.yaml", timeout_s=120)


def test_doctor_json_report_parsing() -> None:
    text = 'log line\n{"summary": {"errors": 0}, "findings": []}\n'
    assert dataset._parse_json_object(text) == {"summary": {"errors": 0}, "findings": []}
    assert dataset._parse_json_object("no json here") is None
    many = {"findings": [{"check_id": "x", "paths": [str(i) for i in range(100)]}]}
    trimmed = dataset._trim_findings(many)
    assert len(trimmed[0]["paths"]) == 20 and trimmed[0]["paths_truncated"] == 80
    assert json.dumps(trimmed)  # JSON-ready for the report
