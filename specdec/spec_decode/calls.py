"""What one call into another process cost: the proposers' and the target's `last_call`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CallStats:
    """One call into another process: time spent computing there, bytes both ways."""

    compute_s: float
    bytes: int
