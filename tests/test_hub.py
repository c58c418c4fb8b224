"""agent/hub.py: the client set-up (timeouts), the version floor, the one error classifier and
the one redaction, driven through the real ``huggingface_hub`` client against the fake Hub."""

from __future__ import annotations

import email.utils
import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import get_session
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
)

from agent import hub
from agent.config.model import DatasetSection, Env
from agent.data import dataset
from agent.sinks.hf import HubSink
from tests.fakes.hub import FakeHub, run_fake_hub

GOOD = "hf_good_token_SECRET_1234"
BAD = "hf_revoked_token_SECRET_9999"
REPO = "org/run1"
ROOT = Path(__file__).resolve().parent.parent
#: Set in the child run of this file on the oldest allowed huggingface_hub (no recursion).
OLD_HUB_RUN = "LIBREYOLO_AGENT_TEST_OLD_HUB"


@pytest.fixture
def fake() -> Iterator[FakeHub]:
    with run_fake_hub(tokens={GOOD}) as h:
        h.add_repo("model", REPO)
        yield h


@pytest.fixture
def short_timeouts() -> Iterator[float]:
    """The client with 0.5 s timeouts for the test, the defaults again after it."""
    hub.configure(timeout_s=0.5, connect_timeout_s=0.5)
    try:
        yield 0.5
    finally:
        hub.configure()


def env(fake: FakeHub, token: str | None = GOOD) -> Env:
    return Env(hf_endpoint=fake.url, hf_token=token)


def raised(call: Callable[[], object]) -> BaseException:
    """What ``call`` raised (it must raise)."""
    try:
        call()
    except Exception as exc:
        return exc
    raise AssertionError("the call did not raise")


def http_error(status: int, headers: dict[str, str] | None = None) -> HfHubHTTPError:
    request = hub.hub_http.Request("GET", "http://127.0.0.1:9/api/models/org/run1")
    response = hub.hub_http.Response(status, headers=headers, request=request)
    return HfHubHTTPError(f"{status} error", response=response)


# ---- the retryable rule, through the real client ----------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind", "retryable"),
    [
        (400, "rejected", False),
        (403, "forbidden", False),
        (404, "missing_repo", False),
        (408, "transient", True),
        (409, "transient", True),  # a commit racing another: "Another commit ... in progress"
        (412, "transient", True),  # "A commit has happened since. Please refresh and try again."
        (413, "rejected", False),
        (422, "rejected", False),
        (423, "transient", True),
        (425, "transient", True),
        (429, "rate_limited", True),
        (500, "transient", True),
        (501, "rejected", False),
        (502, "transient", True),
        (503, "transient", True),
        (504, "transient", True),
        (505, "rejected", False),
        (511, "rejected", False),
    ],
)
def test_http_status_classification(fake: FakeHub, status: int, kind: str, retryable: bool) -> None:
    fake.fail("paths_info", status)  # paths-info is never retried by the client itself
    exc = raised(lambda: hub.api(env(fake)).get_paths_info(REPO, ["w.pt"]))
    failure = hub.classify(exc, token=GOOD)
    assert (failure.kind, failure.retryable, failure.status) == (kind, retryable, status)
    assert hub.is_retryable(status) is retryable
    assert failure.detail.startswith(f"HTTP {status} (Injected fault: HTTP {status}")
    assert failure.retry_after_s is None


def test_the_hubs_own_answers_are_recognised_by_type(fake: FakeHub, tmp_path: Path) -> None:
    fake.add_file("model", REPO, "a.txt", b"a\n")
    fake.add_repo("model", "org/private", private=True)
    api = hub.api(env(fake))
    cases: list[tuple[Callable[[], object], str, int | None]] = [
        (lambda: api.get_paths_info("org/missing", ["a.txt"]), "missing_repo", 404),
        # The Hub answers 401 for a private repo without a token: it does not say it exists.
        (lambda: hub.api(env(fake, None)).model_info("org/private"), "missing_repo", 401),
        (lambda: api.get_paths_info(REPO, ["a.txt"], revision="v9"), "missing_revision", 404),
        (lambda: api.hf_hub_download(REPO, "nope.txt", cache_dir=tmp_path), "missing_file", 404),
        (lambda: hub.api(env(fake, BAD)).whoami(), "unauthorized", 401),
        (lambda: api.get_paths_info("bad//id", ["a.txt"]), "invalid", None),
    ]
    for call, kind, status in cases:
        failure = hub.classify(raised(call), token=GOOD)
        assert (failure.kind, failure.status, failure.retryable) == (kind, status, False), failure


