"""The one home of the Hugging Face Hub: client set-up, HTTP timeouts, error classification and
redaction of ``HF_TOKEN``. The rest of the agent asks this module, never ``huggingface_hub``
directly, for these concerns.

Start-up: the daemon and the CLI call :func:`configure` once, before any Hub call (preflight,
staging, sync). It refuses a ``huggingface_hub`` older than :data:`MIN_HUB_VERSION` and gives
the library's shared HTTP client timeouts: by default it has none (2.x) and a hung connection
would hold a thread forever.

Clients: :func:`api` builds the :class:`~huggingface_hub.HfApi` every caller uses (the job's
endpoint, ``HF_TOKEN`` from the environment only, never a token file lying on the box).

Errors: :func:`classify` turns whatever a Hub call raised into a :class:`HubFailure` - one
:data:`HubErrorKind`, one rule for "retryable" (:data:`RETRYABLE_STATUS`, :func:`is_retryable`),
the server's ``Retry-After``, and a one-line detail with the token redacted (:func:`redact`).
Callers word the advice (a read token for staging, a write token for sync) from the kind.

``huggingface_hub`` 1.x builds on ``httpx``, 2.x on ``httpx2`` (the same API under another name):
:data:`hub_http` is the one the installed version uses, because its exceptions are what a failed
call raises. Only public ``huggingface_hub`` names are imported.

Memory: ``huggingface_hub`` and its HTTP client (some 25 MiB) are imported on first use, not
with this module: a supervising agent whose job never talks to the Hub (a ``file://`` sink, a
local dataset) never loads them. Importing this module checks the installed version from its
package metadata; :func:`configure` records the timeouts and installs them when the library is
loaded (at once if it already is). Every Hub call goes through :func:`api` (or the library,
once something here loaded it), so none runs without the timeouts.

Transfers: Git LFS, not Xet, unless ``HF_HUB_DISABLE_XET`` is set (to anything; ``0`` turns
Xet on). The Hub takes LFS uploads into every repo, Xet-backed ones included, and serves their
files to LFS clients through its LFS bridge. LFS streams each checkpoint from disk in one PUT
(or in the parts the Hub asks for) with the sha256 the agent already has, while ``hf_xet``
would load a Rust runtime and its chunk buffers into the supervising daemon (8.5 MiB at import
alone) on a path no fake can check. Only this process is affected: the trainer's environment
is left alone.
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

from agent import __version__
from agent.config.model import Env
from agent.util import backoff
from agent.util import redact as redaction
from agent.util.text import one_line

log = logging.getLogger(__name__)

#: The oldest ``huggingface_hub`` the agent works with: ``tests/test_sink_hf.py`` and
#: ``tests/test_hub.py`` pass on it (1.3.2 builds a commit's ``RepoUrl`` with the client's
#: endpoint; with 1.3.1 every commit to another endpoint than ``HF_ENDPOINT`` fails after upload).
MIN_HUB_VERSION = "1.3.2"

#: Commits the Hub accepts per repo per hour, the figure its users quote (past it: HTTP 429
#: "You have exceeded our hourly quotas for action: commit", with ``Retry-After``). The sync
#: groups a milestone's files into one commit and spaces milestones out near it
#: (:mod:`agent.sync.commits`).
COMMITS_PER_HOUR = 128


class HubVersionError(ImportError):
    """The installed ``huggingface_hub`` is older than :data:`MIN_HUB_VERSION`.

    An ImportError: it is raised when this module is imported (the names below may not exist in
    an old release), so a caller catches it where it imports the agent's Hub code.
    """

    def __init__(self, installed: str) -> None:
        super().__init__(
            f"huggingface_hub {installed} is too old: libreyolo-agent needs "
            f"huggingface_hub>={MIN_HUB_VERSION}; "
            f"fix: pip install 'huggingface_hub>={MIN_HUB_VERSION}'"
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


def installed_version() -> str:
    """The version of the ``huggingface_hub`` this process imports (or would): the imported
    module's own, else its package metadata, without importing it; a package without metadata
    is imported to ask (ImportError when there is none)."""
    loaded = sys.modules.get("huggingface_hub")
    if loaded is not None:
        return str(loaded.__version__)
    import importlib.metadata

    try:
        return importlib.metadata.version("huggingface_hub")
    except importlib.metadata.PackageNotFoundError:
        return str(importlib.import_module("huggingface_hub").__version__)


def check_hub_version(installed: str | None = None) -> None:
    """Raise :class:`HubVersionError` unless ``installed`` (default: the installed
    ``huggingface_hub``, :func:`installed_version`) is recent enough. Importing this module
    already does it."""
    version = installed_version() if installed is None else installed
    if not hub_version_supported(version):
        raise HubVersionError(version)


def http_module_name(hub_version: str) -> str:
    """The HTTP client ``huggingface_hub`` ``hub_version`` builds on: ``httpx`` before 2.0."""
    release = _release(hub_version)
    return "httpx" if release is not None and release[0] < 2 else "httpx2"


# At import, before anything loads the library: an old huggingface_hub lacks names used below,
# and must be refused with the fix rather than with an ImportError that names a missing function.
check_hub_version()

if TYPE_CHECKING:
    import httpx2 as hub_http
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    #: What a failed Hub call raises (see :func:`_load`); a module attribute, loaded on use.
    CALL_ERRORS: tuple[type[Exception], ...]

#: The library's names this module uses, once :func:`_load` imported them; None before.
_lib: Any = None


def _load() -> Any:
    """Import ``huggingface_hub`` (once) and the names used here; install the timeouts that
    :func:`configure` recorded. Every use of the library in this module goes through it."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        import huggingface_hub

        check_hub_version(huggingface_hub.__version__)
        if not xet_enabled():
            # The submodule itself: the package's lazy attributes do not include it until
            # something imports it, and a switch set on nothing would leave Xet on.
            constants: Any = importlib.import_module("huggingface_hub.constants")
            if hasattr(constants, "HF_HUB_DISABLE_XET"):
                constants.HF_HUB_DISABLE_XET = True  # read at each transfer, never at import
        from huggingface_hub import HfApi, close_session, get_session, set_client_factory
        from huggingface_hub.errors import (
            EntryNotFoundError,
            FileMetadataError,
            GatedRepoError,
            HfHubHTTPError,
            HFValidationError,
            LocalEntryNotFoundError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        # Public (in huggingface_hub.utils.__all__, built at run time, which mypy cannot read).
        from huggingface_hub.utils import (  # type: ignore[attr-defined]
            parse_ratelimit_headers,
        )

        http: ModuleType = importlib.import_module(http_module_name(huggingface_hub.__version__))
        lib = SimpleNamespace(
            version=huggingface_hub.__version__,
            http=http,
            HfApi=HfApi,
            close_session=close_session,
            get_session=get_session,
            set_client_factory=set_client_factory,
            EntryNotFoundError=EntryNotFoundError,
            FileMetadataError=FileMetadataError,
            GatedRepoError=GatedRepoError,
            HfHubHTTPError=HfHubHTTPError,
            HFValidationError=HFValidationError,
            LocalEntryNotFoundError=LocalEntryNotFoundError,
            OfflineModeIsEnabled=OfflineModeIsEnabled,
            RepositoryNotFoundError=RepositoryNotFoundError,
            RevisionNotFoundError=RevisionNotFoundError,
            parse_ratelimit_headers=parse_ratelimit_headers,
            # HTTP errors (HfHubHTTPError is an OSError and an HTTPError of the client), network
            # errors, local I/O, bad answers, and RuntimeError, which wraps LFS/Xet transfer
            # errors (:func:`classify` looks at the cause).
            call_errors=(http.HTTPError, OSError, ValueError, RuntimeError),
        )
        global _installed
        if _wanted is not None and _installed != _wanted:
            _install_client_factory(lib, *_wanted)
            _installed = _wanted
        _lib = lib
        return lib


def load() -> None:
    """Import ``huggingface_hub`` now (ImportError when the install is broken): ``agent run``
    checks it before a job that needs the Hub starts, rather than crash in the middle."""
    _load()


def __getattr__(name: str) -> Any:
    """``hub_http`` (the installed library's HTTP client module) and ``CALL_ERRORS``, which
    need the library: loaded on first use."""
    if name == "hub_http":
        return _load().http
    if name == "CALL_ERRORS":
        return _load().call_errors
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------
# Client set-up


def xet_enabled() -> bool:
    """Whether the agent's Hub transfers may use Xet: only when ``HF_HUB_DISABLE_XET`` is set and
    says no (``0``, ``false``...). Unset, the agent uses Git LFS (see the module's docstring)."""
    raw = os.environ.get("HF_HUB_DISABLE_XET")
    return raw is not None and raw.strip().upper() not in {"1", "ON", "YES", "TRUE"}


#: Seconds to open a connection to the Hub.
HTTP_CONNECT_TIMEOUT_S = 15.0
#: Seconds the client waits for the next bytes of an answer (or to send the next ones).
HTTP_TIMEOUT_S = 120.0

_lock = threading.RLock()
#: ``(connect, read)`` seconds of the installed client factory; None until installed.
_installed: tuple[float, float] | None = None
#: ``(connect, read)`` seconds :func:`configure` asked for; installed when the library loads.
_wanted: tuple[float, float] | None = None


def configure(
    env: Env | None = None,
    *,
    timeout_s: float = HTTP_TIMEOUT_S,
    connect_timeout_s: float = HTTP_CONNECT_TIMEOUT_S,
) -> None:
    """Set the Hub client up for this process; call it once at start-up, before any Hub call.

    Refuses an old ``huggingface_hub`` (:class:`HubVersionError`) and gives the library's shared
    HTTP client ``connect_timeout_s`` to connect and ``timeout_s`` between bytes (2.x has no
    timeout at all by default, 1.x 10 s). Calls that pass their own timeout (downloads do) keep
    theirs. The library is not imported for this: the timeouts are installed when it is loaded
    (the first :func:`api`), or at once when it already is.
    Idempotent: a second call with the same timeouts changes nothing; other timeouts replace the
    client (the shared one is closed, so do it before transfers start). ``env`` only adds the
    endpoint, and whether ``HF_TOKEN`` is set, to the one log line this writes.
    """
    global _wanted, _installed
    version = installed_version()
    check_hub_version(version)
    wanted = (connect_timeout_s, timeout_s)
    with _lock:
        changed = _wanted != wanted
        _wanted = wanted
        # Loaded already (by this module or anyone): install now; else the first use does.
        if _lib is not None or "huggingface_hub" in sys.modules:
            lib = _load()
            if _installed != wanted:
                _install_client_factory(lib, connect_timeout_s, timeout_s)
                _installed = wanted
    if not changed:
        return
    where = ""
    if env is not None:
        token = "set" if env.hf_token else "not set"
        where = f", endpoint {env.hf_endpoint}, HF_TOKEN {token}"
    log.info(
        "hub: huggingface_hub %s over %s, %s, timeouts %gs to connect, %gs between bytes%s",
        version,
        http_module_name(version),
        "Xet transfers" if xet_enabled() else "Git LFS transfers",
        connect_timeout_s,
        timeout_s,
        where,
    )


def _install_client_factory(lib: Any, connect_timeout_s: float, timeout_s: float) -> None:
    # The library's default factory is private (huggingface_hub.utils._http), but the client it
    # builds is not: build one through the public get_session() and keep its event hooks
    # (HF_HUB_OFFLINE, request ids), so every later client is the library's plus timeouts.
    http = lib.http
    lib.close_session()
    template = lib.get_session()
    hooks = {name: list(fns) for name, fns in template.event_hooks.items()}
    follow_redirects = template.follow_redirects
    timeout = http.Timeout(timeout_s, connect=connect_timeout_s)

    def client_factory() -> Any:
        return http.Client(event_hooks=hooks, follow_redirects=follow_redirects, timeout=timeout)

    lib.set_client_factory(client_factory)  # closes the template: the next call builds ours


def api(env: Env) -> HfApi:
    """The client every Hub call of the agent goes through: ``env``'s endpoint and token.

    ``token=False`` when ``HF_TOKEN`` is unset: secrets come from the environment only, never
    from a token file that happens to lie on the box (``None`` would read one).
    """
    hf_api: type[HfApi] = _load().HfApi
    return hf_api(
        endpoint=env.hf_endpoint,
        token=env.hf_token or False,
        library_name="libreyolo-agent",
        library_version=__version__,
    )


# --------------------------------------------------------------------------------------------
# Errors

#: What a failed Hub call is, whatever raised it. Callers word their advice from it.
HubErrorKind = Literal[
    #: HTTP 401: no token where one is needed, or the Hub refused the token.
    "unauthorized",
    #: HTTP 403: the token may not do this (a read token writing, no access to the namespace).
    "forbidden",
    #: A gated repo that the token's account was not granted.
    "gated",
    #: The repo does not exist, or is private and the token cannot see it (404, or 401 on a
    #: repo URL: the Hub does not tell the two apart).
    "missing_repo",
    #: The branch, tag or commit does not exist in the repo.
    "missing_revision",
    #: The file does not exist at that revision.
    "missing_file",
    #: HTTP 429.
    "rate_limited",
    #: Another status in :data:`RETRYABLE_STATUS`, or a 5xx: trouble on the Hub's side; or any
    #: error of an LFS upload to the storage's presigned URL (a fresh URL is asked for next time).
    "transient",
    #: Any other HTTP error (400, 413, 501...): the Hub will answer the same again.
    "rejected",
    #: No answer: connection refused or reset, DNS, TLS, timeouts, a dropped connection.
    "unreachable",
    #: ``HF_HUB_OFFLINE`` is set: the client refuses to make requests.
    "offline",
    #: Something answered, but not like a Hub (no commit id or ETag): a wrong HF_ENDPOINT or a
    #: proxy's page.
    "not_a_hub",
    #: A request the client will not send as is: a malformed repo id or file name, an unusable
    #: URL, a header it refuses (an HF_TOKEN holding a newline).
    "invalid",
    #: This machine failed (disk full, permissions) - an OSError that is not the network.
    "local",
    #: Anything else (an answer the client could not parse, an LFS/Xet transfer error with no
    #: HTTP cause).
    "error",
]

# One rule for "retryable" in the whole agent: the same request, sent again later unchanged,
# may succeed without anyone acting. Callers bound the retries (staging: a few attempts, then the
# job fails; sync: backoff, and a slow retry for the rest, since a person may fix a token).
# - 408, 429 and 5xx: huggingface_hub's own http_backoff retries 408/429/500/502/503/504
#   (utils/_http.py, _DEFAULT_RETRY_ON_STATUS_CODES in 2.x). Other 5xx are server trouble too,
#   except 501/505 (the server will never do it) and 511 (a captive portal: a person must log in).
# - 409, 412: the Hub's answers to a commit racing another commit on the same branch ("Another
#   commit operation is in progress for this repository. Please try again later."; "A commit has
#   happened since. Please refresh and try again."): the next attempt is no longer racing. Our
#   create_repo/create_branch pass exist_ok=True, so a 409 there is never an error at all.
# - 423 (locked) and 425 (too early) say "later" by definition.
# - Network failures the client itself retries (timeouts, connect/read/write errors, a server
#   that drops the connection mid-answer), proxy errors, and the OS's ConnectionError and
#   TimeoutError. An unusable URL or header (UnsupportedProtocol, LocalProtocolError) is not.
# - Errors nothing above explains (kind "error"), since the library raises a typed error for
#   everything a person must fix (token, access, names, offline mode).
# Never retryable: 401, 403, 404, gated, missing revision/file, other 4xx, offline mode, an
# endpoint that is not a Hub, invalid names, and a full or read-only disk.
#: HTTP statuses below 500 that retrying can fix (and every 5xx except :data:`FINAL_5XX`).
RETRYABLE_STATUS = frozenset({408, 409, 412, 423, 425, 429})
#: 5xx statuses that retrying cannot fix.
FINAL_5XX = frozenset({501, 505, 511})
#: OSError numbers of this machine that only a person can fix.
_LOCAL_FINAL_ERRNO = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS})

