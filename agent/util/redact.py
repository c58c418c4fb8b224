"""Secrets out of every text that leaves the agent: the one place redaction is decided.

agent.log and trainer.log are uploaded with the checkpoints, ``GET /logs`` serves their tails,
notifications go to a chat, report.json and report.md sit in the repository, provider and Hub
errors reach state.json and ``/status``. Each of them goes through :func:`redact` (a text) or
:func:`redact_value` (a JSON value), which remove two kinds of secret:

- **known** ones, by value: every secret the agent read from the environment (:func:`remember`,
  called with ``Env.secrets()`` at start) and any the caller names. Each becomes ``<VARIABLE>``
  in every form an error message shows it in (:func:`forms`): as is, stripped, escaped
  (``b'Bearer hf_...\\n'``), JSON-escaped, URL-quoted, and base64 as HTTP Basic credentials.
- **shaped** ones, found by their shape whatever their value: ``Bearer`` tokens, ``Basic``
  credentials, credentials in a URL (``https://user:pass@host``), secret-named parameters and
  assignments (``?token=``, ``&sig=``, ``api_key=``, ``X-Amz-Signature=``,
  ``AWS_SECRET_ACCESS_KEY=``, ``"password": "..."``) and Hugging Face tokens (``hf_...``).
  Each becomes :data:`SECRET`.

Known secrets shorter than :data:`MIN_SECRET` characters are not matched (too many false hits).
This module imports nothing heavy: the supervisor, which must stay small, logs through it.
"""

from __future__ import annotations

import binascii  # not base64, its wrapper: the supervisor holds this module
import contextlib
import functools
import json
import re
from collections.abc import Iterable, Mapping
from urllib.parse import quote, quote_plus, unquote, urlsplit

#: ``typing.TYPE_CHECKING`` without importing typing (0.5 MiB the supervisor does not hold).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: What a secret found by its shape becomes (a known one becomes ``<VARIABLE>``).
SECRET = "<secret>"
#: Known secrets (and forms of them) shorter than this are not matched.
MIN_SECRET = 6

Pair = tuple[str, str]

#: The secrets the agent read from the environment, as ``(variable, value)``.
_environment: tuple[Pair, ...] = ()

# Names whose value is a secret, in ``name=value`` and ``"name": "value"``. Anywhere: one of
# _SECRET_WORDS, or a name whose last part (after _ or -) is one of _SECRET_ENDINGS
# (``api_key``, ``X-Amz-Signature``, ``AWS_SECRET_ACCESS_KEY``; never ``max_tokens``). In a URL's
# query only (after ? & ;): the short, common _QUERY_WORDS too (``?token=``, ``&sig=``), which
# elsewhere in a log are more often Python (``key=len``).
_SECRET_WORDS = frozenset({"password", "passwd", "secret", "apikey"})
_SECRET_ENDINGS = ("token", "secret", "password", "passwd", "key", "signature", "credential", "sig")
_QUERY_WORDS = frozenset({"token", "key", "sig", "signature", "auth", "credential"})
# A shape is looked for only when one of these is in the lower-cased text: this runs on every
# log line, and trainer.log is copied whole.
_NAME_HINTS = ("token", "secret", "passw", "key", "sig", "credential", "auth")

_URL = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://[^\s/?#@:<>\"']*:)(?!<)[^\s/?#@<>\"']+(?=@)")
_BEARER = re.compile(r"\b([Bb]earer|BEARER)(\s+)(?!<)[A-Za-z0-9._~+/-]{8,}=*")
_BASIC = re.compile(r"\b([Bb]asic|BASIC)(\s+)([A-Za-z0-9+/]{4,}={0,2})(?![A-Za-z0-9+/=])")
# A value that is not a placeholder already (``key=<VAST_API_KEY>`` stays as it is).
_PARAM = re.compile(r"(?<![A-Za-z0-9_.-])([A-Za-z][A-Za-z0-9_-]{0,63})=(?!<)[^\s&#\"'<>,;)}\]]+")
_JSON = re.compile(r"([\"'])([A-Za-z][A-Za-z0-9_-]{0,63})\1(\s*:\s*)([\"'])(?!<)[^\"'\s]+(?=\4)")
_HF = re.compile(r"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{30,}(?![A-Za-z0-9])")


def _secret_name(name: str, *, in_query: bool) -> bool:
    name = name.lower()
    if name in _SECRET_WORDS or (in_query and name in _QUERY_WORDS):
        return True
    parts = re.split(r"[_-]", name)
    return len(parts) > 1 and parts[-1] in _SECRET_ENDINGS


def _param(match: re.Match[str]) -> str:
    start = match.start()
    in_query = start > 0 and match.string[start - 1] in "?&;"
    return f"{match[1]}={SECRET}" if _secret_name(match[1], in_query=in_query) else match[0]


def _json(match: re.Match[str]) -> str:
    if not _secret_name(match[2], in_query=False):
        return match[0]
    return f"{match[1]}{match[2]}{match[1]}{match[3]}{match[4]}{SECRET}"


