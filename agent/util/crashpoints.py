"""Fault injection for the kill-at-an-instant tests (tests/test_restart.py, tests/test_chaos.py).

A SIGKILL at an exact instant (between spawning the trainer and recording its pid, between an
upload and its read-back) cannot be produced from outside reliably, so the agent kills itself
there when ``LIBREYOLO_AGENT_CRASHPOINT`` names the point. Unset (always, in production), each
call is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

#: The points: STAGING entered and recorded (nothing staged yet), right after the trainer is
#: spawned (pid not yet recorded), right after an upload was sent (not yet read back), FINISHING
#: with the final sync queued, TEARDOWN decided and recorded but not yet sent, TEARDOWN sent and
#: recorded as sent but not yet read back.
POINTS = (
    "staging",
    "after-launch",
    "upload-sent",
    "finishing",
    "teardown-sending",
    "teardown-sent",
)


def crashpoint(name: str) -> None:
    """SIGKILL this process when ``LIBREYOLO_AGENT_CRASHPOINT`` names ``name``."""
    if os.environ.get("LIBREYOLO_AGENT_CRASHPOINT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
