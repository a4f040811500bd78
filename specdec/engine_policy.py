"""The policy as one engine runs it: decisions at admission from this engine's own live
load, k revisited once per step, and every input measured on this engine.

Why here and not in the HTTP router: with several engine replicas the router cannot know
which replica a request lands on, so a decision from the router's view of "the" load is a
decision on some other replica's load. The router passes what only it knows (the request's
overrides, max_tokens, stop strings); the replica that will run the request decides.

Measured inputs: the step cost (whole step minus drafting, per token count in the
target's forward), the draft's round cost (d0 + k * (e0 + e1 * rows)), both anchored by the
start-up calibration (specdec/calibrate.py); acceptance per method (with its per-position
curve) and completion lengths per prompt-length bucket, from served requests only.
"""

from __future__ import annotations

import dataclasses
import math
import threading

from specdec.engine_config import PolicySettings
from specdec.policy import (
    AcceptanceTracker,
    Decision,
    DraftCostModel,
    LengthEstimator,
    Load,
    PolicyConfig,
    StepCostModel,
    decide,
    revisit,
)
from specdec.request import EngineError


@dataclasses.dataclass
class Overrides:
    """What a request says about speculation (the API's `speculative` field)."""

    mode: str = "auto"            # auto | on | off
    method: str | None = None     # draft | ngram
    k: int | None = None


