"""The spot notice watchers (agent/watch/preemption.py) against fake metadata servers on 127.0.0.1
(tests/fakes/metadata.py): detection from DMI files only, the AWS IMDSv2 token dance (renewed
before its TTL and on a 401), the GCP long poll, endpoint trouble logged once and retried,
``on_notice`` exactly once, a clean cancel. No test here is timed: the latency from a flip to
``on_notice`` is measured by bench/preemption_notice.py."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import warnings
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent.config.model import PreemptionSection
from agent.watch.preemption import AWS_TOKEN_TTL_S, Notice, PreemptionWatcher, detect
from tests.fakes.metadata import (
    FakeGCE,
    FakeIMDS,
    closed_port_url,
    etag_of,
    run_fake_gce,
    run_fake_imds,
)
from tests.support import wait_for

#: Generous bounds on waits for things that take milliseconds: a loaded CI box must not fail.
WAIT_S = 20.0


def dmi_dir(tmp_path: Path, **files: str) -> Path:
    d = tmp_path / "dmi"
    d.mkdir()
    for name, text in files.items():
        (d / name).write_text(text + "\n")
    return d


def cfg(**kw: Any) -> PreemptionSection:
    kw.setdefault("poll_interval_s", 0.05)
    return PreemptionSection(**kw)


class Recorder:
    """An ``on_notice`` that records its calls."""

    def __init__(self) -> None:
        self.notices: list[Notice] = []

    def __call__(self, notice: Notice) -> None:
        self.notices.append(notice)


def watching(
    section: PreemptionSection,
    sources: tuple[str, ...],
    body: Callable[[PreemptionWatcher, asyncio.Task[None]], Awaitable[None]],
    **kw: Any,
) -> tuple[PreemptionWatcher, Recorder]:
    """Run a watcher in a task while ``body`` runs; cancel it after (when still running)."""
    rec = Recorder()
    watcher = PreemptionWatcher(section, sources, on_notice=rec, **kw)

    async def main() -> None:
        task = asyncio.create_task(watcher.run())
        try:
            await body(watcher, task)
            if task.done():
                task.result()  # a watcher that raised fails the test
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    asyncio.run(main())
    return watcher, rec


async def finished(task: asyncio.Task[None]) -> None:
    await asyncio.wait_for(asyncio.shield(task), WAIT_S)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The problems logged (the notice itself, also a warning, left out)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "agent.watch.preemption"
        and r.levelno == logging.WARNING
        and "notice from" not in r.getMessage()
    ]


def infos_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "agent.watch.preemption" and r.levelno == logging.INFO
    ]


# --------------------------------------------------------------------------------------------
# Detection


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"sys_vendor": "Amazon EC2", "product_name": "g5.xlarge"}, ("aws",)),
        ({"board_vendor": "Amazon EC2"}, ("aws",)),
        ({"sys_vendor": "Xen", "product_name": "HVM domU", "bios_vendor": "Amazon"}, ("aws",)),
        ({"sys_vendor": "Xen", "bios_vendor": "Xen", "bios_version": "4.11.amazon"}, ("aws",)),
        ({"sys_vendor": "Google", "product_name": "Google Compute Engine"}, ("gcp",)),
        ({"product_name": "Google Compute Engine"}, ("gcp",)),
        ({"sys_vendor": "Dell Inc.", "product_name": "PowerEdge R750xa"}, ()),
        ({"sys_vendor": "QEMU", "product_name": "Standard PC (Q35 + ICH9, 2009)"}, ()),
        ({}, ()),
    ],
)
def test_auto_detection_reads_the_dmi_strings(
    tmp_path: Path, files: dict[str, str], expected: tuple[str, ...]
) -> None:
    assert detect(cfg(), dmi_dir=dmi_dir(tmp_path, **files)) == expected


def test_explicit_settings_win_over_detection(tmp_path: Path) -> None:
    ec2 = dmi_dir(tmp_path, sys_vendor="Amazon EC2")
    assert detect(cfg(aws=False), dmi_dir=ec2) == ()
    assert detect(cfg(aws=False, gcp=True), dmi_dir=ec2) == ("gcp",)
    assert detect(cfg(aws=True, gcp=True), dmi_dir=tmp_path / "missing") == ("aws", "gcp")
    assert detect(cfg(), dmi_dir=tmp_path / "missing") == ()


def test_detection_sends_no_traffic_and_no_watcher_runs_when_not_detected(
    tmp_path: Path,
) -> None:
    with run_fake_imds() as imds, run_fake_gce() as gce:
        section = cfg(aws_url=imds.url, gcp_url=gce.url)
        ec2 = dmi_dir(tmp_path, sys_vendor="Amazon EC2")
        assert detect(section, dmi_dir=ec2) == ("aws",)
        sources = detect(section, dmi_dir=tmp_path / "missing")
        assert sources == ()
        rec = Recorder()
        watcher = PreemptionWatcher(section, sources, on_notice=rec)
        asyncio.run(asyncio.wait_for(watcher.run(), WAIT_S))  # nothing to watch: returns
        assert rec.notices == []
        assert watcher.status()["sources"] == []
        assert imds.count() == 0
        assert gce.count() == 0


def test_unknown_source_is_refused() -> None:
    with pytest.raises(ValueError, match="azure"):
        PreemptionWatcher(cfg(), ("aws", "azure"), on_notice=Recorder())


# --------------------------------------------------------------------------------------------
# The fakes are as strict as the real services


def test_the_fakes_refuse_what_the_real_services_refuse() -> None:
    async def main(imds: FakeIMDS, gce: FakeGCE) -> list[int]:
        ttl = {"X-aws-ec2-metadata-token-ttl-seconds": "21600"}
        action = imds.url + "/latest/meta-data/spot/instance-action"
        preempted = gce.url + "/computeMetadata/v1/instance/preempted"
        out = []
        async with aiohttp.ClientSession() as s:
            for method, url, headers in [
                ("PUT", imds.url + "/latest/api/token", {**ttl, "X-Forwarded-For": "10.0.0.1"}),
                ("PUT", imds.url + "/latest/api/token", {}),
                (
                    "PUT",
                    imds.url + "/latest/api/token",
                    {"X-aws-ec2-metadata-token-ttl-seconds": "0"},
                ),
                ("GET", imds.url + "/latest/api/token", ttl),
                ("GET", action, {}),
                ("GET", action, {"X-aws-ec2-metadata-token": "forged"}),
                ("GET", preempted, {}),
                ("GET", preempted, {"Metadata-Flavor": "google"}),
                ("GET", preempted, {"Metadata-Flavor": "Google", "X-Forwarded-For": "1.2.3.4"}),
            ]:
                async with s.request(method, url, headers=headers) as r:
                    out.append(r.status)
            async with s.put(imds.url + "/latest/api/token", headers=ttl) as r:
                assert r.headers["X-aws-ec2-metadata-token-ttl-seconds"] == "21600"
                token = await r.text()
            async with s.get(action, headers={"X-aws-ec2-metadata-token": token}) as r:
                out.append(r.status)
            async with s.get(
                preempted, headers={"Metadata-Flavor": "Google"}, params={"timeout_sec": "x"}
            ) as r:
                out.append(r.status)
            async with s.get(preempted, headers={"Metadata-Flavor": "Google"}) as r:
                assert r.headers["Metadata-Flavor"] == "Google"
                assert r.headers["ETag"] == etag_of("FALSE")
                out.append(r.status)
                assert await r.text() == "FALSE"
        return out

    with run_fake_imds() as imds, run_fake_gce() as gce:
        refused = [403, 400, 400, 405, 401, 401, 403, 403, 403]
        assert asyncio.run(main(imds, gce)) == [*refused, 404, 400, 200]


# --------------------------------------------------------------------------------------------
# AWS


@pytest.mark.parametrize("action", ["terminate", "stop", "hibernate"])
def test_aws_notice_seen_after_the_flip(action: str) -> None:
    when = "2026-12-03T08:22:00Z"
    with run_fake_imds() as imds:

        async def body(w: PreemptionWatcher, task: asyncio.Task[None]) -> None:
            await wait_for(lambda: imds.count("instance-action", 404) >= 2, WAIT_S)
            assert not task.done()
            imds.notice(action, time=when)
            await finished(task)

        w, rec = watching(cfg(aws=True, aws_url=imds.url), ("aws",), body, clock=lambda: 42.0)
        [notice] = rec.notices
        assert notice == Notice(
            "aws",
            f"AWS spot instance-action: {action} at {when}",
            42.0,
            datetime.fromisoformat(when).timestamp(),
        )
        assert w.notice == notice
        assert w.status()["notice"]["source"] == "aws"
        [put] = imds.calls("token")
        assert put.method == "PUT"
        assert put.headers["x-aws-ec2-metadata-token-ttl-seconds"] == str(AWS_TOKEN_TTL_S)
        assert put.status == 200
        gets = imds.calls("instance-action")
        assert all("x-aws-ec2-metadata-token" in g.headers for g in gets)
        assert not any("x-forwarded-for" in r.headers for r in imds.requests)
        assert gets[-1].status == 200


def test_aws_token_renewed_at_once_on_a_401(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "agent.watch.preemption")
    with run_fake_imds() as imds:

        async def body(w: PreemptionWatcher, task: asyncio.Task[None]) -> None:
            await wait_for(lambda: imds.count("instance-action", 404) >= 2, WAIT_S)
            imds.expire_tokens()
            await wait_for(lambda: imds.count("instance-action", 404) >= 4, WAIT_S)
            imds.notice()
            await finished(task)

        w, rec = watching(cfg(aws=True, aws_url=imds.url), ("aws",), body)
        assert len(rec.notices) == 1
        assert imds.count("instance-action", 401) == 1
        assert imds.count("token", 200) == 2
        # The 401 and the GET that followed it were one poll: the next request after the 401
        # is the new token, then the same GET again.
        routes = [(r.route, r.status) for r in imds.requests]
        i = routes.index(("instance-action", 401))
        assert routes[i + 1 : i + 3] == [("token", 200), ("instance-action", 404)]
        assert warnings_of(caplog) == []  # an expired token is routine
        assert w.status()["watchers"]["aws"]["failed_polls"] == 0


def test_aws_token_renewed_before_its_ttl_ends() -> None:
    with run_fake_imds(token_ttl_s=1) as imds:

        async def body(w: PreemptionWatcher, task: asyncio.Task[None]) -> None:
            await wait_for(lambda: imds.count("token", 200) >= 3, WAIT_S)

        watching(cfg(aws=True, aws_url=imds.url), ("aws",), body)
        assert imds.count("instance-action", 401) == 0
        assert imds.count("instance-action", 404) >= 3


def test_aws_5xx_logged_once_per_problem_retried_and_recovery_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "agent.watch.preemption")
    with run_fake_imds() as imds:
        token_faults = imds.fail_next(2, 503, route="token")
        action_faults = imds.fail_next(4, 500, route="instance-action")

        async def body(w: PreemptionWatcher, task: asyncio.Task[None]) -> None:
            await wait_for(lambda: imds.count("instance-action", 404) >= 1, WAIT_S)
            assert not task.done()
            assert w.status()["last_error"] is None
            imds.notice()
            await finished(task)

        _, rec = watching(cfg(aws=True, aws_url=imds.url), ("aws",), body)
        assert token_faults.hits == 2
        assert action_faults.hits == 4
        assert [n.source for n in rec.notices] == ["aws"]
        assert warnings_of(caplog) == [
            "preemption: aws: token: HTTP 503; retrying every 0.05s",
            "preemption: aws: instance-action: HTTP 500; retrying every 0.05s",
        ]
        assert "preemption: aws: the endpoint answers again (after 6 failed poll(s))" in (
            infos_of(caplog)
        )


def test_aws_garbage_answer_is_an_error_not_a_notice(caplog: pytest.LogCaptureFixture) -> None:
    with run_fake_imds() as imds:
        # A 200 whose body is an HTML page (a captive portal, a wrong aws_url), not IMDS's JSON.
        fault = imds.fail_next(3, status=200, route="instance-action")

        async def body(w: PreemptionWatcher, task: asyncio.Task[None]) -> None:
            await wait_for(lambda: imds.count("instance-action", 404) >= 1, WAIT_S)
            assert w.notice is None
            imds.notice()
            await finished(task)

        section = cfg(aws=True, aws_url=imds.url)
        _, rec = watching(section, ("aws",), body)
        assert fault.hits == 3
        assert [n.source for n in rec.notices] == ["aws"]
        [problem] = warnings_of(caplog)
        assert problem.startswith("preemption: aws: instance-action: not IMDS's JSON: '<?xml")


def test_status_before_and_after_a_notice() -> None:
    with run_fake_imds() as imds:
        watcher = PreemptionWatcher(
            cfg(aws_url=imds.url), ("aws",), on_notice=Recorder(), clock=lambda: 100.0
        )
        assert watcher.status() == {
            "sources": ["aws"],
            "last_poll_at": None,
            "last_error": None,
            "notice": None,
            "watchers": {
                "aws": {
                    "url": imds.url,
                    "polls": 0,
                    "failed_polls": 0,
                    "last_poll_at": None,
                    "last_error": None,
                }
            },
        }
        imds.notice("stop", time="2026-12-03T08:22:00Z")
        asyncio.run(asyncio.wait_for(watcher.run(), WAIT_S))
        status = watcher.status()
        assert status["notice"] == {
            "source": "aws",
            "message": "AWS spot instance-action: stop at 2026-12-03T08:22:00Z",
            "at": 100.0,
            "action_at": datetime.fromisoformat("2026-12-03T08:22:00Z").timestamp(),
        }
        assert status["last_poll_at"] == 100.0
        assert status["watchers"]["aws"]["polls"] == 1


def test_unreachable_endpoints_do_not_crash_and_are_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    section = cfg(aws=True, gcp=True, aws_url=closed_port_url(), gcp_url=closed_port_url())

    async def body(w: PreemptionWatcher, task: asyncio.Task[None]) -> None:
        await wait_for(
            lambda: all(s["failed_polls"] >= 5 for s in w.status()["watchers"].values()), WAIT_S
        )
        assert not task.done()

    w, rec = watching(section, ("aws", "gcp"), body)
    assert rec.notices == []
    status = w.status()
    assert status["last_poll_at"] is None
    assert "aws: token: ClientConnectorError" in status["last_error"]
    assert "gcp: preempted: ClientConnectorError" in status["last_error"]
    logged = warnings_of(caplog)
    assert len(logged) == 2, logged  # once per problem, not once per poll
    assert logged[0].startswith("preemption: aws: token: ClientConnectorError")
    assert logged[1].startswith("preemption: gcp: preempted: ClientConnectorError")


# --------------------------------------------------------------------------------------------
# GCP


def test_gcp_long_poll_sees_the_flip() -> None:
    # Polls 30 s apart and a 60 s long poll: only the held request can answer the flip in time.
    with run_fake_gce() as gce:

        async def body(w: PreemptionWatcher, task: asyncio.Task[None]) -> None:
            await wait_for(lambda: gce.waiting == 1, WAIT_S)
            gce.notice()
            await finished(task)

        section = cfg(gcp=True, gcp_url=gce.url, poll_interval_s=30.0)
        _, rec = watching(section, ("gcp",), body, clock=lambda: 7.0)
        assert rec.notices == [Notice("gcp", "GCP instance/preempted: TRUE", 7.0, None)]
        first, held = gce.requests
        for r in (first, held):
            assert r.headers["metadata-flavor"] == "Google"
            assert r.query["wait_for_change"] == "true"
            assert r.query["timeout_sec"] == "60"
            assert "x-forwarded-for" not in r.headers
        assert first.query["last_etag"] == "0"  # answers at once: the value now
        assert held.query["last_etag"] == etag_of("FALSE")


def test_gcp_long_poll_that_times_out_is_sent_again_with_the_etag() -> None:
    with run_fake_gce() as gce:

        async def body(w: PreemptionWatcher, task: asyncio.Task[None]) -> None:
            await wait_for(lambda: gce.count("preempted", 200) >= 3, WAIT_S)
            gce.notice()
            await finished(task)

        section = cfg(gcp=True, gcp_url=gce.url, poll_interval_s=30.0)
        _, rec = watching(section, ("gcp",), body, gcp_wait_s=1)
        assert [n.source for n in rec.notices] == ["gcp"]
        later = gce.requests[1:]
        assert len(later) >= 3
        assert all(r.query["last_etag"] == etag_of("FALSE") for r in later)
        assert all(r.query["timeout_sec"] == "1" for r in later)


def test_gcp_5xx_is_retried(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "agent.watch.preemption")
    with run_fake_gce() as gce:
        fault = gce.fail_next(3, 503)

        async def body(w: PreemptionWatcher, task: asyncio.Task[None]) -> None:
            await wait_for(lambda: gce.waiting == 1, WAIT_S)
            gce.notice()
            await finished(task)

        _, rec = watching(cfg(gcp=True, gcp_url=gce.url), ("gcp",), body)
        assert fault.hits == 3
        assert len(rec.notices) == 1
        assert (
            warnings_of(caplog)[0] == "preemption: gcp: preempted: HTTP 503; retrying every 0.05s"
        )
        assert "preemption: gcp: the endpoint answers again (after 3 failed poll(s))" in (
            infos_of(caplog)
        )


def test_gcp_answer_without_metadata_flavor_is_an_error_not_a_notice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with run_fake_gce(flavor_header=False) as gce:
        gce.notice()  # says TRUE, but not as a metadata server

        async def body(w: PreemptionWatcher, task: asyncio.Task[None]) -> None:
            await wait_for(lambda: w.status()["watchers"]["gcp"]["failed_polls"] >= 3, WAIT_S)
            assert not task.done()
            assert w.notice is None
            gce.flavor_header = True
            await finished(task)

        _, rec = watching(cfg(gcp=True, gcp_url=gce.url), ("gcp",), body)
        assert [n.source for n in rec.notices] == ["gcp"]
        assert warnings_of(caplog) == [
            "preemption: gcp: preempted: HTTP 200 without 'Metadata-Flavor: Google': not a "
            "metadata server; retrying every 0.05s"
        ]


# --------------------------------------------------------------------------------------------
# Both, exactly once, cancellation


def test_on_notice_is_called_exactly_once() -> None:
    with run_fake_imds() as imds, run_fake_gce() as gce:
        imds.notice()
        gce.notice()
        section = cfg(aws=True, gcp=True, aws_url=imds.url, gcp_url=gce.url)

        async def body(w: PreemptionWatcher, task: asyncio.Task[None]) -> None:
            await finished(task)
            await asyncio.sleep(0.2)  # a request sent just before the cancel may land now
            seen = imds.count() + gce.count()
            await w.run()  # once a notice was seen, run() returns at once
            await asyncio.sleep(0.3)  # six poll intervals: nothing polls any more
            assert imds.count() + gce.count() == seen

        w, rec = watching(section, ("aws", "gcp"), body)
        assert len(rec.notices) == 1
        assert rec.notices[0].source in ("aws", "gcp")
        assert w.status()["notice"]["message"] == rec.notices[0].message


def test_cancel_closes_the_session_cleanly() -> None:
    contexts: list[dict[str, Any]] = []
    with run_fake_imds() as imds, run_fake_gce() as gce:
        section = cfg(aws=True, gcp=True, aws_url=imds.url, gcp_url=gce.url)
        watcher = PreemptionWatcher(section, ("aws", "gcp"), on_notice=Recorder())

        async def main() -> None:
            asyncio.get_running_loop().set_exception_handler(lambda _, ctx: contexts.append(ctx))
            task = asyncio.create_task(watcher.run())
            # Cancelled with the GCP long poll held open and AWS between polls.
            await wait_for(lambda: gce.waiting == 1 and imds.count("instance-action") >= 2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            asyncio.run(main())
            gc.collect()
        # type(), not isinstance(): isinstance reads __class__, which some objects of another
        # test's imports answer with a warning (torch.distributed.reduce_op, once torch is in).
        open_sessions = [
            o for o in gc.get_objects() if type(o) is aiohttp.ClientSession and not o.closed
        ]
        assert open_sessions == []
        assert [str(w.message) for w in caught] == []
        assert contexts == []
        assert watcher.notice is None
