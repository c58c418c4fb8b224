"""NVML calls made in a process of the agent's own, never in the agent: :class:`NvmlHost`.

The host is a program of its own, started on the first call: it loads the driver's library,
answers each call over a pipe, and ends when the agent closes the pipe (or dies: the kernel
closes it). Where the box has a C compiler it is agent/gpu/nvmlhost.c, built once into the
agent's cache folder (:func:`c_host`); elsewhere ``python -I -S agent/gpu/nvml.py`` (standard
library only), the same protocol. Measured on an H200 (issue 26): the Python host 25.0 MiB PSS,
the C host 16.0 (it keeps NVML from loading ``libcuda``, which none of the agent's calls needs:
agent/gpu/nvmlhost.c says how), NVML's own initialisation most of either.
``LIBREYOLO_AGENT_NVML_HOST=python`` keeps the Python host; ``=c`` asks for the C one (a box
without a compiler still gets the Python host, with a warning). :class:`NvmlHost` looks like the
``pynvml`` module to its callers (:class:`agent.gpu.health.GpuMonitor`, the preflight's driver
check): the constants, ``NVMLError``, and an ``nvml*`` function for each call
:data:`agent.gpu.nvml.FUNCTIONS` names, with handles as integers.

What the agent gains (agent/gpu/nvml.py says why): the driver's libraries (``libnvidia-ml``,
``libcuda``, 18 MiB measured on an H200) are never mapped into the agent; a call that blocks in a
broken driver blocks the host, which is killed after ``timeout_s``; a driver that crashes its
caller crashes the host. Either way the call raises :class:`~agent.gpu.nvml.NVMLError` with
``value`` :data:`~agent.gpu.nvml.HOST_UNRESPONSIVE` or :data:`~agent.gpu.nvml.HOST_GONE`, and every
later call raises the same at once: the host is not started again (a host stuck in the
kernel cannot even be killed, and a second would join it). What it costs: a second, small
process on the box (NVML's initialisation, and the C program or the interpreter with ctypes).

Thread-safe: one lock serialises the calls.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.gpu import nvml
from agent.gpu.nvml import NVMLError

log = logging.getLogger(__name__)

#: Longest wait for one answer, seconds. nvmlInit without persistence mode can take seconds
#: per GPU (the driver brings each one up), so the first call gets :data:`INIT_TIMEOUT_S`.
CALL_TIMEOUT_S = 30.0
INIT_TIMEOUT_S = 120.0
#: After the pipe is closed, how long the host may take to exit before it is killed.
EXIT_WAIT_S = 2.0
#: The longest answer line read (a call answers a few hundred bytes).
_MAX_LINE = 1 << 16

#: Which host to run: ``c``, ``python``, or unset (the C host where it builds).
HOST_ENV = "LIBREYOLO_AGENT_NVML_HOST"
#: Where built programs are kept (default ``$XDG_CACHE_HOME/libreyolo-agent``, else
#: ``~/.cache/libreyolo-agent``).
CACHE_ENV = "LIBREYOLO_AGENT_CACHE_DIR"
#: The C host's source, shipped beside this file, and its program's name before the digest.
C_SOURCE = Path(__file__).with_name("nvmlhost.c")
C_PROGRAM_PREFIX = "nvmlhost-"
#: The longest a build of the C host may take, seconds (0.3 s on a 2-core VM).
BUILD_TIMEOUT_S = 60.0


class NvmlHost:
    """The ``pynvml``-like face of the NVML host process (see the module's text)."""

    NVMLError = NVMLError

    def __init__(
        self,
        *,
        timeout_s: float = CALL_TIMEOUT_S,
        init_timeout_s: float = INIT_TIMEOUT_S,
        python: str | None = None,
        kind: str | None = None,
    ) -> None:
        self._timeout_s = timeout_s
        self._init_timeout_s = init_timeout_s
        self._python = python or sys.executable
        #: ``c``, ``python``, or None: :data:`HOST_ENV` decides (see :func:`host_command`).
        self._kind = kind
        #: The kind of the host started last (``c`` or ``python``), None before the first call.
        self.started_kind: str | None = None
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._failed: nvml.NVMLError | None = None
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        if name in nvml.FUNCTIONS:
            call: Callable[..., Any] = lambda *args: self.call(name, *args)  # noqa: E731
            return call
        if name.startswith(("NVML_", "nvml")):
            return getattr(nvml, name)  # the constants; AttributeError for what NVML lacks
        raise AttributeError(name)

    @property
    def pid(self) -> int | None:
        """The host's pid while it runs (None before the first call and after the end)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    def call(self, fn: str, *args: Any) -> Any:
        """``fn(*args)`` in the host: its value (structures as attribute objects), or
        :class:`NVMLError`."""
        with self._lock:
            if self._failed is not None:
                raise NVMLError(self._failed.value, self._failed.message)
            if self._closed:
                raise NVMLError(nvml.HOST_GONE, "the NVML host was closed")
            first = self._proc is None
            proc = self._start() if first else self._proc
            assert proc is not None and proc.stdin is not None
            timeout = self._init_timeout_s if first or fn == "nvmlInit" else self._timeout_s
            try:
                proc.stdin.write(json.dumps({"fn": fn, "args": list(args)}).encode() + b"\n")
                proc.stdin.flush()
            except OSError:
                self._reap(proc)
                gone = f"the NVML host is gone ({self._how(proc)})"
                raise self._fail(nvml.HOST_GONE, gone) from None
            answer = self._read(proc, fn, timeout)
        if "err" in answer:
            raise NVMLError(int(answer["err"]), str(answer.get("msg") or ""))
        value = answer.get("ok")
        return _Struct(value) if isinstance(value, dict) else value

    def close(self) -> None:
        """End the host (close its pipe, wait :data:`EXIT_WAIT_S`, then kill); idempotent."""
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(EXIT_WAIT_S)
        if proc.stdout is not None:
            proc.stdout.close()

    # ------------------------------------------------------------------------------------------

    def _start(self) -> subprocess.Popen[bytes]:
        kind, command = host_command(self._python, self._kind)
        try:
            proc = self._popen(command)
        except OSError as exc:
            if kind != "c":
                raise self._fail(nvml.HOST_GONE, f"the NVML host did not start: {exc}") from None
            # A built host that will not run (a cache folder mounted noexec, say): the Python one.
            log.warning("the C NVML host did not start (%s): the Python host runs instead", exc)
            kind, command = "python", python_host_command(self._python)
            try:
                proc = self._popen(command)
            except OSError as exc2:
                raise self._fail(nvml.HOST_GONE, f"the NVML host did not start: {exc2}") from None
        self._proc = proc
        self.started_kind = kind
        log.debug("NVML host started (%s): pid %d", kind, proc.pid)
        return proc

    @staticmethod
    def _popen(command: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            env=host_env(),
        )

    def _read(self, proc: subprocess.Popen[bytes], fn: str, timeout: float) -> dict[str, Any]:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                self._kill(proc)
                raise self._fail(
                    nvml.HOST_UNRESPONSIVE,
                    f"NVML did not answer {fn} within {timeout:.0f} s (the driver or a GPU may be"
                    " broken; the NVML host was killed)",
                )
            chunk = os.read(fd, 4096)
            if not chunk:
                self._reap(proc)
                raise self._fail(
                    nvml.HOST_GONE, f"the NVML host died during {fn} ({self._how(proc)})"
                )
            self._buf += chunk
            if len(self._buf) > _MAX_LINE:
                self._kill(proc)
                raise self._fail(nvml.HOST_GONE, "the NVML host sent an answer too long")
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            answer = json.loads(line)
        except ValueError:
            self._kill(proc)
            raise self._fail(nvml.HOST_GONE, "the NVML host sent a broken answer") from None
        if not isinstance(answer, dict):
            self._kill(proc)
            raise self._fail(nvml.HOST_GONE, "the NVML host sent a broken answer")
        return answer

    def _fail(self, code: int, message: str) -> nvml.NVMLError:
        self._failed = NVMLError(code, message)
        log.error("%s", message)
        return NVMLError(code, message)

    def _kill(self, proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(OSError):
            proc.kill()
        # A process blocked in the kernel may not die at once: never wait on it for long.
        self._reap(proc, 1.0)

    def _reap(self, proc: subprocess.Popen[bytes], wait_s: float = EXIT_WAIT_S) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
        for pipe in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()
        self._proc = None

    @staticmethod
    def _how(proc: subprocess.Popen[bytes]) -> str:
        code = proc.poll()
        if code is None:
            return "no exit status"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"


def python_host_command(python: str) -> list[str]:
    """The Python host: ``python -I -S agent/gpu/nvml.py``."""
    return [python, "-I", "-S", os.path.abspath(nvml.__file__)]


def host_command(python: str, kind: str | None = None) -> tuple[str, list[str]]:
    """``(kind, argv)`` of the host to start: the C host where :func:`c_host` has or can build
    it, unless ``kind`` (else :data:`HOST_ENV`) says ``python``."""
    wanted = (kind or os.environ.get(HOST_ENV, "")).strip().lower()
    if wanted not in ("", "c", "python"):
        log.warning(
            "%s=%r is neither c nor python: the default (C where it builds)", HOST_ENV, wanted
        )
        wanted = ""
    if wanted != "python":
        built = c_host()
        if built is not None:
            return "c", [str(built)]
        if wanted == "c":
            log.warning(
                "%s=c, but the C NVML host could not be built: the Python host runs", HOST_ENV
            )
    return "python", python_host_command(python)


def cache_dir(environ: dict[str, str] | None = None) -> Path:
    """Where the agent keeps what it builds (:data:`CACHE_ENV`, else the XDG cache folder)."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "libreyolo-agent"


_build_lock = threading.Lock()
#: The outcome of this process's one build attempt per source digest: the program, or None.
_built: dict[str, Path | None] = {}


def c_host(source: Path = C_SOURCE) -> Path | None:
    """The C host's program, built from ``source`` once per box (kept as
    ``nvmlhost-<digest of the source>`` in :func:`cache_dir`, so an upgrade builds anew); None
    where it cannot be: no ``cc``/``gcc``, a failed build, a cache folder that cannot be
    written. A process tries each source once; the reason it could not is logged once."""
    try:
        digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    except OSError as exc:
        log.info("the C NVML host's source cannot be read (%s): the Python host runs", exc)
        return None
    with _build_lock:
        if digest in _built:
            return _built[digest]
        _built[digest] = program = _build(source, cache_dir() / f"{C_PROGRAM_PREFIX}{digest}")
        return program


def _build(source: Path, program: Path) -> Path | None:
    if program.is_file() and os.access(program, os.X_OK):
        return program
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler (cc) on this box: the NVML host is the Python one (6 MiB more)")
        return None
    tmp = program.with_name(f".{program.name}.{os.getpid()}.tmp")
    started = time.monotonic()
    try:
        program.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        done = subprocess.run(
            # -rdynamic: the program's own dlopen is the one NVML's calls reach (nvmlhost.c).
            [cc, "-O2", "-rdynamic", "-o", str(tmp), str(source), "-ldl"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=BUILD_TIMEOUT_S,
            env=host_env(),
            check=False,
        )
        if done.returncode != 0:
            why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            log.warning(
                "the C NVML host did not build (%s exited %d: %s): the Python host runs",
                cc,
                done.returncode,
                why[0][:200],
            )
            return None
        os.replace(tmp, program)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning(
            "the C NVML host could not be built in %s (%s): the Python host runs",
            program.parent,
            exc,
        )
        return None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    log.info("built the C NVML host in %.2f s: %s", time.monotonic() - started, program)
    return program


#: Parts of a variable's name that mark it a secret (``HF_TOKEN``, ``VAST_API_KEY``,
#: ``AWS_SECRET_ACCESS_KEY``, ...): the host, which loads a driver library and needs none of
#: them, is started without these.
SECRET_NAME_PARTS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


def host_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The agent's environment without its secrets: what the loader needs (``PATH``,
    ``LD_LIBRARY_PATH``) and the driver's own settings stay."""
    source = os.environ if environ is None else environ
    return {
        name: value
        for name, value in source.items()
        if not any(part in name.upper() for part in SECRET_NAME_PARTS)
    }


class _Struct:
    """An answer's structure, read by attribute like pynvml's (``rates.gpu``)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__!r})"
