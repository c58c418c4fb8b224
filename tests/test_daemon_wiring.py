"""The daemon's wiring of systemd's notify socket and of the sizing verdict, with the fake
launcher and clock of tests/test_daemon_loop.py: a real unix datagram socket bound by the test,
the real /status endpoint."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from pathlib import Path

import pytest

from agent.gpu.health import GpuSample
from agent.state import Phase, Reason
from agent.watch.sizing import SizingWatch
from tests.support import HANG_S, wait_for
from tests.test_daemon_loop import make, started, write_status


def test_systemd_hears_ready_each_phase_and_stopping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    messages: list[str] = []
    done = threading.Event()

    def listen() -> None:  # as systemd does: read as the datagrams come
        while not done.is_set():
            try:
                messages.append(sock.recv(4096).decode())
            except TimeoutError:
                continue

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # a ping every 50 ms
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    daemon, trainer, _, _ = make(tmp_path)

    async def main() -> int:
        task = asyncio.create_task(daemon.run())
        await started(daemon)
        # Some watchdog pings while training (waited for: a loaded machine pings later).
        await wait_for(lambda: sum("WATCHDOG=1" in m for m in messages) >= 2)
        write_status(trainer.run_dir, "completed", 10)
        trainer.exit(0)
        return await asyncio.wait_for(task, HANG_S)

    try:
        assert asyncio.run(main()) == 0
    finally:
        done.set()
        listener.join(5)
        sock.close()
    assert daemon.state.phase == Phase.DONE
    text = "\n".join(messages)
    ready = next(i for i, m in enumerate(messages) if "READY=1" in m)
    stopping = next(i for i, m in enumerate(messages) if "STOPPING=1" in m)
    assert ready < stopping == len(messages) - 1
    assert sum("WATCHDOG=1" in m for m in messages) >= 2
    for phase in ("TRAINING", "FINISHING", "TEARDOWN", "DONE"):
        assert f"STATUS=phase {phase}" in text, phase
    assert "STATUS=phase TEARDOWN (completed)" in text


def write_timed_status(run_dir: Path, done: int) -> None:
    """status.json as LibreYOLO writes it at an epoch's end, with the epoch's time."""
    write_status(run_dir, "running", done)
    doc = json.loads((run_dir / "status.json").read_text())
    doc.update(epoch_seconds=60.0, mean_epoch_seconds=60.0, current_epoch=done)
    tmp = run_dir / ".status.tmp"
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, run_dir / "status.json")


class BusyGpu:
    """A GPU monitor whose samples say: idle card (the box is the wrong size for this job)."""

    available = True

    def samples(self) -> list[GpuSample]:
        return [GpuSample(index=0, util_pct=2.0, power_w=60.0, power_limit_w=700.0)]

    def faults(self) -> list[object]:
        return []

    def close(self) -> None:
        pass


def test_sizing_verdict_and_projection_are_served_and_stop_a_wrong_box(
    tmp_path: Path,
) -> None:
    limits = "price_usd_per_hour = 3.6"
    extra = '[profile]\non_verdict = "stop"\n'
    daemon, trainer, _, clock = make(tmp_path, limits, extra=extra)
    daemon.gpu = BusyGpu()  # type: ignore[assignment]
    # The tiny job trains on the CPU (device "cpu": no GPU of its own); watch every GPU instead.
    daemon.sizing.watch = SizingWatch(gpu_indices=None, workers=0)

    async def main() -> int:
        task = asyncio.create_task(daemon.run())
        await started(daemon)
        for _ in range(6):  # samples of the first epoch: the card idles
            clock.now += 10.0
            await asyncio.sleep(0.03)
        write_timed_status(trainer.run_dir, 1)
        return await asyncio.wait_for(task, HANG_S)  # the verdict after epoch 1 stops the run

    assert asyncio.run(main()) == 0
    assert daemon.state.reason == Reason.PREFLIGHT_FAILED
    assert (daemon.state.cause or "").startswith("sizing: wrong box: idle gpu"), daemon.state.cause
    assert daemon.sizing.projection is not None
    assert daemon.sizing.projection.total_usd is not None
    # What /status serves (the same document): the verdict and the projection at $3.6/h.
    served = daemon.status_dict()["sizing"]
    assert served["verdict"]["bound"] == "idle gpu" and served["verdict"]["wrong_box"] is True
    assert served["projection"]["total_s"] == 600.0  # 10 epochs x 60 s
    assert trainer.stops, "the trainer was stopped"
