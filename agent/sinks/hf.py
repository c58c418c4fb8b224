"""A Hugging Face Hub model repo (``hf://org/repo``), through the real ``huggingface_hub`` client.

Works with ``huggingface_hub`` >= 1.3.2 (:data:`MIN_HUB_VERSION`; before it, every commit to an
endpoint other than the import-time ``HF_ENDPOINT`` fails after the upload, in ``CommitInfo``).
The 1.x releases build their client on ``httpx``, 2.x on ``httpx2`` (the same API under another
name): :data:`hub_http` is whichever the installed ``huggingface_hub`` uses, chosen by its
version, because its network errors are what a failed call raises. An older ``huggingface_hub``
is refused when this module is imported (:func:`check_hub_version`), with the fix.

One call is one attempt: ``sync.py`` owns timeouts, retries and backoff. Two things the client
does on its own are worth knowing (``huggingface_hub`` 2.4.0, the same in 1.33):

- Its shared HTTP client has no timeout at all, so a hung connection would hold an upload
  thread forever. :func:`install_http_timeouts` (called by :class:`HubSink`) gives it one,
  process-wide, through the public ``set_client_factory``.
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

import contextlib
import hashlib
import importlib
import logging
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import huggingface_hub

from .. import __version__
from ..config import Env
from . import RemoteFile, SinkError

log = logging.getLogger(__name__)

#: The oldest ``huggingface_hub`` this module works with: ``tests/test_sink_hf.py`` passes on it
#: (1.3.2 builds a commit's ``RepoUrl`` with the client's endpoint; 1.3.1 raises ValueError).
MIN_HUB_VERSION = "1.3.2"


class HubVersionError(SinkError):
    """The installed ``huggingface_hub`` is older than :data:`MIN_HUB_VERSION`."""

    def __init__(self, installed: str) -> None:
        super().__init__(
            f"huggingface_hub {installed} is too old for hf:// sync: libreyolo-agent needs "
            f"huggingface_hub>={MIN_HUB_VERSION}; "
            f"fix: pip install 'huggingface_hub>={MIN_HUB_VERSION}'",
            retryable=False,
        )
        self.installed = installed


def _release(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, micro)`` of a version string ("1.33.0", "2.0.0rc1"); None if unreadable."""
    m = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version.strip())
    if m is None:
        return None
    major, minor, micro = (int(g or 0) for g in m.groups())
    return major, minor, micro


def hub_version_supported(version: str) -> bool:
    """Whether ``huggingface_hub`` ``version`` is at least :data:`MIN_HUB_VERSION`.

    An unreadable version (a local build) is given the benefit of the doubt.
    """
    have, need = _release(version), _release(MIN_HUB_VERSION)
    return have is None or need is None or have >= need


def check_hub_version(installed: str | None = None) -> None:
    """Raise :class:`HubVersionError` unless ``installed`` (default: the imported
    ``huggingface_hub``) is recent enough. Importing this module already does it."""
    version = huggingface_hub.__version__ if installed is None else installed
    if not hub_version_supported(version):
        raise HubVersionError(version)


def http_module_name(hub_version: str) -> str:
    """The HTTP client ``huggingface_hub`` ``hub_version`` builds on: ``httpx`` before 2.0."""
    release = _release(hub_version)
    return "httpx" if release is not None and release[0] < 2 else "httpx2"


# Before the imports below: an old huggingface_hub lacks some of them, and must be refused with
# the fix rather than an ImportError.
check_hub_version()

