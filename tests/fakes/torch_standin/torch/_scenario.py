"""The scenario of the stand-in ``torch``: JSON in ``LIBREYOLO_AGENT_FAKE_TORCH``.

Keys (all optional)::

    version       torch.__version__                       "2.5.1+cu124"
    cuda          torch.version.cuda; null: a CPU-only build  "12.4"
    arch_list     torch.cuda.get_arch_list()              ["sm_80", "sm_86", "sm_90"]
    available     torch.cuda.is_available()               true when there are devices
    init_warning  warned by is_available(), like torch's "driver too old" warning
    import        "ok" | "error" (ImportError import_error) | "hang" | "segv"
    hang_at       "is_available": sleep there
    devices       [{"name", "memory_gib", "free_gib", "capability": [9, 0],
                    "matmul": "ok" | "nan" | "wrong" | "no_kernel" | "oom" | "busy" | "hang",
                    "properties_error": "text"}]
    nccl          "ok" | "hang" | "error" (DistBackendError nccl_error) | "wrong" | "missing"
    libreyolo     "ok" | "missing" | "broken"  (the stand-in libreyolo beside this torch)
    pid_file      every process importing the stand-in appends its pid there
    chatter       print a line on stdout at import (it must not reach a result file)
    train_s       the stand-in ``libreyolo.cli`` trains that many seconds
    train_exit    ... then exits with this code
"""

from __future__ import annotations

import json
import os
from typing import Any

ENV = "LIBREYOLO_AGENT_FAKE_TORCH"


def load() -> dict[str, Any]:
    scenario: dict[str, Any] = json.loads(os.environ.get(ENV) or "{}")
    return scenario