@pytest.mark.parametrize(("status", "retry_after"), [(429, 30), (503, 7)])
def test_retry_after_is_read_from_the_hubs_answer(
    fake: FakeHub, status: int, retry_after: float
) -> None:
    fake.fail("paths_info", status, retry_after=retry_after)
    exc = raised(lambda: hub.api(env(fake)).get_paths_info(REPO, ["w.pt"]))
    failure = hub.classify(exc, token=GOOD)
    assert failure.retryable
    assert failure.retry_after_s == retry_after


def test_retry_after_as_a_date_and_the_rate_limit_reset() -> None:
    when = email.utils.formatdate(time.time() + 60, usegmt=True)
    wait = hub.classify(http_error(503, {"Retry-After": when}), token=None).retry_after_s
    assert wait is not None and 55 <= wait <= 61
    # The Hub's RateLimit header, what huggingface_hub's own backoff waits for on a 429.
    limited = http_error(429, {"RateLimit": '"api";r=0;t=42'})
    assert hub.classify(limited, token=None).retry_after_s == 42.0
    assert hub.classify(http_error(429, {"Retry-After": "soon"}), token=None).retry_after_s is None
    # Never on a final answer: waiting does not fix it.
    assert hub.classify(http_error(403, {"Retry-After": "5"}), token=None).retry_after_s is None


# ---- transport errors of the real client ------------------------------------------------------


def test_connection_refused_is_unreachable_and_retryable() -> None:
    with run_fake_hub() as gone:
        url = gone.url
    exc = raised(lambda: hub.api(Env(hf_endpoint=url, hf_token=GOOD)).whoami())
    assert isinstance(exc, hub.hub_http.ConnectError)
    failure = hub.classify(exc, token=GOOD)
    assert (failure.kind, failure.retryable) == ("unreachable", True)
    assert failure.detail.startswith("ConnectError: ")


def test_connection_dropped_without_an_answer_is_retryable(fake: FakeHub) -> None:
    fake.reset("paths_info")
    exc = raised(lambda: hub.api(env(fake)).get_paths_info(REPO, ["w.pt"]))
    # The fake closes the socket without a byte: the client sees the close as a protocol error
    # (EOF before a status line) or, when the reset reaches it first, as ECONNRESET on read.
    # Both mean "dropped without an answer", and both must be retried.
    assert isinstance(exc, (hub.hub_http.RemoteProtocolError, hub.hub_http.ReadError)), exc
    failure = hub.classify(exc, token=GOOD)
    assert (failure.kind, failure.retryable) == ("unreachable", True)


def test_errors_that_are_not_http() -> None:
    # hf_hub_download wraps what kept it from asking the Hub (its HEAD is retried for ~23 s
    # before that, too slow to provoke here).
    refused = LocalEntryNotFoundError("An error happened while trying to locate the file")
    refused.__cause__ = hub.hub_http.ConnectError("[Errno 111] Connection refused")
    offline = LocalEntryNotFoundError("not in the cache")
    offline.__cause__ = OfflineModeIsEnabled("offline mode is enabled")
    unexplained = LocalEntryNotFoundError("no answer")
    wrapped = RuntimeError("Error while uploading 'w.pt' to the Hub.")
    wrapped.__cause__ = http_error(503)
    cases: list[tuple[BaseException, str, bool]] = [
        (refused, "unreachable", True),
        (offline, "offline", False),
        (unexplained, "unreachable", True),
        (wrapped, "transient", True),  # LFS/Xet transfers wrap the HTTP error
        (TimeoutError("no answer within 30 s"), "unreachable", True),
        (OSError(errno.ENOSPC, "No space left on device"), "local", False),
        (OSError(errno.EROFS, "Read-only file system"), "local", False),
        (OSError(errno.EIO, "Input/output error"), "local", True),
        (ValueError("Expecting value: line 1 column 1"), "error", True),
    ]
    for exc, kind, retryable in cases:
        failure = hub.classify(exc, token=GOOD)
        assert (failure.kind, failure.retryable) == (kind, retryable), exc


