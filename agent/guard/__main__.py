"""``python -m agent.guard STATE_DIR``: the guard process (agent/guard/run.py), as the agent starts
it."""

import sys

from agent.guard.run import main

sys.exit(main())
