"""The draft's catch-up priced against what speculating saves: the tokens of a row's
context the draft has not seen (a prompt, a plain stretch, rounds the suffix index led)
cost it a prefill before its next guess, and that prefill delays every row of the batch
(in sequential steps the draft runs before the target's step)."""

from __future__ import annotations

from specdec.policy.cost_model import CatchupCost, StepCostModel
from specdec.policy.decide import Decision, Load

# A probe or an exploration must be able to repay the draft's catch-up if speculation turns
# out to pay this much: it is run to find out, whatever the estimate says now.
TRIAL_SPEEDUP = 4 / 3

# A catch-up the policy learns a per-token cost from: long enough to run at the draft's
# prefill rate (a few tokens ride along a round's forward for almost nothing, and taken
# per token they would price a long prompt's catch-up near nothing).
CATCHUP_SAMPLE_MIN = 64


def catchup_seconds(tokens: int, measured: CatchupCost, step_cost: StepCostModel,
                    draft_cost: float) -> float | None:
    """The draft's time to catch up on `tokens` tokens: measured, or until then a target
    forward of that many tokens times the draft's cost ratio."""
    got = measured.seconds(tokens)
    if got is not None:
        return got
    target = step_cost.step_seconds(tokens)
    return None if target is None else draft_cost * target


def catchup_refused(d: Decision, catchup: int, expected: float, load: Load, k_max: int,
                    measured: CatchupCost, step_cost: StepCostModel, draft_cost: float,
                    trial: bool = False) -> str | None:
    """Why a speculative decision does not pay once the draft's catch-up is priced in, or
    None when it does. Speculating saves this row (1 - 1/speedup) of a plain step per
    expected token; the catch-up costs every running row its time. trial (a probe, an
    exploration): the decision is there to find out whether speculation pays after all,
    so the row must be able to repay the catch-up if it turns out to pay modestly
    (TRIAL_SPEEDUP), whatever the estimate."""
    if d.method != "draft" or catchup <= k_max + 1:
        return None  # a round's own catch-up (the target's last tokens): priced as one
    cost = catchup_seconds(catchup, measured, step_cost, draft_cost)
    plain = step_cost.step_seconds(max(load.running, 1) + load.prefill_tokens)
    speedup = max(d.expected_speedup, TRIAL_SPEEDUP) if trial else d.expected_speedup
    if cost is None or plain is None or speedup <= 1.0:
        return None if cost is None or plain is None else "no gain to repay it with"
    saved = expected * plain * (1 - 1 / speedup)
    paid = cost * max(load.running, 1)
    if saved >= paid:
        return None
    return (f"the draft's catch-up on {catchup} tokens ({paid:.2f} s) is not repaid by "
            f"~{expected:.0f} tokens at {speedup:.2f}x ({saved:.2f} s)")
