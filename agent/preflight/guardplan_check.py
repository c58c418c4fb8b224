"""``guard.plan``: what the guard (agent/guard/run.py) will do with this box if the agent dies, said
before training, where the user can still choose.

The guard never destroys checkpoints that are not verified off the box: where it would stop the
box, a provider without a stop (Lambda; ``command`` without ``teardown.stop_command``) makes it
KEEP the box, billing in full, until a person stops or destroys it. The agent's own teardown does
the same with a destroy whose sync is not verified (``teardown.require_verified_sync``). That is a
warning (the job may still be right to run), one line with what to change.
"""

from __future__ import annotations

from agent.config.model import Job
from agent.preflight.report import WARN, Check, make_check

NAME = "guard.plan"


def guard_plan_check(job: Job) -> Check | None:
    """A warning when a dead agent's box (or an unverified destroy) would be kept rather than
    stopped; None when the provider can stop (or is ``none``)."""
    td = job.teardown
    if td.provider == "lambda":
        why = "provider lambda has no stop"
        fix = (
            "Lambda cannot stop a box: set up [notify] to hear of it, keep limits.max_runtime "
            "tight, or run on a provider with a stop (vast, runpod)"
        )
    elif td.provider == "command" and not td.stop_command:
        why = "provider command has no teardown.stop_command"
        fix = "set teardown.stop_command to a command that stops (not destroys) this box"
    else:
        return None
    value = (
        f"{why}: if the agent dies, the guard KEEPS this box (billing in full) instead of "
        "stopping it, and an unverified destroy is kept too; it never destroys checkpoints "
        "that are not verified off the box"
    )
    return make_check(NAME, WARN, value, fix)
