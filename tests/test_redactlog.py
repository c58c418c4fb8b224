"""Logs leave the box as /logs shows them: agent/sync/redactlog.py makes the redacted copy the sync
uploads, and never hands over the raw file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.sync.redactlog import as_sent, redacted_copy
from agent.util import logutil

TOKEN = "hf_redactlog_secret_0123456789"
KEY = "vast-redactlog-key-abcdef"


@pytest.fixture
def secrets() -> Iterator[None]:
    logutil.redact_secrets([("HF_TOKEN", TOKEN), ("VAST_API_KEY", KEY)])
    try:
        yield
    finally:
        logutil.redact_secrets([])


def test_the_copy_is_redacted_line_by_line_and_follows_the_source(
    tmp_path: Path, secrets: None
) -> None:
    log = tmp_path / "trainer.log"
    log.write_bytes(f"token {TOKEN}\nbar\r50%\rkey={KEY}\n\xff raw byte\n".encode("latin-1"))
    copy = redacted_copy(log, tmp_path / "redacted")
    assert copy == tmp_path / "redacted" / "trainer.log"
    text = copy.read_bytes().decode("latin-1")
    assert TOKEN not in text and KEY not in text
    assert "token <HF_TOKEN>\nbar\r50%\rkey=<VAST_API_KEY>\n" in text
    assert text.endswith("\xff raw byte\n")  # bytes that are not UTF-8 are kept as they were
    with open(log, "a") as f:
        f.write(f"later {TOKEN}\n")
    again = redacted_copy(log, tmp_path / "redacted").read_bytes()
    assert again.endswith(b"later <HF_TOKEN>\n")


def test_without_known_secrets_a_token_is_still_found_by_its_shape(tmp_path: Path) -> None:
    # No secret read from the environment (no HF_TOKEN set), yet the trainer printed a header.
    logutil.redact_secrets([])
    log = tmp_path / "trainer.log"
    log.write_text("nothing secret\nAuthorization: Bearer abcdef0123456789xyz\n")
    copy = redacted_copy(log, tmp_path / "redacted")
    assert copy == tmp_path / "redacted" / "trainer.log"
    assert copy.read_text() == "nothing secret\nAuthorization: Bearer <secret>\n"


def test_a_log_that_cannot_be_copied_is_left_out_never_sent_raw(
    tmp_path: Path, secrets: None
) -> None:
    log, state = tmp_path / "trainer.log", tmp_path / "state.json"
    log.write_text(f"{TOKEN}\n")
    state.write_text("{}")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the copies' folder should be")
    assert as_sent([log, state], blocked) == [state]
    assert as_sent([log, state], tmp_path / "ok") == [tmp_path / "ok" / "trainer.log", state]
