"""The job's ``[sync] target`` made into its sink: ``file://`` (:mod:`agent.sinks.local`) or
``hf://`` (:mod:`agent.sinks.hf`).

Not in the package's ``__init__``: each sink module imports the shared nouns from there, so the
choice between them lives beside them. The Hub's sink is imported only for an ``hf://`` target,
so a job with a local target never loads ``huggingface_hub``.
"""

from __future__ import annotations

from pathlib import Path

from agent.config.model import Env, SyncSection
from agent.sinks import Sink
from agent.sinks.local import LocalSink


def make_sink(sync: SyncSection, env: Env) -> Sink:
    """Build the sink for ``sync.target``."""
    if sync.scheme == "file":
        return LocalSink(Path(sync.location))
    if sync.scheme == "hf":
        from agent.sinks.hf import HubSink

        return HubSink(sync.location, env=env, private=sync.private)
    raise ValueError(f"unsupported sync target scheme {sync.scheme!r}")
