"""Rate-limited logging and the descriptor limit, with real records, sockets and processes."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import resource
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.util import logutil
from agent.util.logutil import RateLimitFilter

ROOT = Path(__file__).resolve().parent.parent


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def logger() -> Iterator[logging.Logger]:
    lg = logging.getLogger("agent.test_logutil")
    lg.propagate = False
    lg.setLevel(logging.DEBUG)
    yield lg
    lg.handlers.clear()
    lg.propagate = True


def stream_handler(flt: logging.Filter) -> tuple[logging.Handler, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(flt)
    return handler, out


def test_a_repeated_warning_passes_once_per_interval_then_says_how_many_were_held(
    logger: logging.Logger,
) -> None:
    clock = Clock()
    handler, out = stream_handler(RateLimitFilter(60.0, clock=clock))
    logger.addHandler(handler)
    for i in range(1000):
        clock.now = 1000.0 + i * 0.05  # 50 s of one message, 20 a second
        logger.warning("upload of %s failed: %s", "last.pt", "EMFILE")
    assert out.getvalue().splitlines() == [
        "WARNING agent.test_logutil: upload of last.pt failed: EMFILE"
    ]
    clock.now = 1061.0
    logger.warning("upload of %s failed: %s", "last.pt", "EMFILE")
    assert out.getvalue().splitlines()[1] == (
        "WARNING agent.test_logutil: upload of last.pt failed: EMFILE "
        "(999 similar suppressed in the last 61s)"
    )
    clock.now = 1062.0  # a new window started at 1061
    logger.warning("upload of %s failed: %s", "last.pt", "EMFILE")
    assert len(out.getvalue().splitlines()) == 2


def test_distinct_messages_levels_and_exception_types_are_not_merged(
    logger: logging.Logger,
) -> None:
    handler, out = stream_handler(RateLimitFilter(60.0, clock=Clock()))
    logger.addHandler(handler)
    for warning in ("labels missing", "3 images unreadable", "labels missing"):
        logger.warning("dataset: %s", warning)  # one template, different messages
    logger.error("dataset: %s", "labels missing")  # another level
    for exc in (ValueError("x"), OSError(24, "Too many open files"), ValueError("y")):
        try:
            raise exc
        except Exception:
            logger.exception("snapshot failed")
    for _ in range(3):
        logger.info("epoch 3 done")  # below WARNING: never held back
    lines = [line for line in out.getvalue().splitlines() if not line.startswith((" ", "Trace"))]
    assert [line for line in lines if line.startswith(("WARNING", "ERROR", "INFO"))] == [
        "WARNING agent.test_logutil: dataset: labels missing",
        "WARNING agent.test_logutil: dataset: 3 images unreadable",
        "ERROR agent.test_logutil: dataset: labels missing",
        "ERROR agent.test_logutil: snapshot failed",
        "ERROR agent.test_logutil: snapshot failed",
        "INFO agent.test_logutil: epoch 3 done",
        "INFO agent.test_logutil: epoch 3 done",
        "INFO agent.test_logutil: epoch 3 done",
    ]


def test_one_filter_on_two_handlers_decides_each_record_once(logger: logging.Logger) -> None:
    clock = Clock()
    flt = RateLimitFilter(60.0, clock=clock)
    (first, out1), (second, out2) = stream_handler(flt), stream_handler(flt)
    logger.addHandler(first)
    logger.addHandler(second)
    for _ in range(5):
        logger.warning("hub unreachable")
    clock.now += 61
    logger.warning("hub unreachable")
    for out in (out1, out2):
        assert out.getvalue().splitlines() == [
            "WARNING agent.test_logutil: hub unreachable",
            "WARNING agent.test_logutil: hub unreachable (4 similar suppressed in the last 61s)",
        ]


def test_install_rate_limits_asyncio_accept_errors_on_the_handler() -> None:
    """asyncio's own 'out of system resource' record, through the loop's real exception
    handler: without install() each went to stderr (logging.lastResort), unfiltered."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logutil.rate_limit.reset()
    logutil.install(handler)
    logutil.install(handler)  # idempotent
    try:

        async def main() -> None:
            loop = asyncio.get_running_loop()
            with socket.socket() as sock:
                for _ in range(500):
                    try:
                        raise OSError(24, "Too many open files")
                    except OSError as exc:
                        loop.call_exception_handler(
                            {
                                "message": "socket.accept() out of system resource",
                                "exception": exc,
                                "socket": sock,
                            }
                        )

        asyncio.run(main())
    finally:
        logutil.uninstall(handler)
    text = out.getvalue()
    assert text.count("socket.accept() out of system resource") == 1
    assert text.count("Traceback") == 1
    assert handler not in logging.getLogger("asyncio").handlers
    assert logutil.rate_limit not in handler.filters