#: What stands in for ``HF_TOKEN`` in every message, log line and report.
REDACTED = "<HF_TOKEN>"


def is_retryable(status: int) -> bool:
    """Whether an HTTP ``status`` from the Hub is worth the same request again, later."""
    if status >= 500:
        return status not in FINAL_5XX
    return status in RETRYABLE_STATUS


@dataclass(frozen=True)
class HubFailure:
    """What a failed Hub call was: see :func:`classify`."""

    kind: HubErrorKind
    #: Whether the same call, later, may succeed without anyone acting.
    retryable: bool
    #: One line, the token redacted: ``HTTP 503 (server message)``, ``ConnectError: ...``.
    detail: str
    #: The HTTP status, when the Hub answered.
    status: int | None = None
    #: The Hub's own word on when to come back (``Retry-After``, or the rate limit's reset), s.
    retry_after_s: float | None = None
    #: The error the classification rests on (the cause behind a wrapper), for errno and the like.
    cause: BaseException | None = None


def classify(exc: BaseException, *, token: str | None) -> HubFailure:
    """Classify what a Hub call (``huggingface_hub``, or a request on its session) raised.

    Wrappers are looked through: ``LocalEntryNotFoundError`` (a download that could not ask the
    Hub) and ``RuntimeError`` (LFS/Xet transfers) are classified by their ``__cause__``.
    ``token`` is redacted from the detail.
    """
    lib = _load()
    root = _root_cause(exc)
    if isinstance(root, lib.HfHubHTTPError):
        return _http_failure(root, token)
    if isinstance(root, lib.OfflineModeIsEnabled):  # a ConnectionError: before the network's
        return _failure("offline", False, root, token)
    if isinstance(root, lib.http.TransportError | ConnectionError | TimeoutError):
        if isinstance(root, lib.http.UnsupportedProtocol | lib.http.LocalProtocolError):
            return _failure("invalid", False, root, token)
        return _failure("unreachable", True, root, token)
    if isinstance(root, lib.FileMetadataError):
        return _failure("not_a_hub", False, root, token)
    if isinstance(root, lib.HFValidationError):
        return _failure("invalid", False, root, token)
    if isinstance(root, lib.LocalEntryNotFoundError):
        # Not in the download cache and the Hub could not be asked (HEAD failed unexplained).
        return _failure("unreachable", True, root.__cause__ or root, token)
    if isinstance(root, lib.EntryNotFoundError):
        return _failure("missing_file", False, root, token)
    if isinstance(root, OSError):
        return _failure("local", root.errno not in _LOCAL_FINAL_ERRNO, root, token)
    return _failure("error", True, root, token)