from huggingface_hub import (  # noqa: E402
    HfApi,
    get_session,
    hf_hub_url,
    hf_raise_for_status,
    set_client_factory,
)
from huggingface_hub.errors import (  # noqa: E402
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile  # noqa: E402

if TYPE_CHECKING:
    import httpx2 as hub_http
else:
    #: The HTTP client module of the installed huggingface_hub (``httpx`` or ``httpx2``).
    hub_http = importlib.import_module(http_module_name(huggingface_hub.__version__))

#: Per-request limits of the Hub client: connect, then the longest wait for the next bytes.
HTTP_CONNECT_TIMEOUT_S = 15.0
HTTP_TIMEOUT_S = 120.0
#: Status codes that retrying can fix (the Hub's own client retries 408, 429 and 5xx).
_RETRYABLE_STATUS = frozenset({408, 409, 412, 423, 425, 429})

#: What a failed Hub call raises: HTTP errors, network errors, local I/O, bad answers, and
#: RuntimeError, which wraps LFS/Xet transfer errors (the cause is classified, see _error).
_FAILURES = (HfHubHTTPError, hub_http.HTTPError, OSError, ValueError, RuntimeError)

_timeouts_lock = threading.Lock()
_timeouts_installed = False


def install_http_timeouts() -> None:
    """Give ``huggingface_hub``'s shared HTTP client timeouts (process-wide, idempotent).

    The library's default client is built with ``timeout=None``. Calls that pass their own
    timeout (downloads do) keep it. Installing closes the current shared client once, so do it
    before transfers start.
    """
    global _timeouts_installed
    with _timeouts_lock:
        if _timeouts_installed:
            return
        set_client_factory(_client_with_timeouts)
        _timeouts_installed = True


def _client_with_timeouts() -> hub_http.Client:
    timeout = hub_http.Timeout(HTTP_TIMEOUT_S, connect=HTTP_CONNECT_TIMEOUT_S)
    try:
        # The library's own factory keeps its request hook (offline mode, request ids).
        from huggingface_hub.utils._http import default_client_factory
    except ImportError:  # pragma: no cover - a later huggingface_hub moved it
        return hub_http.Client(follow_redirects=True, timeout=timeout)
    client = default_client_factory()
    client.timeout = timeout
    return client


class HubSink:
    """Checkpoints go to a model repo on the Hub (created private unless told otherwise)."""

    def __init__(self, repo_id: str, *, env: Env, private: bool, revision: str = "main") -> None:
        self.repo_id = repo_id
        self.private = private
        self.revision = revision
        self.description = f"hf://{repo_id}" + ("" if revision == "main" else f"@{revision}")
        self._endpoint = env.hf_endpoint
        # Secrets come from the environment only: no fallback to a token saved on disk.
        self._token: str | None = env.hf_token
        self._api = HfApi(
            endpoint=env.hf_endpoint,
            token=self._token or False,
            library_name="libreyolo-agent",
            library_version=__version__,
        )
        install_http_timeouts()

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
        except _FAILURES as exc:
            raise self._error(f"creating {self.description}", exc) from exc

    def upload(self, local: Path, remote_path: str) -> None:
        path = self._check(remote_path)
        if not local.is_file():
            raise SinkError(f"upload of {path} to {self.description}: {local} is not a file")
        try:
            info = self._api.upload_file(
                path_or_fileobj=str(local),
                path_in_repo=path,
                repo_id=self.repo_id,
                repo_type="model",
                revision=self.revision,
                commit_message=f"libreyolo-agent: upload {path}",
            )
        except _FAILURES as exc:
            raise self._error(f"upload of {path} to {self.description}", exc) from exc
        log.debug("hub commit path=%s repo=%s commit=%s", path, self.repo_id, info.oid)

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
        except _FAILURES as exc:
            raise self._error(action, exc) from exc

    # ---- internals -----------------------------------------------------------------------------

    def _check(self, remote_path: str) -> str:
        # Checked on the raw text: PurePosixPath would quietly turn "a//b" into "a/b".
        if any(part in ("", ".", "..") for part in remote_path.split("/")):
            raise SinkError(f"refusing remote path {remote_path!r}", retryable=False)
        return remote_path

    def _hash_regular(self, path: str, entry: RepoFile, action: str) -> RemoteFile | None:
        """sha256 of a regular (non-LFS) file: download it (it is small) and hash it."""
        url = hf_hub_url(self.repo_id, path, revision=self.revision, endpoint=self._endpoint)
        headers = {"user-agent": f"libreyolo-agent/{__version__}"}
        if self._token:
            headers["authorization"] = f"Bearer {self._token}"
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
        except RemoteEntryNotFoundError:
            return None  # deleted between the listing and the download
        if size != entry.size or git.hexdigest() != entry.blob_id:
            # The content moved on under us (a concurrent commit) or the Hub is inconsistent.
            raise SinkError(
                f"{action}: the downloaded content ({size} bytes) does not match the Hub's "
                f"listing ({entry.size} bytes, git oid {entry.blob_id}); retry"
            )
        return RemoteFile(path, size, sha256.hexdigest())

    def _error(self, action: str, exc: BaseException) -> SinkError:
        """One readable line that says what to do; never the token."""
        exc = _root_cause(exc)
        wait_s: float | None = None
        fix = f"set HF_TOKEN to a token with write access to {self.repo_id}"
        if not self._token:
            fix = f"HF_TOKEN is not set: {fix}"
        if isinstance(exc, HfHubHTTPError):
            status = exc.response.status_code
            server = _one_line(exc.server_message or "")
            detail = f"HTTP {status}" + (f" ({server})" if server else "")
            if isinstance(exc, RevisionNotFoundError):
                msg, retryable = (
                    f"{detail}: branch {self.revision!r} does not exist in {self.repo_id}; "
                    "create it or sync to an existing branch",
                    False,
                )
            elif isinstance(exc, RepositoryNotFoundError) or status == 404:
                msg, retryable = (
                    f"{detail}: repository {self.repo_id} was not found or the token cannot "
                    f"see it; check sync.target, or {fix}",
                    False,
                )
            elif status == 401:
                msg, retryable = f"{detail}: the Hub refused the token; {fix}", False
            elif status == 403:
                msg, retryable = f"{detail}: the token may not write there; {fix}", False
            elif status == 429:
                retry_after = exc.response.headers.get("Retry-After")
                with contextlib.suppress(TypeError, ValueError):
                    wait_s = float(retry_after) if retry_after else None
                hint = f"; the Hub asks to wait {retry_after} s" if retry_after else ""
                msg, retryable = f"{detail}: rate limited by the Hub{hint}", True
            elif status >= 500 or status in _RETRYABLE_STATUS:
                msg, retryable = f"{detail}: a transient error on the Hub", True
            else:
                msg, retryable = f"{detail}: the Hub rejected the request", False
        elif isinstance(exc, hub_http.HTTPError):
            msg, retryable = (
                f"cannot reach {self._endpoint} ({type(exc).__name__}: {_one_line(str(exc))})",
                True,
            )
        elif isinstance(exc, OSError):
            msg, retryable = f"{type(exc).__name__}: {exc.strerror or exc}", True
        else:
            msg, retryable = f"{type(exc).__name__}: {_one_line(str(exc))}", True
        return SinkError(
            self._redact(f"{action} failed: {msg}"), retryable=retryable, retry_after_s=wait_s
        )

    def _redact(self, text: str) -> str:
        return text.replace(self._token, "<HF_TOKEN>") if self._token else text


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
        if isinstance(seen, HfHubHTTPError):
            return seen.response.status_code in (401, 402, 403)
        seen = seen.__context__
    return False


def _root_cause(exc: BaseException) -> BaseException:
    """The HTTP or network error behind a wrapper (LFS/Xet uploads raise RuntimeError from it)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, HfHubHTTPError | hub_http.HTTPError):
            return seen
        seen = seen.__cause__
    return exc


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
