"""The warm start: the trainer's own Python runs preflight's torch probe, then waits to train.

A cold start imports torch twice before the first epoch: once in preflight's probe (a child
Python, ``agent/preflight/probe.py``) and once in ``libreyolo train``. On an H200 box each import
with its
CUDA start-up costs about 4 s of billed time. Here one process does both: the agent starts it
when preflight begins (own session, stdout to the result file, stderr to ``trainer.log``, like
any trainer), it runs the probe while the dataset downloads, reports, and waits. When preflight
and staging have passed, the agent sends the command line and this process becomes the trainer
(LibreYOLO's own CLI, in this process, with torch, CUDA and the training stack already loaded).

    python -m agent.trainer.warm_entry '<probe config json>'      # fds 3 (report) and 4 (gate) open

Fd 3 (``REPORT_FD``) gets the probe's stage lines, then one line ``DOC_PREFIX + json``. Fd 4
(``GATE_FD``) is read for one line: ``{"argv": ["libreyolo", "train", ...]}`` starts the
training; anything else, or end of file (the agent closed it, or died), ends this process with
nothing trained and nothing written to stdout. Both are closed before the training starts, so
the trainer outlives the agent like any other and its workers inherit neither.

Whatever torch, CUDA or LibreYOLO print while probing goes to stderr (the log), never to stdout,
which is the ``json=true`` result of the training.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

#: Inherited descriptors: the probe's report (written here) and the agent's go (read here).
REPORT_FD = 3
GATE_FD = 4
#: Prefix of the report's last line, the probe's JSON document.
DOC_PREFIX = "libreyolo-agent-probe: doc "
#: Exit code when the agent called the start off (closed the gate): nothing was trained.
CALLED_OFF = 0
#: Set when the agent added ``PYTHONSAFEPATH`` for this process only (not for what it starts).
SAFEPATH_ADDED = "LIBREYOLO_AGENT_WARM_SAFEPATH"


def _release_gpu_cache() -> None:
    """Hand the probe's cached GPU blocks back to the driver: the trainer sizes its batch
    (``batch=-1``) from the free memory. The CUDA context itself stays: the trainer needs it."""
    cuda: Any = getattr(sys.modules.get("torch"), "cuda", None)
    initialized = getattr(cuda, "is_initialized", None)
    try:
        if initialized is not None and initialized():
            cuda.empty_cache()
    except Exception as exc:  # the probe's document already says what is wrong
        sys.stderr.write(f"libreyolo-agent warm start: empty_cache failed: {exc}\n")


def _read_gate() -> list[str] | None:
    with os.fdopen(GATE_FD, "rb", closefd=True) as gate:
        line = gate.readline()
    try:
        message: Any = json.loads(line) if line.strip() else None
    except ValueError:
        return None
    argv = message.get("argv") if isinstance(message, dict) else None
    if not (isinstance(argv, list) and len(argv) >= 2 and all(isinstance(a, str) for a in argv)):
        return None
    return argv


def main(argv: list[str] | None = None) -> int:
    args = sys.argv if argv is None else argv
    config = json.loads(args[1]) if len(args) > 1 else {}
    if os.environ.pop(SAFEPATH_ADDED, None):
        os.environ.pop("PYTHONSAFEPATH", None)  # applied already; the trainer's children: bare
    from agent.preflight import probe

    report = os.fdopen(REPORT_FD, "w", encoding="utf-8", closefd=True)
    probe.stage_out = report
    out_fd = os.dup(1)
    os.dup2(2, 1)  # the probe's chatter goes to the log, never to the result file
    try:
        doc = probe.probe(config)
        _release_gpu_cache()
        probe.stage_out = None
        try:
            report.write(DOC_PREFIX + json.dumps(doc) + "\n")
            report.close()
        except OSError:  # the agent is gone (EPIPE): nobody will say go
            return CALLED_OFF
        try:
            train_argv = _read_gate()
        except KeyboardInterrupt:
            return 130
    finally:
        os.dup2(out_fd, 1)
        os.close(out_fd)
    if train_argv is None:
        return CALLED_OFF
    sys.stderr.write(f"libreyolo-agent warm start: training: {' '.join(train_argv)}\n")
    sys.stderr.flush()
    from agent.trainer.train_entry import run_cli

    return run_cli(train_argv)


if __name__ == "__main__":
    sys.exit(main())
