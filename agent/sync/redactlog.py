"""Logs as they may leave the box: every secret the agent read from the environment replaced by
``<VARIABLE>``, every other one it recognises (a Bearer token, a signed URL) by ``<secret>``: the
very redaction ``GET /logs`` gives (:func:`agent.util.redact.redact`).

``trainer.log`` is written by the trainer itself (a process that outlives the agent, its output
straight into the file), so whatever it prints (a token in a traceback, an environment dump)
is in the file on this disk. The sync uploads a redacted copy, made here, never the file.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from agent.util import redact as redaction
from agent.util.text import os_error

log = logging.getLogger(__name__)

_lock = threading.Lock()
#: ``{source: (size, mtime_ns, ctime_ns)}`` of the version each copy was made from.
_made: dict[Path, tuple[int, int, int]] = {}


def redacted_copy(src: Path, folder: Path) -> Path:
    """``folder/<name>``: the lines of ``src`` redacted, made again only when ``src`` changed
    since the last copy. Always a copy, also when no secret of the environment is known: a
    token is also found by its shape. A missing ``src`` is returned as is (the sync says it is
    unavailable). Blocking; raises ``OSError`` when the copy fails."""
    try:
        st = src.stat()
    except FileNotFoundError:
        return src
    dst = folder / src.name
    version = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    with _lock:
        if _made.get(src) == version and dst.exists():
            return dst
    folder.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp")
    try:
        with (
            open(src, encoding="utf-8", errors="surrogateescape", newline="") as f,
            open(tmp, "w", encoding="utf-8", errors="surrogateescape", newline="") as out,
        ):
            clean = redaction.redactor().text
            # By blocks of whole lines (a secret never spans a line break): one call per MiB,
            # not per line, is what makes a copy of a long trainer.log quick.
            while block := f.readlines(1 << 20):
                out.write(clean("".join(block)))
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with _lock:
        _made[src] = version
    return dst


def as_sent(paths: Iterable[Path], folder: Path) -> list[Path]:
    """What the sync uploads for the agent's files ``paths``: each ``*.log`` as its redacted
    copy (:func:`redacted_copy`; left out, logged, when no copy can be made: never the raw
    file), the rest as they are. Blocking."""
    out: list[Path] = []
    for path in paths:
        if path.suffix != ".log":
            out.append(path)
            continue
        try:
            out.append(redacted_copy(path, folder))
        except OSError as exc:
            log.warning("%s not sent: no redacted copy (%s)", path.name, os_error(exc))
    return out
