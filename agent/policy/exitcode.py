"""The exit code a launch engine reads (SkyPilot, dstack): ``run --exit-codes engine``.

The agent's own codes answer a supervisor on the same box (systemd, ``supervise``): 0 means
"the job ended as planned, do not start me again", whatever the training outcome. An engine
that relaunches a job on another box needs a different question answered: did the job
*succeed*, and if not, would another box help? Three answers, one code each:

- ``0``: the training completed (here, or the target says it already had).
- :data:`EXIT_RETRY` (75, ``EX_TEMPFAIL``): the box failed, not the job - a preemption notice
  was handled (``last.pt`` saved first), a GPU fault was seen, or the agent left before the
  job ended (the engine stopped it, or the box is going). A new box with the same job and
  target resumes from the target's ``last.pt``.
- :data:`EXIT_DO_NOT_RETRY` (65, ``EX_DATAERR``): the job ended and another box would end it
  the same way - a bad job file, a failed preflight or dataset check, a training failure the
  agent already retried or judged deterministic, a stall, a limit (``max_runtime`` counts from
  each box's first boot, so a relaunch would reset it), a stop by a person, a full disk, a
  diverged run, the agent's own crash loop.

The agent's crash (exit 1) and an open teardown (exit 3) keep their codes: neither says
anything about the job, and a person must look.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Final

from agent.config.model import ConfigError, Env
from agent.state import Reason, RunState, StateStore

#: The box failed, not the job: relaunch it elsewhere (sysexits ``EX_TEMPFAIL``).
EXIT_RETRY: Final = 75
#: The job ended and another box would end it the same way (sysexits ``EX_DATAERR``).
EXIT_DO_NOT_RETRY: Final = 65

#: Endings a new box can help: the box was going (a handled notice) or is broken.
_RETRY_REASONS = frozenset({Reason.PREEMPTED})


def for_engine(agent_code: int, state: RunState | None) -> int:
    """The engine's exit code for a ``run`` that exited with ``agent_code`` leaving ``state``
    (None: the job file was bad, nothing ran)."""
    if agent_code == 2:  # a bad job file: no box can run it
        return EXIT_DO_NOT_RETRY
    if agent_code != 0:  # 1 the agent failed, 3 a teardown open: said as they are
        return agent_code
    if state is None:
        return EXIT_DO_NOT_RETRY
    if not state.phase.terminal:
        # The agent left before the job ended: asked to exit, a SIGTERM notice, HELD.
        return EXIT_RETRY
    if state.reason == Reason.COMPLETED:
        return 0
    if state.reason in _RETRY_REASONS or (state.teardown or {}).get("box_fault"):
        return EXIT_RETRY
    return EXIT_DO_NOT_RETRY


#: ``run --exit-codes``'s help.
HELP = (
    "agent (default): the codes below, for a supervisor on this box; engine (with a JOB): 0 "
    f"completed, {EXIT_RETRY} the box failed (retry the job on another), {EXIT_DO_NOT_RETRY} "
    "the job ended and would end so again (do not retry), 1 and 3 as below - for SkyPilot "
    "and dstack (README, 'Many boxes')"
)


def from_state_dir(agent_code: int, state_dir: Path) -> int:
    """:func:`for_engine` over what the agent left in ``state_dir``'s state file: the record
    ``status`` reads too. An unreadable file says nothing about the job: the agent's code."""
    try:
        state = StateStore(state_dir).load()
    except (OSError, ValueError, KeyError, TypeError):
        return agent_code if agent_code != 0 else EXIT_DO_NOT_RETRY
    return for_engine(agent_code, state)


def wrap(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``run``'s command, exiting with the engine's code when ``--exit-codes engine`` came with
    a JOB (the demo keeps the agent's: its state lives in its own folder)."""

    def run(args: argparse.Namespace) -> int:
        code = command(args)
        if args.exit_codes != "engine" or not args.job:
            return code
        try:
            state_dir = Env.from_environ().state_dir
        except ConfigError:  # run has said why (it read the same environment)
            return EXIT_DO_NOT_RETRY
        return from_state_dir(code, state_dir)

    return run
