"""A fake Hugging Face Hub that the real ``huggingface_hub`` client (2.4.0) talks to over loopback.

It speaks the HTTP contract in ``shared/contracts/hub.md``: repo creation, branch creation,
preupload + NDJSON commit, ``resolve`` downloads (HEAD + GET + Range, model and dataset repos),
``paths-info``, ``tree`` (paginated by ``Link``), repo info (``model_info``/``repo_info``, also
what the client reads when every file of a commit is unchanged), ``whoami-v2`` and
``validate-yaml``, with the Hub's auth rules and error headers (``X-Error-Code``,
``X-Error-Message``, ``X-Repo-Commit`` on 404s of entries).
The client is synchronous, so the server runs in a background thread with its own event loop::

    from tests.fakes.hub import run_fake_hub

    with run_fake_hub(tokens={"hf_good"}, read_tokens={"hf_read"}) as hub:
        api = HfApi(endpoint=hub.url, token="hf_good")       # never HF_ENDPOINT: read at import
        hub.add_file("dataset", "org/data", "data.tar", b"...", private=True)
        hf_hub_download("org/data", "data.tar", repo_type="dataset", endpoint=hub.url,
                        token="hf_good", cache_dir=tmp_path)
        hub.file("model", "org/run", "weights/last.pt")       # -> bytes | None
        hub.fail("commit", 503, times=2)                        # fault knobs, see below

``run_fake_hub(tokens=, read_tokens=, user="fake-user", lfs_threshold=10 MiB,
tree_page_size=1000, lfs_uploads=True, lfs_chunk_size=16 MiB, commit_limit=None,
commit_window_s=3600)``: ``tokens`` may write (and read), ``read_tokens`` may only read; ``user``
is the namespace of repos created without an organization and what ``whoami`` answers.

Commit limit (``commit_limit``, or ``limit_commits(limit, window_s=, as_date=)`` while it runs):
as the Hub's per-repo hourly quota, at most ``commit_limit`` commits (HTTP ``commit`` route,
deletions included; ``add_file`` is not counted) per repo per ``commit_window_s``; the next one
is refused with 429 ``You have exceeded our hourly quotas for action: commit. We invite you to
retry later.`` and ``Retry-After`` = seconds until the oldest commit of the window ages out (an
HTTP date with ``as_date=True``). The client never retries a commit: ``create_commit`` raises
``HfHubHTTPError`` (status 429). ``commits_refused[(kind, repo_id)]`` counts the refusals.

Tests must set ``HF_HUB_DISABLE_TELEMETRY=1``, ``HF_HUB_DISABLE_XET=1`` and ``NO_PROXY=127.0.0.1``
(``tests/conftest.py`` does).

State helpers (thread-safe, callable from the test thread while the server runs)
    ``url``                                  base URL, ``http://127.0.0.1:PORT``
    ``revoke(token)``                        the token is refused from now on (401)
    ``add_repo(kind, repo_id, private=)``    create a repo (no-op if it exists); kind is
                                             ``"model"``, ``"dataset"`` or ``"space"``
    ``add_file(kind, repo_id, path, data, private=, revision="main")`` -> commit sha; creates
                                             the repo (and the branch) when missing
    ``files(kind, repo_id, revision="main")`` -> ``{path: bytes}`` at the head of ``revision``
    ``file(kind, repo_id, path, revision="main")`` -> ``bytes | None``
    ``has_repo(kind, repo_id)``, ``is_private(kind, repo_id)``, ``head(kind, repo_id, rev)``
    ``commits(kind, repo_id, revision="main")`` -> ``[CommitRecord]``, oldest first
    ``describe(kind, repo_id, path, revision="main")`` -> the paths-info entry (dict) or None
    ``requests`` -> ``[RequestRecord]`` (method, path, route, status, start, end, files, auth),
                                             times from ``time.monotonic()``; ``clear_requests()``;
                                             ``overlaps(records)`` -> pairs whose spans overlap,
                                             e.g. ``overlaps(r for r in hub.requests
                                             if r.route == "commit" and "a.pt" in r.files)``

Like the real Hub, a new repo starts with an "initial commit" holding ``.gitattributes`` (the
default LFS patterns), so ``files()`` includes it; use ``file()`` for single paths.

How files are described (the point of the fake, see the contract): a file is "LFS" when its path
matches an LFS pattern of the repo's ``.gitattributes`` (``*.pt``, ``*.bin``, ``*.tar``,
``*.zip``, ...), or it is larger than ``lfs_threshold`` (10 MiB, as on the Hub), or it looks binary
(a NUL byte in its first 8000 bytes). For LFS files paths-info/tree/repo-info give ``oid`` = git
sha1 of the LFS *pointer* and ``lfs = {oid: sha256 of content, size, pointerSize}``; resolve
answers ``ETag`` = ``X-Linked-Etag`` = the sha256 and ``X-Linked-Size``. Regular files give
``oid`` = git blob sha1 of the content, no ``lfs``, and ``ETag`` = that sha1. (The real Hub
redirects LFS downloads to a CDN host; the fake serves them directly.)

How files go up (``lfs_uploads=True``, the default): as on the Hub, preupload answers
``uploadMode: "lfs"`` for an LFS file (by the rule above, judged from the path, the size and the
512-byte sample) with ``oid`` = the sha256 of the content already there, and ``"regular"``
(``oid`` = git sha1) for the rest. An LFS file then goes through the Git LFS batch API
(``POST /{repo}.git/info/lfs/objects/batch``, route ``lfs_batch``; objects the repo already has
get no actions): one ``PUT`` to a presigned URL without ``Authorization`` (``lfs_upload``), or
for objects over ``lfs_chunk_size`` (16 MiB) one ``PUT`` per part, each answered with an ETag,
and a completion ``POST`` (``lfs_complete``) that checks them; then ``POST`` verify
(``lfs_verify``). The fake checks size and sha256 of what arrives and refuses a commit whose
``lfsFile`` names an object the repo was not sent (422, as the Hub). ``lfs_transfers`` lists the
transfers each batch offered (``"xet"`` when the client would use Xet; the fake always chooses
``basic``, as the Hub does for a client without Xet). With ``lfs_uploads=False`` every file goes
up "regular", as base64 in the NDJSON commit.

Auth (``Authorization: Bearer TOKEN``)
    - a token that is not in ``tokens``/``read_tokens`` -> 401 ``Invalid credentials in
      Authorization header`` on every route, public repos included (as the Hub does);
    - private repo (or missing repo) read without a token -> 401 ``X-Error-Code: RepoNotFound``;
      with a valid token but missing repo -> 404 ``RepoNotFound``;
    - writes (create repo/branch, preupload, commit) need a token: none -> 401; a read token
      -> 403 (the client's create_repo(exist_ok=True) then checks the repo exists instead).
    Simplification: every valid token may act on every namespace.

Fault knobs (thread-safe; each returns the :class:`Fault`, whose ``hits`` counts applications;
``times=None`` means until ``clear_faults()``). ``route`` is one of :data:`ROUTES` (``create_repo``,
``branch``, ``preupload``, ``commit``, ``paths_info``, ``tree``, ``repo_info``, ``resolve``,
``whoami``, ``validate_yaml``, ``lfs_batch``, ``lfs_upload``, ``lfs_complete``, ``lfs_verify``)
or ``"*"``; ``method`` narrows it (e.g. ``"HEAD"`` of resolve):
    ``fail(route, status=503, times=1, retry_after=None, method=None)``  answer with an error
        (``Retry-After`` header when given). The client retries some calls on its own
        (``utils/_http.py`` ``http_backoff``, up to 5 retries, 1-2-4-8-8 s): preupload and tree
        on 429/5xx/network errors; a failed download HEAD is repeated at once, then with that
        backoff; the download GET on 408/429, and on network errors (1 s, 5 times).
        create_repo, create_branch, commit, paths-info and whoami are never retried.
    ``delay(route, seconds, times=None, method=None)``  sleep before handling
    ``reset(route, times=1, after=False, method=None)``  close the connection without an
        answer; ``after=True`` first performs the request (e.g. the commit IS applied) and then
        drops the answer
    ``truncate(fraction=0.5, times=1)``  a download (GET resolve) sends its headers and part of
        the body, then drops the connection (the client retries after 1 s, with ``Range``
        from the whole 10 MB chunks it kept, if any)
    ``lose(mode="drop"|"corrupt", times=1, path=None)``  a commit answers success but the file is
        not stored ("drop": the commit exists, the file does not change) or is stored with one
        byte flipped ("corrupt": same size, different content); faults naming different
        paths all apply to a commit that carries them
    ``clear_faults()``
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import fnmatch
import hashlib
import json
import math
import re
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import formatdate
from typing import Any
from urllib.parse import quote, urlencode

from aiohttp import web

#: Route families that faults and the request log refer to.
ROUTES = frozenset(
    {
        "create_repo",
        "preupload",
        "commit",
        "paths_info",
        "tree",
        "repo_info",
        "resolve",
        "whoami",
        "validate_yaml",
        "branch",
        "lfs_batch",
        "lfs_upload",
        "lfs_complete",
        "lfs_verify",
    }
)
KINDS = ("model", "dataset", "space")
#: Files larger than this are LFS on the real Hub whatever their name.
DEFAULT_LFS_THRESHOLD = 10 * 1024 * 1024
#: The Hub pages tree listings by 1000 entries.
DEFAULT_TREE_PAGE_SIZE = 1000
#: Objects larger than this go up in parts (the Hub's multipart LFS transfer); smaller ones in
#: one PUT ("basic").
DEFAULT_LFS_CHUNK_SIZE = 16 * 1024 * 1024
#: The window the Hub counts commits over (``commit_limit`` per repo per window), seconds.
COMMIT_WINDOW_S = 3600.0
#: Commits carry whole files as base64 in one NDJSON body: allow big ones.
CLIENT_MAX_SIZE = 2 * 1024**3

_DEFAULT_LFS_PATTERNS = [
    *("*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib"),
    *("*.lfs.*", "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot"),
    *("*.parquet", "*.pb", "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors"),
    *("saved_model/**/*", "*.tar.*", "*.tar", "*.tflite", "*.tgz", "*.wasm", "*.xz", "*.zip"),
    *("*.zst", "*tfevents*"),
]
# The .gitattributes the Hub puts in every new repo (its LFS patterns decide "LFS or regular").
DEFAULT_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n" for pattern in _DEFAULT_LFS_PATTERNS
)

_REPO_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
_KIND_PLURAL = "{kind:models|datasets|spaces}"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Per-request notes for the request log.
_FILES: web.RequestKey[tuple[str, ...]] = web.RequestKey("hub_files", tuple)
_RESET: web.RequestKey[bool] = web.RequestKey("hub_reset", bool)


def git_blob_sha1(data: bytes) -> str:
    """``git hash-object`` of ``data``: what the Hub calls the ``oid`` of a regular file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    """The git-lfs pointer file git stores in place of an LFS file's content."""
    sha = hashlib.sha256(data).hexdigest()
    text = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n"
    return text.encode()


