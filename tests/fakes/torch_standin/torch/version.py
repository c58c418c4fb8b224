from __future__ import annotations

from torch import SCENARIO

cuda: str | None = SCENARIO.get("cuda", "12.4")
hip: str | None = None
