"""The routing brain: plain or speculative decoding, which method and which k, per request
and again between rounds as the load changes. Pure: no Ray, no clocks, no I/O.

Inputs: the expected output length (max_tokens, stop settings, what finished requests of a
similar prompt length produced), the live load (rows in the engine's batch, tokens per step,
and the measured step time as a function of tokens per step), and the measured acceptance
(per method, and per request after its first rounds). Output: the k (0 = plain) with the
highest expected goodput from the cost model, and the reasons.
"""

from __future__ import annotations

import dataclasses
import math

from specdec.policy.cost_model import expected_tokens_per_round
from specdec.policy.measured_costs import DraftCostModel, StepCostModel
from specdec.policy.settings import PolicySettings


class AcceptanceTracker:
    """Per-token acceptance alpha per method: every drafted position up to and including the
    first rejection is one Bernoulli trial (later guesses were never tested). Exponentially
    decayed: older trials weigh less (half-life in trials, see PolicySettings)."""

    def __init__(self, config: PolicySettings) -> None:
        self.config = config
        self.trials: dict[str, float] = {}
        self.kept: dict[str, float] = {}
        self.pos_drafted: dict[str, list[float]] = {}
        self.pos_kept: dict[str, list[float]] = {}

    def observe(self, method: str, accepted: int, rejections: int,
                accepted_per_position: list[int] = (),
                drafted_per_position: list[int] = ()) -> None:
        """accepted guesses and rounds that ended in a rejection (each one more trial); per
        position i, rounds that drafted a guess there and rounds that kept guesses 1..i."""
        new_trials = accepted + rejections
        keep = 0.5 ** (new_trials / self.config.acceptance_half_life) \
            if self.config.acceptance_half_life else 1.0
        self.trials[method] = keep * self.trials.get(method, 0.0) + new_trials
        self.kept[method] = keep * self.kept.get(method, 0.0) + accepted
        for counts, new in ((self.pos_drafted.setdefault(method, []), drafted_per_position),
                            (self.pos_kept.setdefault(method, []), accepted_per_position)):
            counts.extend([0.0] * (len(new) - len(counts)))
            for i in range(len(counts)):
                counts[i] = keep * counts[i] + (new[i] if i < len(new) else 0)

    def curve(self, method: str, k_max: int) -> list[float]:
        """r_i, i = 1..k_max: the chance that a round keeps its first i guesses. Measured per
        position where rounds reached it, shrunk toward alpha^i (the i.i.d. model) with the
        prior's weight, and never rising with i. Acceptance is bursty (easy stretches, hard
        ones), so the measured curve falls off differently from alpha^i."""
        a = self.alpha(method)
        w = self.config.prior_weight
        drafted = self.pos_drafted.get(method, [])
        kept = self.pos_kept.get(method, [])
        out, prev = [], 1.0
        for i in range(1, k_max + 1):
            d = drafted[i - 1] if i <= len(drafted) else 0
            n = kept[i - 1] if i <= len(kept) else 0
            r = min(prev, (n + w * a ** i) / (d + w))
            out.append(r)
            prev = r
        return out

    def alpha(self, method: str) -> float:
        prior = dict(self.config.acceptance_prior).get(method, 0.5)
        w = self.config.prior_weight
        return (self.kept.get(method, 0.0) + prior * w) / (self.trials.get(method, 0.0) + w)


class LengthEstimator:
    """Completion length of finished requests, per prompt-length bucket (running mean)."""

    def __init__(self, config: PolicySettings) -> None:
        self.config = config
        self.sum: dict[int, float] = {}
        self.count: dict[int, int] = {}

    def bucket(self, prompt_tokens: int) -> int:
        for i, edge in enumerate(self.config.length_buckets):
            if prompt_tokens <= edge:
                return i
        return len(self.config.length_buckets)

    def observe(self, prompt_tokens: int, completion_tokens: int) -> None:
        b = self.bucket(prompt_tokens)
        self.sum[b] = self.sum.get(b, 0.0) + completion_tokens
        self.count[b] = self.count.get(b, 0) + 1

    def expected(self, prompt_tokens: int, max_tokens: int, has_stop: bool) -> float:
        b = self.bucket(prompt_tokens)
        if self.count.get(b):
            learned = self.sum[b] / self.count[b]
            return min(max_tokens, learned)
        # Nothing learned yet: a stop string usually ends a reply early.
        return max_tokens * (0.5 if has_stop else 1.0)


