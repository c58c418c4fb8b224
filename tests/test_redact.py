"""One redaction (agent/util/redact.py) for every text that leaves the agent: every form of
secret, through every path (a log line, the ``/logs`` answer, a notification's body, report.json
and report.md, the uploaded copy of a log, a provider's error, a Hub error), comes out the same.

The forms: a secret the agent read from the environment (as is, and as HTTP Basic's base64),
Bearer tokens, Basic credentials, secret-named query parameters and assignments, a signed URL,
credentials in a URL, a Hugging Face token the agent never read, an environment dump, JSON."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent import hub
from agent.config.model import Env
from agent.events import EventBus
from agent.status import report
from agent.status.views import Views, tail_lines
from agent.sync.redactlog import as_sent
from agent.util import logutil, redact
from tests.test_notify import Receiver, notifier, running
from tests.test_providers_command import provider
from tests.test_report import status_doc, synthetic_state

#: Secrets of the environment: a real token's shape, and a provider key.
HF_TOKEN = "hf_" + "FakeEnvToken0123456789abcdefghij01"
VAST_KEY = "vastFAKEkey-0123456789abcdef"
#: A Hugging Face token the agent never read (the trainer's own, say).
OTHER_HF = "hf_" + "OtherFakeToken9876543210zyxwvuts98"
BASIC_VALUE = base64.b64encode(b"someone:hunter2-fake-pass").decode()


@dataclass(frozen=True)
class Form:
    #: A text carrying the secret, as a library or the trainer would print it.
    text: str
    #: What must not survive.
    secret: str
    #: What must be there instead.
    shown: str


FORMS = [
    Form(f"upload refused for token {HF_TOKEN}", HF_TOKEN, "token <HF_TOKEN>"),
    Form(
        "Authorization: Basic " + base64.b64encode(f"{VAST_KEY}:".encode()).decode(),
        base64.b64encode(f"{VAST_KEY}:".encode()).decode(),
        "Basic <VAST_API_KEY>",
    ),
    Form(f"Authorization: Basic {BASIC_VALUE}", BASIC_VALUE, "Authorization: Basic <secret>"),
    Form(
        "headers {'authorization': 'Bearer eyJhbGciOiJIUzI1NiJ9.fakePayload.fakeSig0'}",
        "eyJhbGciOiJIUzI1NiJ9.fakePayload.fakeSig0",
        "'Bearer <secret>'",
    ),
    Form(
        "GET https://example.com/file?token=tokFAKE0123456789&x=1",
        "tokFAKE0123456789",
        "?token=<secret>&x=1",
    ),
    Form("GET /v1/items?key=keyFAKE0123456789 401", "keyFAKE0123456789", "?key=<secret> 401"),
    Form("config api_key=akFAKE0123456789 loaded", "akFAKE0123456789", "api_key=<secret> loaded"),
    Form("oauth access_token=ya29.FAKE0123456789", "ya29.FAKE0123456789", "access_token=<secret>"),
    Form(
        "PUT https://bucket.s3.amazonaws.com/o?X-Amz-Credential=AKIAFAKE0123%2F2026"
        "&X-Amz-Signature=5igFAKE0123456789abcdef failed: 403",
        "5igFAKE0123456789abcdef",
        "X-Amz-Signature=<secret> failed",
    ),
    Form(
        "cloning https://someone:pa55FAKEword@git.example.com/repo.git",
        "pa55FAKEword",
        "https://someone:<secret>@git.example.com/repo.git",
    ),
    Form(f"trainer: login with {OTHER_HF}", OTHER_HF, "login with <secret>"),
    Form(
        "env: AWS_SECRET_ACCESS_KEY=wJalrFAKE0123456789 HOME=/root",
        "wJalrFAKE0123456789",
        "AWS_SECRET_ACCESS_KEY=<secret> HOME=/root",
    ),
    Form('body {"password": "hunter2FAKE0123"}', "hunter2FAKE0123", '"password": "<secret>"'),
]


@pytest.fixture(autouse=True)
def environment_secrets() -> Iterator[None]:
    """What the daemon does at start: remember the secrets it read from the environment."""
    logutil.redact_secrets([("HF_TOKEN", HF_TOKEN), ("VAST_API_KEY", VAST_KEY)])
    try:
        yield
    finally:
        logutil.redact_secrets([])


def assert_redacted(out: str, forms: list[Form] = FORMS) -> None:
    for form in forms:
        assert form.secret not in out, (form.text, out)
        assert form.shown in out, (form.text, out)


# --------------------------------------------------------------------------------------------
# The rule alone


def test_every_form_is_redacted_and_ordinary_text_is_not() -> None:
    assert_redacted("\n".join(redact.redact(f.text) for f in FORMS))
    ordinary = [
        "epoch 3/100 loss=0.4321 lr=0.001 max_tokens=5 sorted(x, key=len) https://host:8080/p",
        "Basic checks passed; Bearer tokens are refused",
        "hf_hub_download failed; see https://huggingface.co/docs?tab=files",
        "key=<VAST_API_KEY> and Bearer <HF_TOKEN> stay placeholders",
    ]
    for line in ordinary:
        assert redact.redact(line) == line


def test_a_known_secret_is_redacted_in_every_form_an_error_shows_it_in() -> None:
    key = "vast key/with+odd=chars\n"
    shown = [
        key,
        key.strip(),
        "vast key/with+odd=chars\\n",  # escaped: b'...\n'
        json.dumps(key)[1:-1],
        "vast%20key%2Fwith%2Bodd%3Dchars",  # URL-quoted
        base64.b64encode(f"{key}:".encode()).decode(),  # HTTP Basic, the key as user
        base64.b64encode(f":{key}".encode()).decode(),  # and as password
    ]
    for text in shown:
        assert redact.redact(f"[{text}]", [("KEY", key)]) == "[<KEY>]", text


def test_the_secret_named_first_wins_and_short_ones_are_not_matched() -> None:
    # The Hub's own name for the token it was given, though the environment names it too.
    assert hub.redact(f"x {HF_TOKEN}", HF_TOKEN) == "x <HF_TOKEN>"
    assert redact.redact(f"x {HF_TOKEN}", [("TOKEN", HF_TOKEN)]) == "x <TOKEN>"
    assert redact.redact("a 12345 b", [("PIN", "12345")]) == "a 12345 b"


# --------------------------------------------------------------------------------------------
# Every path


def test_a_log_line_and_its_traceback(tmp_path: Path) -> None:
    path = tmp_path / "agent.log"
    handler = logging.FileHandler(path)
    logutil.install(handler)
    log = logging.getLogger("agent.test.redact_paths")
    log.addHandler(handler)
    log.propagate = False
    try:
        for form in FORMS:
            log.warning("failed: %s", form.text)
        try:
            raise RuntimeError(FORMS[4].text)
        except RuntimeError:
            log.exception("in a traceback")
    finally:
        log.removeHandler(handler)
        logutil.uninstall(handler)
        handler.close()
    assert_redacted(path.read_text())


def test_the_logs_view(tmp_path: Path) -> None:
    """``GET /logs`` over a socket: lines read from trainer.log, and lines handed over raw
    (the view redacts whatever its source gives it)."""
    trainer_log = tmp_path / "trainer.log"
    trainer_log.write_text("".join(f"{f.text}\n" for f in FORMS))

    def logs(n: int) -> dict[str, list[str]]:
        return {"trainer": tail_lines(trainer_log, n), "raw": [f.text for f in FORMS]}

    views = Views(
        status=dict, events=None, logs=logs, history=None, stream_started=lambda r, f: None
    )

    async def main() -> Any:
        app = web.Application()
        views.add_routes(app.router)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{port}/logs?tail=100") as response,
            ):
                assert response.status == 200
                return await response.json()
        finally:
            await runner.cleanup()

    answer = asyncio.run(main())
    assert_redacted("\n".join(answer["trainer"]))
    assert_redacted("\n".join(answer["raw"]))


def test_a_notification_body() -> None:
    # No secret handed to the notifier: the ones the agent remembered still never leave.
    with Receiver() as receiver:

        async def main() -> None:
            bus = EventBus()
            n = notifier(receiver.url(), bus, events=("failure",))
            async with running(n):
                bus.publish(
                    "failure",
                    reason="training_failed",
                    cause=" | ".join(f.text for f in FORMS),
                    lines=[f.text for f in FORMS],
                )
                assert await n.flush(10)

        asyncio.run(main())
        raw = "\n".join(a["raw"] for a in receiver.attempts)
        body = receiver.received[0]
    for form in FORMS:
        assert form.secret not in raw
    assert_redacted(body["text"])
    assert_redacted("\n".join(body["event"]["data"]["lines"]))


def test_report_json_and_markdown(tmp_path: Path) -> None:
    st = synthetic_state()
    st.cause = " | ".join(f.text for f in FORMS)
    built = report.build(st, status_doc(), [], [], [f.text for f in FORMS])
    json_path, md_path = report.write(tmp_path, built)
    on_disk = json.loads(json_path.read_text())
    assert_redacted(on_disk["cause"])
    assert_redacted("\n".join(on_disk["warnings"]))
    assert_redacted(md_path.read_text())


def test_the_uploaded_copy_of_a_log(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    log.write_text("".join(f"{f.text}\n" for f in FORMS))
    (sent,) = as_sent([log], tmp_path / "redacted")
    assert sent != log
    assert_redacted(sent.read_text())
    assert HF_TOKEN in log.read_text()  # the file on this disk is left as it was


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.shown)
def test_a_provider_error(form: Form) -> None:
    """A teardown command that fails and prints the secret: the result's detail (what
    state.json, /status and the log carry)."""
    script = f"import sys\nprint({form.text!r})\nsys.exit(3)\n"
    p = provider([sys.executable, "-c", script], env=Env(vast_api_key=VAST_KEY))
    result = asyncio.run(p.teardown("destroy", "completed"))
    assert not result.confirmed
    assert_redacted(result.detail, [form])


def test_a_hub_error() -> None:
    """The one-line detail of a Hub failure (what the sink, staging and preflight report)."""
    for form in FORMS:
        for exc in (ConnectionError(form.text), OSError(5, form.text), ValueError(form.text)):
            assert_redacted(hub.classify(exc, token=HF_TOKEN).detail, [form])
