"""How fast the guard saves and stops a dead agent's box: from the hard deadline to the newest
``last.pt`` verified on the target, and to the provider call.

Reads the guard's own lines in ``STATE_DIR/guard.log`` (agent/guard/run.py writes them when it
acts)::

    guard: timing: newest last.pt verified at 1796395245.161 (+12.3s after the hard deadline): ...
    guard: timing: provider call at 1796395245.170 (+12.3s after the hard deadline): stop ...

and the plan's hard deadline (``guard-plan.json``). Prints one JSON object; exits 1 when the
guard has not acted (no such lines). The H200 scenario: start a job with ``limits.max_runtime``
and a ``[sync]`` target, SIGKILL the agent (not restarted), wait for the guard, then::

    .venv/bin/python bench/guard_timing.py "$LIBREYOLO_AGENT_STATE_DIR"
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"guard: timing: (?P<what>.+?) at (?P<at>\d+(?:\.\d+)?) \((?P<after>[^)]*)\)")


def measure(state_dir: Path) -> dict[str, object]:
    plan = json.loads((state_dir / "guard-plan.json").read_text())
    deadline = plan.get("hard_deadline")
    out: dict[str, object] = {"hard_deadline": deadline}
    for line in (state_dir / "guard.log").read_text(errors="replace").splitlines():
        m = LINE.search(line)
        if not m:
            continue
        at = float(m["at"])
        key = "last_pt_verified" if "last.pt" in m["what"] else "provider_call"
        out.setdefault(key + "_at", at)  # the first: a later retry does not move it
        if isinstance(deadline, int | float):
            out.setdefault(key + "_after_deadline_s", round(at - deadline, 3))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    result = measure(Path(argv[1]))
    print(json.dumps(result, indent=2))
    return 0 if "provider_call_at" in result else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