def _basic(match: re.Match[str]) -> str:
    # "Basic" is also a word: only what decodes to user:password is a credential.
    with contextlib.suppress(binascii.Error, ValueError):
        if b":" in binascii.a2b_base64(match[3], strict_mode=True):  # b64decode(validate=True)
            return f"{match[1]}{match[2]}{SECRET}"
    return match[0]


def _shapes(text: str) -> str:
    """``text`` with every secret found by its shape replaced by :data:`SECRET`."""
    low = text.lower()
    if "@" in text and "://" in text:
        text = _URL.sub(lambda m: f"{m[1]}{SECRET}", text)
    if "bearer" in low:
        text = _BEARER.sub(lambda m: f"{m[1]}{m[2]}{SECRET}", text)
    if "basic" in low:
        text = _BASIC.sub(_basic, text)
    if any(hint in low for hint in _NAME_HINTS):
        if "=" in text:
            text = _PARAM.sub(_param, text)
        if ":" in text:
            text = _JSON.sub(_json, text)
    if "hf_" in text:
        text = _HF.sub(SECRET, text)
    return text


def forms(value: str) -> set[str]:
    """The forms in which the secret ``value`` shows up in error messages, logs and JSON: as is,
    stripped, escaped, JSON-escaped, URL-quoted, and base64 the way HTTP Basic sends it (an API
    key as user or as password). Forms shorter than :data:`MIN_SECRET` are left out."""
    found: set[str] = set()
    # Stripped too: a value read from a file with its newline is sent (and quoted) without it.
    for v in {value, value.strip()} - {""}:
        found.update(
            {
                v,
                v.encode("unicode_escape").decode("ascii"),
                json.dumps(v)[1:-1],
                json.dumps(v, ensure_ascii=False)[1:-1],
                quote(v, safe=""),
                quote_plus(v, safe=""),
            }
        )
        for raw in (f"{v}:", f":{v}", v):
            found.add(binascii.b2a_base64(raw.encode(), newline=False).decode("ascii"))
    return {f for f in found if len(f) >= MIN_SECRET}


def url_forms(url: str) -> list[str]:
    """The forms in which a secret URL (a webhook: Slack and Discord put the token in the path)
    shows up in an error message: whole, as the HTTP client normalises it, without its scheme,
    and its path, query, password and long path segments (a token alone)."""
    found = [url, url.rstrip("/")]
    with contextlib.suppress(ValueError, ImportError):
        import yarl  # aiohttp's; imported here only: the supervisor never needs it

        found.append(str(yarl.URL(url)))
    with contextlib.suppress(ValueError):
        parsed = urlsplit(url)
        found.append(url.split("://", 1)[-1])
        if parsed.path.strip("/"):
            found.extend([parsed.path, unquote(parsed.path)])
        found.extend(s for s in parsed.path.split("/") if len(s) >= 16)
        found.extend([parsed.query, parsed.password or ""])
    return [f for f in found if f]


class Redactor:
    """Every known secret (``(variable, value)`` pairs; the first name given for a value wins)
    and every shaped one, out of a text or a JSON value. Build once, use often."""

    def __init__(self, secrets: Iterable[Pair] = ()) -> None:
        names: dict[str, str] = {}
        for name, value in secrets:
            for form in forms(value):
                names.setdefault(form, name)
        self._names = names
        # Longest first: a secret that contains another (or a form of it) is replaced whole.
        pattern = "|".join(re.escape(f) for f in sorted(names, key=len, reverse=True))
        self._known = re.compile(pattern) if names else None

    def text(self, text: str) -> str:
        """``text`` with every known secret replaced by ``<VARIABLE>``, then every shaped one
        by :data:`SECRET`."""
        if self._known is not None:
            text = self._known.sub(lambda m: f"<{self._names[m[0]]}>", text)
        return _shapes(text)

    def value(self, value: Any) -> Any:
        """``value`` with every string in it redacted (mapping keys too), however deep; a tuple
        becomes a list, everything else stays as it is."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {self.value(k): self.value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.value(v) for v in value]
        return value


def remember(secrets: Iterable[Pair]) -> None:
    """The secrets the agent read from the environment (``Env.secrets()``): from now on every
    :func:`redact` removes them. An empty value is ignored; ``[]`` forgets them all."""
    global _environment
    _environment = tuple((n, v) for n, v in secrets if v)


def remembered() -> tuple[Pair, ...]:
    """What :func:`remember` was last given (empty values left out)."""
    return _environment


@functools.lru_cache(maxsize=16)
def _redactor(secrets: tuple[Pair, ...]) -> Redactor:
    return Redactor(secrets)


def redactor(secrets: Iterable[Pair] = ()) -> Redactor:
    """The :class:`Redactor` of ``secrets`` and of the remembered ones (``secrets`` name first)."""
    return _redactor((*tuple(secrets), *_environment))


def redact(text: str, secrets: Iterable[Pair] = ()) -> str:
    """``text`` without any secret: the remembered ones and ``secrets`` as ``<VARIABLE>``, those
    found by their shape as :data:`SECRET`."""
    return redactor(secrets).text(text)


def redact_value(value: Any, secrets: Iterable[Pair] = ()) -> Any:
    """:func:`redact` for every string in a JSON value (report.json, a notification's body)."""
    return redactor(secrets).value(value)
