"""Modules the agent's process never uses, kept out of it before anything imports them.

Measured on an H200 box whose image holds ``huggingface_hub`` 1.x, ``rich``, ``click`` and
``pygments`` (issue 26): importing ``huggingface_hub.hf_api`` cost the agent 13.4 MiB there
against 7.9 on a venv without them, for two imports no code of ours reaches:

- ``httpx._main``, the ``httpx`` command-line client: ``httpx/__init__.py`` imports it, with
  ``rich``, ``click`` and ``pygments``, whenever they are installed (6.0 MiB with
  ``huggingface_hub.hf_api``). httpx catches the ImportError and gives ``httpx.main`` a stand-in
  that says the CLI is not installed; nothing else of httpx changes.
- ``sqlite3``, for ``filelock``'s read-write locks (``filelock/__init__.py`` catches the
  ImportError, "lacks sqlite3"; huggingface_hub takes plain file locks): 1.0 MiB.

A ``None`` in :data:`sys.modules` makes ``import X`` raise ImportError (the import system's
documented way to block a module). Only the agent's own process (``libreyolo-agent run``) does
this: its children, the trainer first, start with their own interpreter.
"""

from __future__ import annotations

import sys

#: What the agent keeps out, and why (above).
KEPT_OUT = ("httpx._main", "sqlite3")


def keep_out() -> list[str]:
    """Block :data:`KEPT_OUT` where nothing imported it yet; the names blocked."""
    blocked = []
    for name in KEPT_OUT:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
            blocked.append(name)
    return blocked