class EnginePolicy:
    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.config = PolicyConfig(**(settings or PolicySettings()).model_dump())
        self.acceptance = AcceptanceTracker(self.config)
        self.lengths = LengthEstimator(self.config)
        self.step_cost = StepCostModel()
        self.draft_round_cost = DraftCostModel()
        self._overlapped = False  # the engine drafts during verification (round cost max)
        self.draft_cost: float | None = None  # c as a moving average, for display/fallback
        self._step_seen = -1
        self._k_cache: dict[tuple, int] = {}
        self._plain_decisions = 0
        # Decisions come from the serving thread, observations from the engine's loop.
        self._lock = threading.Lock()

    # ---- admission -------------------------------------------------------------------

    def admit(self, load: dict, methods: list[str], prompt_tokens: int, max_tokens: int,
              has_stop: bool, wanted: Overrides) -> Decision:
        """Plain or speculative, method and k for a request about to join this engine.
        load: Engine.load(); methods: the proposers available right now."""
        with self._lock:
            return self._admit(load, methods, prompt_tokens, max_tokens, has_stop, wanted)

    def _admit(self, load, methods, prompt_tokens, max_tokens, has_stop, wanted) -> Decision:
        if wanted.method and wanted.method not in methods:
            raise EngineError(f"speculative.method {wanted.method!r} is not available "
                              f"(available: {methods})", param="speculative.method")
        if wanted.mode == "off":
            return Decision("plain", "none", 0, "request asked for plain decoding", 1.0, {},
                            "request")
        lw = self._load(load, joining=1)
        alpha = {m: self.acceptance.alpha(m) for m in methods}
        curves = {m: self.acceptance.curve(m, self.config.k_max) for m in methods}
        if wanted.mode == "on":
            method = wanted.method or ("draft" if "draft" in methods else "ngram")
            if method not in methods:
                raise EngineError(f"speculative.mode 'on' but no proposer is available "
                                  f"(available: {methods})", param="speculative.mode")
            d = self._decide([method], alpha, math.inf, lw, curves, method, wanted.k)
            if d.k == 0:  # "on" means speculate: take a k even below break-even
                d = self._decide([method], alpha, math.inf, lw, curves, method,
                                 min(4, self.config.k_max))
            d.reason, d.why = "request asked for speculation; " + d.reason, "request"
            return d
        expected = self.lengths.expected(prompt_tokens, max_tokens, has_stop)
        d = self._decide(methods, alpha, expected, lw, curves, wanted.method, wanted.k)
        if d.why == "no_gain" and self.config.explore_share > 0 and \
                self._could_pay(methods, expected, lw):
            self._plain_decisions += 1
            if self._plain_decisions >= 1 / self.config.explore_share:
                # Keep testing speculation now and then (a draft back from an outage, a
                # workload that became predictable): the estimate learns only from trials.
                self._plain_decisions = 0
                method = max(methods, key=lambda m: alpha.get(m, 0.0))
                e = self._decide([method], alpha, expected, lw, curves, method, 2)
                e.reason, e.why = f"exploring: {d.reason}", "explore"
                return e
        return d

    def _could_pay(self, methods, expected, load) -> bool:
        """Whether speculation would pay at this load with a draft that is nearly always
        right. If not, the load alone rules it out, and exploring would only cost: every
        explored row lengthens a verify that the whole batch waits for (at 16 clients on 2
        cores, 6-9% of the requests exploring)."""
        sure = {m: 0.95 for m in methods}
        curves = {m: [0.95 ** i for i in range(1, self.config.k_max + 1)] for m in methods}
        return self._decide(methods, sure, expected, load, curves).mode == "speculative"

    def _decide(self, methods, alpha, expected, load, curves, method=None, k=None) -> Decision:
        config = self.config
        if self.draft_cost is not None:
            config = dataclasses.replace(config, draft_cost_ratio=self.draft_cost)
        return decide(config, methods, alpha, expected, load, self.step_cost,
                      forced_method=method, forced_k=k, draft_cost=self.draft_round_cost,
                      curves=curves, overlapped=self._overlapped)

    @staticmethod
    def _load(load: dict, joining: int = 0) -> Load:
        """The batch this decision will run in. A joining request also runs with the ones
        queued ahead of it, as far as free slots take them: a burst of requests admitted
        before the next step must not each be priced as if it ran alone."""
        running, waiting = load.get("running", 0), load.get("waiting", 0)
        rows, pinned = running, load.get("pinned_running", 0)
        if joining:
            slots = running + load.get("free_slots", 0)
            rows = max(min(running + waiting + joining, slots), running + joining)
            # Pinned plain rows among the queued ahead that will run with it.
            pinned += min(load.get("pinned_waiting", 0), rows - running - joining)
        # The row being decided follows the decision: at least one row drafts.
        return Load(rows, waiting, load.get("prefill_tokens_per_step", 0.0),
                    max(min(pinned, rows - 1), 0))

    # ---- between rounds (Engine's choose_k hook) ---------------------------------------

    def choose_k(self, engine, req, spec, running: int) -> int:
        """k for a running request's next round. The method-level answer depends only on
        the step's load, so it is computed once per step; a request's own acceptance moves
        it only through a coarse bucket (and drops it to plain when it collapsed)."""
        with self._lock:
            return self._choose_k(engine, req, spec)

    def _choose_k(self, engine, req, spec) -> int:
        if engine.steps != self._step_seen:
            self._step_seen, self._k_cache = engine.steps, {}
            self._overlapped = _overlapping(engine)  # admissions use it too
        own = spec.policy_trials
        bucket = None
        if spec.rounds >= self.config.collapse_rounds and own:
            bucket = round(10 * spec.accepted / own)
        key = (req.method, req.k, bucket, spec.rounds >= self.config.collapse_rounds)
        if key not in self._k_cache:
            config = self.config if self.draft_cost is None else dataclasses.replace(
                self.config, draft_cost_ratio=self.draft_cost)
            load = self._load(engine.load())
            # The request's own acceptance, as its bucket (trials 10, kept = bucket).
            trials, kept = (0, 0) if bucket is None else (10, bucket)
            self._k_cache[key] = revisit(
                config, req.method, trials, kept, spec.rounds,
                self.acceptance.alpha(req.method), load, self.step_cost,
                self.draft_round_cost, self.acceptance.curve(req.method, self.config.k_max),
                overlapped=self._overlapped)
        return self._k_cache[key]

    # ---- observations ----------------------------------------------------------------

    def observe_step(self, rec) -> None:
        with self._lock:
            self._observe_step(rec)

    def calibrate_step(self, rec) -> None:
        """A step of the start-up calibration (specdec/calibrate.py): kept by the cost fits
        for good."""
        with self._lock:
            self._observe_step(rec, anchor=True)

    def _observe_step(self, rec, anchor: bool = False) -> None:
        step, draft = self.step_cost, self.draft_round_cost
        (step.calibrate if anchor else step.observe)(rec.tokens, rec.step_s - rec.draft_s)
        (draft.calibrate if anchor else draft.observe)(rec.draft_k, rec.draft_rows,
                                                       rec.draft_model_s)
        if rec.draft_model_s and rec.draft_k:
            # c = the draft's time per guess / one plain target step (rows are batched).
            fit = self.step_cost.fit()
            plain = (fit[0] + fit[1] * max(rec.rows, 1)) if fit else rec.verify_s
            c = rec.draft_model_s / rec.draft_k / max(plain, 1e-6)
            self.draft_cost = c if self.draft_cost is None else 0.9 * self.draft_cost + 0.1 * c

    def observe_finished(self, out) -> None:
        with self._lock:
            self._observe_finished(out)

    def _observe_finished(self, out) -> None:
        self.lengths.observe(out.prompt_tokens, len(out.token_ids))
        if out.method != "none":
            s = out.spec
            # An empty proposal was a chance at position 1 that failed, like a rejection.
            drafted = list(s.drafted_per_position) or [0]
            drafted[0] += s.empty_proposals
            self.acceptance.observe(out.method, s.accepted, s.rejections + s.empty_proposals,
                                    s.accepted_per_position, drafted)

    def report(self, methods: list[str]) -> dict:
        with self._lock:
            return self._report(methods)

    def _report(self, methods: list[str]) -> dict:
        return {
            "alpha": {m: self.acceptance.alpha(m) for m in methods},
            "acceptance_curve": {m: self.acceptance.curve(m, self.config.k_max)
                                 for m in methods},
            "step_cost_fit": self.step_cost.fit(), "draft_cost_ratio": self.draft_cost,
            "draft_round_fit": self.draft_round_cost.fit(),
        }


def _overlapping(engine) -> bool:
    """Whether the engine drafts during verification now (on, or auto having chosen it)."""
    mode = getattr(engine, "overlap", "off")
    chooser = getattr(engine, "overlap_chooser", None)
    return mode == "on" or (chooser is not None and bool(chooser.choice))
