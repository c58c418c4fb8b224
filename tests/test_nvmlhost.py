"""NVML through the NVML host process (agent/gpu/nvml.py, agent/gpu/nvmlhost.py,
agent/gpu/nvmlhost.c), for real: the host is the C program agent/gpu/nvmlhost.py builds with the
box's ``cc``, or a real ``python -I -S agent/gpu/nvml.py`` (the ``host`` fixture runs each test
with both), that loads, through the dynamic loader, a ``libnvidia-ml.so.1`` found on
``LD_LIBRARY_PATH``. This machine has no driver, so that library
is tests/fakes/nvml/fake_nvml.c, compiled here: NVML's C symbols and return codes over a box
scripted by a control file the tests rewrite while the host runs (hangs and crashes included).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent.config.model import Env
from agent.daemon.spine import Daemon
from agent.gpu import nvml as nv
from agent.gpu import nvmlhost
from agent.gpu.health import GpuMonitor
from agent.gpu.nvmlhost import HOST_ENV, NvmlHost
from agent.preflight.driver import read_driver
from agent.state import Reason
from agent.util import logutil
from tests.fakes.scripted_launcher import ScriptedLauncher
from tests.support import tiny_job, wait_for
from tests.test_metrics import samples

FAKE_SOURCE = Path(__file__).parent / "fakes" / "nvml" / "fake_nvml.c"


@pytest.fixture(scope="session")
def fake_lib_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:  # as tests/test_page.py without chromium: .ci/run installs both
        pytest.skip("needs a C compiler for the stand-in libnvidia-ml.so.1 (.ci/run installs gcc)")
    out = tmp_path_factory.mktemp("nvml")
    subprocess.run(
        [cc, "-Wall", "-shared", "-fPIC", "-o", str(out / "libnvidia-ml.so.1"), str(FAKE_SOURCE)],
        check=True,
    )
    # A stand-in libcuda.so.1 (empty) for the stand-in NVML to dlopen, as the real one does.
    subprocess.run(
        [cc, "-shared", "-fPIC", "-x", "c", "-o", str(out / "libcuda.so.1"), "/dev/null"],
        check=True,
    )
    return out


class Box:
    """The control file of the stand-in library."""

    def __init__(self, path: Path, calls: Path) -> None:
        self.path = path
        self.calls = calls
        self.values: dict[str, str] = {}

    def set(self, **values: object) -> None:
        self.values.update({k: str(v) for k, v in values.items()})
        lines = [f"{k}={v}" for k, v in self.values.items()] + [f"calls={self.calls}"]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.path)

    def called(self) -> list[str]:
        return self.calls.read_text().split() if self.calls.exists() else []


@pytest.fixture
def box(fake_lib_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Box:
    monkeypatch.setenv("LD_LIBRARY_PATH", str(fake_lib_dir))
    monkeypatch.setenv("FAKE_NVML_CONTROL", str(tmp_path / "box.txt"))
    b = Box(tmp_path / "box.txt", tmp_path / "calls.txt")
    b.set(gpus=2, util=97, power=650000, limit=700000, ecc=0)
    return b


@pytest.fixture(params=["c", "python"])
def host(request: pytest.FixtureRequest) -> Iterator[NvmlHost]:
    h = NvmlHost(timeout_s=2.0, init_timeout_s=10.0, kind=request.param)
    yield h
    h.close()
    assert h.started_kind in (None, request.param)


def _maps(pid: int | str) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped counts as gone
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        time.sleep(0.05)
    return False


def test_every_call_reaches_the_c_library_through_the_host(box: Box, host: NvmlHost) -> None:
    box.set(temp=61, reasons=nv.nvmlClocksEventReasonHwThermalSlowdown, xids="1:79")
    host.nvmlInit()
    assert host.nvmlDeviceGetCount() == 2
    h0, h1 = host.nvmlDeviceGetHandleByIndex(0), host.nvmlDeviceGetHandleByIndex(1)
    assert isinstance(h0, int) and h0 != h1
    assert host.nvmlDeviceGetUUID(h1) == "GPU-fake-1"
    assert host.nvmlDeviceGetIndex(h1) == 1
    rates = host.nvmlDeviceGetUtilizationRates(h0)
    assert (rates.gpu, rates.memory) == (97, 0)
    assert host.nvmlDeviceGetPowerUsage(h0) == 650000
    assert host.nvmlDeviceGetEnforcedPowerLimit(h0) == 700000
    memory = host.nvmlDeviceGetMemoryInfo(h0)
    assert (memory.total, memory.free, memory.used) == (80 << 30, 80 << 30, 0)
    assert host.nvmlDeviceGetTemperature(h0, nv.NVML_TEMPERATURE_GPU) == 61
    args = (h0, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
    assert host.nvmlDeviceGetTotalEccErrors(*args) == 0
    assert host.nvmlDeviceGetCurrentClocksEventReasons(h0) == 0x40
    assert host.nvmlSystemGetDriverVersion() == "580.159.04"
    assert host.nvmlSystemGetCudaDriverVersion() == 13000
    events = host.nvmlEventSetCreate()
    host.nvmlDeviceRegisterEvents(h1, nv.nvmlEventTypeXidCriticalError, events)
    data = host.nvmlEventSetWait(events, 0)
    assert (data.device, data.eventType, data.eventData) == (h1, 8, 79)
    with pytest.raises(nv.NVMLError) as no_event:
        host.nvmlEventSetWait(events, 0)
    assert no_event.value.value == nv.NVML_ERROR_TIMEOUT
    host.nvmlEventSetFree(events)
    host.nvmlShutdown()
    # pynvml's C symbols, versioned where pynvml uses the versioned ones.
    for symbol in (
        "nvmlInitWithFlags",
        "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByIndex_v2",
        "nvmlEventSetWait_v2",
        "nvmlShutdown",
    ):
        assert symbol in box.called()


def test_memory_info_reads_nvml_memory_t_and_its_return_codes(box: Box, host: NvmlHost) -> None:
    """``nvmlMemory_t`` (v1) is three unsigned long longs in the order total, free, used: a
    141 GiB H200's figures (past 32 bits) come back whole and each in its own field."""
    box.set(mem_total=150_754_820_096, mem_used=30_000_000_000)
    host.nvmlInit()
    h0 = host.nvmlDeviceGetHandleByIndex(0)
    memory = host.nvmlDeviceGetMemoryInfo(h0)
    assert (memory.total, memory.free, memory.used) == (
        150_754_820_096,
        150_754_820_096 - 30_000_000_000,
        30_000_000_000,
    )
    box.set(mem_rc=nv.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(nv.NVMLError) as refused:
        host.nvmlDeviceGetMemoryInfo(h0)
    assert refused.value.value == nv.NVML_ERROR_NO_PERMISSION
    box.set(mem_rc=0, lost=0)
    with pytest.raises(nv.NVMLError) as lost:
        host.nvmlDeviceGetMemoryInfo(h0)
    assert lost.value.value == nv.NVML_ERROR_GPU_IS_LOST
    assert "nvmlDeviceGetMemoryInfo" in box.called()


def test_the_monitors_samples_carry_memory_and_a_refusal_leaves_it_unknown(box: Box) -> None:
    box.set(mem_total=150_754_820_096, mem_used=30_000_000_000)
    gpu = GpuMonitor()
    try:
        samples = gpu.samples()
        assert [(s.memory_used_bytes, s.memory_total_bytes) for s in samples] == [
            (30_000_000_000, 150_754_820_096)
        ] * 2
        assert samples[0].as_dict()["memory_used_bytes"] == 30_000_000_000
        # Some virtualised GPUs refuse it: unknown, and the GPU is not taken for lost.
        box.set(mem_rc=nv.NVML_ERROR_NO_PERMISSION)
        refused = gpu.samples()
        assert [(s.memory_used_bytes, s.util_pct) for s in refused] == [(None, 97.0)] * 2
        assert gpu.faults() == []
    finally:
        gpu.close()


@pytest.mark.parametrize("kind", ["", "python"])
def test_the_library_is_mapped_in_the_host_never_in_the_agent(
    box: Box, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HOST_ENV, kind)  # unset: the C host, built with the box's cc
    gpu = GpuMonitor()
    try:
        assert gpu.available
        host_pid = gpu._nvml.pid
        assert host_pid is not None and host_pid != os.getpid()
        assert "libnvidia-ml.so.1" in _maps(host_pid)
        assert "libnvidia-ml" not in _maps("self")
        cmdline = Path(f"/proc/{host_pid}/cmdline").read_bytes().split(b"\0")
        if kind == "python":  # a bare interpreter: -I -S, nothing of the agent's site-packages
            assert cmdline[1:3] == [b"-I", b"-S"] and cmdline[3].endswith(b"agent/gpu/nvml.py")
            assert "libpython" in _maps(host_pid) or "python" in os.readlink(
                f"/proc/{host_pid}/exe"
            )
        else:  # the C program, and no Python in it
            assert Path(cmdline[0].decode()).name.startswith("nvmlhost-")
            assert gpu._nvml.started_kind == "c"
            assert "python" not in _maps(host_pid).lower()
    finally:
        gpu.close()
    assert _gone(host_pid)
    assert "nvmlShutdown" in box.called()


def test_the_monitor_over_the_host_sees_load_xid_ecc_and_a_lost_gpu(box: Box) -> None:
    box.set(xids="0:13,0:79")
    gpu = GpuMonitor()
    try:
        samples = gpu.samples()
        assert [(s.index, s.util_pct, s.power_w, s.power_limit_w) for s in samples] == [
            (0, 97.0, 650.0, 700.0),
            (1, 97.0, 650.0, 700.0),
        ]
        assert all(s.busy for s in samples)
        faults = gpu.faults()  # Xid 13 is the application's: only 79 is a box fault
        assert [(f.index, f.kind) for f in faults] == [(0, "xid")]
        assert "Xid 79" in faults[0].message and "GPU-fake-0" in faults[0].message
        assert gpu.faults() == []  # each event once
        box.set(ecc=2)
        assert [(f.index, f.kind) for f in gpu.faults()] == [(0, "ecc_dbe"), (1, "ecc_dbe")]
        box.set(lost=1)
        lost = gpu.faults()
        assert [(f.index, f.kind) for f in lost] == [(1, "lost")]
        assert "GPU is lost" in lost[0].message
    finally:
        gpu.close()


def test_a_call_that_hangs_in_the_driver_kills_the_host_not_the_agent(
    box: Box, host: NvmlHost, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = GpuMonitor(host)
    assert gpu.available
    pid = host.pid
    assert pid is not None
    box.set(hang="nvmlDeviceGetPowerUsage")
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="agent.gpu"):
        samples = gpu.samples()
    took = time.monotonic() - t0
    assert took < 10, took  # the host's 2 s timeout, then the kill
    assert (samples[0].util_pct, samples[0].power_w) == (97.0, None)
    assert _gone(pid)
    reason = gpu.unavailable_reason or ""
    assert "did not answer nvmlDeviceGetPowerUsage within 2 s" in reason
    assert "no longer watched" in reason
    assert gpu.available is False
    assert [r.getMessage() for r in caplog.records if "did not answer" in r.getMessage()]
    # From now on nothing is asked: no new host, nothing blocks.
    box.set(hang="")
    t0 = time.monotonic()
    assert gpu.samples() == [] and gpu.faults() == []
    assert time.monotonic() - t0 < 1
    assert host.pid is None
    gpu.close()


def test_a_driver_that_crashes_its_caller_crashes_the_host(box: Box, host: NvmlHost) -> None:
    gpu = GpuMonitor(host)
    assert gpu.available
    box.set(crash="nvmlDeviceGetUtilizationRates")
    gpu.samples()
    reason = gpu.unavailable_reason or ""
    assert "NVML host died during nvmlDeviceGetUtilizationRates" in reason
    assert "SIGSEGV" in reason
    assert gpu.faults() == []
    with pytest.raises(nv.NVMLError) as again:
        host.nvmlDeviceGetCount()
    assert again.value.value == nv.HOST_GONE


def test_a_driver_that_does_not_start_leaves_the_monitor_unavailable(box: Box) -> None:
    box.set(init_rc=nv.NVML_ERROR_DRIVER_NOT_LOADED)
    gpu = GpuMonitor()
    assert gpu.available is False
    assert gpu.unavailable_reason == (
        "NVML did not start: Driver Not Loaded (no NVIDIA driver or GPU here)"
    )
    assert gpu._nvml.pid is None  # ended at once: nothing to watch
    gpu.close()


def test_the_host_gets_no_secret_of_the_agent(
    box: Box, host: NvmlHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_Zq9w1")
    monkeypatch.setenv("VAST_API_KEY", "vk_Zq9w2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws_Zq9w3")
    host.nvmlInit()
    environ = Path(f"/proc/{host.pid}/environ").read_bytes().split(b"\0")
    names = {e.split(b"=", 1)[0] for e in environ if e}
    assert b"LD_LIBRARY_PATH" in names and b"PATH" in names  # what the loader needs stays
    assert not names & {b"HF_TOKEN", b"VAST_API_KEY", b"AWS_SECRET_ACCESS_KEY"}
    assert b"Zq9w" not in b"".join(environ)


def test_the_host_ignores_sigint_and_ends_with_its_pipe(box: Box, host: NvmlHost) -> None:
    host.nvmlInit()
    pid = host.pid
    assert pid is not None
    os.kill(pid, signal.SIGINT)  # a Ctrl-C meant for the agent reaches its process group
    time.sleep(0.2)
    assert host.nvmlDeviceGetCount() == 2
    host.close()
    assert _gone(pid)
    with pytest.raises(nv.NVMLError) as closed:
        host.nvmlDeviceGetCount()
    assert closed.value.value == nv.HOST_GONE


def test_the_host_ends_when_the_agent_is_killed(box: Box, tmp_path: Path) -> None:
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import sys, time
                from agent.gpu.nvmlhost import NvmlHost
                host = NvmlHost()
                host.nvmlInit()
                print(host.pid, flush=True)
                time.sleep(60)
                """
            ),
        ],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stdout is not None
        host_pid = int(agent.stdout.readline())
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(10)
        # The kernel closed the agent's end of the pipe: the host read end of input and left.
        assert _gone(host_pid)
    finally:
        agent.kill()
        agent.wait()
        if agent.stdout is not None:
            agent.stdout.close()


def test_the_host_imports_ctypes_json_and_signal_and_what_they_need_only() -> None:
    # The host runs as long as the job: every module is memory of ours (issue 26). -X importtime
    # lists what the real host process imports, up to its exit at the end of its input.
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-X", "importtime", nv.__file__],
        input=b"",
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in out.stderr.decode().splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert {"ctypes", "json", "signal"} <= imported
    assert not imported & {"typing", "logging", "subprocess", "threading", "agent", "asyncio"}


def test_requests_the_host_does_not_know_are_refused_not_fatal() -> None:
    lib = nv.Library("libnvidia-ml-not-here.so.1")
    assert nv.answer(lib, b'{"fn": "nvmlDeviceGetCount", "args": []}') == {
        "err": nv.NVML_ERROR_UNINITIALIZED,
        "msg": "Uninitialized",
    }
    assert nv.answer(lib, b'{"fn": "nvmlInit"}')["err"] == nv.NVML_ERROR_LIBRARY_NOT_FOUND
    refused = nv.answer(lib, b'{"fn": "__init__", "args": []}')
    assert refused["err"] == nv.NVML_ERROR_INVALID_ARGUMENT
    assert nv.answer(lib, b"not json")["err"] == nv.NVML_ERROR_INVALID_ARGUMENT
    assert nv.answer(lib, b'{"fn": "nvmlDeviceGetIndex", "args": "x"}')["err"] == 2


class _Talk:
    """A host process spoken to line by line, as NvmlHost speaks to it."""

    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=nvmlhost.host_env()
        )

    def ask(self, request: bytes | dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        line = request if isinstance(request, bytes) else json.dumps(request).encode()
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        assert isinstance(answer, dict)
        return answer

    def end(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        code = self.proc.wait(10)
        self.proc.stdout.close()
        return code


def test_the_c_host_answers_every_request_as_the_python_host_does(box: Box) -> None:
    # The two hosts side by side over the same stand-in library, request by request: the same
    # values, the same NVML error codes and words (nvmlErrorString for a code pynvml does not
    # name), and the same refusal code for what is not a request.
    box.set(xids="0:79", temp=55, driver="580.159.04", cuda=13000)
    built = nvmlhost.c_host()
    assert built is not None, "cc is here (.ci/run installs gcc): the C host must build"
    c, py = _Talk([str(built)]), _Talk(nvmlhost.python_host_command(sys.executable))

    def both(request: bytes | dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        return c.ask(request), py.ask(request)

    def call(fn: str, *args: int) -> dict[str, Any]:
        a, b = both({"fn": fn, "args": list(args)})
        assert a == b, (fn, a, b)
        return a

    try:
        assert call("nvmlDeviceGetCount") == {"err": 1, "msg": "Uninitialized"}
        assert call("nvmlInit") == {"ok": None}
        assert call("nvmlDeviceGetCount") == {"ok": 2}
        # Handles and event sets are addresses in each host: the same call, each its own.
        hc, hp = both({"fn": "nvmlDeviceGetHandleByIndex", "args": [1]})
        assert isinstance(hc["ok"], int) and isinstance(hp["ok"], int)
        pairs = [
            ("nvmlDeviceGetUUID", []),
            ("nvmlDeviceGetIndex", []),
            ("nvmlDeviceGetUtilizationRates", []),
            ("nvmlDeviceGetMemoryInfo", []),
            ("nvmlDeviceGetPowerUsage", []),
            ("nvmlDeviceGetEnforcedPowerLimit", []),
            ("nvmlDeviceGetTemperature", [nv.NVML_TEMPERATURE_GPU]),
            ("nvmlDeviceGetTotalEccErrors", [nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, 0]),
            ("nvmlDeviceGetCurrentClocksEventReasons", []),
            ("nvmlDeviceGetCurrentClocksThrottleReasons", []),  # not in the stand-in: 13
        ]
        for fn, extra in pairs:
            a = c.ask({"fn": fn, "args": [hc["ok"], *extra]})
            b = py.ask({"fn": fn, "args": [hp["ok"], *extra]})
            assert a == b, (fn, a, b)
        assert call("nvmlSystemGetDriverVersion") == {"ok": "580.159.04"}
        assert call("nvmlSystemGetCudaDriverVersion") == {"ok": 13000}
        ec, ep = both({"fn": "nvmlEventSetCreate", "args": []})
        h0c = c.ask({"fn": "nvmlDeviceGetHandleByIndex", "args": [0]})["ok"]
        h0p = py.ask({"fn": "nvmlDeviceGetHandleByIndex", "args": [0]})["ok"]
        xid = nv.nvmlEventTypeXidCriticalError
        assert c.ask({"fn": "nvmlDeviceRegisterEvents", "args": [h0c, xid, ec["ok"]]}) == {
            "ok": None
        }
        assert py.ask({"fn": "nvmlDeviceRegisterEvents", "args": [h0p, xid, ep["ok"]]}) == {
            "ok": None
        }
        wc = c.ask({"fn": "nvmlEventSetWait", "args": [ec["ok"], 10]})
        wp = py.ask({"fn": "nvmlEventSetWait", "args": [ep["ok"], 10]})
        assert wc["ok"].pop("device") == h0c and wp["ok"].pop("device") == h0p
        assert wc == wp and wc["ok"]["eventData"] == 79
        assert c.ask({"fn": "nvmlEventSetWait", "args": [ec["ok"], 10]}) == py.ask(
            {"fn": "nvmlEventSetWait", "args": [ep["ok"], 10]}
        )  # each event once: a timeout now
        box.set(mem_rc=17)  # a code pynvml has no words for: nvmlErrorString's
        a = c.ask({"fn": "nvmlDeviceGetMemoryInfo", "args": [hc["ok"]]})
        assert a == py.ask({"fn": "nvmlDeviceGetMemoryInfo", "args": [hp["ok"]]})
        assert a == {"err": 17, "msg": "a fake NVML error"}
        box.set(mem_rc=0, lost=1)
        assert c.ask({"fn": "nvmlDeviceGetPowerUsage", "args": [hc["ok"]]}) == {
            "err": 15,
            "msg": "GPU is lost",
        }
        # Not requests: refused with INVALID_ARGUMENT, and each host keeps serving.
        for bad in [
            b"not json",
            b"[1, 2]",
            b'{"fn": "nope", "args": []}',
            b'{"fn": "__init__", "args": []}',
            b'{"fn": "nvmlDeviceGetIndex", "args": "x"}',
            b'{"fn": "nvmlDeviceGetIndex", "args": ["x"]}',
            b'{"fn": "nvmlDeviceGetIndex", "args": [1, 2, 3]}',
            b'{"fn": "nvmlDeviceGetCount", "args": [], "trailing"',
            b'{"args": []}',
            b"{" + b'"a": [' * 40 + b"]" * 40 + b"}",
        ]:
            a, b = both(bad)
            assert a["err"] == b["err"] == nv.NVML_ERROR_INVALID_ARGUMENT, (bad, a, b)
            assert isinstance(a["msg"], str) and a["msg"]
        # A line over 64 KiB, and a NUL inside a line: refused, not fatal.
        assert c.ask(b'{"fn": "nvmlDeviceGetCount", "pad": "' + b"x" * 70000 + b'"}')["err"] == 2
        assert c.ask(b'{"fn": "nvmlDeviceGetCount"\x00}')["err"] == 2
        assert c.ask(b'{"fn": "nvmlDeviceGetCount", "x": {"y": [1.5e3, "a\\"b", null]}}') == {
            "ok": 2
        }
        assert call("nvmlShutdown") == {"ok": None}
    finally:
        assert c.end() == 0 and py.end() == 0


def test_the_c_host_keeps_libcuda_out_unless_nvml_cannot_start_without_it(box: Box) -> None:
    # The 580 driver's nvmlInitWithFlags dlopens libcuda (3.9 MiB of the host on an H200), which
    # no call of the agent's needs: the C host refuses it; the Python host lets it load.
    box.set(libcuda=1)
    for kind, seen in (("c", "libcuda:refused"), ("python", "libcuda:loaded")):
        box.calls.unlink(missing_ok=True)
        host = NvmlHost(timeout_s=2.0, kind=kind)
        try:
            host.nvmlInit()
            assert host.started_kind == kind
            assert seen in box.called()
            assert ("libcuda.so.1" in _maps(host.pid or 0)) is (kind == "python")
            assert host.nvmlDeviceGetCount() == 2
        finally:
            host.close()
    # A driver whose NVML fails to start without libcuda: the C host lets it load and starts it
    # again; the agent sees an NVML that started.
    box.set(libcuda=2)
    box.calls.unlink(missing_ok=True)
    host = NvmlHost(timeout_s=2.0, kind="c")
    try:
        host.nvmlInit()
        called = box.called()
        assert called.index("libcuda:refused") < called.index("libcuda:loaded")
        assert "libcuda.so.1" in _maps(host.pid or 0)
        assert host.nvmlDeviceGetCount() == 2
    finally:
        host.close()


def test_the_c_host_is_built_once_and_kept_by_the_digest_of_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(nvmlhost.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(nvmlhost, "_built", {})
    with caplog.at_level(logging.INFO, logger="agent.gpu.nvmlhost"):
        first = nvmlhost.c_host()
    assert first is not None and first.parent == tmp_path / "cache"
    assert first.name.startswith("nvmlhost-") and os.access(first, os.X_OK)
    assert [r for r in caplog.records if "built the C NVML host" in r.getMessage()]
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left
    # Another process (a fresh memo) finds the program and builds nothing.
    monkeypatch.setattr(nvmlhost, "_built", {})
    monkeypatch.setenv("PATH", str(tmp_path / "no-compiler-here"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="agent.gpu.nvmlhost"):
        assert nvmlhost.c_host() == first
    assert not [r for r in caplog.records if "built" in r.getMessage()]
    # A changed source is another program.
    changed = tmp_path / "nvmlhost.c"
    changed.write_bytes(nvmlhost.C_SOURCE.read_bytes() + b"\n/* changed */\n")
    monkeypatch.undo()
    monkeypatch.setenv(nvmlhost.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(nvmlhost, "_built", {})
    other = nvmlhost.c_host(changed)
    assert other is not None and other != first and other.parent == first.parent


def test_without_a_compiler_or_with_a_failed_build_the_python_host_runs(
    box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(nvmlhost.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(nvmlhost, "_built", {})
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no cc, no gcc
    with caplog.at_level(logging.INFO, logger="agent.gpu.nvmlhost"):
        host = NvmlHost(timeout_s=2.0)
        try:
            host.nvmlInit()
            assert host.started_kind == "python" and host.nvmlDeviceGetCount() == 2
        finally:
            host.close()
    assert [r for r in caplog.records if "no C compiler" in r.getMessage()]
    # A compiler that fails (a broken source here): a warning that names the failure.
    monkeypatch.undo()
    monkeypatch.setenv(nvmlhost.CACHE_ENV, str(tmp_path / "cache2"))
    monkeypatch.setattr(nvmlhost, "_built", {})
    broken = tmp_path / "nvmlhost.c"
    broken.write_text("int main(void) { this is not C }\n")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agent.gpu.nvmlhost"):
        assert nvmlhost.c_host(broken) is None
    assert [r for r in caplog.records if "did not build" in r.getMessage()]
    assert not (tmp_path / "cache2").exists() or not list((tmp_path / "cache2").iterdir())


def test_the_host_kind_is_the_users_choice(
    box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HOST_ENV, "python")
    assert nvmlhost.host_command(sys.executable)[0] == "python"
    monkeypatch.setenv(HOST_ENV, "c")
    assert nvmlhost.host_command(sys.executable)[0] == "c"
    monkeypatch.setenv(HOST_ENV, "rust")  # not a kind: the default, with a warning
    assert nvmlhost.host_command(sys.executable)[0] == "c"
    # A built program that cannot run (a cache on a noexec mount, say): the Python host.
    monkeypatch.delenv(HOST_ENV)
    monkeypatch.setattr(nvmlhost, "c_host", lambda: tmp_path / "nvmlhost-gone")
    host = NvmlHost(timeout_s=2.0)
    try:
        host.nvmlInit()
        assert host.started_kind == "python"
    finally:
        host.close()


def test_preflight_reads_the_driver_through_a_host_it_ends(box: Box) -> None:
    box.set(driver="570.86.15", cuda=12080)
    info = asyncio.run(read_driver(10.0))
    assert (info.version, info.cuda, info.source) == ("570.86.15", "12.8", "nvml")
    assert "nvmlShutdown" in box.called()
    box.set(init_rc=nv.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
    failed = asyncio.run(read_driver(10.0))
    assert failed.version is None
    assert "NVML: RM has detected an NVML/RM version mismatch." in (failed.error or "")


# ------------------------------------------------------------------------------------------
# The whole agent: its supervision loop over a GPU monitor on the host


def _run_daemon(
    tmp: Path, gpu: GpuMonitor, during: Any, *, epochs: int = 5, limits: str = ""
) -> Daemon:
    data = tmp / "data.yaml"
    data.write_text("train: images\nval: images\nnames:\n  0: box\n")
    sections = f'[sync]\ntarget = "file://{tmp / "synced"}"\n' + (
        f"[limits]\n{limits}\n" if limits else ""
    )
    job = tiny_job(tmp, data, epochs=epochs, sections=sections)
    daemon = Daemon(
        job,
        Env(state_dir=tmp / "state"),
        launcher=ScriptedLauncher(epoch_s=0.3),
        gpu=gpu,
        poll_interval_s=0.1,
    )

    async def main() -> int:
        side = asyncio.create_task(during(tmp / "runs" / "run1"))
        try:
            code = await asyncio.wait_for(daemon.run(), 120)
        finally:
            side.cancel()
        if not side.cancelled() and side.exception() is not None:
            raise AssertionError("the test's side of the run failed") from side.exception()
        return code

    assert asyncio.run(main()) == 0
    return daemon


async def _epoch(run_dir: Path, n: int) -> None:
    def reached() -> bool:
        try:
            return int(json.loads((run_dir / "status.json").read_text())["completed_epochs"]) >= n
        except (OSError, ValueError, KeyError, TypeError):
            return False

    await wait_for(reached, 60)


def test_an_xid_seen_by_the_host_stops_the_run_as_a_box_fault(box: Box, tmp_path: Path) -> None:
    async def xid_at_epoch_2(run_dir: Path) -> None:
        await _epoch(run_dir, 2)
        box.set(xids="0:79")

    logutil.rate_limit.reset()  # an earlier test's same line must not hold this one back
    daemon = _run_daemon(tmp_path, GpuMonitor(), xid_at_epoch_2)
    assert daemon.state.reason == Reason.TRAINING_FAILED
    assert "GPU fault: GPU 0 (GPU-fake-0): Xid 79 (GPU has fallen off the bus)" in (
        daemon.state.cause or ""
    )
    assert daemon.state.resumes == []  # a box fault is not resumed on the same box
    assert daemon.gpu is not None and daemon.gpu._nvml.pid is None  # the host ended with the agent
    # The fault is logged once where it is seen, then once for each thing done about it; the
    # monitor no longer logs it a second time (it returns it to the supervision, which does).
    lines = (tmp_path / "state" / "agent.log").read_text().splitlines()
    said = [line.split()[3] for line in lines if "Xid 79" in line]
    assert said == ["agent.daemon.training:", "agent.daemon.relaunch:", "agent.daemon.finish:"]
    assert sum("ERROR agent.daemon.training: GPU fault: GPU 0" in line for line in lines) == 1


@pytest.mark.parametrize(
    "limits", ['stall_timeout = "10m"', ""], ids=["stall-watch", "no-stall-limit"]
)
def test_gpu_memory_reaches_history_and_metrics_from_the_host(
    box: Box, tmp_path: Path, limits: str
) -> None:
    """The C library's figures, through the host, the monitor and the progress watch's samples,
    into the real server's /history (per epoch, summed over the GPUs) and /metrics (per GPU),
    with a stall limit or without one (the default job has none: the watch still samples)."""
    box.set(mem_total=150_754_820_096, mem_used=30_000_000_000)
    seen: dict[str, Any] = {}

    async def read_then_end(run_dir: Path) -> None:
        try:
            await _read(run_dir)
        finally:
            box.set(xids="0:79")  # ends the run (a box fault), whatever the reads found

    async def _read(run_dir: Path) -> None:
        await _epoch(run_dir, 1)  # the server is up and its port in state.json
        port = json.loads((tmp_path / "state" / "state.json").read_text())["server"]["port"]
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:

            async def get(path: str) -> Any:
                async with session.get(base + path) as r:
                    assert r.status == 200, (path, r.status)
                    return await (r.json() if path == "/history" else r.text())

            rows: list[dict[str, Any]] = []
            # The first epochs may end before the first sample: a few more, not for ever.
            while not any("gpu/memory_used_bytes" in r for r in rows) and len(rows) < 20:
                await _epoch(run_dir, len(rows) + 1)
                rows = await get("/history")
            seen["history"] = rows
            seen["metrics"] = await get("/metrics")

    _run_daemon(tmp_path, GpuMonitor(), read_then_end, epochs=1000, limits=limits)
    with_memory = [r for r in seen["history"] if "gpu/memory_used_bytes" in r]
    assert with_memory, seen["history"][-1]
    row = with_memory[-1]
    assert row["gpu/memory_used_bytes"] == 2 * 30_000_000_000
    assert row["gpu/memory_total_bytes"] == 2 * 150_754_820_096
    got = samples(seen["metrics"])
    for gpu in ("0", "1"):
        assert got[("libreyolo_agent_gpu_memory_used_bytes", (("gpu", gpu),))] == 30_000_000_000
        assert got[("libreyolo_agent_gpu_memory_total_bytes", (("gpu", gpu),))] == 150_754_820_096


def test_a_hung_nvml_call_does_not_freeze_the_supervision_loop(box: Box, tmp_path: Path) -> None:
    async def hang_at_epoch_2(run_dir: Path) -> None:
        await _epoch(run_dir, 2)
        box.set(hang="nvmlEventSetWait_v2")  # faults() asks for Xid events every loop turn

    host = NvmlHost(timeout_s=1.0)
    daemon = _run_daemon(tmp_path, GpuMonitor(host), hang_at_epoch_2)
    assert daemon.state.reason == Reason.COMPLETED, daemon.state.cause
    log = (tmp_path / "state" / "agent.log").read_text()
    assert "NVML did not answer nvmlEventSetWait within 1 s" in log
    assert daemon.gpu is not None
    assert "no longer watched" in (daemon.gpu.unavailable_reason or "")
    host.close()
