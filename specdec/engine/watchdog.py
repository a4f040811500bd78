"""Progress of a loop that must not stall while it has work (the engine's step loop): the
health check asks it, and a stalled replica is replaced by Serve."""

from __future__ import annotations

import time


class Watchdog:
    def __init__(self, limit_s: float, clock=time.monotonic) -> None:
        self.limit_s, self.clock = limit_s, clock
        self.last = clock()

    def beat(self) -> None:
        """The loop went round once (a step done, failed, or nothing to do)."""
        self.last = self.clock()

    def stalled(self, has_work: bool) -> float | None:
        """Seconds without progress while there was work, once past the limit; else None."""
        idle = self.clock() - self.last
        return idle if has_work and idle > self.limit_s else None
