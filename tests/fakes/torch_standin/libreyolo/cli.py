"""A stand-in ``libreyolo.cli`` for the warm start's hand-off (``agent/trainer/warm_entry.py``).

``entrypoint()`` prints one JSON line on stdout, as ``libreyolo train ... json=true`` does: the
command line it got, its pid and whether torch was already imported (the warm start's point),
then exits with the scenario's ``train_exit`` (default 0). It also says whether
``PYTHONSAFEPATH`` is in its environment (what the processes it starts would inherit).
``train_s`` makes it train that long.
"""

from __future__ import annotations

import json
import os
import sys
import time


def entrypoint() -> None:
    scenario = json.loads(os.environ.get("LIBREYOLO_AGENT_FAKE_TORCH") or "{}")
    time.sleep(float(scenario.get("train_s", 0)))
    doc = {
        "argv": sys.argv,
        "pid": os.getpid(),
        "torch_loaded": "torch" in sys.modules,
        "safepath": os.environ.get("PYTHONSAFEPATH"),
    }
    print(json.dumps(doc), flush=True)
    sys.exit(int(scenario.get("train_exit", 0)))