def http_status(exc: BaseException) -> int | None:
    """The status of the Hub's answer when ``exc`` is an HTTP error from it, else None."""
    if _lib is None and "huggingface_hub" not in sys.modules:
        return None  # nothing could have raised one
    return exc.response.status_code if isinstance(exc, _load().HfHubHTTPError) else None


def redact(text: str, token: str | None) -> str:
    """``text`` with ``token`` replaced by :data:`REDACTED` in every form error messages show it
    in (stripped, escaped: ``b'Bearer hf_...\\n'``), and every other secret removed
    (:func:`agent.util.redact.redact`)."""
    return redaction.redact(text, [("HF_TOKEN", token)] if token else ())


def _root_cause(exc: BaseException) -> BaseException:
    """The first error along the ``__cause__`` chain that says what happened."""
    lib = _load()
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(
            seen,
            lib.http.HTTPError  # HfHubHTTPError included
            | lib.OfflineModeIsEnabled
            | lib.FileMetadataError
            | lib.HFValidationError
            | ConnectionError
            | TimeoutError,
        ):
            return seen
        seen = seen.__cause__
    return exc


def _failure(
    kind: HubErrorKind, retryable: bool, exc: BaseException, token: str | None
) -> HubFailure:
    text = one_line(redact(str(exc), token))
    detail = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return HubFailure(kind, retryable, detail, cause=exc)