# ---- redaction --------------------------------------------------------------------------------


def test_redact_replaces_every_form_of_the_token() -> None:
    assert hub.redact(f"Bearer {GOOD} and {GOOD}", GOOD) == "Bearer <HF_TOKEN> and <HF_TOKEN>"
    # The forms error messages show a token with stray whitespace in: escaped, or stripped.
    token = f"{GOOD}\n"
    assert hub.redact(f"b'Bearer {GOOD}\\n'", token) == "b'Bearer <HF_TOKEN>'"
    assert hub.redact(f"value={GOOD};", token) == "value=<HF_TOKEN>;"
    assert hub.redact("nothing secret", None) == "nothing secret"
    assert hub.redact("nothing secret", "") == "nothing secret"


def test_a_token_with_a_newline_is_refused_and_never_shown(fake: FakeHub) -> None:
    """``HF_TOKEN`` from an env file with a trailing newline: the client refuses the header and
    quotes it, escaped, in its message."""
    token = f"{GOOD}\n"
    exc = raised(lambda: hub.api(env(fake, token)).whoami())
    assert isinstance(exc, hub.hub_http.LocalProtocolError)
    assert GOOD in str(exc)  # the library's own message does show it
    failure = hub.classify(exc, token=token)
    assert (failure.kind, failure.retryable) == ("invalid", False)
    assert GOOD not in failure.detail and hub.REDACTED in failure.detail


def test_the_token_never_leaks_from_any_kind(fake: FakeHub, tmp_path: Path) -> None:
    """Whatever carries the token (the server's message, the exception text), the detail, the
    sink's error and staging's error show the one placeholder instead."""
    request = hub.hub_http.Request("GET", f"{fake.url}/api/whoami-v2")
    response = hub.hub_http.Response(500, request=request)
    carriers: list[BaseException] = [
        HfHubHTTPError(f"bad {GOOD}", response=response, server_message=f"token {GOOD} x"),
        hub.hub_http.ConnectError(f"proxy said {GOOD}"),
        OSError(errno.EIO, f"cannot read {GOOD}"),
        ValueError(f"bad answer {GOOD}"),
        RuntimeError(f"xet {GOOD}"),
    ]
    sink = HubSink(REPO, env=env(fake), private=True)
    ds = DatasetSection(repo="org/ds", file="ds.tar")
    for exc in carriers:
        detail = hub.classify(exc, token=GOOD).detail
        assert GOOD not in detail and hub.REDACTED in detail, detail
        for text in (
            str(sink._error("upload of w.pt", exc)),
            str(dataset._hub_error(exc, ds, env(fake), None)),
        ):
            assert GOOD not in text, text
            assert "***" not in text, text  # the one placeholder, wherever one is shown


# ---- client set-up ----------------------------------------------------------------------------


def test_configure_installs_the_timeouts_and_is_idempotent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="agent.hub")
    try:
        hub.configure(Env(hf_token=GOOD), timeout_s=7.0, connect_timeout_s=3.0)
        session = get_session()
        assert (session.timeout.connect, session.timeout.read) == (3.0, 7.0)
        # The library's request hook (HF_HUB_OFFLINE, request ids) is kept.
        assert session.event_hooks["request"]
        hub.configure(Env(hf_token=GOOD), timeout_s=7.0, connect_timeout_s=3.0)
        assert get_session() is session  # nothing replaced, nothing closed
    finally:
        hub.configure()
    assert get_session().timeout.read == hub.HTTP_TIMEOUT_S
    assert get_session().timeout.connect == hub.HTTP_CONNECT_TIMEOUT_S
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hub: ")]
    assert lines[0] == (
        f"hub: huggingface_hub {huggingface_hub.__version__} over {hub.hub_http.__name__}, "
        "Git LFS transfers, timeouts 3s to connect, 7s between bytes, "
        "endpoint https://huggingface.co, HF_TOKEN set"
    )
    assert len(lines) == 2  # installed, then the defaults again: the repeat logged nothing
    assert GOOD not in caplog.text