# ---- for real: a process out of descriptors ----------------------------------------------------

EMFILE_CHILD = textwrap.dedent(
    """
    import asyncio, logging, os, resource, sys
    from agent.util import logutil
    from agent.status.server import StatusServer

    handler = logging.FileHandler(sys.argv[1])
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    agent_log = logging.getLogger("agent")
    agent_log.addHandler(handler)
    agent_log.setLevel(logging.INFO)
    logutil.install(handler)

    async def main():
        server = StatusServer(
            "127.0.0.1", 0, token="t", status=lambda: {"ok": 1}, actions={},
            header_timeout_s=60.0, keepalive_timeout_s=60.0,
        )
        port = await server.start()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        # Room for a handful of connections only: far below the cap of 64.
        limit = len(os.listdir("/proc/self/fd")) + 6
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        print(port, flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


def _healthz(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        s.settimeout(2)
        return s.recv(4096)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
def test_out_of_descriptors_the_log_stays_small_and_the_server_comes_back(
    tmp_path: Path,
) -> None:
    log_path = tmp_path / "agent.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", EMFILE_CHILD, str(log_path)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    flood: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        for _ in range(150):  # more than the child's descriptors plus its listen backlog
            try:
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=0.2))
            except OSError:
                break  # the backlog is full: enough
        said = "socket.accept() out of system resource"
        end = time.monotonic() + 60  # a cap for a hang: the loop ends on the first line
        while said not in log_path.read_text() and time.monotonic() < end:
            time.sleep(0.1)
        time.sleep(3.5)  # asyncio retries accept() every second, 100 attempts each time
        text = log_path.read_text()
        assert text.count(said) == 1, text[-3000:]
        assert len(text.splitlines()) < 60, text[-3000:]
        for s in flood:
            s.close()
        flood.clear()
        deadline = time.monotonic() + 60  # a cap for a hang: the loop ends on the answer
        answer = b""
        while time.monotonic() < deadline:
            try:
                answer = _healthz(port)
            except OSError:
                answer = b""
            if answer.startswith(b"HTTP/1.0 200"):
                break
            time.sleep(0.2)
        assert answer.startswith(b"HTTP/1.0 200"), answer
    finally:
        for s in flood:
            s.close()
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "Traceback" not in err, err[-3000:]  # nothing escaped to stderr (lastResort)


RAISE_CHILD = textwrap.dedent(
    """
    import logging, resource, sys
    from agent.util import logutil
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))
    first = logutil.raise_fd_limit(cap=int(sys.argv[2]))
    again = logutil.raise_fd_limit(cap=int(sys.argv[2]))
    print(first, again, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)
    """
)


def _raise_in_child(start: int, cap: int) -> tuple[list[int], str]:
    run = subprocess.run(
        [sys.executable, "-c", RAISE_CHILD, str(start), str(cap)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [int(v) for v in run.stdout.split()], run.stderr


def test_raise_fd_limit_lifts_the_soft_limit_to_the_hard_one_capped_and_logs_once() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard descriptor limit here is {hard}: nothing to raise to")
    cap = 512 if hard == resource.RLIM_INFINITY else min(hard, 512)
    (first, again, now, _), err = _raise_in_child(256, cap)
    assert first == again == now == cap
    assert err.count("file descriptor limit raised from 256 to") == 1
    # Never lowered: a soft limit already above the cap stays.
    (first, _, now, _), err = _raise_in_child(cap, 300)
    assert first == now == cap
    assert "raised" not in err


def test_secrets_from_the_environment_never_reach_a_handler(tmp_path: Path) -> None:
    # agent.log is uploaded with the checkpoints: the last line of defence is a filter that
    # knows every secret the agent read, whatever module logged it and however.
    secret = "hf_SECRETTOKEN0123456789"
    key = "vast-KEY-abcdefghijklmnop"
    path = tmp_path / "agent.log"
    handler = logging.FileHandler(path)
    logutil.install(handler)
    logutil.redact_secrets([("HF_TOKEN", secret), ("VAST_API_KEY", key), ("X", "")])
    log = logging.getLogger("agent.test.redact")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("token %s and key %s", secret, key)
        log.error("plain " + secret)
        log.warning("a header: Authorization: Bearer someoneElsesToken0123")  # by its shape
        try:
            raise RuntimeError(f"Authorization: Bearer {key}")
        except RuntimeError:
            log.exception("a call failed")
    finally:
        log.removeHandler(handler)
        logutil.uninstall(handler)
        logutil.redact_secrets([])
        handler.close()
    text = path.read_text()
    assert secret not in text and key not in text
    assert "token <HF_TOKEN> and key <VAST_API_KEY>" in text
    assert "Bearer <VAST_API_KEY>" in text  # the traceback too
    assert "someoneElsesToken0123" not in text and "Authorization: Bearer <secret>" in text


def test_a_bad_format_string_is_written_without_its_arguments(tmp_path: Path) -> None:
    # The redaction filter formats every record; a mistake in one must not raise from the
    # logging call, nor let its (unredactable) arguments through.
    path = tmp_path / "agent.log"
    handler = logging.FileHandler(path)
    logutil.install(handler)
    log = logging.getLogger("agent.test.badformat")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("count %d", "Bearer someoneElsesToken0123")
    finally:
        log.removeHandler(handler)
        logutil.uninstall(handler)
        handler.close()
    text = path.read_text()
    assert "count %d" in text and "someoneElsesToken0123" not in text


# ------------------------------------------------------------------------------ journald

_LOGS_THREE = """\
import logging, sys
from agent.util import logutil
logutil.configure_console(False)
log = logging.getLogger("agent.x")
log.info("an info line")
log.warning("a warning line")
try:
    raise ValueError("boom")