@dataclasses.dataclass
class Load:
    """The batch a decision is made for. The plain step it is compared with holds one token
    per running row plus the prefill tokens that ride along; a speculative round adds k per
    row on top. (Tokens per step as measured already contain the running rows' drafts:
    taking them as the plain base would count every draft twice.)"""

    running: int = 0            # decoding rows, the one being decided included
    waiting: int = 0
    prefill_tokens: float = 0.0  # prompt tokens per step being prefilled alongside
    # Rows that stay plain whatever is decided (asked for plain, or too short to pay): they
    # draft nothing but wait for every verify, so a speculative batch's gain is diluted.
    # The other rows all follow the one decision (specdec/policy/engine_policy.py): a batch
    # of speculative and plain followers costs more than either pure batch
    # (benchmarks/mixed_batch.py; benchmarks/RESULTS.md, "Mixed batches"), so the policy
    # never makes one.
    pinned: int = 0


@dataclasses.dataclass
class Decision:
    mode: str                  # "speculative" | "plain"
    method: str                # "draft" | "suffix" | "ngram" | "none"
    k: int
    reason: str
    expected_speedup: float
    inputs: dict
    # A short label of the reason, for metrics (the reason text carries the numbers).
    why: str = "goodput"
    # A plain decision for lack of gain: the method the request takes up in a later round
    # if the batch's decision turns speculative (fewer rows, better acceptance).
    standby: str | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def decide(config: PolicySettings, methods: list[str], alpha: dict[str, float],
           expected_tokens: float, load: Load, cost: StepCostModel,
           forced_method: str | None = None, forced_k: int | None = None,
           draft_cost: DraftCostModel | None = None,
           curves: dict[str, list[float]] | None = None,
           overlapped: bool = False, speculate: bool = False) -> Decision:
    """Choose method and k for a request about to start (or for its next round).

    overlapped (specdec/spec_decode/overlap.py): the draft drafts while the target verifies, so a
    draft-model round costs max(k*c, v) instead of k*c + v (and the draft stops when the
    target is done: guesses beyond what fits in v are not made).

    Tokens per round come from the method's measured acceptance curve (r_i, see
    AcceptanceTracker.curve) when given, else from the i.i.d. model with alpha.

    The draft's cost of a k-guess round is the fitted draft time over the fitted plain step
    time when both are measured, else k * config.draft_cost_ratio.

    The decision is for the batch: every row that is not pinned plain drafts the same k
    (they all follow it), so the verify holds (rows - pinned) * k guesses and the draft runs
    that many rows; the speedup is the batch's goodput over its all-plain goodput.

    speculate (the request asked for it, mode "on"): the best k >= 1 whatever it is worth;
    plain only when no proposer is available."""
    inputs = _inputs(expected_tokens, load, alpha, curves)
    if not methods:
        return Decision("plain", "none", 0, "no proposer available", 1.0, inputs,
                        "no_proposer")
    if expected_tokens < config.min_expected_tokens and forced_k is None and not speculate:
        return Decision("plain", "none", 0, f"short output expected ({expected_tokens:.0f} "
                        f"< {config.min_expected_tokens} tokens)", 1.0, inputs,
                        "short_output")
    ks = [forced_k] if forced_k is not None else list(range(1, config.k_max + 1))
    best = _best_round(config, [forced_method] if forced_method else methods, ks, alpha,
                       load, cost, draft_cost, curves, overlapped, inputs)
    if forced_k is not None or speculate:
        best.why = "forced" if forced_k is not None else "request"
        return best
    if best.expected_speedup <= 1.0:
        return Decision("plain", "none", 0, "no k beats plain decoding at this load and "
                        f"acceptance (best: k {best.k}, {best.expected_speedup:.2f}x)",
                        best.expected_speedup, inputs, "no_gain", best.method)
    if best.expected_speedup < config.min_speedup:
        return Decision("plain", "none", 0, f"best speculation only {best.expected_speedup:.2f}x",
                        best.expected_speedup, inputs, "no_gain", best.method)
    return best