def _http_failure(exc: HfHubHTTPError, token: str | None) -> HubFailure:
    status = exc.response.status_code
    server = one_line(redact(exc.server_message or "", token))
    detail = f"HTTP {status}" + (f" ({server})" if server else "")
    kind: HubErrorKind
    lib = _load()
    # Typed errors first: the library reads the Hub's X-Error-Code for them.
    if isinstance(exc, lib.GatedRepoError):
        kind = "gated"
    elif isinstance(exc, lib.RepositoryNotFoundError):
        kind = "missing_repo"
    elif isinstance(exc, lib.RevisionNotFoundError):
        kind = "missing_revision"
    elif isinstance(exc, lib.EntryNotFoundError):
        kind = "missing_file"
    elif exc.response.request.method == "PUT":
        # An LFS upload to the storage's presigned URL (the client PUTs nothing else): a 403 is
        # an expired signature, a 400 a timed-out socket, not the token. The next attempt asks
        # the Hub for a fresh URL, and the Hub checks everything again at commit.
        kind = "transient"
    elif status == 401:
        kind = "unauthorized"
    elif status == 403:
        kind = "forbidden"
    elif status == 404:
        kind = "missing_repo"
    elif status == 429:
        kind = "rate_limited"
    elif is_retryable(status):
        kind = "transient"
    else:
        kind = "rejected"
    retryable = kind in ("rate_limited", "transient")
    wait_s = _retry_after_s(exc.response.headers, status) if retryable else None
    return HubFailure(kind, retryable, detail, status, wait_s, exc)


def _retry_after_s(headers: hub_http.Headers, status: int) -> float | None:
    """Seconds the Hub asks to wait: ``Retry-After`` (seconds or an HTTP date, read by the one
    backoff home, :func:`agent.util.backoff.retry_after_s`), else on a 429 the reset of an
    exhausted ``RateLimit`` (what huggingface_hub's own backoff honours)."""
    asked = backoff.retry_after_s(headers)
    if asked is not None:
        return asked
    if status == 429:
        info = _load().parse_ratelimit_headers(headers)
        if info is not None and info.remaining == 0:
            return float(info.reset_in_seconds)
    return None
