"""The policy as one engine runs it: decisions at admission from this engine's own live
load, k revisited once per step, and every input measured on this engine.

Why here and not in the HTTP ingress: with several engine replicas the ingress cannot know
which replica a request lands on, so a decision from the ingress's view of "the" load is a
decision on some other replica's load. The ingress passes what only it knows (the request's
overrides, max_tokens, stop strings); the replica that will run the request decides.

Measured inputs: the step cost (whole step minus drafting, per token count in the
target's forward), the draft's round cost (d0 + k * (e0 + e1 * rows)), both anchored by the
start-up calibration (specdec/engine/calibrate.py); acceptance per method (with its per-position
curve) and completion lengths per prompt-length bucket, from served requests only.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from specdec.errors import EngineError
from specdec.policy.catchup import CATCHUP_SAMPLE_MIN, catchup_refused
from specdec.policy.cost_model import CatchupCost, DraftCostModel, StepCostModel
from specdec.policy.decide import (
    Acceptance,
    Decision,
    Load,
    OwnRecord,
    RoundCosts,
    decide,
    revisit,
)
from specdec.policy.estimators import AcceptanceTracker, LengthEstimator
from specdec.policy.probes import Probe, Prober
from specdec.policy.settings import PolicySettings
from specdec.policy.view import EngineView
from specdec.spec_decode.speculation import AUTO, Speculation

log = logging.getLogger(__name__)


class EnginePolicy:
    def __init__(self, settings: PolicySettings | None = None, clock=time.monotonic) -> None:
        self.config = settings or PolicySettings()
        self.acceptance = AcceptanceTracker(self.config)
        self.lengths = LengthEstimator(self.config)
        self.clock = clock
        self.step_cost = StepCostModel(clock)
        self.draft_round_cost = DraftCostModel(clock)
        # A draft not yet run for real is corrected as far as the target's calibration was.
        self.draft_round_cost.borrow = self.step_cost.calibration_error
        # The draft's catch-up on context it has not seen, per token (priced in specdec/policy/catchup.py).
        self.catchup_cost = CatchupCost()
        # Steps that run a shape the batch would not, so its cost is measured (probes.py).
        self.prober = Prober(self.config, clock)
        self._probe: Probe | None = None  # this step's
        self._overlapped = False  # the engine drafts during verification (round cost max)
        self.draft_cost: float | None = None  # c as a moving average, for display/fallback
        self._step_seen = -1
        self._k_cache: dict[tuple, int] = {}
        self._plain_decisions = 0
        # Decisions come from the serving thread, observations from the engine's loop.
        self._lock = threading.Lock()

    # ---- admission -------------------------------------------------------------------

    def admit(self, load: dict, methods: list[str], prompt_tokens: int, max_tokens: int,
              has_stop: bool, wanted: Speculation, catchup: int = 0) -> Decision:
        """Plain or speculative, method and k for a request about to join this engine.
        load: Engine.load(); methods: the proposers available right now; catchup: tokens of
        the prompt the draft would have to compute before its first guess (the prompt less
        the longest prefix of it the draft's cache holds)."""
        with self._lock:
            d = self._admit(load, methods, prompt_tokens, max_tokens, has_stop, wanted)
            if wanted.mode == "auto" and d.mode == "speculative":
                expected = self.lengths.expected(prompt_tokens, max_tokens, has_stop)
                why = self._catchup_refused(d, catchup, expected, self._load(load, joining=1),
                                            trial=d.why == "explore")
                if why is not None:
                    return Decision.plain(why, "catchup", d.expected_speedup, d.inputs,
                                          standby=d.method)
            return d

    def _catchup_refused(self, d: Decision, catchup: int, expected: float, load: Load,
                         trial: bool = False) -> str | None:
        """Why d does not pay once the draft's catch-up is priced in (specdec/policy/catchup.py)."""
        c = self.draft_cost if self.draft_cost is not None else self.config.draft_cost_ratio
        return catchup_refused(d, catchup, expected, load, self.config.k_max,
                               self.catchup_cost, self.step_cost, c, trial)

    def _remaining(self, req, spec) -> float:
        """Tokens a running request is expected to produce still: what finished replies of
        its prompt length ran to, or, past that, as many again as it has run (up to its
        max_tokens)."""
        params = req.params
        done = spec.emitted
        left = params.max_tokens - done
        expected = self.lengths.expected(len(req.prompt_ids), params.max_tokens,
                                         bool(params.stop))
        return max(min(left, max(expected - done, done)), 0)

    def _admit(self, load, methods, prompt_tokens, max_tokens, has_stop, wanted) -> Decision:
        if wanted.method and wanted.method not in methods:
            raise EngineError(f"speculative.method {wanted.method!r} is not available "
                              f"(available: {methods})", param="speculative.method")
        if wanted.mode == "off":
            return Decision.plain("request asked for plain decoding", "request")
        lw = self._load(load, joining=1)
        measured = self._measured(methods)
        if wanted.mode == "on":
            method = wanted.method or ("draft" if "draft" in methods else
                                       "ngram" if "ngram" in methods else None)
            if method is None:
                return Decision.plain("request asked for speculation, but no proposer is "
                                      f"available (available: {methods})", "no_proposer")
            # "on" means speculate, every round: the request's k, or the best k >= 1 even
            # below break-even (the engine holds every round of it to k >= 1).
            d = self._decide([method], measured, math.inf, lw,
                             Speculation(mode="on", method=method, k=wanted.k))
            d.reason, d.why = "request asked for speculation; " + d.reason, "request"
            return d
        expected = self.lengths.expected(prompt_tokens, max_tokens, has_stop)
        d = self._decide(methods, measured, expected, lw, wanted)
        if d.why == "no_gain" and "draft" in methods and wanted.method is None:
            # On standby for the draft, not the n-gram lookup that priced a hair better:
            # the standby method is what the per-step decision and its probes measure, and
            # the draft's cost is the one a busy start misprices (a lookup costs nothing).
            # On standby for n-gram after a busy start, the draft was never probed again.
            d.standby = "draft"
        if d.why == "no_gain" and self.config.explore_share > 0 and \
                self._could_pay(methods, expected, lw):
            self._plain_decisions += 1
            if self._plain_decisions >= 1 / self.config.explore_share:
                # Keep testing speculation now and then (a draft back from an outage, a
                # workload that became predictable): the estimate learns only from trials.
                self._plain_decisions = 0
                method = max(methods, key=lambda m: measured.alpha.get(m, 0.0))
                e = self._decide([method], measured, expected, lw,
                                 Speculation(method=method, k=2))
                e.reason, e.why = f"exploring: {d.reason}", "explore"
                return e
        return d

    def _could_pay(self, methods, expected, load) -> bool:
        """Whether speculation would pay at this load with a draft that is nearly always
        right. If not, the load alone rules it out, and exploring would only cost: every
        explored row lengthens a verify that the whole batch waits for."""
        sure = Acceptance(
            alpha={m: 0.95 for m in methods},
            curves={m: [0.95 ** i for i in range(1, self.config.k_max + 1)] for m in methods})
        return self._decide(methods, sure, expected, load).mode == "speculative"

    def _measured(self, methods: list[str]) -> Acceptance:
        """The methods' acceptance as measured so far."""
        return Acceptance(alpha={m: self.acceptance.alpha(m) for m in methods},
                          curves={m: self.acceptance.curve(m, self.config.k_max)
                                  for m in methods})

    def _costs(self) -> RoundCosts:
        return RoundCosts(step=self.step_cost, draft=self.draft_round_cost,
                          overlapped=self._overlapped)

    def _decide(self, methods: list[str], acceptance: Acceptance, expected: float,
                load: Load, ask: Speculation = AUTO) -> Decision:
        return decide(self._config(), methods, acceptance, expected, load, self._costs(), ask)

    def _config(self) -> PolicySettings:
        if self.draft_cost is None:
            return self.config
        return self.config.model_copy(update={"draft_cost_ratio": self.draft_cost})

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

    def choose_k(self, engine: EngineView, req, spec, running: int, catchup: int = 0) -> int:
        """k for a running request's next round. The method-level answer depends only on
        the step's load, so it is computed once per step; a request's own acceptance moves
        it only through a coarse bucket (and drops it to plain when it collapsed). catchup:
        tokens of its context the draft has not seen: a row whose remaining output cannot
        repay that stays plain (a probe included); one that asked for speculation pays it."""
        with self._lock:
            k = self._choose_k(engine, req, spec)
            if k and catchup > self.config.k_max + 1 and not req.speculation.on and \
                    req.method == "draft":
                load = self._load(engine.load())
                d = self._decide([req.method], self._measured([req.method]), math.inf, load,
                                 Speculation(method=req.method, k=k))
                probed = self._probe is not None and self._probe.k == k
                if self._catchup_refused(d, catchup, self._remaining(req, spec), load,
                                         trial=probed):
                    return 0
            return k

    def _choose_k(self, engine, req, spec) -> int:
        if engine.steps != self._step_seen:
            self._step_seen, self._k_cache = engine.steps, {}
            self._overlapped = engine.overlapped  # admissions use it too
            self._probe = self._plan_probe(engine.load())
        probe = self._probe
        # A probe overrides the policy's k for the rows that follow it: a plain step for all
        # but those that asked for speculation, a verify of k for the rows of its method.
        if probe is not None:
            if probe.kind == "plain" and not req.speculation.on:
                return 0
            if probe.kind == "verify" and req.method == probe.method:
                return probe.k
        own = spec.policy_trials
        bucket = None
        if spec.rounds >= self.config.collapse_rounds and own:
            bucket = round(10 * spec.accepted / own)
        key = (req.method, req.k, bucket, spec.rounds >= self.config.collapse_rounds,
               req.speculation.on)
        if key not in self._k_cache:
            load = self._load(engine.load())
            # The request's own acceptance, as its bucket (trials 10, kept = bucket).
            trials, kept = (0, 0) if bucket is None else (10, bucket)
            self._k_cache[key] = revisit(
                self._config(), req.method,
                OwnRecord(rounds=spec.rounds, trials=trials, kept=kept),
                self._measured([req.method]), load, self._costs(),
                speculate=req.speculation.on)
        return self._k_cache[key]

    def probing(self) -> Probe | None:
        """This step's probe (see probes.py), or None."""
        return self._probe

    @property
    def probes(self):
        """Probes run so far, by kind ("plain", "verify")."""
        return self.prober.counts

    def _plan_probe(self, raw: dict) -> Probe | None:
        def shapes(method: str, load: Load, stale) -> list[Decision]:
            """The batch's own decision, then every stale k's, for the prober to rank."""
            measured = self._measured([method])
            batch = self._decide([method], measured, math.inf, load, Speculation(method=method))
            return [batch] + [self._decide([method], measured, math.inf, load,
                                           Speculation(method=method, k=k))
                              for k in range(1, self.config.k_max + 1)
                              if k != batch.k and stale(k)]

        return self.prober.plan(raw, self._load(raw), self.step_cost, self.draft_round_cost,
                                shapes)

    # ---- observations ----------------------------------------------------------------

    def observe_step(self, rec) -> None:
        with self._lock:
            self._observe_step(rec)

    def calibrate_step(self, rec) -> None:
        """A step of the start-up calibration (specdec/engine/calibrate.py): kept by the cost fits
        for good."""
        with self._lock:
            self._observe_step(rec, anchor=True)

    def _observe_step(self, rec, anchor: bool = False) -> None:
        if getattr(rec, "graph_built", False):
            # The step compiled or captured a new bucket's graph: its time was the build
            # (seconds for a compile), and one such sample is a new shape's whole price.
            return
        step, draft = self.step_cost, self.draft_round_cost
        (step.calibrate if anchor else step.observe)(rec.tokens, rec.step_s - rec.draft_s)
        prompt, rows = getattr(rec, "prompt_catchup", 0), getattr(rec, "prompt_catchup_rows", 0)
        if rows and prompt >= CATCHUP_SAMPLE_MIN * rows:
            # The draft's own call beside a prefill: its one dropped guess per row is a
            # round of k 1 (until one is measured, a few % of the call: counted in).
            one = draft.round_seconds(1, rec.prompt_catchup_rows)
            self.catchup_cost.observe(prompt, rec.prompt_catchup_s, one or 0.0, anchor=anchor)
        if getattr(rec, "draft_catchup", 0) > self.config.k_max + 1:
            # The draft first prefilled a row's context (its first round, or its first after
            # a plain stretch or a round the suffix index led): not what a round costs
            # (taken as one, the first round of every request priced the draft up to 2x
            # and turned speculation off), but what a catch-up costs beyond the round,
            # when it is long enough to run at the draft's prefill rate: a few tokens ride
            # along a round's forward almost free, and taken per token they would price
            # a 1000-token prompt's catch-up near nothing. Overlapped, the catch-up was hidden
            # beside the target's step (no draft time recorded): not a sample either.
            if rec.draft_catchup >= CATCHUP_SAMPLE_MIN and not rec.overlapped:
                total = getattr(rec, "draft_catchup_total", 0) or rec.draft_catchup
                self.catchup_cost.observe(total, rec.draft_model_s,
                                          draft.round_seconds(rec.draft_k, rec.draft_rows),
                                          anchor=anchor)
            return
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
        if out.finish_reason == "stop":
            # Only a reply that ended by itself says how long replies run. One cut at its
            # max_tokens says "at least this long", not how long: taken as the length, short
            # max_tokens would make later requests of its prompt length look short.
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
            "step_costs": self.step_cost.report(), "probes": dict(self.probes),
            "draft_catchup": self.catchup_cost.report(),
            "priced_one_row": self._priced_one_row(methods),
        }

    def _priced_one_row(self, methods: list[str]) -> list[dict]:
        """What the policy believes a draft round at each k costs and yields for a lone row,
        and whether each cost comes from live steps or only from the start-up calibration:
        the first place to look when it will not speculate (docs/troubleshooting.md)."""
        if "draft" not in methods:
            return []
        step, draft = self.step_cost, self.draft_round_cost
        plain = step.step_seconds(1)
        measured = self._measured(["draft"])
        out = []
        for k in range(1, self.config.k_max + 1):
            d = self._decide(["draft"], measured, math.inf, Load(1),
                             Speculation(method="draft", k=k))
            drafted = draft.round_seconds(k, 1)
            verify = step.step_seconds(1 + k)
            out.append({
                "k": k, "speedup": round(d.expected_speedup, 3),
                "plain_ms": _ms(plain), "verify_ms": _ms(verify), "draft_ms": _ms(drafted),
                "verify_live": step.last_live_at(1 + k) is not None,
                "draft_live": draft.last_live((float(k), 1.0)) is not None})
        return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)

