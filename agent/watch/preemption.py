"""Spot/preemption notices from the cloud's metadata service: AWS IMDSv2, GCP metadata.

:func:`detect` picks the watchers (the job's ``[preemption]`` or, in ``auto``, the box's DMI
strings: no network traffic, so a non-cloud box never touches 169.254.169.254);
:class:`PreemptionWatcher` polls them until one announces the box is going away, then calls
``on_notice`` once. What the daemon does with a notice (upload ``last.pt``, stop the trainer,
end with reason ``preempted``) is the daemon's.

AWS (IMDSv2): ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` gives a
token, renewed before its TTL ends (and at once on a 401); ``GET
/latest/meta-data/spot/instance-action`` with ``X-aws-ec2-metadata-token`` answers 404 (nothing
scheduled) or 200 ``{"action": "terminate", "time": "...Z"}`` about two minutes ahead.
https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html

GCP: ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google`` answers
``TRUE``/``FALSE``; ``wait_for_change=true&last_etag=...&timeout_sec=N`` holds the request until
the value changes (GCP's recommended way: the notice arrives at once). An answer without
``Metadata-Flavor: Google`` did not come from a metadata server and is an error, never a notice.
https://cloud.google.com/compute/docs/metadata/querying-metadata#waitforchange

Endpoint trouble (unreachable, timeouts, 5xx, garbage) never ends the watch: each distinct
problem is logged once, a line says when the endpoint answers again, and the poll is retried
every ``poll_interval_s``. Requests go straight to the endpoint (``trust_env`` off): a proxy
would add ``X-Forwarded-For``, which both metadata services refuse.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from multidict import CIMultiDict

from agent.config.model import PreemptionSection
from agent.util.text import one_line, show

log = logging.getLogger(__name__)

#: The watchers this module knows, in the order :func:`detect` lists them.
SOURCES = ("aws", "gcp")

AWS_TOKEN_PATH = "/latest/api/token"
AWS_ACTION_PATH = "/latest/meta-data/spot/instance-action"
AWS_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
AWS_TOKEN_HEADER = "X-aws-ec2-metadata-token"
#: The TTL asked for: IMDSv2's longest (6 hours).
AWS_TOKEN_TTL_S = 21600
GCP_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
GCP_FLAVOR = ("Metadata-Flavor", "Google")
#: ``timeout_sec`` of the GCP long poll: the server answers at a change or after this long.
GCP_WAIT_S = 60
#: Seconds to open a connection to a metadata endpoint (it is on the host, or nowhere).
CONNECT_TIMEOUT_S = 2.0
#: Seconds one AWS request may take, answer included.
AWS_REQUEST_TIMEOUT_S = 5.0
#: Slack over ``timeout_sec`` for the GCP long poll's answer.
GCP_TIMEOUT_SLACK_S = 5.0
#: The most of an answer read: the metadata answers here are a few dozen bytes.
MAX_REPLY_BYTES = 64 * 1024
#: Never poll faster than this, whatever the job says (a busy loop helps nobody).
MIN_INTERVAL_S = 0.01

_DMI_FILES = ("sys_vendor", "board_vendor", "product_name", "bios_vendor", "bios_version")


@dataclass(frozen=True)
class Notice:
    """The provider announced the box is going away."""

    #: ``"aws"``, ``"gcp"`` (the daemon also builds ``Notice("sigterm", ...)``).
    source: str
    #: One line for logs and /status: ``AWS spot instance-action: terminate at 2026-...Z``.
    message: str
    #: Clock time (the watcher's ``clock``, epoch seconds) the notice was seen.
    at: float
    #: When the provider will act (AWS ``time``), epoch seconds, when known.
    action_at: float | None = None


# --------------------------------------------------------------------------------------------
# Which watchers


def _dmi(dmi_dir: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for name in _DMI_FILES:
        try:
            values[name] = (dmi_dir / name).read_text(errors="replace").strip().lower()
        except OSError:  # absent (not Linux, a container without /sys), or unreadable
            values[name] = ""
    return values


def _is_ec2(dmi: dict[str, str]) -> bool:
    # Nitro instances say "Amazon EC2"; the Xen ones (p3, g3, ...) say Xen with an Amazon BIOS
    # ("Amazon" vendor, or a bios_version like "4.11.amazon").
    return (
        any("amazon ec2" in dmi[k] for k in ("sys_vendor", "board_vendor", "product_name"))
        or "amazon" in dmi["bios_vendor"]
        or "amazon" in dmi["bios_version"]
    )


def _is_gce(dmi: dict[str, str]) -> bool:
    return "google compute engine" in dmi["product_name"] or dmi["sys_vendor"].startswith("google")


def detect(cfg: PreemptionSection, *, dmi_dir: Path = Path("/sys/class/dmi/id")) -> tuple[str, ...]:
    """Which watchers to run: an explicit True/False from ``cfg`` decides; None (``auto``)
    watches only where the box's DMI says EC2 (``sys_vendor``/``board_vendor``/``product_name``
    containing "Amazon EC2", or an Amazon BIOS) or Compute Engine (``product_name`` "Google
    Compute Engine", ``sys_vendor`` "Google"). Reads files only: auto-detection never sends
    network traffic, so a non-cloud box (and the test suite) never touches 169.254.169.254."""
    dmi: dict[str, str] | None = None
    chosen: list[str] = []
    for source, setting, check in (("aws", cfg.aws, _is_ec2), ("gcp", cfg.gcp, _is_gce)):
        if setting is None:
            if dmi is None:
                dmi = _dmi(dmi_dir)
            setting = check(dmi)
        if setting:
            chosen.append(source)
    return tuple(chosen)


# --------------------------------------------------------------------------------------------
# The watcher


class _Problem(Exception):
    """One poll failed; the text is what the log and /status say (no secrets, no timings, so
    that the same problem repeated reads the same)."""


@dataclass
class _SourceState:
    url: str
    polls: int = 0
    failed_polls: int = 0
    last_poll_at: float | None = None
    last_error: str | None = None
    #: Distinct problems logged since the endpoint last answered.
    logged: set[str] = field(default_factory=set)


class PreemptionWatcher:
    """Polls the metadata endpoints of ``sources`` for a preemption notice.

    One watcher reports one notice: once it has seen one, :meth:`run` returns at once (to
    watch again, build a new one; note that AWS keeps ``instance-action`` until the box goes).
    ``gcp_wait_s`` is the GCP long poll's ``timeout_sec`` (tests shorten it)."""

    def __init__(
        self,
        cfg: PreemptionSection,
        sources: tuple[str, ...],
        *,
        on_notice: Callable[[Notice], None],
        clock: Callable[[], float] = time.time,
        gcp_wait_s: int = GCP_WAIT_S,
    ) -> None:
        unknown = [s for s in sources if s not in SOURCES]
        if unknown:
            raise ValueError(f"unknown preemption source(s): {', '.join(map(show, unknown))}")
        if gcp_wait_s < 1:
            raise ValueError(f"gcp_wait_s must be at least 1, not {gcp_wait_s}")
        self.cfg = cfg
        self.sources = tuple(dict.fromkeys(sources))
        self._on_notice = on_notice
        self._clock = clock
        self._gcp_wait_s = int(gcp_wait_s)
        self._interval_s = max(MIN_INTERVAL_S, cfg.poll_interval_s)
        urls = {"aws": cfg.aws_url.rstrip("/"), "gcp": cfg.gcp_url.rstrip("/")}
        self._state = {s: _SourceState(urls[s]) for s in self.sources}
        self._notice: Notice | None = None
        # AWS token, and the loop.time() at which to get a new one.
        self._token: str | None = None
        self._token_renew_at = 0.0

    @property
    def notice(self) -> Notice | None:
        """The notice seen, or None."""
        return self._notice

    async def run(self) -> None:
        """Poll every source until a notice is seen (``on_notice`` is called exactly once, then
        this returns) or until cancelled. Never raises for endpoint trouble: unreachable, 5xx
        and garbage answers are logged (once per distinct problem, then a line when the
        endpoint answers again) and retried every ``poll_interval_s``. Cancellation closes the
        HTTP session cleanly. Returns at once with no sources, or after a notice was seen.
        An exception from ``on_notice`` propagates (after the polls are stopped)."""
        if self._notice is not None or not self.sources:
            return
        log.info(
            "preemption: watching %s",
            ", ".join(
                f"{s} ({self._state[s].url}, "
                + (f"every {self._interval_s:g}s)" if s == "aws" else "long poll)")
                for s in self.sources
            ),
        )
        watchers: dict[str, Callable[[aiohttp.ClientSession], Coroutine[Any, Any, Notice]]] = {
            "aws": self._watch_aws,
            "gcp": self._watch_gcp,
        }
        timeout = aiohttp.ClientTimeout(
            total=AWS_REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S
        )
        async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
            tasks = [
                asyncio.create_task(watchers[s](session), name=f"preemption-{s}")
                for s in self.sources
            ]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                # A watcher ends only with a notice (or a bug, which propagates); the first
                # source in order wins when two end together.
                first = next(t for t in tasks if t in done)
                self._notice = notice = first.result()
                log.warning("preemption: notice from %s: %s", notice.source, notice.message)
                self._on_notice(notice)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def status(self) -> dict[str, Any]:
        """For /status: the sources watched, the last answer from any of them
        (``last_poll_at``, clock time), the problem of the moment (``last_error``, None while
        every source answers), the notice (or None) and each source's own figures."""
        polled = [st.last_poll_at for st in self._state.values() if st.last_poll_at is not None]
        errors = [f"{s}: {st.last_error}" for s, st in self._state.items() if st.last_error]
        return {
            "sources": list(self.sources),
            "last_poll_at": max(polled) if polled else None,
            "last_error": "; ".join(errors) or None,
            "notice": asdict(self._notice) if self._notice is not None else None,
            "watchers": {
                s: {
                    "url": st.url,
                    "polls": st.polls,
                    "failed_polls": st.failed_polls,
                    "last_poll_at": st.last_poll_at,
                    "last_error": st.last_error,
                }
                for s, st in self._state.items()
            },
        }

    # ------------------------------------------------------------------ bookkeeping

    def _answered(self, source: str) -> None:
        st = self._state[source]
        st.polls += 1
        st.last_poll_at = self._clock()
        if st.last_error is not None:
            log.info(
                "preemption: %s: the endpoint answers again (after %d failed poll(s))",
                source,
                st.failed_polls,
            )
        st.last_error = None
        st.failed_polls = 0
        st.logged.clear()

    def _failed(self, source: str, problem: str) -> None:
        st = self._state[source]
        st.polls += 1
        st.failed_polls += 1
        st.last_error = problem
        if problem not in st.logged:
            st.logged.add(problem)
            log.warning("preemption: %s: %s; retrying every %gs", source, problem, self._interval_s)

    async def _pace(self, started: float) -> None:
        """Sleep until ``poll_interval_s`` after ``started`` (a ``loop.time()``)."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, started + self._interval_s - loop.time()))

    # ------------------------------------------------------------------ AWS IMDSv2

    async def _watch_aws(self, session: aiohttp.ClientSession) -> Notice:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                notice = await self._poll_aws(session)
            except _Problem as exc:
                self._failed("aws", str(exc))
            else:
                self._answered("aws")
                if notice is not None:
                    return notice
            await self._pace(started)

    async def _poll_aws(self, session: aiohttp.ClientSession) -> Notice | None:
        loop = asyncio.get_running_loop()
        if self._token is None or loop.time() >= self._token_renew_at:
            await self._aws_token(session)
        status, body = await self._aws_action(session)
        if status == 401:  # expired or revoked: a fresh token, and ask again at once
            await self._aws_token(session)
            status, body = await self._aws_action(session)
            if status == 401:
                raise _Problem("instance-action: HTTP 401 with a fresh token")
        if status == 404:
            return None
        if status != 200:
            raise _Problem(f"instance-action: HTTP {status}")
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        action = data.get("action") if isinstance(data, dict) else None
        if not isinstance(action, str) or not action.strip():
            raise _Problem(f"instance-action: not IMDS's JSON: {show(one_line(body, 80))}")
        when = data.get("time") if isinstance(data, dict) else None
        when_text = one_line(when, 40) if isinstance(when, str) else "an unknown time"
        return Notice(
            "aws",
            f"AWS spot instance-action: {one_line(action, 40)} at {when_text}",
            self._clock(),
            _epoch(when),
        )

    async def _aws_token(self, session: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        asked = loop.time()
        self._token = None
        status, body, headers = await self._request(
            session,
            "PUT",
            self._state["aws"].url + AWS_TOKEN_PATH,
            "token",
            headers={AWS_TTL_HEADER: str(AWS_TOKEN_TTL_S)},
            hint=" (in a container? the instance's IMDS hop limit must be 2 or more)",
        )
        if status != 200:
            raise _Problem(f"token: HTTP {status}")
        token = body.strip()
        if not token or len(token) > 1024 or not token.isascii() or not token.isprintable():
            raise _Problem("token: the answer is not a token")
        try:
            ttl = int(headers.get(AWS_TTL_HEADER, AWS_TOKEN_TTL_S))
        except ValueError:
            ttl = AWS_TOKEN_TTL_S
        ttl = min(max(ttl, 1), AWS_TOKEN_TTL_S)
        # Renew well before the end: a minute early, or a quarter of a short TTL.
        self._token = token
        self._token_renew_at = asked + ttl - min(60.0, ttl / 4)

    async def _aws_action(self, session: aiohttp.ClientSession) -> tuple[int, str]:
        assert self._token is not None
        status, body, _ = await self._request(
            session,
            "GET",
            self._state["aws"].url + AWS_ACTION_PATH,
            "instance-action",
            headers={AWS_TOKEN_HEADER: self._token},
        )
        return status, body

    # ------------------------------------------------------------------ GCP metadata

    async def _watch_gcp(self, session: aiohttp.ClientSession) -> Notice:
        loop = asyncio.get_running_loop()
        # "0" matches no ETag: the first request answers at once with the current value.
        etag = "0"
        url = self._state["gcp"].url + GCP_PREEMPTED_PATH
        timeout = aiohttp.ClientTimeout(
            total=self._gcp_wait_s + GCP_TIMEOUT_SLACK_S,
            connect=CONNECT_TIMEOUT_S,
            sock_connect=CONNECT_TIMEOUT_S,
        )
        params = {"wait_for_change": "true", "timeout_sec": str(self._gcp_wait_s)}
        while True:
            started = loop.time()
            try:
                status, body, headers = await self._request(
                    session,
                    "GET",
                    url,
                    "preempted",
                    headers=dict([GCP_FLAVOR]),
                    params={**params, "last_etag": etag},
                    timeout=timeout,
                )
                if headers.get(GCP_FLAVOR[0]) != GCP_FLAVOR[1]:
                    raise _Problem(
                        f"preempted: HTTP {status} without 'Metadata-Flavor: Google': not a "
                        "metadata server"
                    )
                if status != 200:
                    raise _Problem(f"preempted: HTTP {status}")
                value = body.strip()
                if value not in ("TRUE", "FALSE"):
                    raise _Problem(f"preempted: not TRUE or FALSE: {show(one_line(body, 40))}")
            except _Problem as exc:
                self._failed("gcp", str(exc))
            else:
                self._answered("gcp")
                if value == "TRUE":
                    return Notice("gcp", "GCP instance/preempted: TRUE", self._clock())
                new_etag = headers.get("ETag", "").strip()
                waited = loop.time() - started >= self._gcp_wait_s / 2
                if new_etag and (new_etag != etag or waited):
                    etag = new_etag
                    continue  # the (next) long poll, at once
            # An error, or an answer that came back at once with nothing new (no ETag, or the
            # same one: a server that does not hold the request): at most one request per
            # poll_interval_s.
            await self._pace(started)

    # ------------------------------------------------------------------ HTTP

    async def _request(
        self,
        session: aiohttp.ClientSession,
        method: str,
        url: str,
        what: str,
        *,
        headers: dict[str, str],
        params: dict[str, str] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
        hint: str = "",
    ) -> tuple[int, str, CIMultiDict[str]]:
        """One request: status, body text, headers. Network trouble raises :class:`_Problem`."""
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        try:
            async with session.request(
                method, url, headers=headers, params=params, allow_redirects=False, **extra
            ) as resp:
                raw = await resp.content.read(MAX_REPLY_BYTES)
                return resp.status, raw.decode("utf-8", "replace"), CIMultiDict(resp.headers)
        except TimeoutError:  # aiohttp's own timeouts are TimeoutErrors too
            raise _Problem(f"{what}: timed out{hint}") from None
        except aiohttp.ClientError as exc:
            text = one_line(str(exc), 160)
            raise _Problem(
                f"{what}: {type(exc).__name__}" + (f": {text}" if text else "")
            ) from None


def _epoch(value: object) -> float | None:
    """``"2026-12-03T08:22:00Z"`` as epoch seconds; None when it is not such a time."""
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        return None
    if moment.tzinfo is None:  # IMDS times are UTC
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()