def test_a_hung_hub_times_out_within_the_configured_seconds(
    fake: FakeHub, short_timeouts: float
) -> None:
    fake.delay("whoami", 10.0)
    started = time.monotonic()
    exc = raised(lambda: hub.api(env(fake)).whoami())
    elapsed = time.monotonic() - started
    assert short_timeouts <= elapsed < 8.0  # the client's timeout, not the Hub's 10 s
    assert isinstance(exc, hub.hub_http.ReadTimeout)
    failure = hub.classify(exc, token=GOOD)
    assert (failure.kind, failure.retryable) == ("unreachable", True)


def _child(script: str, *, unset: tuple[str, ...] = (), **environ: str) -> dict[str, object]:
    """Run ``script`` in a fresh interpreter (the Hub client never set up), without the
    variables in ``unset``; its last stdout line is JSON."""
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if k not in unset}, **environ},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


_PREFLIGHT_LIKE = """
    import json, sys, time
    from agent import hub
    from agent.data import dataset  # the staging code loaded, as in preflight
    from agent.config.model import Env
    from tests.fakes.hub import run_fake_hub

    hub.configure(timeout_s=0.5, connect_timeout_s=0.5)
    with run_fake_hub(tokens={"hf_good"}) as fake:
        fake.delay("whoami", 10.0)
        started = time.monotonic()
        try:
            hub.api(Env(hf_endpoint=fake.url, hf_token="hf_good")).whoami()
            kind = "answered"
        except Exception as exc:
            kind = hub.classify(exc, token="hf_good").kind
        elapsed = time.monotonic() - started
        requests = len(fake.requests)
    print(json.dumps({"kind": kind, "elapsed": elapsed, "requests": requests,
                      "sink_imported": "agent.sinks.hf" in sys.modules}))
"""


def test_configure_alone_bounds_a_preflight_call_without_any_sink() -> None:
    """The bug: timeouts existed only once a sink was built, so `libreyolo-agent preflight`
    could hang on a silent Hub. A fresh process that only configures the Hub module."""
    result = _child(_PREFLIGHT_LIKE)
    assert result["sink_imported"] is False
    assert result["kind"] == "unreachable"
    # The 0.5 s timeout, not the Hub's 10 s silence (a loaded machine adds seconds, not ten).
    assert isinstance(result["elapsed"], float) and result["elapsed"] < 8.0


def test_configure_keeps_the_librarys_offline_guard() -> None:
    """HF_HUB_OFFLINE is enforced by a request hook of the library's client: the client with
    timeouts must keep it (nothing reaches the Hub)."""
    result = _child(_PREFLIGHT_LIKE, HF_HUB_OFFLINE="1")
    assert result["kind"] == "offline"
    assert result["requests"] == 0


_UPLOAD_A_CHECKPOINT = """
    import json, sys
    from pathlib import Path
    from agent import hub

    # As `agent run` does before anything else for a Hub job: the client is loaded first.
    hub.load()
    from agent.config.model import Env
    from agent.sinks.hf import HubSink
    from tests.fakes.hub import run_fake_hub

    hub.configure()
    ckpt = Path(sys.argv[1])
    with run_fake_hub(tokens={"hf_good"}) as fake:
        sink = HubSink("org/run", env=Env(hf_endpoint=fake.url, hf_token="hf_good"), private=True)
        sink.prepare()
        try:
            sink.upload(ckpt, "weights/last.pt")
        except Exception:
            pass
        stored = fake.file("model", "org/run", "weights/last.pt") == ckpt.read_bytes()
        transfers = [list(t) for t in fake.lfs_transfers]
        asked_xet = any("xet-write-token" in r.path for r in fake.requests)
    # Imported only now: imported before the agent's, it would hide a switch set on nothing.
    import huggingface_hub.constants
    print(json.dumps({"stored": stored, "transfers": transfers, "asked_xet": asked_xet,
                      "disable_xet": huggingface_hub.constants.HF_HUB_DISABLE_XET,
                      "hf_xet_loaded": "hf_xet" in sys.modules}))
"""