def _inputs(expected_tokens: float, load: Load, alpha: dict[str, float],
            curves: dict[str, list[float]] | None) -> dict:
    """What a decision saw, as the response's spec_decode.inputs reports it."""
    inputs = {"expected_tokens": round(expected_tokens, 1) if math.isfinite(expected_tokens)
              else None, "running": load.running, "pinned": load.pinned,
              "waiting": load.waiting, "prefill_tokens": round(load.prefill_tokens, 1),
              "alpha": {m: round(a, 3) for m, a in alpha.items()}}
    if curves:
        inputs["acceptance_curve"] = {m: [round(r, 3) for r in c] for m, c in curves.items()}
    return inputs


def _best_round(config: PolicySettings, methods: list[str], ks: list[int],
                alpha: dict[str, float], load: Load, cost: StepCostModel,
                draft_cost: DraftCostModel | None, curves: dict[str, list[float]] | None,
                overlapped: bool, inputs: dict) -> Decision:
    """The speculative (method, k) with the highest expected goodput, worth it or not."""
    rows = max(load.running, 1)
    drafting = max(rows - min(load.pinned, rows - 1), 1)  # the rows that follow the decision
    base = rows + load.prefill_tokens  # a plain step: one token per row
    plain_step = cost.step_seconds(base)
    best: Decision | None = None
    for m in methods:
        c = config.draft_cost_ratio if m == "draft" else config.ngram_cost_ratio
        for k in ks:
            v = cost.verify_cost(base, drafting * k)  # every following row drafts k
            measured = draft_cost.round_seconds(k, drafting) if m == "draft" and draft_cost \
                else None
            if measured is not None and plain_step:
                c = measured / plain_step / k  # this k's draft cost per guess, fixed part in
            curve = (curves or {}).get(m)
            round_cost = max(k * c, v) if overlapped and m == "draft" else k * c + v
            if curve and len(curve) >= k:
                per_row = 1.0 + sum(curve[:k])
            else:
                per_row = expected_tokens_per_round(alpha.get(m, 0.5), k)
            # Tokens per round of the whole batch over what its plain step makes (rows).
            s = (rows - drafting + drafting * per_row) / rows / round_cost
            if best is None or s > best.expected_speedup:
                best = Decision("speculative", m, k, f"best expected goodput: {s:.2f}x plain "
                                f"(alpha {alpha.get(m, 0.5):.2f}, c {c:.2f}, v {v:.2f})",
                                s, inputs, "goodput")
    return best


def revisit(config: PolicySettings, method: str, own_trials: int, own_kept: int,
            rounds: int, method_alpha: float, load: Load, cost: StepCostModel,
            draft_cost: DraftCostModel | None = None, curve: list[float] | None = None,
            overlapped: bool = False, speculate: bool = False) -> int:
    """k for a running request's next round: its own acceptance (once trusted) blended with
    the method's, under the current load; 0 when its acceptance collapsed. The method's
    curve is rescaled by (blended alpha / method alpha)^i for this request. The same for a
    request admitted plain on standby for method (Decision.standby): it speculates as soon
    as the batch's decision does."""
    if method == "none":
        return 0
    if rounds >= config.collapse_rounds and own_trials:
        own = own_kept / own_trials
        if own < config.collapse_alpha and not speculate:
            return 0
        w = min(1.0, rounds / (4.0 * config.collapse_rounds))
        alpha = w * own + (1 - w) * method_alpha
    else:
        alpha = method_alpha
    curves = None
    if curve:
        ratio = alpha / max(method_alpha, 1e-6)
        curves = {method: [min(1.0, r * ratio ** i) for i, r in enumerate(curve, 1)]}
    d = decide(config, [method], {method: alpha}, math.inf, load, cost, forced_method=method,
               draft_cost=draft_cost, curves=curves, overlapped=overlapped,
               speculate=speculate)
    return d.k
