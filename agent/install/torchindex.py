"""Does PyTorch's CPU wheel index answer? Asked by agent/install/torchpick.py on a machine without
``nvidia-smi``: where ``$TORCH_INDEX_BASE/cpu`` lists the wanted ``+cpu`` builds, install.sh
installs those (about 0.2 GB) instead of the default build, which is the CUDA one (about 3 GB).
Never longer than :data:`CPU_INDEX_TIMEOUT_S`: an unreachable index must not hang the install.
Standard library only.
"""

from __future__ import annotations

import http.client
import threading
import time
import urllib.request
from dataclasses import dataclass

#: Seconds PyTorch's CPU wheel index has to answer on a machine without ``nvidia-smi``.
CPU_INDEX_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class IndexProbe:
    """Whether PyTorch's CPU wheel index answered with the wanted builds."""

    ok: bool
    #: What was asked and what came back (an error, the missing build).
    why: str


def probe_cpu_index(index_base: str, spec: str, timeout: float = CPU_INDEX_TIMEOUT_S) -> IndexProbe:
    """Whether ``index_base/cpu`` lists the ``+cpu`` builds of ``spec`` (its simple index pages
    for torch and torchvision), within ``timeout`` seconds for both; never raises.

    Asked in a daemon thread given ``timeout`` in all: socket timeouts do not cover a name
    lookup, which may wait on an unanswering resolver for much longer.
    """
    answer: list[IndexProbe] = []
    thread = threading.Thread(
        target=lambda: answer.append(_probe(index_base, spec, timeout)), daemon=True
    )
    thread.start()
    thread.join(timeout)
    if not answer:
        return IndexProbe(False, f"{index_base.rstrip('/')}/cpu: no answer within {timeout:g} s")
    return answer[0]


def _probe(index_base: str, spec: str, timeout: float) -> IndexProbe:
    deadline = time.monotonic() + timeout
    base = f"{index_base.rstrip('/')}/cpu"
    for name, _, version in (word.partition("==") for word in spec.split()):
        url = f"{base}/{name}/"
        left = deadline - time.monotonic()
        if left <= 0:
            return IndexProbe(False, f"{url}: no answer within {timeout:g} s")
        request = urllib.request.Request(url, headers={"Accept": "text/html"})
        try:
            with urllib.request.urlopen(request, timeout=left) as response:
                body = response.read(8 << 20).decode("utf-8", errors="replace").lower()
        except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, timeouts...
            reason = getattr(exc, "reason", None) or exc
            return IndexProbe(False, f"{url}: {reason}")
        wanted = [f"{name}-{version}+cpu", f"{name}-{version}%2bcpu"]
        if not any(w.lower() in body for w in wanted):
            return IndexProbe(False, f"{url} lists no {name} {version}+cpu")
    return IndexProbe(True, f"{base} lists {spec} +cpu")
