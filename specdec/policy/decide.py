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

from specdec.policy.cost_model import DraftCostModel, StepCostModel, expected_tokens_per_round
from specdec.policy.settings import PolicySettings
from specdec.spec_decode.speculation import AUTO, Speculation


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
    # (specdec_bench/mixed_batch.py; specdec_bench/RESULTS.md, "Mixed batches"), so the policy
    # never makes one.
    pinned: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Acceptance:
    """What each method's guesses are worth: alpha (the i.i.d. model's chance a guess is
    kept) and, where measured, the curve r_i (the chance the i-th guess of a round is kept;
    AcceptanceTracker.curve), which decide() prefers."""

    alpha: dict[str, float]
    curves: dict[str, list[float]] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoundCosts:
    """What a round costs on this engine: the target's step as a function of its tokens,
    the draft's k-guess round where measured (else k * draft_cost_ratio of a plain step),
    and whether the draft runs while the target verifies (specdec/spec_decode/overlap.py:
    a draft round then costs max(k*c, v) instead of k*c + v)."""

    step: StepCostModel
    draft: DraftCostModel | None = None
    overlapped: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class OwnRecord:
    """A running request's own rounds: how many, and the guesses tried and kept."""

    rounds: int = 0
    trials: int = 0
    kept: int = 0


@dataclasses.dataclass(kw_only=True)
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

    @classmethod
    def plain(cls, reason: str, why: str, expected_speedup: float = 1.0,
              inputs: dict | None = None, standby: str | None = None) -> Decision:
        return cls(mode="plain", method="none", k=0, reason=reason,
                   expected_speedup=expected_speedup, inputs=inputs or {}, why=why,
                   standby=standby)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def decide(config: PolicySettings, methods: list[str], acceptance: Acceptance,
           expected_tokens: float, load: Load, costs: RoundCosts,
           ask: Speculation = AUTO) -> Decision:
    """Choose method and k for a request about to start (or for its next round), among
    `methods` (those available), for `expected_tokens` more output; what the request fixed
    (`ask`: its method, its k, mode "on") is taken as given.

    Tokens per round come from the method's measured acceptance curve when given, else
    from the i.i.d. model with alpha. Under overlap the draft stops when the target is
    done: guesses beyond what fits in v are not made.

    The draft's cost of a k-guess round is the fitted draft time over the fitted plain step
    time when both are measured, else k * config.draft_cost_ratio.

    The decision is for the batch: every row that is not pinned plain drafts the same k
    (they all follow it), so the verify holds (rows - pinned) * k guesses and the draft runs
    that many rows; the speedup is the batch's goodput over its all-plain goodput.

    Mode "on": the best k >= 1 whatever it is worth; plain only when no proposer is
    available."""
    forced_method, forced_k, speculate = ask.method, ask.k, ask.on
    inputs = _inputs(expected_tokens, load, acceptance)
    if not methods:
        return Decision.plain("no proposer available", "no_proposer", inputs=inputs)
    if expected_tokens < config.min_expected_tokens and forced_k is None and not speculate:
        return Decision.plain(f"short output expected ({expected_tokens:.0f} "
                              f"< {config.min_expected_tokens} tokens)", "short_output",
                              inputs=inputs)
    ks = [forced_k] if forced_k is not None else list(range(1, config.k_max + 1))
    best = _best_round(config, [forced_method] if forced_method else methods, ks,
                       acceptance, load, costs, inputs)
    if forced_k is not None or speculate:
        best.why = "forced" if forced_k is not None else "request"
        return best
    if best.expected_speedup <= 1.0:
        return Decision.plain("no k beats plain decoding at this load and acceptance "
                              f"(best: k {best.k}, {best.expected_speedup:.2f}x)", "no_gain",
                              best.expected_speedup, inputs, standby=best.method)
    if best.expected_speedup < config.min_speedup:
        return Decision.plain(f"best speculation only {best.expected_speedup:.2f}x", "no_gain",
                              best.expected_speedup, inputs, standby=best.method)
    return best


def _inputs(expected_tokens: float, load: Load, acceptance: Acceptance) -> dict:
    """What a decision saw, as the response's spec_decode.inputs reports it."""
    alpha, curves = acceptance.alpha, acceptance.curves
    inputs = {"expected_tokens": round(expected_tokens, 1) if math.isfinite(expected_tokens)
              else None, "running": load.running, "pinned": load.pinned,
              "waiting": load.waiting, "prefill_tokens": round(load.prefill_tokens, 1),
              "alpha": {m: round(a, 3) for m, a in alpha.items()}}
    if curves:
        inputs["acceptance_curve"] = {m: [round(r, 3) for r in c] for m, c in curves.items()}
    return inputs


def _best_round(config: PolicySettings, methods: list[str], ks: list[int],
                acceptance: Acceptance, load: Load, costs: RoundCosts,
                inputs: dict) -> Decision:
    """The speculative (method, k) with the highest expected goodput, worth it or not."""
    alpha, curves = acceptance.alpha, acceptance.curves
    cost, draft_cost, overlapped = costs.step, costs.draft, costs.overlapped
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
                best = Decision(mode="speculative", method=m, k=k, reason=(
                    f"best expected goodput: {s:.2f}x plain (alpha {alpha.get(m, 0.5):.2f}, "
                    f"c {c:.2f}, v {v:.2f})"), expected_speedup=s, inputs=inputs, why="goodput")
    return best


def revisit(config: PolicySettings, method: str, own: OwnRecord, acceptance: Acceptance,
            load: Load, costs: RoundCosts, speculate: bool = False) -> int:
    """k for a running request's next round: its own acceptance (once trusted) blended with
    the method's (`acceptance`), under the current load; 0 when its acceptance collapsed,
    unless it asked for speculation (`speculate`, mode "on"). The method's curve is rescaled
    by (blended alpha / method alpha)^i for this request. The same for a request admitted
    plain on standby for method (Decision.standby): it speculates as soon as the batch's
    decision does."""
    if method == "none":
        return 0
    method_alpha = acceptance.alpha.get(method, 0.5)
    curve = (acceptance.curves or {}).get(method)
    rounds = own.rounds
    if rounds >= config.collapse_rounds and own.trials:
        own_alpha = own.kept / own.trials
        if own_alpha < config.collapse_alpha and not speculate:
            return 0
        w = min(1.0, rounds / (4.0 * config.collapse_rounds))
        alpha = w * own_alpha + (1 - w) * method_alpha
    else:
        alpha = method_alpha
    curves = None
    if curve:
        ratio = alpha / max(method_alpha, 1e-6)
        curves = {method: [min(1.0, r * ratio ** i) for i, r in enumerate(curve, 1)]}
    d = decide(config, [method], Acceptance(alpha={method: alpha}, curves=curves), math.inf,
               load, costs, Speculation(mode="on" if speculate else "auto", method=method))
    return d.k