@pytest.mark.parametrize(
    ("environ", "xet"), [({}, False), ({"HF_HUB_DISABLE_XET": "0"}, True)], ids=["unset", "0"]
)
def test_the_agent_uploads_over_git_lfs_unless_told_to_use_xet(
    tmp_path: Path, environ: dict[str, str], xet: bool
) -> None:
    """Unset, the agent keeps Xet (and its Rust runtime) out of the daemon: the checkpoint goes
    through the LFS batch API, which the Hub takes for every repo. ``HF_HUB_DISABLE_XET=0`` is
    the user's choice and is kept: the client then goes for Xet, which no fake here speaks."""
    import importlib.util

    assert importlib.util.find_spec("hf_xet") is not None  # installed with huggingface_hub
    ckpt = tmp_path / "last.pt"
    ckpt.write_bytes(b"PK\x03\x04" + os.urandom(300_000))
    script = _UPLOAD_A_CHECKPOINT.replace("sys.argv[1]", repr(str(ckpt)))
    result = _child(script, unset=("HF_HUB_DISABLE_XET",), **environ)
    assert result["disable_xet"] is (not xet)
    transfers = result["transfers"]
    assert isinstance(transfers, list)
    # 2.x asks for a Xet write token at once; 1.x first offers "xet" to the LFS batch API.
    assert (result["asked_xet"] or any("xet" in t for t in transfers)) is xet
    if not xet:
        assert result["stored"] is True
        assert result["transfers"] == [["basic", "multipart"]]
        assert result["hf_xet_loaded"] is False


# ---- huggingface_hub versions -------------------------------------------------------------------


def test_installed_huggingface_hub_is_accepted() -> None:
    hub.check_hub_version()
    assert hub.hub_version_supported(huggingface_hub.__version__)
    expected = "httpx" if huggingface_hub.__version__.startswith("1.") else "httpx2"
    assert hub.hub_http.__name__ == expected == type(get_session()).__module__.split(".")[0]


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
    assert hub.hub_version_supported(version) is supported
    assert hub.http_module_name(version) == client
    if supported:
        hub.check_hub_version(version)
        return
    with pytest.raises(hub.HubVersionError) as exc:
        hub.check_hub_version(version)
    assert isinstance(exc.value, ImportError)  # what a caller catches where it imports
    assert exc.value.installed == version
    assert f"huggingface_hub {version} is too old" in str(exc.value)
    assert "pip install 'huggingface_hub>=1.3.2'" in str(exc.value)


#: Folder of ``pip install --target`` trees, one per huggingface_hub version (``1.3.2/``,
#: ``1.3.1/``), prepared by .ci/run before the suite: tests never reach a package index.
HUB_SITES = "LIBREYOLO_AGENT_HUB_SITES"


def _hub_site(version: str) -> Path:
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
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=170
    )


@pytest.mark.skipif(bool(os.environ.get(OLD_HUB_RUN)), reason="already the old-hub run")
@pytest.mark.timeout(240)
def test_hub_and_sink_tests_pass_on_the_oldest_allowed_huggingface_hub() -> None:
    """huggingface_hub 1.x builds on httpx, not httpx2 (a GPU image shipped 1.33): this file and
    the sink's and the one-commit-per-milestone tests run again on MIN_HUB_VERSION."""
    site = _hub_site(hub.MIN_HUB_VERSION)
    probe = _run_with(
        site,
        "-c",
        "import huggingface_hub, agent.hub as hub; "
        "print(huggingface_hub.__version__, hub.hub_http.__name__)",
    )
    assert probe.stdout.split() == [hub.MIN_HUB_VERSION, "httpx"], probe.stderr
    files = [
        __file__,
        *(str(ROOT / "tests" / f) for f in ("test_sink_hf.py", "test_sync_commits.py")),
    ]
    run = _run_with(site, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert int(summary.split(" passed")[0].split()[-1]) >= 60, summary


@pytest.mark.skipif(bool(os.environ.get(OLD_HUB_RUN)), reason="already the old-hub run")
@pytest.mark.parametrize("module", ["agent.hub", "agent.sinks.hf", "agent.data.dataset"])
def test_too_old_huggingface_hub_is_refused_with_the_fix(module: str) -> None:
    """1.3.1 would fail every upload to a non-default endpoint after sending it (the fake Hub's
    is one): refused wherever the agent's Hub code is imported, with the fix."""
    site = _hub_site("1.3.1")
    run = _run_with(site, "-c", f"import {module}")
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last == (
        "agent.hub.HubVersionError: huggingface_hub 1.3.1 is too old: libreyolo-agent needs "
        "huggingface_hub>=1.3.2; fix: pip install 'huggingface_hub>=1.3.2'"
    )
