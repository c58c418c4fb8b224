"""A Hugging Face Hub model repo (``hf://org/repo``), through the real ``huggingface_hub`` client.

Client set-up (timeouts), the version floor, error classification and token redaction live in
:mod:`agent.hub`; this module words what a failed call means for sync. The daemon calls
:func:`agent.hub.configure` at start-up, before a sink is built.

One call is one attempt: ``sync.py`` owns timeouts, retries and backoff. One
:meth:`HubSink.upload_many` is one commit (``create_commit`` with one ``CommitOperationAdd`` per
file: the client's preupload, then the LFS batch API and a PUT per checkpoint, then one NDJSON
commit): the Hub counts commits per repo per hour (:data:`agent.hub.COMMITS_PER_HOUR`), so a
milestone's files go together, never one commit each. Two things the client
does on its own are worth knowing (``huggingface_hub`` 2.4.0, the same in 1.33):

- Its shared HTTP client has no timeout at all unless :func:`agent.hub.configure` gave it one,
  so a hung connection would hold an upload thread forever.
- The preupload call (the first request of every upload) goes through ``http_backoff``, which
  retries 429/5xx/network errors up to 5 times (1+2+4+8+8 s, or ``Retry-After`` + 1 s) before
  raising. That cannot be switched off through the public API, so one ``upload`` may take that
  long to fail; the commit request itself is never retried by the client.

Read-back (``stat``) handles the two ways the Hub stores a file:

- LFS/Xet files (checkpoints: ``*.pt`` and every binary or > 10 MB file): ``paths-info`` gives
  ``lfs.oid`` = sha256 of the content and ``lfs.size``; the Hub computed and checked that hash
  when it received the content, so it is returned as is (no multi-GB download).
- Regular git files (small text): ``paths-info``'s ``oid`` is only the git blob sha1
  (``sha1("blob N\\0" + content)``), not a sha256. The file is small, so it is downloaded,
  hashed with sha256, and its git sha1 is checked against ``oid`` so the listing and the
  content are known to agree.

No Hub cache is used (the download is hashed in memory), so ``HF_HOME`` does not matter here.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

from huggingface_hub import (
    CommitOperationAdd,
    RepoFile,
    get_session,
    hf_hub_url,
    hf_raise_for_status,
)

from agent import __version__, hub
from agent.config.model import Env
from agent.sinks import RemoteFile, SinkError, check_download
from agent.sinks.digests import DIGESTS

log = logging.getLogger(__name__)

#: Files in one commit at most: a milestone holds about ten; the final sync of a long run with
#: ``save_period`` may hold hundreds of ``epoch_N.pt``, sent in commits of this many.
MAX_FILES_PER_COMMIT = 50


class HubSink:
    """Checkpoints go to a model repo on the Hub (created private unless told otherwise)."""

    max_files_per_upload = MAX_FILES_PER_COMMIT

    def __init__(self, repo_id: str, *, env: Env, private: bool, revision: str = "main") -> None:
        self.repo_id = repo_id
        self.private = private
        self.revision = revision
        self.description = f"hf://{repo_id}" + ("" if revision == "main" else f"@{revision}")
        self._endpoint = env.hf_endpoint
        # Secrets come from the environment only: no fallback to a token saved on disk.
        self._token: str | None = env.hf_token
        self._api = hub.api(env)
        #: The Hub's commit limit for this repo; a test's sink may be given a smaller one.
        self.commits_per_hour: int | None = hub.COMMITS_PER_HOUR

    # ---- Sink ----------------------------------------------------------------------------------

    def prepare(self) -> None:
        try:
            try:
                self._api.create_repo(
                    self.repo_id, repo_type="model", private=self.private, exist_ok=True
                )
            except ValueError as exc:
                if not _repo_exists_after_refused_create(exc):
                    raise
            if self.revision != "main":
                self._api.create_branch(
                    self.repo_id, branch=self.revision, repo_type="model", exist_ok=True
                )
        except hub.CALL_ERRORS as exc:
            raise self._error(f"creating {self.description}", exc) from exc

    def upload(self, local: Path, remote_path: str) -> None:
        self.upload_many([(local, remote_path)])

    def upload_many(self, files: Sequence[tuple[Path, str]]) -> None:
        paths = [self._check(remote) for _, remote in files]
        if not paths:
            return
        what = paths[0] if len(paths) == 1 else f"{len(paths)} files ({_summary(paths)})"
        ops = []
        for (local, _), path in zip(files, paths, strict=True):
            if not local.is_file():
                raise SinkError(f"upload of {path} to {self.description}: {local} is not a file")
            op = CommitOperationAdd(path_in_repo=path, path_or_fileobj=str(local))
            _give_known_digest(op, local)
            ops.append(op)
        try:
            info = self._api.create_commit(
                self.repo_id,
                operations=ops,
                commit_message=f"libreyolo-agent: upload {_summary(paths)}",
                repo_type="model",
                revision=self.revision,
            )
        except hub.CALL_ERRORS as exc:
            raise self._error(f"upload of {what} to {self.description}", exc) from exc
        log.debug("hub commit paths=%s repo=%s commit=%s", ",".join(paths), self.repo_id, info.oid)

    def stat(self, remote_path: str) -> RemoteFile | None:
        path = self._check(remote_path)
        action = f"read-back of {path} from {self.description}"
        try:
            infos = self._api.get_paths_info(
                self.repo_id, [path], revision=self.revision, repo_type="model"
            )
            entry = next((i for i in infos if isinstance(i, RepoFile) and i.path == path), None)
            if entry is None:
                return None
            if entry.lfs is not None:
                return RemoteFile(path, entry.lfs.size, entry.lfs.sha256)
            return self._hash_regular(path, entry, action)
        except hub.CALL_ERRORS as exc:
            raise self._error(action, exc) from exc

    def download(self, remote_path: str, local: Path) -> RemoteFile | None:
        expected = self.stat(remote_path)
        if expected is None:
            return None
        path = self._check(remote_path)
        action = f"download of {path} from {self.description}"
        url = hf_hub_url(self.repo_id, path, revision=self.revision, endpoint=self._endpoint)
        tmp = local.with_name(f".{local.name}.download")
        try:
            local.parent.mkdir(parents=True, exist_ok=True)
            with get_session().stream("GET", url, headers=self._headers()) as r:
                hf_raise_for_status(r)
                with open(tmp, "wb") as f:
                    for chunk in r.iter_bytes():
                        f.write(chunk)
            return check_download(tmp, local, expected, action)
        except hub.CALL_ERRORS as exc:
            tmp.unlink(missing_ok=True)
            raise self._error(action, exc) from exc
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise SinkError(f"{action} failed: {exc.strerror or exc}") from exc

    def delete(self, remote_path: str) -> None:
        path = self._check(remote_path)
        try:
            self._api.delete_file(
                path,
                self.repo_id,
                repo_type="model",
                revision=self.revision,
                commit_message=f"libreyolo-agent: delete {path}",
            )
        except hub.CALL_ERRORS as exc:
            if hub.classify(exc, token=self._token).kind == "missing_file":
                return  # not there: nothing to delete
            raise self._error(f"delete of {path} from {self.description}", exc) from exc

    def _headers(self) -> dict[str, str]:
        headers = {"user-agent": f"libreyolo-agent/{__version__}"}
        if self._token:
            headers["authorization"] = f"Bearer {self._token}"
        return headers

    # ---- internals -----------------------------------------------------------------------------

    def _check(self, remote_path: str) -> str:
        # Checked on the raw text: PurePosixPath would quietly turn "a//b" into "a/b".
        if any(part in ("", ".", "..") for part in remote_path.split("/")):
            raise SinkError(f"refusing remote path {remote_path!r}", retryable=False)
        return remote_path

    def _hash_regular(self, path: str, entry: RepoFile, action: str) -> RemoteFile | None:
        """sha256 of a regular (non-LFS) file: download it (it is small) and hash it."""
        url = hf_hub_url(self.repo_id, path, revision=self.revision, endpoint=self._endpoint)
        headers = self._headers()
        sha256 = hashlib.sha256()
        git = hashlib.sha1(b"blob %d\0" % entry.size, usedforsecurity=False)
        size = 0
        try:
            with get_session().stream("GET", url, headers=headers) as r:
                hf_raise_for_status(r)
                for chunk in r.iter_bytes():
                    sha256.update(chunk)
                    git.update(chunk)
                    size += len(chunk)
        except hub.CALL_ERRORS as exc:
            if hub.classify(exc, token=self._token).kind == "missing_file":
                return None  # deleted between the listing and the download
            raise
        if size != entry.size or git.hexdigest() != entry.blob_id:
            # The content moved on under us (a concurrent commit) or the Hub is inconsistent.
            raise SinkError(
                f"{action}: the downloaded content ({size} bytes) does not match the Hub's "
                f"listing ({entry.size} bytes, git oid {entry.blob_id}); retry"
            )
        return RemoteFile(path, size, sha256.hexdigest())

    def _error(self, action: str, exc: BaseException) -> SinkError:
        """One readable line that says what to do; never the token."""
        failure = hub.classify(exc, token=self._token)
        detail = failure.detail
        fix = f"set HF_TOKEN to a token with write access to {self.repo_id}"
        if not self._token:
            fix = f"HF_TOKEN is not set: {fix}"
        match failure.kind:
            case "missing_revision":
                msg = (
                    f"{detail}: branch {self.revision!r} does not exist in {self.repo_id}; "
                    "create it or sync to an existing branch"
                )
            case "missing_repo" | "gated":
                msg = (
                    f"{detail}: repository {self.repo_id} was not found or the token cannot "
                    f"see it; check sync.target, or {fix}"
                )
            case "unauthorized":
                msg = f"{detail}: the Hub refused the token; {fix}"
            case "forbidden":
                msg = f"{detail}: the token may not write there; {fix}"
            case "rate_limited":
                wait = failure.retry_after_s
                hint = f"; the Hub asks to wait {wait:g} s" if wait is not None else ""
                msg = f"{detail}: rate limited by the Hub{hint}"
            case "transient":
                msg = f"{detail}: a transient error on the Hub"
            case "rejected" | "missing_file":
                msg = f"{detail}: the Hub rejected the request"
            case "unreachable":
                msg = f"cannot reach {self._endpoint} ({detail})"
            case _:
                msg = detail
        return SinkError(
            hub.redact(f"{action} failed: {msg}", self._token),
            retryable=failure.retryable,
            retry_after_s=failure.retry_after_s,
        )


def _summary(paths: Sequence[str]) -> str:
    """The commit's title: the paths, or the first two and how many more."""
    if len(paths) <= 3:
        return ", ".join(paths)
    return f"{paths[0]}, {paths[1]} and {len(paths) - 2} more"


