"""Probes: a step that runs a shape the batch would not, so the policy learns what it costs
now. ("verify", method, k) makes the rows that follow the policy draft k although the batch
would run plain; ("plain", "none", 0) makes a speculating batch run one plain step. The
calibration that priced a shape may have run on a busy machine, and a batch that never runs
a shape never learns what it costs; one step in an interval is the price. A probe is an
override the engine's k passes through: EnginePolicy.choose_k returns its k to the rows that
follow the policy.
"""

from __future__ import annotations

import collections
import logging
import math
from typing import NamedTuple

from specdec.policy.settings import PolicySettings

log = logging.getLogger(__name__)

# A shape never run live is probed this much more often than probe_interval_s (a tenth of
# it): after a busy start every shape the batch does not run is priced by a calibration
# known to be off, and one probe per interval took minutes of serving to measure the k_max
# verify shapes; the first request or two ended before speculation was priced right. A
# probe of a verify still emits the tokens it accepts, so this costs a step or two a second
# at most, and only until each shape has been run once.
UNMEASURED_GAP = 0.1


class Probe(NamedTuple):
    kind: str    # "verify" | "plain"
    method: str  # the method probed, "none" for a plain step
    k: int


class Prober:
    def __init__(self, config: PolicySettings, clock) -> None:
        self.config, self.clock = config, clock
        self.counts: collections.Counter = collections.Counter()  # by kind
        self._last = -math.inf
        self._plain_turn = True  # a speculating batch alternates plain and verify probes
        # A draft probe runs twice in a row: its first round also feeds the draft the
        # context it missed while the rows ran plain, which is not what a round costs (and
        # is not priced as one); the second round is the draft's clean cost.
        self._again: Probe | None = None

    def plan(self, raw: dict, load, step_cost, draft_round_cost, shapes) -> Probe | None:
        """A probe for this step, or None. Only for a shape not run for real within
        probe_interval_s, at most once per interval (a shape never run live: ten times as
        often), and only while nothing waits. shapes(method, load, stale) -> the batch's
        own decision, then a decision per stale k."""
        interval = self.config.probe_interval_s
        now = self.clock()
        again, self._again = self._again, None
        if again is not None and not raw.get("waiting", 0):
            return again
        following = raw.get("following") or {}
        since = now - self._last
        if not interval or since < interval * UNMEASURED_GAP or raw.get("waiting", 0) \
                or not following:
            return None
        method = max(following, key=lambda m: (following[m], m == "draft"))
        if method == "none":
            return None
        base = load.running + load.prefill_tokens
        drafting = max(load.running - min(load.pinned, load.running - 1), 1)

        def unmeasured(k: int) -> bool:
            """Never run live: its cost is the calibration's alone."""
            return step_cost.last_live_at(round(base + drafting * k)) is None or bool(
                k and method == "draft"
                and draft_round_cost.last_live((float(k), float(drafting))) is None)

        full = since >= interval
        if not full and not any(unmeasured(k) for k in range(self.config.k_max + 1)):
            return None  # between intervals only shapes never measured are probed

        def stale(k: int) -> bool:
            return unmeasured(k) or (full and now - step_cost.last_live_at(
                round(base + drafting * k)) >= interval)

        probe = self._shape(raw, method, shapes(method, load, stale), stale)
        if probe is not None:
            self._last = now
            self.counts[probe.kind] += 1
            if probe.kind == "verify" and probe.method == "draft":
                self._again = probe
            log.info("probing a %s step (method %s, k %d) at %d rows: its shape was %s",
                     probe.kind, probe.method, probe.k, load.running,
                     f"not run for {interval:.0f} s" if full else "never run live")
        return probe

    def _shape(self, raw: dict, method: str, decisions: list, stale) -> Probe | None:
        """Which stale shape (stale(k): k = 0 is the plain step) to probe. The verify shapes
        the batch does not run, best expected first: a plain batch probes the one that would
        pay best if it was priced wrong; a speculating batch takes turns between that and a
        plain step (is plain still slower?)."""
        batch, options = decisions[0], sorted(decisions[1:], key=lambda d: -d.expected_speedup)
        plain_ok = batch.k and not raw.get("speculating_on_request") and stale(0)
        probe = None
        if plain_ok and (self._plain_turn or not options):
            probe = Probe("plain", "none", 0)
        elif options:
            probe = Probe("verify", method, options[0].k)
        if batch.k:
            self._plain_turn = probe is not None and probe.kind == "verify"
        return probe
