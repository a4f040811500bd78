"""The routing policy's choices respond to length, load and acceptance as the cost model says."""

from __future__ import annotations

from specdec.cost_model import acceptance_from_mean_length, best_k, expected_speedup
from specdec.policy import (
    AcceptanceTracker,
    LengthEstimator,
    Load,
    PolicyConfig,
    StepCostModel,
    decide,
    revisit,
)

CFG = PolicyConfig()


def flat_cost() -> StepCostModel:
    m = StepCostModel()
    for t in (1, 5, 9, 20, 40, 2, 6, 30):
        m.observe(t, 0.2)  # memory bound: time does not grow with tokens
    return m


def compute_bound_cost() -> StepCostModel:
    m = StepCostModel()
    for t in (1, 5, 9, 20, 40, 2, 6, 30):
        m.observe(t, 0.01 * t)  # time grows with every token
    return m


def test_short_outputs_go_plain():
    d = decide(CFG, ["draft"], {"draft": 0.9}, 4, Load(running=1), flat_cost())
    assert d.mode == "plain" and "short output" in d.reason and d.why == "short_output"


def test_good_acceptance_at_light_load_speculates_with_the_cost_model_k():
    d = decide(CFG, ["draft", "ngram"], {"draft": 0.9, "ngram": 0.2}, 200, Load(running=1),
               flat_cost())
    k, s = best_k(0.9, CFG.draft_cost_ratio, CFG.k_max, 1.0)
    assert (d.mode, d.method, d.k, d.why) == ("speculative", "draft", k, "goodput")
    assert abs(d.expected_speedup - s) < 1e-9 and s > 1.5


def test_heavy_compute_bound_load_goes_plain():
    d = decide(CFG, ["draft"], {"draft": 0.8}, 200, Load(running=16, tokens_per_step=16),
               compute_bound_cost())
    assert d.mode == "plain" and d.why == "no_gain"


def test_load_shrinks_k_before_turning_speculation_off():
    cost = StepCostModel()
    for t in (1, 5, 9, 20, 40, 2, 6, 30):
        cost.observe(t, 0.2 + 0.01 * t)  # partly compute bound
    light = decide(CFG, ["draft"], {"draft": 0.85}, 200, Load(1, 0, 1), cost)
    heavy = decide(CFG, ["draft"], {"draft": 0.85}, 200, Load(12, 0, 12), cost)
    heavier = decide(CFG, ["draft"], {"draft": 0.85}, 200, Load(32, 0, 32), cost)
    assert light.k > heavy.k > 0
    assert heavier.mode == "plain"


def test_cheap_ngram_wins_when_its_acceptance_is_decent():
    d = decide(CFG, ["draft", "ngram"], {"draft": 0.5, "ngram": 0.6}, 200, Load(1), flat_cost())
    assert d.method == "ngram"


def test_collapsed_request_acceptance_drops_to_plain():
    k = revisit(CFG, "draft", 4, own_trials=20, own_kept=2, rounds=10, method_alpha=0.9,
                load=Load(1), cost=flat_cost())
    assert k == 0
    k = revisit(CFG, "draft", 4, own_trials=40, own_kept=36, rounds=10, method_alpha=0.9,
                load=Load(1), cost=flat_cost())
    assert k >= 3


def test_acceptance_tracker_counts_trials_up_to_the_first_rejection():
    t = AcceptanceTracker(PolicyConfig(prior_weight=0.0))
    t.observe("draft", 2, 1)   # kept 2, third rejected: 3 trials
    t.observe("draft", 4, 0)   # all 4 kept: 4 trials
    assert abs(t.alpha("draft") - 6 / 7) < 1e-12


def test_length_estimator_learns_per_bucket():
    e = LengthEstimator(CFG)
    assert e.expected(10, 100, has_stop=False) == 100
    for _ in range(5):
        e.observe(10, 20)
    assert e.expected(12, 100, has_stop=False) == 20
    assert e.expected(500, 100, has_stop=True) == 50  # another bucket, nothing learned


def test_cost_model_formulas():
    assert abs(expected_speedup(0.8, 4, 0.05, 1.0) - 3.3616 / 1.2) < 1e-3
    assert abs(acceptance_from_mean_length(3.3616, 4) - 0.8) < 1e-3
    assert best_k(0.1, 0.5, 6) == (0, 1.0)