def _repo_exists_after_refused_create(exc: ValueError) -> bool:
    """Whether ``create_repo(exist_ok=True)`` failed only in building the URL of a repo it found.

    When the Hub refuses the create (401/402/403; 403 only before 2.0), the client checks that
    the repo exists (``repo_info``), then builds its ``RepoUrl`` without the endpoint, which
    raises ``ValueError`` (``HfUriError`` since 2.0) for any endpoint but the import-time
    ``HF_ENDPOINT``. The repo exists then; whether the token may write shows at the first upload.
    Recognised by the refusal it was raised while handling, not by its message.
    """
    seen: BaseException | None = exc.__context__
    while seen is not None:
        status = hub.http_status(seen)
        if status is not None:
            return status in (401, 402, 403)
        seen = seen.__context__
    return False


def _give_known_digest(op: CommitOperationAdd, local: Path) -> None:
    """Hand the client the sha256 the snapshot already computed, so that the upload does not
    read a multi-GB checkpoint once more only to hash it (the LFS batch request and the commit
    need it). Only where the client hashes lazily (``UploadInfo.is_hashed``, ``huggingface_hub``
    2.x) and only for this exact version of the file (:data:`agent.sinks.digests.DIGESTS`); older
    clients hashed it already when ``op`` was built, and nothing changes for them."""
    info = op.upload_info
    if getattr(info, "is_hashed", True):
        return
    try:
        st = local.stat()
    except OSError:
        return
    known = DIGESTS.lookup(st)
    if known is not None and st.st_size == info.size:
        info.sha256 = bytes.fromhex(known)