except ValueError:
    log.exception("an error with its traceback")
"""


def _console_lines(tmp_path: Path, journal: str | None) -> list[str]:
    """The console's stderr, written to a file; ``journal``: "this" for JOURNAL_STREAM naming
    that very file, "other" for one naming another stream, None for none."""
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        st = os.fstat(f.fileno())
        env = {"PATH": "/usr/bin:/bin"}
        if journal == "this":
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        elif journal == "other":
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino + 1}"
        subprocess.run(
            [sys.executable, "-c", _LOGS_THREE], stderr=f, cwd=ROOT, env=env, timeout=60, check=True
        )
    return err.read_text().splitlines()


def test_under_systemd_each_line_carries_its_syslog_priority(tmp_path: Path) -> None:
    lines = _console_lines(tmp_path, "this")
    assert lines[0].startswith("<6>") and lines[0].endswith("an info line")
    assert lines[1].startswith("<4>") and lines[1].endswith("a warning line")
    assert lines[2].startswith("<3>") and lines[2].endswith("an error with its traceback")
    # journald reads a priority per line: the traceback's lines keep the error's.
    assert len(lines) > 3 and all(line.startswith("<3>") for line in lines[2:])
    assert lines[-1] == "<3>ValueError: boom"


@pytest.mark.parametrize("journal", [None, "other"])
def test_without_the_journal_on_stderr_no_line_has_a_prefix(
    tmp_path: Path, journal: str | None
) -> None:
    lines = _console_lines(tmp_path, journal)
    assert lines and not any(line.startswith("<") for line in lines)
    assert lines[1].endswith("a warning line")


# ------------------------------------------------------------------ no line logged twice


def _messages(log_text: str) -> list[str]:
    """agent.log's messages without time, level and logger (the same words from two loggers
    are one duplicate)."""
    return [line.split(": ", 1)[-1] for line in log_text.splitlines() if line[:2] == "20"]


def test_held_to_teardown_is_logged_once_in_a_real_runs_agent_log(tmp_path: Path) -> None:
    from agent.state import Phase
    from tests.support import wait_for
    from tests.test_supervise import WAIT_S, Clock, Run, ScriptedLauncher, make_job

    logutil.rate_limit.reset()
    clock = Clock()
    run = Run(tmp_path, make_job(tmp_path), ScriptedLauncher(epoch_s=0.1, pause_at=3), clock=clock)

    async def during(run: Run) -> None:
        await run.paused()
        await run.post("hold", "1s")
        run.resume_trainer()
        await wait_for(lambda: run.daemon.state.phase == Phase.HELD, WAIT_S)
        clock.now += 1.5  # the hold's second passes

    assert run.go(during) == 0
    messages = _messages(run.log())
    assert [m for m in messages if "HELD -> TEARDOWN" in m] == [
        "phase HELD -> TEARDOWN (hold timed out)"
    ]
    warnings = [line for line in run.log().splitlines() if " WARNING " in line]
    assert len(set(_messages("\n".join(warnings)))) == len(warnings), warnings


def test_the_doctors_warnings_are_logged_once_in_agent_log(tmp_path: Path) -> None:
    """The real ``libreyolo doctor`` on the demo's dataset (its one class has fewer than ten
    instances: a warning), checked as staging checks it, agent.log written as the daemon writes
    it. Each warning was logged where it was found and again by the caller."""
    import shutil

    from agent import demo
    from agent.data import staging
    from agent.state import StateStore
    from tests.support import tiny_job

    if shutil.which("libreyolo", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("the training stack (libreyolo) is not installed: run ./install.sh")
    logutil.rate_limit.reset()
    data = demo.make_dataset(tmp_path / "ds")
    job = tiny_job(tmp_path, data, doctor=True)
    store = StateStore(tmp_path / "state")
    store.ensure()
    with logutil.to_file(store.log_handler()):
        outcome = asyncio.run(staging.check_data(job, None, doctor=True))
    assert outcome.ok, outcome.cause
    found = (outcome.report or {})["data_check"]["warnings"]
    assert found, "the demo dataset is expected to draw a doctor warning"
    messages = _messages(store.path("agent.log").read_text())
    for warning in found:
        assert sum(warning in m for m in messages) == 1, (warning, messages)


def test_the_doctors_errors_are_logged_once_in_agent_log(tmp_path: Path) -> None:
    """The doctor's errors were logged three times: where found (a warning), by staging (the
    error) and by the training loop that stops the trainer for them."""
    import shutil

    from agent import demo
    from agent.data import staging
    from agent.state import StateStore
    from tests.support import tiny_job

    if shutil.which("libreyolo", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("the training stack (libreyolo) is not installed: run ./install.sh")
    logutil.rate_limit.reset()
    data = demo.make_dataset(tmp_path / "ds")
    shutil.rmtree(tmp_path / "ds" / "images" / "val")
    job = tiny_job(tmp_path, data, doctor=True)
    store = StateStore(tmp_path / "state")
    store.ensure()
    with logutil.to_file(store.log_handler()):
        outcome = asyncio.run(staging.check_data(job, None, doctor=True))
    assert not outcome.ok
    log = store.path("agent.log").read_text()
    assert log.count("doctor found 1 error(s)") == 1, log
    assert " ERROR agent.data.staging: dataset check failed: libreyolo doctor found" in log
