"""Webhook notices: a real aiohttp receiver on 127.0.0.1 gets what the bus publishes, in order,
retried when it answers 5xx/429, given up on a 400, never a secret, never blocking publish."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agent.config.model import DEFAULT_NOTIFY_EVENTS, NotifySection
from agent.events import Event, EventBus
from agent.status.notify import REDACTED, Notifier, Retry, notice_text
from tests.support import wait_for
from tests.test_daemon_loop import PricedProvider

#: A Slack-like path: the token is part of the URL, so the URL is a secret.
HOOK_PATH = "/services/T0FAKE/B0FAKE/xoxFAKEwebhookTOKEN0123456789"
HF_TOKEN = "hf_FAKEtokenABCDEFGHIJ0123456789"
VAST_KEY = "vastFAKEkey-0123456789abcdef"


@dataclass
class Answer:
    status: int
    retry_after: str | None = None
    #: Hold the request until :meth:`Receiver.release` (a receiver that hangs).
    hang: bool = False


class Receiver:
    """A webhook receiver on 127.0.0.1 in its own thread and event loop (so that it can hang
    while the test's loop goes on). Records every request; answers 200 unless told otherwise.
    Its error answers echo the request's URL, as some servers do, to catch a leak in logs."""

    def __init__(self) -> None:
        self.attempts: list[dict[str, Any]] = []
        #: Raw bodies of the requests answered 200, in arrival order.
        self.raw: list[str] = []
        self.answers: deque[Answer] = deque()
        self.arrived = threading.Event()
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def received(self) -> list[dict[str, Any]]:
        with self._lock:
            return [json.loads(r) for r in self.raw]

    def kinds(self) -> list[str]:
        return [b["event"]["kind"] for b in self.received]

    def url(self, path: str = HOOK_PATH) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def answer(self, status: int, *, times: int = 1, retry_after: str | None = None) -> None:
        for _ in range(times):
            self.answers.append(Answer(status, retry_after))

    def hang(self) -> None:
        """The next request is held until :meth:`release`."""
        self.answers.append(Answer(200, hang=True))

    def release(self) -> None:
        self._released.set()

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.text()
        with self._lock:
            self.attempts.append({"path": request.path, "raw": raw})
            answer = self.answers.popleft() if self.answers else Answer(200)
        self.arrived.set()
        if answer.hang:
            await asyncio.to_thread(self._released.wait)
        if answer.status != 200:
            headers = {"Retry-After": answer.retry_after} if answer.retry_after else {}
            return web.Response(status=answer.status, text=f"no: {request.url}", headers=headers)
        with self._lock:
            self.raw.append(raw)
        return web.Response(text="ok")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        # The receiver's own access log is not the agent's: it would show the URL it was sent.
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def __enter__(self) -> Receiver:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture(autouse=True)
def agent_logs_reach_caplog(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CLI's console set-up (run in-process by other tests) stops "agent" propagating.
    monkeypatch.setattr(logging.getLogger("agent"), "propagate", True)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


class Delays:
    """A ``sleep`` for the notifier that records the pauses and does not wait."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.seconds.append(seconds)
        await asyncio.sleep(0)


def notifier(
    url: str,
    bus: EventBus,
    *,
    delays: Delays | None = None,
    retry: Retry | None = None,
    secrets: tuple[str, ...] = (),
    **cfg: Any,
) -> Notifier:
    return Notifier(
        NotifySection(webhook=url, **cfg),
        bus,
        secrets=secrets,
        job="run1",
        retry=retry or Retry(first_s=0.5, cap_s=10.0, retry_after_max_s=30.0, attempts=4),
        sleep=delays or Delays(),
    )


@contextlib.asynccontextmanager
async def running(n: Notifier) -> Any:
    task = asyncio.create_task(n.run())
    try:
        yield task
    finally:
        await n.close()
        await asyncio.wait_for(task, 10)


def free_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------------------------
# Order, filter, format


def test_events_arrive_in_order_and_only_the_chosen_kinds(receiver: Receiver) -> None:
    async def main() -> None:
        bus = EventBus()
        n = notifier(receiver.url(), bus, events=("job_started", "best", "done"))
        async with running(n):
            bus.publish("job_started", job="run1", phase="preflight", restarted=False)
            bus.publish("phase", **{"from": "booting", "to": "preflight"})
            bus.publish("best", epoch=3, metric=0.4561, metric_name="mAP50-95")
            bus.publish("upload", path="weights/best.pt", epoch=3, size=10, ok=True, error=None)
            bus.publish("epoch", epoch=3, total_epochs=10, eta_s=60.0, loss=1.0, metric=0.4)
            bus.publish("done", reason="completed", cause=None)
            assert await n.flush(10)
        assert n.status()["sent"] == 3 and n.status()["queued"] == 0

    asyncio.run(main())
    bodies = receiver.received
    assert receiver.kinds() == ["job_started", "best", "done"]
    seqs = [b["event"]["seq"] for b in bodies]
    assert seqs == sorted(seqs) and seqs[0] == 1
    assert all(b["job"] == "run1" and b["text"] == b["content"] for b in bodies)
    assert bodies[1]["text"] == "run1: new best at epoch 3 - mAP50-95 0.4561"
    assert bodies[1]["event"]["data"] == {"epoch": 3, "metric": 0.4561, "metric_name": "mAP50-95"}
    assert bodies[2]["text"] == "run1: done (completed)"
    assert {a["path"] for a in receiver.attempts} == {HOOK_PATH}


def test_every_epochs_sends_every_nth_epoch_and_the_last(receiver: Receiver) -> None:
    async def main() -> None:
        bus = EventBus()
        n = notifier(receiver.url(), bus, events=("done",), every_epochs=5)
        async with running(n):
            for epoch in range(1, 13):
                bus.publish(
                    "epoch", epoch=epoch, total_epochs=12, eta_s=90.0, loss=0.5, metric=0.25
                )
            assert await n.flush(10)

    asyncio.run(main())
    bodies = receiver.received
    assert [b["event"]["data"]["epoch"] for b in bodies] == [5, 10, 12]
    assert bodies[0]["text"] == "run1: epoch 5/12 - metric 0.25, loss 0.5, ETA 1m30s"


def test_the_default_events_are_the_important_ones_and_no_epochs() -> None:
    cfg = NotifySection(webhook="https://hooks.slack.com/services/x")
    bus = EventBus()
    n = Notifier(cfg, bus, job="run1")
    for kind in ("phase", "upload", "steering", "epoch"):
        bus.publish(kind, epoch=5, total_epochs=5)
    assert n.status()["queued"] == 0
    for kind in DEFAULT_NOTIFY_EVENTS:
        bus.publish(kind)
    assert n.status()["queued"] == len(DEFAULT_NOTIFY_EVENTS)
    assert {"failure", "teardown", "teardown_confirmed", "stall", "best"} <= set(
        DEFAULT_NOTIFY_EVENTS
    )


def _event(kind: str, **data: Any) -> Event:
    return Event(7, 0.0, kind, data)


@pytest.mark.parametrize(
    ("event", "line"),
    [
        (
            _event("teardown", action="stop", why="destroy downgraded to stop: x", downgraded=True),
            "run1: destroy downgraded to stop - checkpoints not verified off the box; the box "
            "keeps billing (its disk), and its GPUs are released: they may be gone on restart",
        ),
        (
            _event(
                "teardown", action="keep", why="destroy refused and the box KEPT", downgraded=True
            ),
            "run1: the box is KEPT and keeps billing (all of it) - destroy refused and the box "
            "KEPT",
        ),
        (
            _event(
                "teardown", action="destroy", why="teardown.on_success = destroy", provider="vast"
            ),
            "run1: teardown: destroy via vast (teardown.on_success = destroy)",
        ),
        (
            _event("teardown_confirmed", action="stop", confirmed=False, detail="still running"),
            "run1: stop NOT confirmed: check the box by hand - still running",
        ),
        (
            _event("failure", reason="stalled", cause="no progress for 20m"),
            "run1: FAILED (stalled) - no progress for 20m",
        ),
        (
            _event("training_started", total_epochs=100, resumed=True),
            "run1: training resumed (100 epochs)",
        ),
        (
            _event("job_started", phase="training", restarted=True),
            "run1: agent restarted, carrying on from phase training",
        ),
        (
            _event("warning", message="budget: $9.50 of $10 by the end"),
            "run1: warning - budget: $9.50 of $10 by the end",
        ),
        (_event("steering", action="extend", seconds=7200), "run1: extend 2h"),
        (_event("gap", dropped=3), 'run1: gap {"dropped": 3}'),
    ],
)
def test_each_kind_has_a_human_line(event: Event, line: str) -> None:
    assert notice_text("run1", event) == line


# --------------------------------------------------------------------------------------------
# Failures of the receiver


def test_5xx_and_429_are_retried_with_backoff_honouring_a_capped_retry_after(
    receiver: Receiver,
) -> None:
    receiver.answer(500)
    receiver.answer(429, retry_after="7")
    receiver.answer(429, retry_after="1000")  # capped at retry_after_max_s = 30
    delays = Delays()

    async def main() -> bool:
        bus = EventBus()
        n = notifier(receiver.url(), bus, delays=delays)
        async with running(n):
            bus.publish("best", epoch=1, metric=0.1, metric_name="mAP50-95")
            bus.publish("done", reason="completed", cause=None)
            ok = await n.flush(10)
            assert n.status()["sent"] == 2 and n.status()["failed"] == 0
            return ok

    assert asyncio.run(main())
    assert len(receiver.attempts) == 5  # best x4, done x1
    assert receiver.kinds() == ["best", "done"]
    assert len(delays.seconds) == 3
    assert 0.25 <= delays.seconds[0] <= 0.5  # the first backoff, jittered
    assert delays.seconds[1:] == [7.0, 30.0]


def test_a_400_is_given_up_at_once_with_one_log_line(
    receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    receiver.answer(400)
    caplog.set_level(logging.DEBUG)

    async def main() -> tuple[bool, dict[str, Any]]:
        bus = EventBus()
        n = notifier(receiver.url(), bus)
        async with running(n):
            bus.publish("best", epoch=1, metric=0.1, metric_name="mAP50-95")
            bus.publish("done", reason="completed", cause=None)
            return await n.flush(10), n.status()

    flushed, status = asyncio.run(main())
    assert not flushed  # one of them was not delivered
    assert len(receiver.attempts) == 2  # the 400 was not retried
    assert receiver.kinds() == ["done"]
    assert status["failed"] == 1 and status["sent"] == 1
    assert "HTTP 400" in status["last_error"]
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert "gave up on the best notice" in lines[0] and "HTTP 400" in lines[0]
    assert "not retried" in lines[0] and "http://127.0.0.1/..." in lines[0]


def test_attempts_run_out_on_a_receiver_that_is_down(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"http://127.0.0.1:{free_port()}{HOOK_PATH}"
    delays = Delays()

    async def main() -> tuple[bool, dict[str, Any]]:
        bus = EventBus()
        n = notifier(url, bus, delays=delays, retry=Retry(first_s=0.1, cap_s=1.0, attempts=3))
        async with running(n):
            bus.publish("done", reason="completed", cause=None)
            return await n.flush(10), n.status()

    flushed, status = asyncio.run(main())
    assert not flushed
    assert len(delays.seconds) == 2
    assert status["failed"] == 1 and status["last_error"]
    assert any("gave up on the done notice" in r.getMessage() for r in caplog.records)
    assert "xoxFAKE" not in caplog.text and "T0FAKE" not in caplog.text
    assert "T0FAKE" not in json.dumps(status)


def test_a_receiver_that_hangs_past_the_timeout_is_retried(receiver: Receiver) -> None:
    receiver.hang()  # the first request never gets an answer (until the test ends)

    async def main() -> bool:
        bus = EventBus()
        n = notifier(receiver.url(), bus, timeout_s=0.3)
        async with running(n):
            bus.publish("stall", message="no progress for 20m")
            return await n.flush(10)

    assert asyncio.run(main())
    assert len(receiver.attempts) == 2
    assert receiver.kinds() == ["stall"]


def test_publish_returns_while_the_receiver_is_blocked_and_flush_waits(
    receiver: Receiver,
) -> None:
    receiver.hang()

    async def main() -> None:
        bus = EventBus()
        n = notifier(receiver.url(), bus, timeout_s=60)
        async with running(n):
            bus.publish("job_started", job="run1", phase="preflight", restarted=False)
            await wait_for(receiver.arrived.is_set, timeout=10)
            # The receiver holds the first notice; publishing goes on regardless.
            for epoch in range(1, 6):
                bus.publish("best", epoch=epoch, metric=0.1 * epoch, metric_name="mAP50-95")
            assert n.status()["queued"] == 6
            assert receiver.received == []
            assert not await n.flush(0.05)  # cannot finish while the receiver is blocked
            receiver.release()
            assert await n.flush(10)
            # flush returned: everything was delivered, nothing still to wait for.
            assert len(receiver.received) == 6
            assert n.status()["queued"] == 0

    asyncio.run(main())
    assert receiver.kinds() == ["job_started"] + ["best"] * 5
    assert [b["event"]["data"]["epoch"] for b in receiver.received[1:]] == [1, 2, 3, 4, 5]


def test_a_full_queue_drops_the_oldest_with_a_counted_warning(
    receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        bus = EventBus()
        n = Notifier(
            NotifySection(webhook=receiver.url(), events=("best",)),
            bus,
            job="run1",
            queue_size=2,
        )
        # run() not started yet: the receiver is not keeping up.
        for epoch in range(1, 6):
            bus.publish("best", epoch=epoch, metric=0.5, metric_name="mAP50-95")
        assert n.status()["dropped"] == 3 and n.status()["queued"] == 2
        async with running(n):
            assert await n.flush(10)

    asyncio.run(main())
    assert [b["event"]["data"]["epoch"] for b in receiver.received] == [4, 5]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("dropped the oldest (best), 1 dropped so far" in w for w in warnings)
    assert any("2 dropped so far" in w for w in warnings)


def test_close_stops_the_sender_and_later_events_are_not_queued(receiver: Receiver) -> None:
    async def main() -> dict[str, Any]:
        bus = EventBus()
        n = notifier(receiver.url(), bus)
        task = asyncio.create_task(n.run())
        await asyncio.sleep(0)
        await n.close()
        await asyncio.wait_for(task, 10)
        bus.publish("done", reason="completed", cause=None)
        return n.status()

    assert asyncio.run(main())["queued"] == 0
    assert receiver.attempts == []


# --------------------------------------------------------------------------------------------
# Secrets


def test_no_secret_and_not_the_webhook_url_reaches_the_receiver_or_the_log(
    receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # aiohttp's loggers included
    receiver.answer(500)  # its body echoes the URL: the retry's log line must not
    receiver.answer(400)  # and so does this one: the give-up line must not either
    url = receiver.url()

    async def main() -> dict[str, Any]:
        bus = EventBus()
        n = notifier(url, bus, secrets=(HF_TOKEN, VAST_KEY), events=("failure", "warning"))
        async with running(n):
            bus.publish("warning", message=f"upload refused for token {HF_TOKEN}")  # 500, 400
            bus.publish(
                "failure",
                reason="training_failed",
                cause=f'401 for "Bearer {HF_TOKEN}\\n" at {url}',
                nested={VAST_KEY: [f"key={VAST_KEY}", {"k": f"{HF_TOKEN!r}"}]},
                escaped=f"b'Bearer {HF_TOKEN}\\n'",
            )
            await n.flush(10)
            return n.status()

    status = asyncio.run(main())
    assert receiver.kinds() == ["failure"]
    secret_bits = (HF_TOKEN, VAST_KEY, "xoxFAKEwebhookTOKEN", "T0FAKE", HOOK_PATH)
    everything = "\n".join(a["raw"] for a in receiver.attempts)
    for bit in secret_bits:
        assert bit not in everything, bit
        assert bit not in caplog.text, bit
        assert bit not in json.dumps(status), bit
    body = receiver.received[0]
    assert REDACTED in body["text"] and body["text"] == body["content"]
    assert body["event"]["data"]["nested"] == {
        REDACTED: [f"key={REDACTED}", {"k": f"'{REDACTED}'"}]
    }
    assert "http://127.0.0.1/..." in caplog.text  # the URL is shown by its host only
    assert "HTTP 400" in status["last_error"] and "HTTP 500" in caplog.text


def test_the_section_never_shows_its_url() -> None:
    cfg = NotifySection(webhook="https://hooks.slack.com/services/T0/B0/SECRETxyz")
    assert "SECRET" not in repr(cfg)
    assert cfg.shown == "https://hooks.slack.com/..."
    assert NotifySection(webhook="http://me:pw@[::1]:9/x").shown == "http://[::1]/..."


# --------------------------------------------------------------------------------------------
# A whole run, through the daemon


class RecordingProvider(PricedProvider):
    """Records, for each teardown call, how many notices the receiver had already got."""

    def __init__(self, receiver: Receiver) -> None:
        super().__init__(price=0.0)
        self.receiver = receiver
        self.calls: list[tuple[str, list[str]]] = []

    async def teardown(self, action: str, reason: str, *, on_sent: Any = None) -> Any:
        self.calls.append((action, self.receiver.kinds()))
        return await super().teardown(action, reason, on_sent=on_sent)


def test_whole_run_notifies_in_order_including_a_downgrade(
    tmp_path: Path, receiver: Receiver
) -> None:
    from tests.test_daemon_loop import make, started, write_status

    # No [sync]: nothing is verified off the box, so on_success = destroy becomes a stop.
    notify = f'[notify]\nwebhook = "{receiver.url()}"\nevents = {list(DEFAULT_NOTIFY_EVENTS)!r}\n'
    daemon, trainer, _, _ = make(tmp_path, extra=notify)
    provider = RecordingProvider(receiver)
    daemon.provider_factory = lambda cfg, env: provider  # type: ignore[assignment,return-value]

    async def main() -> int:
        task = asyncio.create_task(daemon.run())
        await started(daemon)
        for epoch in (1, 2, 3):
            write_status(trainer.run_dir, "running", epoch)
            await wait_for(
                lambda e=epoch: daemon.status is not None and daemon.status.completed_epochs == e
            )
        write_status(trainer.run_dir, "completed", 10)
        trainer.exit(0)
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(main()) == 0
    kinds = receiver.kinds()
    bodies = receiver.received
    seqs = [b["event"]["seq"] for b in bodies]
    assert seqs == sorted(seqs), "notices arrive in the order they happened"
    assert kinds[0] == "job_started"
    last = [k for k in kinds if k != "teardown_sent"][-3:]
    assert last == ["teardown", "teardown_confirmed", "done"], kinds
    teardown = bodies[kinds.index("teardown")]
    assert teardown["event"]["data"]["downgraded"] is True
    assert "destroy downgraded to stop" in teardown["text"]
    assert "keeps billing" in teardown["text"]
    # The decision (the downgrade) reached the receiver before the box was touched.
    assert [action for action, _ in provider.calls] == ["stop"]
    assert provider.calls[0][1][-1] == "teardown"
