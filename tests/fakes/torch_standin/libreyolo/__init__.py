"""A stand-in ``libreyolo`` beside the stand-in torch (the real one would import torchvision)."""

from __future__ import annotations

import json
import os
from typing import Any

# Read without importing torch: the real libreyolo imports it lazily too.
_mode = json.loads(os.environ.get("LIBREYOLO_AGENT_FAKE_TORCH") or "{}").get("libreyolo", "ok")
if _mode == "missing":
    raise ModuleNotFoundError("No module named 'libreyolo'", name="libreyolo")

__version__ = "1.6.0"


def __getattr__(name: str) -> Any:
    if name == "LibreYOLO":
        if _mode == "broken":
            # What a torchvision built for another torch says when libreyolo imports it.
            raise RuntimeError("operator torchvision::nms does not exist")
        return object
    raise AttributeError(name)