# --------------------------------------------------------------------------------------------
# Records and faults


@dataclass
class _LfsUpload:
    """An object the batch API said to upload: where it goes and the parts received so far."""

    kind: str
    repo_id: str
    oid: str
    size: int
    #: Multipart only: ``{part number: bytes}``.
    parts: dict[int, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestRecord:
    """One request as the fake saw it. ``status`` is None when the connection was reset."""

    method: str
    path: str
    route: str | None
    status: int | None
    start: float
    end: float
    #: Paths a preupload or commit carried (empty for other routes).
    files: tuple[str, ...] = ()
    #: ``"none"``, ``"valid"`` or ``"invalid"``: what Authorization header came (never the token).
    auth: str = "none"


@dataclass(frozen=True)
class CommitRecord:
    sha: str
    parent: str | None
    summary: str
    #: Paths added or changed by the commit.
    paths: tuple[str, ...]
    #: Paths deleted by the commit.
    deleted: tuple[str, ...] = ()


@dataclass
class Fault:
    """One injected fault. ``hits`` counts how often it was applied."""

    route: str
    action: str
    times: int | None
    method: str | None = None
    status: int = 503
    retry_after: float | None = None
    seconds: float = 0.0
    after: bool = False
    mode: str = "drop"
    path: str | None = None
    fraction: float = 0.5
    hits: int = 0

    def matches(self, route: str | None, method: str) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if self.method is not None and self.method.upper() != method:
            return False
        return self.route == "*" or self.route == route


# --------------------------------------------------------------------------------------------
# Repository state


@dataclass
class _Commit:
    sha: str
    parent: str | None
    summary: str
    files: dict[str, bytes]
    date: str
    paths: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()


@dataclass
class _Repo:
    kind: str
    repo_id: str
    private: bool
    refs: dict[str, str] = field(default_factory=dict)
    commits: dict[str, _Commit] = field(default_factory=dict)
    created_at: str = ""


class _HubError(Exception):
    """Turned into the Hub's error answer: JSON ``{"error": ...}`` plus X-Error-* headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = dict(headers or {})


@dataclass(frozen=True)
class _Caller:
    #: None (no token), "read" or "write".
    role: str | None


def _now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def _check_path(path: object) -> str:
    if not isinstance(path, str) or not path:
        raise _HubError(400, f"Invalid path {path!r}")
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\x00" in path:
        raise _HubError(400, f"Invalid path {path!r}")
    return path


# --------------------------------------------------------------------------------------------
# The fake


class FakeHub:
    """State, fault knobs and the aiohttp application. Use :func:`run_fake_hub` to serve it."""

    def __init__(
        self,
        *,
        tokens: Iterable[str] = (),
        read_tokens: Iterable[str] = (),
        user: str = "fake-user",
        lfs_threshold: int = DEFAULT_LFS_THRESHOLD,
        tree_page_size: int = DEFAULT_TREE_PAGE_SIZE,
        lfs_uploads: bool = True,
        lfs_chunk_size: int = DEFAULT_LFS_CHUNK_SIZE,
        commit_limit: int | None = None,
        commit_window_s: float = COMMIT_WINDOW_S,
    ) -> None:
        #: Commits per repo per ``commit_window_s`` (None: no limit); see :meth:`limit_commits`.
        self.commit_limit = commit_limit
        self.commit_window_s = commit_window_s
        #: ``Retry-After`` of a refused commit as an HTTP date instead of seconds.
        self.retry_after_as_date = False
        #: When each repo's commits over HTTP were made (``time.monotonic()``), for the limit.
        self._commit_times: dict[tuple[str, str], list[float]] = {}
        #: Commits refused for the limit (429), per repo.
        self.commits_refused: dict[tuple[str, str], int] = {}
        self.lfs_uploads = lfs_uploads
        self.lfs_chunk_size = lfs_chunk_size
        #: LFS objects uploaded (and verified) per repo: ``{(kind, repo_id): {sha256: bytes}}``.
        self._lfs: dict[tuple[str, str], dict[str, bytes]] = {}
        #: Upload URLs handed out by the batch API: ``{token: _LfsUpload}`` (the presigned URL).
        self._lfs_pending: dict[str, _LfsUpload] = {}
        #: The ``transfers`` each LFS batch request offered (``"xet"`` when the client has it).
        self.lfs_transfers: list[tuple[str, ...]] = []
        self._roles: dict[str, str] = {t: "read" for t in read_tokens}
        self._roles.update({t: "write" for t in tokens})
        self.user = user
        self.lfs_threshold = lfs_threshold
        self.tree_page_size = tree_page_size
        self.url = ""
        self._lock = threading.RLock()
        self._repos: dict[tuple[str, str], _Repo] = {}
        self._faults: list[Fault] = []
        self._log: list[RequestRecord] = []
        self._counter = 0
        self._closing: asyncio.Event | None = None

    # ---- state helpers (test thread) ---------------------------------------------------------

    def revoke(self, token: str) -> None:
        """The token is revoked (or expired): from now on it is refused like any unknown token
        (401 ``Invalid credentials in Authorization header``), as the Hub does."""
        with self._lock:
            self._roles.pop(token, None)

    def add_repo(self, kind: str, repo_id: str, *, private: bool = False) -> None:
        with self._lock:
            self._ensure_repo(kind, repo_id, private)

    def add_file(
        self,
        kind: str,
        repo_id: str,
        path: str,
        data: bytes,
        *,
        private: bool = False,
        revision: str = "main",
    ) -> str:
        _check_path(path)
        with self._lock:
            repo = self._ensure_repo(kind, repo_id, private)
            if revision not in repo.refs:
                repo.refs[revision] = repo.refs["main"]
            return self._commit(repo, revision, f"Upload {path}", {path: bytes(data)}, ()).sha

    def has_repo(self, kind: str, repo_id: str) -> bool:
        with self._lock:
            return (self._kind(kind), repo_id) in self._repos

    def is_private(self, kind: str, repo_id: str) -> bool:
        with self._lock:
            return self._repos[(self._kind(kind), repo_id)].private

    def head(self, kind: str, repo_id: str, revision: str = "main") -> str:
        with self._lock:
            return self._repos[(self._kind(kind), repo_id)].refs[revision]

    def files(self, kind: str, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        with self._lock:
            repo = self._repos[(self._kind(kind), repo_id)]
            return dict(repo.commits[self._rev_sha(repo, revision)].files)

    def file(self, kind: str, repo_id: str, path: str, revision: str = "main") -> bytes | None:
        with self._lock:
            repo = self._repos.get((self._kind(kind), repo_id))
            if repo is None:
                return None
            return repo.commits[self._rev_sha(repo, revision)].files.get(path)

    def commits(self, kind: str, repo_id: str, revision: str = "main") -> list[CommitRecord]:
        with self._lock:
            repo = self._repos[(self._kind(kind), repo_id)]
            out: list[CommitRecord] = []
            sha: str | None = self._rev_sha(repo, revision)
            while sha is not None:
                c = repo.commits[sha]
                out.append(CommitRecord(c.sha, c.parent, c.summary, c.paths, c.deleted))
                sha = c.parent
            return out[::-1]

    def describe(
        self, kind: str, repo_id: str, path: str, revision: str = "main"
    ) -> dict[str, Any] | None:
        with self._lock:
            repo = self._repos[(self._kind(kind), repo_id)]
            files = repo.commits[self._rev_sha(repo, revision)].files
            if path not in files:
                return None
            return self._describe(files, path)

    @property
    def requests(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._log)

    def clear_requests(self) -> None:
        with self._lock:
            self._log.clear()

    # ---- fault knobs ---------------------------------------------------------------------------

    def fail(
        self,
        route: str,
        status: int = 503,
        *,
        times: int | None = 1,
        retry_after: float | None = None,
        method: str | None = None,
    ) -> Fault:
        """Answer the next ``times`` requests of ``route`` with ``status`` (None: until cleared)."""
        if status < 400:
            raise ValueError(f"fail() needs an error status, got {status}")
        return self._add_fault(
            Fault(route, "status", times, method=method, status=status, retry_after=retry_after)
        )

    def delay(
        self, route: str, seconds: float, *, times: int | None = None, method: str | None = None
    ) -> Fault:
        """Sleep ``seconds`` before handling requests of ``route``."""
        return self._add_fault(Fault(route, "delay", times, method=method, seconds=seconds))

    def reset(
        self, route: str, *, times: int | None = 1, after: bool = False, method: str | None = None
    ) -> Fault:
        """Close the connection without answering (``after=True``: once the request is done)."""
        return self._add_fault(Fault(route, "reset", times, method=method, after=after))

    def lose(self, mode: str = "drop", *, times: int | None = 1, path: str | None = None) -> Fault:
        """Commits (touching ``path``, if given) answer success but drop or corrupt the file."""
        if mode not in ("drop", "corrupt"):
            raise ValueError(f"lose() mode must be 'drop' or 'corrupt', got {mode!r}")
        return self._add_fault(Fault("commit", "lose", times, mode=mode, path=path))

    def truncate(self, *, fraction: float = 0.5, times: int | None = 1) -> Fault:
        """Downloads (GET resolve) send full headers, then ``fraction`` of the body, then drop
        the connection."""
        if not 0 <= fraction < 1:
            raise ValueError("fraction must be in [0, 1)")
        return self._add_fault(Fault("resolve", "truncate", times, method="GET", fraction=fraction))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def limit_commits(
        self, limit: int | None, *, window_s: float = COMMIT_WINDOW_S, as_date: bool = False
    ) -> None:
        """At most ``limit`` commits per repo per ``window_s`` from now on (None: no limit), the
        rest refused with 429 and ``Retry-After`` (seconds, or an HTTP date with ``as_date``)."""
        with self._lock:
            self.commit_limit = limit
            self.commit_window_s = window_s
            self.retry_after_as_date = as_date

    def _check_commit_quota(self, repo: _Repo) -> None:
        """Refuse a commit past the limit as the Hub does (call with the lock held)."""
        if self.commit_limit is None:
            return
        key = (repo.kind, repo.repo_id)
        now = time.monotonic()
        times = [t for t in self._commit_times.get(key, []) if t > now - self.commit_window_s]
        self._commit_times[key] = times
        if len(times) < self.commit_limit:
            times.append(now)
            return
        self.commits_refused[key] = self.commits_refused.get(key, 0) + 1
        left_s = times[0] + self.commit_window_s - now
        wait_s = max(1, math.ceil(left_s))
        if self.retry_after_as_date:
            # Whole seconds, rounded up: never a moment before the window has room.
            retry_after = formatdate(math.ceil(time.time() + left_s), usegmt=True)
        else:
            retry_after = str(wait_s)
        raise _HubError(
            429,
            "You have exceeded our hourly quotas for action: commit. We invite you to retry later.",
            headers={"Retry-After": retry_after},
        )

    def _add_fault(self, fault: Fault) -> Fault:
        if fault.route != "*" and fault.route not in ROUTES:
            raise ValueError(f"unknown route {fault.route!r} (expected one of {sorted(ROUTES)})")
        if fault.times is not None and fault.times < 1:
            raise ValueError("times must be >= 1 or None")
        with self._lock:
            self._faults.append(fault)
        return fault

    def _take(self, action: str, route: str | None, method: str) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.action == action and f.matches(route, method):
                    f.hits += 1
                    return f
        return None

    def _take_lose(self, paths: Iterable[str]) -> dict[str, Fault]:
        """The ``lose`` faults this commit applies, by path: each fault naming a path of the
        commit (several in one commit, one per path), else the first without a path for all."""
        paths = set(paths)
        out: dict[str, Fault] = {}
        with self._lock:
            for f in self._faults:
                if f.action != "lose" or not f.matches("commit", "POST"):
                    continue
                if f.path is not None and f.path in paths and f.path not in out:
                    f.hits += 1
                    out[f.path] = f
            if not out:
                for f in self._faults:
                    if f.action == "lose" and f.path is None and f.matches("commit", "POST"):
                        f.hits += 1
                        return dict.fromkeys(paths, f)
        return out

    # ---- internals on state (call with the lock held) ------------------------------------------

    @staticmethod
    def _kind(kind: str) -> str:
        if kind not in KINDS:
            raise ValueError(f"repo kind must be one of {KINDS}, got {kind!r}")
        return kind

    def _ensure_repo(self, kind: str, repo_id: str, private: bool) -> _Repo:
        key = (self._kind(kind), repo_id)
        repo = self._repos.get(key)
        if repo is None:
            repo = _Repo(kind, repo_id, private, created_at=_now_iso())
            self._repos[key] = repo
            self._commit(
                repo,
                "main",
                "initial commit",
                {".gitattributes": DEFAULT_GITATTRIBUTES.encode()},
                (),
            )
        return repo

    def _new_sha(self) -> str:
        self._counter += 1
        seed = f"{self._counter}:{uuid.uuid4()}".encode()
        return hashlib.sha1(seed, usedforsecurity=False).hexdigest()

    def _commit(
        self,
        repo: _Repo,
        branch: str,
        summary: str,
        added: Mapping[str, bytes],
        deleted: Iterable[str],
        *,
        lost: Mapping[str, Fault] | None = None,
    ) -> _Commit:
        parent = repo.refs.get(branch)
        files = dict(repo.commits[parent].files) if parent else {}
        deleted = tuple(deleted)
        for d in deleted:
            if d.endswith("/"):
                for p in [p for p in files if p.startswith(d)]:
                    del files[p]
            else:
                files.pop(d, None)
        for path, data in added.items():
            fault = (lost or {}).get(path)
            if fault is not None:
                if fault.mode == "drop":
                    continue
                if data:
                    i = len(data) // 2
                    data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
                else:
                    data = b"\x00"
            files[path] = data
        commit = _Commit(self._new_sha(), parent, summary, files, _now_iso(), tuple(added), deleted)
        repo.commits[commit.sha] = commit
        repo.refs[branch] = commit.sha
        return commit

    @staticmethod
    def _rev_sha(repo: _Repo, rev: str) -> str:
        if rev in repo.refs:
            return repo.refs[rev]
        if _COMMIT_SHA.fullmatch(rev) and rev in repo.commits:
            return rev
        raise _HubError(404, f"Invalid rev id: {rev}", code="RevisionNotFound")

    def _lfs_patterns(self, files: Mapping[str, bytes]) -> list[str]:
        text = files.get(".gitattributes", DEFAULT_GITATTRIBUTES.encode()).decode(errors="replace")
        patterns = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 2 and "filter=lfs" in parts[1:]:
                patterns.append(parts[0])
        return patterns

    def is_lfs(self, files: Mapping[str, bytes], path: str) -> bool:
        """Would the real Hub store ``path`` (as it is in ``files``) in LFS/Xet?"""
        data = files[path]
        if len(data) > self.lfs_threshold or b"\x00" in data[:8000]:
            return True
        name = path.rsplit("/", 1)[-1]
        for pattern in self._lfs_patterns(files):
            target = path if "/" in pattern else name
            if fnmatch.fnmatchcase(target, pattern.replace("**/", "*")):
                return True
        return False

    def _describe(self, files: Mapping[str, bytes], path: str) -> dict[str, Any]:
        data = files[path]
        if self.is_lfs(files, path):
            pointer = lfs_pointer(data)
            return {
                "type": "file",
                "oid": git_blob_sha1(pointer),
                "size": len(data),
                "path": path,
                "lfs": {
                    "oid": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "pointerSize": len(pointer),
                },
            }
        return {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": path}

    @staticmethod
    def _dirs(files: Mapping[str, bytes]) -> set[str]:
        out = set()
        for p in files:
            parts = p.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                out.add("/".join(parts[:i]))
        return out

    def _describe_dir(self, files: Mapping[str, bytes], path: str) -> dict[str, Any]:
        inner = sorted((p, git_blob_sha1(d)) for p, d in files.items() if p.startswith(path + "/"))
        tree_id = hashlib.sha1(repr(inner).encode(), usedforsecurity=False).hexdigest()
        return {"type": "directory", "oid": tree_id, "size": 0, "path": path}

    def _last_commit(self, repo: _Repo, head: str, path: str) -> dict[str, str]:
        sha: str | None = head
        found = repo.commits[head]
        while sha is not None:
            c = repo.commits[sha]
            if path in c.paths or any(p.startswith(path + "/") for p in c.paths):
                found = c
                break
            sha = c.parent
        return {"id": found.sha, "title": found.summary, "date": found.date}

    # ---- HTTP: plumbing ----------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(
            client_max_size=CLIENT_MAX_SIZE,
            middlewares=[self._mw_log, self._mw_faults, self._mw_errors],
        )
        r = app.router
        kp = f"/api/{_KIND_PLURAL}/{{ns}}/{{name}}"
        routes: list[tuple[str, str, str, _Handler]] = [
            ("POST", "/api/repos/create", "create_repo", self._h_create),
            ("POST", "/api/validate-yaml", "validate_yaml", self._h_validate_yaml),
            ("GET", "/api/whoami-v2", "whoami", self._h_whoami),
            ("POST", f"{kp}/preupload/{{rev}}", "preupload", self._h_preupload),
            ("POST", f"{kp}/commit/{{rev}}", "commit", self._h_commit),
            ("POST", f"{kp}/paths-info/{{rev}}", "paths_info", self._h_paths_info),
            ("GET", f"{kp}/tree/{{rev}}", "tree", self._h_tree),
            ("GET", f"{kp}/tree/{{rev}}/{{path:.+}}", "tree", self._h_tree),
            ("POST", f"{kp}/branch/{{branch}}", "branch", self._h_branch),
            ("GET", kp, "repo_info", self._h_repo_info),
            ("GET", f"{kp}/revision/{{rev}}", "repo_info", self._h_repo_info),
            ("PUT", "/__s3/{token}", "lfs_upload", self._h_lfs_put),
            ("PUT", "/__s3/{token}/{part}", "lfs_upload", self._h_lfs_put),
            ("POST", "/__lfs/complete/{token}", "lfs_complete", self._h_lfs_complete),
            ("POST", "/__lfs/verify/{kind}/{ns}/{name}", "lfs_verify", self._h_lfs_verify),
        ]
        for prefix, kind in (("/datasets", "dataset"), ("/spaces", "space"), ("", "model")):
            path = f"{prefix}/{{ns}}/{{name}}.git/info/lfs/objects/batch"
            routes.append(("POST", path, "lfs_batch", self._lfs_batch_handler(kind)))
        for prefix, kind in (("/datasets", "dataset"), ("/spaces", "space"), ("", "model")):
            path = f"{prefix}/{{ns}}/{{name}}/resolve/{{rev}}/{{path:.+}}"
            handler = self._resolve_handler(kind)
            routes.append(("GET", path, "resolve", handler))
            routes.append(("HEAD", path, "resolve", handler))
        for method, path, family, handler in routes:
            r.add_route(method, path, _tag(family, handler))
        return app

    @staticmethod
    def _route_of(request: web.Request) -> str | None:
        handler = request.match_info.handler
        return getattr(handler, "hub_route", None)

    def _auth_state(self, request: web.Request) -> str:
        header = request.headers.get("Authorization")
        if header is None:
            return "none"
        scheme, _, token = header.partition(" ")
        return "valid" if scheme.lower() == "bearer" and token.strip() in self._roles else "invalid"

    @web.middleware
    async def _mw_log(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        start = time.monotonic()
        status: int | None = None
        try:
            response = await handler(request)
            status = None if request.get(_RESET) else response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except ConnectionError:
            # The client went away (e.g. it timed out during a delay): nobody to answer.
            return web.Response(status=499)
        except Exception:
            status = 500
            raise
        finally:
            record = RequestRecord(
                method=request.method,
                path=request.path,
                route=self._route_of(request),
                status=status,
                start=start,
                end=time.monotonic(),
                files=request.get(_FILES, ()),
                auth=self._auth_state(request),
            )
            with self._lock:
                self._log.append(record)

    @web.middleware
    async def _mw_faults(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        route = self._route_of(request)
        method = request.method
        delay = self._take("delay", route, method)
        if delay is not None:
            await self._sleep(delay.seconds)
        status = self._take("status", route, method)
        if status is not None:
            headers = {}
            if status.retry_after is not None:
                headers["Retry-After"] = f"{status.retry_after:g}"
            return _error_response(
                _HubError(status.status, f"Injected fault: HTTP {status.status}", headers=headers)
            )
        reset = self._take("reset", route, method)
        if reset is not None and not reset.after:
            return self._drop(request)
        response = await handler(request)
        if reset is not None:
            return self._drop(request)
        return response

    @web.middleware
    async def _mw_errors(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except _HubError as exc:
            return _error_response(exc)

    def _drop(self, request: web.Request) -> web.StreamResponse:
        request[_RESET] = True
        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=499)

    async def _sleep(self, seconds: float) -> None:
        assert self._closing is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing.wait(), seconds)

    def _caller(self, request: web.Request) -> _Caller:
        header = request.headers.get("Authorization")
        if header is None:
            return _Caller(None)
        scheme, _, token = header.partition(" ")
        role = self._roles.get(token.strip()) if scheme.lower() == "bearer" else None
        if role is None:
            raise _HubError(401, "Invalid credentials in Authorization header")
        return _Caller(role)

    def _read_repo(self, request: web.Request, caller: _Caller, kind: str | None = None) -> _Repo:
        kind = kind or request.match_info["kind"][:-1]
        repo_id = f"{request.match_info['ns']}/{request.match_info['name']}"
        with self._lock:
            repo = self._repos.get((kind, repo_id))
        if repo is None or (repo.private and caller.role is None):
            # The Hub never says whether a repo it won't show you exists.
            status = 401 if caller.role is None else 404
            raise _HubError(status, "Repository not found", code="RepoNotFound")
        return repo

    def _write_repo(self, request: web.Request, caller: _Caller, kind: str | None = None) -> _Repo:
        if caller.role is None:
            raise _HubError(401, "Invalid username or password.")
        repo = self._read_repo(request, caller, kind)
        if caller.role != "write":
            raise _HubError(
                403, "You have read access but not the required permissions for this operation."
            )
        return repo

    def _base(self, request: web.Request) -> str:
        return self.url or f"{request.scheme}://{request.host}"

    def _repo_url(self, request: web.Request, repo: _Repo) -> str:
        prefix = "" if repo.kind == "model" else f"{repo.kind}s/"
        return f"{self._base(request)}/{prefix}{repo.repo_id}"

    # ---- HTTP: handlers ------------------------------------------------------------------------

    async def _h_create(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        body = await _json_body(request)
        if caller.role is None:
            raise _HubError(401, "Invalid username or password.")
        kind = body.get("type") or "model"
        if kind not in KINDS:
            raise _HubError(400, f"Invalid repo type {kind!r}")
        name = body.get("name")
        org = body.get("organization") or self.user
        if not isinstance(name, str) or not _REPO_NAME.fullmatch(name):
            raise _HubError(400, f"Invalid repo name {name!r}")
        if not isinstance(org, str) or not _REPO_NAME.fullmatch(org):
            raise _HubError(400, f"Invalid organization {org!r}")
        if caller.role != "write":
            msg = f"You don't have the rights to create a {kind} under this namespace"
            raise _HubError(403, msg)
        visibility = body.get("visibility")
        if visibility not in (None, "public", "private"):
            raise _HubError(400, f"Invalid visibility {visibility!r}")
        private = visibility == "private" or body.get("private") is True
        if kind == "space" and not body.get("sdk"):
            raise _HubError(400, "sdk is required for spaces")
        repo_id = f"{org}/{name}"
        with self._lock:
            exists = (kind, repo_id) in self._repos
            repo = self._ensure_repo(kind, repo_id, private)
        url = self._repo_url(request, repo)
        if exists:
            return web.json_response(
                {"error": f"You already created this {kind} repo", "url": url}, status=409
            )
        return web.json_response({"url": url, "name": repo_id, "id": repo_id})

    async def _h_validate_yaml(self, request: web.Request) -> web.StreamResponse:
        self._caller(request)
        body = await _json_body(request)
        if not isinstance(body.get("content"), str):
            raise _HubError(400, "content is required")
        return web.json_response({"errors": [], "warnings": []})

    async def _h_whoami(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        if caller.role is None:
            raise _HubError(401, "Invalid username or password.")
        return web.json_response(
            {
                "type": "user",
                "id": hashlib.sha1(self.user.encode(), usedforsecurity=False).hexdigest()[:24],
                "name": self.user,
                "fullname": self.user,
                "email": None,
                "emailVerified": False,
                "canPay": False,
                "isPro": False,
                "periodEnd": None,
                "avatarUrl": "",
                "orgs": [],
                "auth": {
                    "type": "access_token",
                    "accessToken": {
                        "displayName": "fake",
                        "role": caller.role,
                        "createdAt": "2026-01-01T00:00:00.000Z",
                    },
                },
            }
        )

    async def _h_preupload(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        body = await _json_body(request)
        files = body.get("files")
        if isinstance(files, list):
            request[_FILES] = tuple(str(f.get("path")) for f in files if isinstance(f, dict))
        repo = self._write_repo(request, caller)
        if not isinstance(files, list) or not files:
            raise _HubError(400, "files must be a non-empty list")
        rev = request.match_info["rev"]
        out = []
        with self._lock:
            if rev not in repo.refs:
                raise _HubError(404, f"Invalid rev id: {rev}", code="RevisionNotFound")
            current = repo.commits[repo.refs[rev]].files
            for f in files:
                if not isinstance(f, dict):
                    raise _HubError(400, "each file must be an object")
                path = _check_path(f.get("path"))
                size, sample = f.get("size"), f.get("sample")
                if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                    raise _HubError(400, f"Invalid size for {path}")
                if not isinstance(sample, str):
                    raise _HubError(400, f"Missing sample for {path}")
                try:
                    base64.b64decode(sample, validate=True)
                except binascii.Error:
                    raise _HubError(400, f"sample of {path} is not base64") from None
                # As the Hub decides: LFS by the repo's .gitattributes, size or a binary
                # sample. ``oid`` lets the client skip a file whose content is already there:
                # the sha256 of an LFS file, the git sha1 of a regular one.
                lfs = self.lfs_uploads and size > 0 and self._wants_lfs(current, path, size, sample)
                old = current.get(path)
                if old is None:
                    oid = None
                elif lfs:
                    oid = hashlib.sha256(old).hexdigest()
                else:
                    oid = git_blob_sha1(old)
                out.append(
                    {
                        "path": path,
                        "uploadMode": "lfs" if lfs else "regular",
                        "shouldIgnore": False,
                        "oid": oid,
                    }
                )
        return web.json_response({"files": out, "commitOid": repo.refs[rev]})

    async def _h_commit(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        if request.content_type != "application/x-ndjson":
            raise _HubError(400, "Content-Type must be application/x-ndjson")
        raw = await request.read()
        if request.query.get("create_pr"):
            raise _HubError(400, "this fake does not support create_pr")
        try:
            lines = [json.loads(line) for line in raw.split(b"\n") if line.strip()]
        except ValueError:
            raise _HubError(400, "the commit body is not valid NDJSON") from None
        if not all(isinstance(item, dict) for item in lines):
            raise _HubError(400, "every NDJSON line must be an object")
        if not lines or lines[0].get("key") != "header":
            raise _HubError(400, "the first NDJSON line must be the commit header")
        header = lines[0].get("value") or {}
        summary = header.get("summary")
        if not isinstance(summary, str) or not summary.strip():
            raise _HubError(400, "the commit summary must not be empty")
        added: dict[str, bytes] = {}
        lfs_files: dict[str, dict[str, Any]] = {}
        deleted: list[str] = []
        for item in lines[1:]:
            key, value = item.get("key"), item.get("value") or {}
            if key == "file":
                path = _check_path(value.get("path"))
                if value.get("encoding") != "base64" or not isinstance(value.get("content"), str):
                    raise _HubError(400, f"file {path}: content must be base64 (encoding: base64)")
                try:
                    added[path] = base64.b64decode(value["content"], validate=True)
                except binascii.Error:
                    raise _HubError(400, f"file {path}: content is not valid base64") from None
            elif key == "lfsFile":
                path = _check_path(value.get("path"))
                lfs_files[path] = value
            elif key == "deletedFile":
                deleted.append(_check_path(value.get("path")))
            elif key == "deletedFolder":
                deleted.append(_check_path(str(value.get("path", "")).rstrip("/")) + "/")
            else:
                raise _HubError(400, f"unknown commit operation {key!r}")
        request[_FILES] = (*added, *lfs_files, *deleted)
        repo = self._write_repo(request, caller)
        rev = request.match_info["rev"]
        with self._lock:
            stored = self._lfs.get((repo.kind, repo.repo_id), {})
            for path, value in lfs_files.items():
                data = stored.get(str(value.get("oid")))
                if value.get("algo") != "sha256" or data is None or len(data) != value.get("size"):
                    raise _HubError(
                        422,
                        f"Your push was rejected because an LFS pointer pointed to a file that "
                        f"does not exist ({path}, oid {value.get('oid')})",
                    )
                added[path] = data
            if rev not in repo.refs:
                raise _HubError(404, f"Invalid rev id: {rev}", code="RevisionNotFound")
            head = repo.commits[repo.refs[rev]]
            parent = header.get("parentCommit")
            if parent is not None and parent != head.sha:
                raise _HubError(412, "A commit has happened since. Please refresh and try again.")
            for d in deleted:
                if not d.endswith("/") and d not in head.files:
                    raise _HubError(
                        404, f"A file with this name doesn't exist: {d}", code="EntryNotFound"
                    )
            self._check_commit_quota(repo)
            lost = self._take_lose(added)
            commit = self._commit(repo, rev, summary, added, deleted, lost=lost)
        return web.json_response(
            {
                "success": True,
                "commitOid": commit.sha,
                "commitUrl": f"{self._repo_url(request, repo)}/commit/{commit.sha}",
                "hookOutput": "",
            }
        )

    # ---- Git LFS uploads (HF_HUB_DISABLE_XET=1: the batch API, then PUTs to "S3") ----------

    def _wants_lfs(self, files: Mapping[str, bytes], path: str, size: int, sample: str) -> bool:
        if size > self.lfs_threshold or b"\x00" in base64.b64decode(sample):
            return True
        return self.is_lfs({**files, path: b""}, path)

    def _lfs_batch_handler(self, kind: str) -> _Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._h_lfs_batch(request, kind)

        return handler

    async def _h_lfs_batch(self, request: web.Request, kind: str) -> web.StreamResponse:
        caller = self._caller(request)
        body = await _json_body(request)
        repo = self._write_repo(request, caller, kind)
        if body.get("operation") != "upload" or body.get("hash_algo", "sha256") != "sha256":
            raise _HubError(400, "only sha256 uploads are supported")
        objects = body.get("objects")
        if not isinstance(objects, list) or not objects:
            raise _HubError(400, "objects must be a non-empty list")
        transfers = body.get("transfers") or ["basic"]
        out = []
        chosen = "basic"
        with self._lock:
            self.lfs_transfers.append(tuple(map(str, transfers)))
            stored = self._lfs.setdefault((repo.kind, repo.repo_id), {})
            for obj in objects:
                if not isinstance(obj, dict):
                    raise _HubError(422, "each object must be {oid, size}")
                oid, size = obj.get("oid"), obj.get("size")
                if not isinstance(oid, str) or not re.fullmatch(r"[0-9a-f]{64}", oid):
                    raise _HubError(422, f"invalid oid {oid!r}")
                if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                    raise _HubError(422, f"invalid size for {oid}")
                if oid in stored and len(stored[oid]) == size:
                    out.append({"oid": oid, "size": size})  # already there: no actions
                    continue
                token = uuid.uuid4().hex
                self._lfs_pending[token] = _LfsUpload(repo.kind, repo.repo_id, oid, size)
                base = self._base(request)
                verify = {
                    "href": f"{base}/__lfs/verify/{repo.kind}/{repo.repo_id}",
                    "header": {},
                }
                if size > self.lfs_chunk_size and "multipart" in transfers:
                    count = -(-size // self.lfs_chunk_size)
                    header: dict[str, str] = {"chunk_size": str(self.lfs_chunk_size)}
                    header.update(
                        {f"{n:05d}": f"{base}/__s3/{token}/{n}" for n in range(1, count + 1)}
                    )
                    upload = {"href": f"{base}/__lfs/complete/{token}", "header": header}
                    chosen = "multipart"
                else:
                    upload = {"href": f"{base}/__s3/{token}"}
                out.append(
                    {"oid": oid, "size": size, "actions": {"upload": upload, "verify": verify}}
                )
        return web.json_response(
            {"transfer": chosen, "objects": out},
            content_type="application/vnd.git-lfs+json",
        )

    async def _h_lfs_put(self, request: web.Request) -> web.StreamResponse:
        # The presigned "S3" URL: no Authorization, the token in the URL is the credential.
        with self._lock:
            pending = self._lfs_pending.get(request.match_info["token"])
        if pending is None:
            raise _HubError(403, "Request has expired or the signature does not match")
        request[_FILES] = (pending.oid,)
        digest = hashlib.sha256()
        chunks = []
        async for chunk in request.content.iter_chunked(1 << 20):
            chunks.append(chunk)
            digest.update(chunk)
        data = b"".join(chunks)
        part = request.match_info.get("part")
        if part is not None:
            with self._lock:
                pending.parts[int(part)] = data
            return web.Response(headers={"ETag": f'"{hashlib.md5(data).hexdigest()}"'})
        if len(data) != pending.size or digest.hexdigest() != pending.oid:
            raise _HubError(400, f"the uploaded object does not match {pending.oid}")
        self._store_lfs(pending, data)
        return web.Response(headers={"ETag": f'"{hashlib.md5(data).hexdigest()}"'})

    async def _h_lfs_complete(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        with self._lock:
            pending = self._lfs_pending.get(request.match_info["token"])
        if pending is None or body.get("oid") != pending.oid:
            raise _HubError(404, "no such multipart upload")
        request[_FILES] = (pending.oid,)
        parts = body.get("parts")
        if not isinstance(parts, list) or [p.get("partNumber") for p in parts] != list(
            range(1, len(pending.parts) + 1)
        ):
            raise _HubError(400, "parts must list every uploaded part in order")
        for p in parts:
            data = pending.parts[p["partNumber"]]
            if p.get("etag") != f'"{hashlib.md5(data).hexdigest()}"':
                raise _HubError(400, f"part {p['partNumber']}: etag does not match")
        data = b"".join(pending.parts[n] for n in sorted(pending.parts))
        if len(data) != pending.size or hashlib.sha256(data).hexdigest() != pending.oid:
            raise _HubError(400, f"the uploaded object does not match {pending.oid}")
        self._store_lfs(pending, data)
        return web.json_response({"oid": pending.oid})

    def _store_lfs(self, pending: _LfsUpload, data: bytes) -> None:
        with self._lock:
            self._lfs.setdefault((pending.kind, pending.repo_id), {})[pending.oid] = data
            for token, other in list(self._lfs_pending.items()):
                if other is pending:
                    del self._lfs_pending[token]

    async def _h_lfs_verify(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        body = await _json_body(request)
        kind = request.match_info["kind"]
        if kind not in KINDS:
            raise _HubError(404, "Not Found")
        repo = self._write_repo(request, caller, kind)
        oid, size = body.get("oid"), body.get("size")
        with self._lock:
            data = self._lfs.get((repo.kind, repo.repo_id), {}).get(str(oid))
        if data is None or len(data) != size:
            raise _HubError(404, f"Object {oid} not found")
        return web.json_response({"oid": oid, "size": size})

    async def _h_branch(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        body = await _json_body(request)
        repo = self._write_repo(request, caller)
        branch = request.match_info["branch"]
        if not re.fullmatch(r"[A-Za-z0-9._-]+", branch):
            raise _HubError(400, f"Invalid reference for a branch: {branch}")
        with self._lock:
            if branch in repo.refs:
                raise _HubError(409, f"Reference already exists: refs/heads/{branch}")
            start = body.get("startingPoint") or "main"
            repo.refs[branch] = self._rev_sha(repo, str(start))
        return web.json_response({})

    async def _h_paths_info(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        if request.content_type != "application/x-www-form-urlencoded":
            raise _HubError(400, "paths-info takes a form-encoded body (paths=...&expand=...)")
        form = await request.post()
        paths = [str(p) for p in form.getall("paths", [])]
        expand = str(form.get("expand", "false")).lower() == "true"
        repo = self._read_repo(request, caller)
        out = []
        with self._lock:
            head = self._rev_sha(repo, request.match_info["rev"])
            files = repo.commits[head].files
            dirs = self._dirs(files)
            for path in dict.fromkeys(p.strip("/") for p in paths):
                if path in files:
                    entry = self._describe(files, path)
                elif path in dirs:
                    entry = self._describe_dir(files, path)
                else:
                    continue  # the Hub silently leaves out paths that do not exist
                if expand:
                    entry["lastCommit"] = self._last_commit(repo, head, path)
                out.append(entry)
        return web.json_response(out)

    async def _h_tree(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        repo = self._read_repo(request, caller)
        base = request.match_info.get("path", "").strip("/")
        recursive = request.query.get("recursive", "false").lower() == "true"
        expand = request.query.get("expand", "false").lower() == "true"
        try:
            cursor = int(request.query.get("cursor", "0"))
        except ValueError:
            raise _HubError(400, "invalid cursor") from None
        with self._lock:
            rev = request.match_info["rev"]
            head = self._rev_sha(repo, rev)
            files = repo.commits[head].files
            dirs = self._dirs(files)
            if base and base not in dirs:
                raise _HubError(
                    404,
                    f"Entry not found: {base}",
                    code="EntryNotFound",
                    headers={"X-Repo-Commit": head},
                )
            prefix = f"{base}/" if base else ""

            def wanted(p: str) -> bool:
                return p.startswith(prefix) and (recursive or "/" not in p[len(prefix) :])

            entries = [self._describe_dir(files, d) for d in sorted(dirs) if wanted(d)]
            entries += [self._describe(files, p) for p in sorted(files) if wanted(p)]
            page = entries[cursor : cursor + self.tree_page_size]
            if expand:
                for e in page:
                    e["lastCommit"] = self._last_commit(repo, head, e["path"])
        headers = {}
        if cursor + self.tree_page_size < len(entries):
            query = {k: v for k, v in request.query.items() if k != "cursor"}
            query["cursor"] = str(cursor + self.tree_page_size)
            next_url = f"{self._base(request)}{request.path}?{urlencode(query)}"
            headers["Link"] = f'<{next_url}>; rel="next"'
        return web.json_response(page, headers=headers)

    async def _h_repo_info(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        repo = self._read_repo(request, caller)
        blobs = request.query.get("blobs", "false").lower() == "true"
        with self._lock:
            head = self._rev_sha(repo, request.match_info.get("rev", "main"))
            commit = repo.commits[head]
            siblings = []
            for path in sorted(commit.files):
                sib: dict[str, Any] = {"rfilename": path}
                if blobs:
                    d = self._describe(commit.files, path)
                    sib.update(size=d["size"], blobId=d["oid"])
                    if "lfs" in d:
                        lfs = d["lfs"]
                        sib["lfs"] = {
                            "sha256": lfs["oid"],
                            "size": lfs["size"],
                            "pointerSize": lfs["pointerSize"],
                        }
                siblings.append(sib)
        return web.json_response(
            {
                "_id": hashlib.sha1(repo.repo_id.encode(), usedforsecurity=False).hexdigest()[:24],
                "id": repo.repo_id,
                "author": repo.repo_id.split("/")[0],
                "sha": head,
                "private": repo.private,
                "gated": False,
                "disabled": False,
                "createdAt": repo.created_at,
                "lastModified": commit.date,
                "tags": [],
                "siblings": siblings,
            }
        )

    def _resolve_handler(self, kind: str) -> _Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._h_resolve(request, kind)

        return handler

    async def _h_resolve(self, request: web.Request, kind: str) -> web.StreamResponse:
        caller = self._caller(request)
        repo = self._read_repo(request, caller, kind)
        path = request.match_info["path"]
        with self._lock:
            head = self._rev_sha(repo, request.match_info["rev"])
            files = repo.commits[head].files
            if path not in files:
                raise _HubError(
                    404, "Entry not found", code="EntryNotFound", headers={"X-Repo-Commit": head}
                )
            data = files[path]
            desc = self._describe(files, path)
        headers = {
            "X-Repo-Commit": head,
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if "lfs" in desc:
            etag = f'"{desc["lfs"]["oid"]}"'
            headers.update({"ETag": etag, "X-Linked-Etag": etag, "X-Linked-Size": str(len(data))})
        else:
            headers["ETag"] = f'"{desc["oid"]}"'
        status = 200
        body = data
        rng = request.headers.get("Range")
        if rng:
            m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", rng)
            if m is None or (not m.group(1) and not m.group(2)):
                raise _HubError(416, f"Invalid range {rng!r}")
            if m.group(1):
                first = int(m.group(1))
                last = int(m.group(2)) if m.group(2) else len(data) - 1
            else:
                first, last = max(len(data) - int(m.group(2)), 0), len(data) - 1
            last = min(last, len(data) - 1)
            if first > last:
                raise _HubError(
                    416, "Range not satisfiable", headers={"Content-Range": f"bytes */{len(data)}"}
                )
            body = data[first : last + 1]
            status = 206
            headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
        if request.method == "HEAD":
            headers["Content-Length"] = str(len(body))
            return web.Response(status=status, headers=headers)
        cut = self._take("truncate", "resolve", "GET")
        if cut is not None and request.transport is not None:
            response = web.StreamResponse(status=status, headers=headers)
            response.content_length = len(body)
            await response.prepare(request)
            await response.write(body[: int(len(body) * cut.fraction)])
            request[_RESET] = True
            request.transport.abort()
            return response
        return web.Response(status=status, body=body, headers=headers)


def _tag(family: str, handler: _Handler) -> _Handler:
    async def tagged(request: web.Request) -> web.StreamResponse:
        return await handler(request)

    tagged.hub_route = family  # type: ignore[attr-defined]
    return tagged


async def _json_body(request: web.Request) -> dict[str, Any]:
    if request.content_type not in ("application/json", "application/vnd.git-lfs+json"):
        raise _HubError(400, "Content-Type must be application/json")
    try:
        body = json.loads(await request.read())
    except ValueError:
        raise _HubError(400, "body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _HubError(400, "body must be a JSON object")
    return body


def _error_response(exc: _HubError) -> web.Response:
    headers = {"X-Error-Message": exc.message, **exc.headers}
    if exc.code:
        headers["X-Error-Code"] = exc.code
    return web.json_response({"error": exc.message}, status=exc.status, headers=headers)


# --------------------------------------------------------------------------------------------
# Serving in a background thread


class _ServerThread:
    def __init__(self, hub: FakeHub) -> None:
        self.hub = hub
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="fake-hub", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError("the fake Hub did not start") from self._error
        if not self._ready.is_set():
            raise RuntimeError("the fake Hub did not start within 30 s")

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(self.hub.make_app(), access_log=None, shutdown_timeout=2.0)
        try:
            self.hub._closing = asyncio.Event()
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            port = runner.addresses[0][1]
            self.hub.url = f"http://127.0.0.1:{port}"
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            loop.run_until_complete(runner.cleanup())
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def stop(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def _stop() -> None:
            assert self.hub._closing is not None
            self.hub._closing.set()
            loop.stop()

        loop.call_soon_threadsafe(_stop)
        self._thread.join(30)


@contextlib.contextmanager
def run_fake_hub(
    *,
    tokens: Iterable[str] = ("hf_good",),
    read_tokens: Iterable[str] = (),
    user: str = "fake-user",
    lfs_threshold: int = DEFAULT_LFS_THRESHOLD,
    tree_page_size: int = DEFAULT_TREE_PAGE_SIZE,
    lfs_uploads: bool = True,
    lfs_chunk_size: int = DEFAULT_LFS_CHUNK_SIZE,
    commit_limit: int | None = None,
    commit_window_s: float = COMMIT_WINDOW_S,
) -> Iterator[FakeHub]:
    """Serve a :class:`FakeHub` on ``127.0.0.1`` (a free port) for the ``with`` block.

    ``tokens`` may write (and read everything); ``read_tokens`` may only read.
    """
    hub = FakeHub(
        tokens=tokens,
        read_tokens=read_tokens,
        user=user,
        lfs_threshold=lfs_threshold,
        tree_page_size=tree_page_size,
        lfs_uploads=lfs_uploads,
        lfs_chunk_size=lfs_chunk_size,
        commit_limit=commit_limit,
        commit_window_s=commit_window_s,
    )
    server = _ServerThread(hub)
    server.start()
    try:
        yield hub
    finally:
        server.stop()


def overlaps(records: Iterable[RequestRecord]) -> list[tuple[RequestRecord, RequestRecord]]:
    """Pairs of requests whose [start, end] spans overlap (e.g. two commits of one path)."""
    ordered = sorted(records, key=lambda r: r.start)
    out = []
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b.start >= a.end:
                break
            out.append((a, b))
    return out


def resolve_url(hub_url: str, kind: str, repo_id: str, path: str, revision: str = "main") -> str:
    """The ``resolve`` URL of a file, as ``hf_hub_url`` builds it."""
    prefix = "" if kind == "model" else f"{kind}s/"
    return f"{hub_url}/{prefix}{repo_id}/resolve/{quote(revision, safe='')}/{quote(path)}"
