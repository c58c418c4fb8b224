"""A folder on this machine or a mounted volume (``file:///mnt/backup/run1``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from agent.sinks import RemoteFile, SinkError, check_download
from agent.sinks.digests import DIGESTS, copy_hashing


class LocalSink:
    #: A copy costs nothing on its own: each file goes alone (several at once), never grouped.
    max_files_per_upload = 1
    #: No commits, no limit.
    commits_per_hour: int | None = None

    def __init__(self, root: Path) -> None:
        self.root = root
        self.description = f"file://{root}"

    def _target(self, remote_path: str) -> Path:
        rel = PurePosixPath(remote_path)
        if rel.is_absolute() or ".." in rel.parts:
            raise SinkError(f"refusing remote path {remote_path!r}", retryable=False)
        return self.root.joinpath(*rel.parts)

    def prepare(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SinkError(f"cannot create {self.root}: {exc.strerror or exc}") from exc

    def upload(self, local: Path, remote_path: str) -> None:
        target = self._target(remote_path)
        tmp = target.with_name(f".{target.name}.partial")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            # A snapshot's sha256 is known (hashed once, as it was made): not hashed again.
            digest = copy_hashing(local, tmp, known_ok=True)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
            # The bytes written are the bytes hashed: the read-back (stat) finds this digest
            # unless something else touched the file since.
            DIGESTS.remember(target.stat(), digest)
        except OSError as exc:
            raise SinkError(f"copy to {target} failed: {exc.strerror or exc}") from exc

    def upload_many(self, files: Sequence[tuple[Path, str]]) -> None:
        for local, remote_path in files:
            self.upload(local, remote_path)

    def stat(self, remote_path: str) -> RemoteFile | None:
        target = self._target(remote_path)
        try:
            size = target.stat().st_size
            return RemoteFile(remote_path, size, DIGESTS.sha256(target))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SinkError(f"cannot read back {target}: {exc.strerror or exc}") from exc

    def download(self, remote_path: str, local: Path) -> RemoteFile | None:
        expected = self.stat(remote_path)
        if expected is None:
            return None
        tmp = local.with_name(f".{local.name}.download")
        try:
            local.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self._target(remote_path), tmp)
            return check_download(tmp, local, expected, f"download of {remote_path}")
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise SinkError(f"download of {remote_path} failed: {exc.strerror or exc}") from exc

    def delete(self, remote_path: str) -> None:
        target = self._target(remote_path)
        try:
            target.unlink(missing_ok=True)
        except OSError as exc:
            raise SinkError(f"cannot delete {target}: {exc.strerror or exc}") from exc
