"""What the policy reads of the engine between rounds, and nothing more."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class EngineView:
    """steps: the engine's step count (the policy's per-step caches and probes key on it);
    load: the engine's load report, called only when the policy needs it (building it walks
    the queue); overlapped: whether the draft drafts during verification now (overlap on,
    or auto having chosen it)."""

    steps: int
    load: Callable[[], dict]
    overlapped: bool
