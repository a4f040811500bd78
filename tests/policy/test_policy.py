"""The routing policy's choices respond to length, load and acceptance as the cost model says."""

from __future__ import annotations

from specdec.policy.cost_model import DraftCostModel, StepCostModel, expected_tokens_per_round
from specdec.policy.decide import Acceptance, Load, OwnRecord, RoundCosts, decide, revisit
from specdec.policy.engine_policy import EnginePolicy
from specdec.policy.estimators import AcceptanceTracker, LengthEstimator
from specdec.policy.settings import PolicySettings
from specdec.spec_decode.speculation import Speculation

CFG = PolicySettings()


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
    d = decide(CFG, ["draft"], Acceptance(alpha={"draft": 0.9}), 4, Load(running=1),
               RoundCosts(step=flat_cost()))
    assert d.mode == "plain" and "short output" in d.reason and d.why == "short_output"


def test_good_acceptance_at_light_load_speculates_with_the_cost_model_k():
    d = decide(CFG, ["draft", "ngram"], Acceptance(alpha={"draft": 0.9, "ngram": 0.2}), 200,
               Load(running=1), RoundCosts(step=flat_cost()))
    k, s = best_k(0.9, CFG.draft_cost_ratio, CFG.k_max, 1.0)
    assert (d.mode, d.method, d.k, d.why) == ("speculative", "draft", k, "goodput")
    assert abs(d.expected_speedup - s) < 1e-9 and s > 1.5


def test_heavy_compute_bound_load_goes_plain():
    d = decide(CFG, ["draft"], Acceptance(alpha={"draft": 0.8}), 200, Load(running=16),
               RoundCosts(step=compute_bound_cost()))
    assert d.mode == "plain" and d.why == "no_gain"


def test_load_shrinks_k_before_turning_speculation_off():
    cost = StepCostModel()
    for t in (1, 5, 9, 20, 40, 2, 6, 30):
        cost.observe(t, 0.2 + 0.01 * t)  # partly compute bound
    light = decide(CFG, ["draft"], Acceptance(alpha={"draft": 0.85}), 200, Load(1, 0),
                   RoundCosts(step=cost))
    heavy = decide(CFG, ["draft"], Acceptance(alpha={"draft": 0.85}), 200, Load(12, 0),
                   RoundCosts(step=cost))
    heavier = decide(CFG, ["draft"], Acceptance(alpha={"draft": 0.85}), 200, Load(32, 0),
                     RoundCosts(step=cost))
    assert light.k > heavy.k > 0
    assert heavier.mode == "plain"


def test_cheap_ngram_wins_when_its_acceptance_is_decent():
    d = decide(CFG, ["draft", "ngram"], Acceptance(alpha={"draft": 0.5, "ngram": 0.6}), 200,
               Load(1), RoundCosts(step=flat_cost()))
    assert d.method == "ngram"


def test_collapsed_request_acceptance_drops_to_plain():
    k = revisit(CFG, "draft", OwnRecord(rounds=10, trials=20, kept=2),
                Acceptance(alpha={"draft": 0.9}), Load(1), RoundCosts(step=flat_cost()))
    assert k == 0
    k = revisit(CFG, "draft", OwnRecord(rounds=10, trials=40, kept=36),
                Acceptance(alpha={"draft": 0.9}), Load(1), RoundCosts(step=flat_cost()))
    assert k >= 3


def test_acceptance_tracker_counts_trials_up_to_the_first_rejection():
    t = AcceptanceTracker(PolicySettings(prior_weight=0.0, acceptance_half_life=0))
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


def with_fit(model_cls, fit):
    """A cost model whose answer is given, for what-if pricing."""
    m = model_cls()
    m._fixed = tuple(float(x) for x in fit)
    return m


def best_k(a: float, c: float, k_max: int, v: float = 1.0) -> tuple[int, float]:
    """The i.i.d. textbook answer: the k with the highest (1 - a^(k+1)) / (1 - a) / (k c + v)
    and that speedup; (0, 1.0) where none beats plain."""
    speedups = {k: (1 - a ** (k + 1)) / (1 - a) / (k * c + v) for k in range(1, k_max + 1)}
    k = max(speedups, key=speedups.get)
    return (k, speedups[k]) if speedups[k] > 1.0 else (0, 1.0)


def test_tokens_per_round_formula():
    assert abs(expected_tokens_per_round(0.8, 4) - 3.3616) < 1e-9
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.5, 0) == 1.0


def test_draft_round_cost_fit_recovers_fixed_and_per_guess_parts():
    m = DraftCostModel()
    for k in (1, 2, 3, 4, 6):
        m.observe(k, 0, 1.0)  # no rows: ignored
    assert m.fit() is None
    for k in (2, 4, 4):
        m.observe(k, 3, 0.05 + k * (0.02 + 0.004 * 3))
    assert m.fit() is None  # too few shapes yet (2 for 3 parameters)
    for k, rows in ((1, 1), (3, 8), (5, 2), (6, 6), (2, 8), (4, 1)):
        m.observe(k, rows, 0.05 + k * (0.02 + 0.004 * rows))
    d0, e0, e1 = m.fit()
    assert abs(d0 - 0.05) < 1e-9 and abs(e0 - 0.02) < 1e-9 and abs(e1 - 0.004) < 1e-9
    same_k = DraftCostModel()
    for rows in range(1, 12):
        same_k.observe(4, rows, 0.1 + 0.01 * rows)
    assert same_k.fit() is None  # one k: fixed and per-guess parts are confounded


def test_a_fixed_draft_cost_per_round_favours_longer_drafts():
    """Same draft time at k = 4 (0.28 s), but most of it paid once per round: longer drafts
    amortize it, so the policy picks a larger k than a flat per-guess cost would."""
    flat = with_fit(DraftCostModel, (0.0, 0.07, 0.0))
    fixed = with_fit(DraftCostModel, (0.2, 0.02, 0.0))
    step = with_fit(StepCostModel, (0.2, 0.0))
    a = decide(CFG, ["draft"], Acceptance(alpha={"draft": 0.85}), 200, Load(1),
               RoundCosts(step=step, draft=flat))
    b = decide(CFG, ["draft"], Acceptance(alpha={"draft": 0.85}), 200, Load(1),
               RoundCosts(step=step, draft=fixed))
    assert b.k > a.k > 0
    # Without a measured round cost the configured ratio is used.
    c = decide(CFG, ["draft"], Acceptance(alpha={"draft": 0.85}), 200, Load(1),
               RoundCosts(step=step))
    assert c.k == best_k(0.85, CFG.draft_cost_ratio, CFG.k_max, 1.0)[0]


def test_acceptance_curve_starts_at_the_iid_prior_and_follows_measurements():
    t = AcceptanceTracker(CFG)
    prior = dict(CFG.acceptance_prior)["draft"]
    assert all(abs(r - prior ** i) < 1e-12 for i, r in enumerate(t.curve("draft", 4), 1))
    # Bursty acceptance: 300 rounds of k = 4, half keep all four, half reject the first.
    for _ in range(150):
        t.observe("draft", 4, 0, [1, 1, 1, 1], [1, 1, 1, 1])
        t.observe("draft", 0, 1, [], [1, 1, 1, 1])
    curve = t.curve("draft", 6)
    assert all(abs(r - 0.5) < 0.03 for r in curve[:4])    # flat, unlike alpha^i
    assert curve == sorted(curve, reverse=True)            # never rises with i
    assert curve[5] <= curve[4] <= curve[3]                # beyond the data: the prior


def test_decide_uses_the_measured_curve_over_the_iid_model():
    step = with_fit(StepCostModel, (0.2, 0.0))
    alpha = {"draft": 0.8}
    iid = decide(CFG, ["draft"], Acceptance(alpha=alpha), 200, Load(1), RoundCosts(step=step))
    # Same alpha, but guesses after the first two are almost never kept.
    steep = decide(CFG, ["draft"],
                   Acceptance(alpha=alpha, curves={"draft": [0.9, 0.8, 0.05, 0.01, 0.0, 0.0]}), 200,
                   Load(1), RoundCosts(step=step))
    # Once a round gets going it keeps going: long drafts pay.
    flat = decide(CFG, ["draft"],
                  Acceptance(alpha=alpha, curves={"draft": [0.8, 0.78, 0.77, 0.76, 0.75, 0.75]}),
                  200, Load(1), RoundCosts(step=step))
    assert steep.k == 2 < iid.k < flat.k == CFG.k_max
    assert steep.inputs["acceptance_curve"]["draft"][2] == 0.05


def test_acceptance_is_a_recent_estimate():
    t = AcceptanceTracker(PolicySettings(prior_weight=0.0, acceptance_half_life=500))
    for _ in range(500):
        t.observe("draft", 0, 1)          # a bad stretch: every first guess rejected
    assert t.alpha("draft") < 0.01
    for _ in range(300):
        t.observe("draft", 4, 1)          # then 4 of 5 tested guesses kept
    assert t.alpha("draft") > 0.7         # the bad stretch has faded (no decay: 0.60)
    never = AcceptanceTracker(PolicySettings(prior_weight=0.0, acceptance_half_life=0))
    for _ in range(500):
        never.observe("draft", 0, 1)
    for _ in range(300):
        never.observe("draft", 4, 1)
    assert abs(never.alpha("draft") - 1200 / 2000) < 1e-9


def test_after_an_outage_the_policy_explores_and_speculates_again():
    """An outage that was counted as failures (or a bad stretch) drives the estimate to
    'plain'; a share of requests still speculates, their good rounds restore the estimate,
    and the policy speculates on every request again."""
    from specdec.engine.request import RequestOutput
    from specdec.policy.engine_policy import EnginePolicy
    from specdec.policy.settings import PolicySettings
    from specdec.spec_decode.counters import SpecCounters
    from specdec.spec_decode.speculation import Speculation

    policy = EnginePolicy(PolicySettings(acceptance_half_life=400, explore_share=0.1))
    load = {"running": 0, "waiting": 0}

    def finish(kept_per_round: int, rounds: int) -> None:
        spec = SpecCounters()
        for _ in range(rounds):
            spec.record_round(4, kept_per_round, kept_per_round + 1)
        policy.observe_finished(RequestOutput(
            request_id="r", new_token_ids=[], new_text="", token_ids=[1] * 50, text="",
            finished=True, finish_reason="length", prompt_tokens=10, spec=spec,
            method="draft"))

    for _ in range(40):
        finish(0, 10)                     # nothing kept
    modes = [policy.admit(load, ["draft"], 10, 200, False, Speculation()).mode for _ in range(40)]
    assert modes.count("speculative") == 4 and modes.count("plain") == 36  # 10% explore
    for _ in range(30):                   # the explored requests find the draft works again
        finish(4, 10)
    d = policy.admit(load, ["draft"], 10, 200, False, Speculation())
    assert d.mode == "speculative" and d.why == "goodput", d.reason


def test_overlap_round_cost_is_the_max_of_draft_and_verify():
    """Overlapped, a draft round costs max(k*c, v), not k*c + v: guesses that fit under the
    verify are free, so the policy drafts longer and expects more."""

    from specdec.policy.cost_model import expected_tokens_per_round

    cfg = CFG.model_copy(update={"draft_cost_ratio": 0.15})
    seq = decide(cfg, ["draft"], Acceptance(alpha={"draft": 0.8}), 200, Load(running=1),
                 RoundCosts(step=flat_cost()))
    ovl = decide(cfg, ["draft"], Acceptance(alpha={"draft": 0.8}), 200, Load(running=1),
                 RoundCosts(step=flat_cost(), overlapped=True))
    c = cfg.draft_cost_ratio
    assert ovl.k > seq.k and ovl.expected_speedup > seq.expected_speedup
    want = expected_tokens_per_round(0.8, ovl.k) / max(ovl.k * c, 1.0)
    assert abs(ovl.expected_speedup - want) < 1e-9
    # n-gram rounds do not overlap: their cost stays the sum.
    ng = decide(CFG, ["ngram"], Acceptance(alpha={"ngram": 0.6}), 200, Load(running=1),
                RoundCosts(step=flat_cost(), overlapped=True))
    ng_seq = decide(CFG, ["ngram"], Acceptance(alpha={"ngram": 0.6}), 200, Load(running=1),
                    RoundCosts(step=flat_cost()))
    assert (ng.k, ng.expected_speedup) == (ng_seq.k, ng_seq.expected_speedup)


# A roofline measured on a 2-core CPU (tokens in the target's forward -> seconds): memory
# bound up to a few tokens, compute bound beyond.
ROOFLINE = [(1, 0.16), (2, 0.16), (4, 0.16), (8, 0.30), (16, 0.38), (24, 0.61), (56, 1.37),
            (128, 2.30)]


def roofline_cost() -> StepCostModel:
    m = StepCostModel()
    for t, s in ROOFLINE:
        m.calibrate(t, s)
    return m


def test_step_cost_follows_the_measured_points_where_a_line_cannot():
    m = roofline_cost()
    a, b = m.fit()
    for t, s in ROOFLINE:
        assert abs(m.step_seconds(t) - s) < 1e-9  # the measured points themselves
    # Between points: on the segment; beyond the largest: on at the last slope.
    assert abs(m.step_seconds(20) - (0.38 + 0.23 / 2)) < 1e-9
    slope = max((2.30 - 1.37) / 72, b)  # never flatter than the line
    assert abs(m.step_seconds(200) - (2.30 + 72 * slope)) < 1e-9
    # The line through the same points misprices the verify of 4 rows at k = 4 (4 -> 20
    # tokens) by more than a fifth; the measured points do not.
    measured = (0.38 + 0.23 / 2) / 0.16
    line = (a + b * 20) / (a + b * 4)
    assert abs(m.verify_cost(4, 16) - measured) < 1e-9
    assert abs(line - measured) / measured > 0.2


def test_noise_never_makes_more_tokens_cheaper():
    m = StepCostModel()
    for t, s in ((1, 0.20), (2, 0.15), (3, 0.22), (4, 0.21), (6, 0.3), (8, 0.35), (9, 0.3),
                 (12, 0.5)):
        m.observe(t, s)
    costs = [m.step_seconds(t) for t in range(1, 13)]
    assert costs == sorted(costs)
    assert m.verify_cost(1, 1) >= 1.0


def test_calibration_anchors_outlive_a_window_of_one_batch_shape():
    """Steady traffic of one shape fills the window; without the start-up anchors the line
    would be undetermined (one x) and v would fall back to 1 (memory bound) at any load."""
    m = roofline_cost()
    for _ in range(600):
        m.observe(4, 0.16)
    assert len(m.samples) == 512 and len(m.anchors) == len(ROOFLINE)
    assert m.fit() is not None and m.verify_cost(4, 16) > 2.5
    alone = StepCostModel()
    for _ in range(600):
        alone.observe(4, 0.16)
    assert alone.fit() is None and alone.verify_cost(4, 16) == 1.0


def test_on_a_roofline_speculation_pays_alone_and_not_in_a_batch():
    """What the concurrency sweep measured on 2 cores (plain faster from 4 clients up, the
    draft pair faster alone) follows from the measured costs."""
    draft = DraftCostModel()
    for k, rows, s in ((2, 1, 0.10), (6, 1, 0.30), (2, 8, 0.25), (6, 8, 0.70)) * 2:
        draft.calibrate(k, rows, s)
    step = roofline_cost()
    alone = decide(CFG, ["draft"], Acceptance(alpha={"draft": 0.8}), 200, Load(1),
                   RoundCosts(step=step, draft=draft))
    batch = decide(CFG, ["draft"], Acceptance(alpha={"draft": 0.8}), 200, Load(4),
                   RoundCosts(step=step, draft=draft))
    assert alone.mode == "speculative" and alone.expected_speedup > 1.2
    assert batch.mode == "plain" and batch.why == "no_gain"


def test_admission_prices_the_batch_a_burst_will_run_in():
    """Requests admitted before the next step run together: the fourth of a burst is priced
    with the three queued ahead of it (as far as slots take them), not as if alone."""
    load = EnginePolicy._load({"running": 0, "waiting": 3, "free_slots": 8}, joining=1)
    assert load.running == 4
    full = EnginePolicy._load({"running": 6, "waiting": 5, "free_slots": 2}, joining=1)
    assert full.running == 8
    between = EnginePolicy._load({"running": 5, "waiting": 9, "free_slots": 3})
    assert between.running == 5  # between rounds: the rows that run


def test_no_exploring_where_the_load_alone_rules_speculation_out():
    """Exploration tests whether acceptance recovered; where a verify costs more than even a
    draft that is always right returns (a big batch on a compute-bound target), it only
    costs, so the policy does not explore there, and does again once the load is light."""
    from specdec.policy.engine_policy import EnginePolicy
    from specdec.policy.settings import PolicySettings
    from specdec.spec_decode.speculation import Speculation

    policy = EnginePolicy(PolicySettings(explore_share=0.25))
    for t, s in ROOFLINE:
        policy.step_cost.calibrate(t, s)
    for k, rows, s in ((2, 1, 0.10), (6, 1, 0.30), (2, 8, 0.25), (6, 8, 0.70)) * 2:
        policy.draft_round_cost.calibrate(k, rows, s)
    policy.acceptance.observe("draft", 0, 400)  # the draft looks useless: plain, explore
    busy = {"running": 3, "waiting": 0, "free_slots": 5}  # a batch of 4 with this request
    light = {"running": 0, "waiting": 0, "free_slots": 8}

    def modes(load):
        return [policy.admit(load, ["draft"], 10, 200, False, Speculation()).mode
                for _ in range(40)]

    assert modes(busy).count("speculative") == 0
    assert modes(light).count("speculative") == 10  # a quarter explores


def test_pinned_plain_rows_dilute_a_speculative_batch():
    """Rows pinned plain (asked for plain, too short) draft nothing but wait for every
    verify: the batch's gain is the following rows' tokens over all rows' plain tokens,
    and the verify holds only the following rows' guesses."""
    cost = compute_bound_cost()
    free = decide(CFG, ["draft"], Acceptance(alpha={"draft": 0.8}), 200, Load(4),
                  RoundCosts(step=cost), Speculation(k=2))
    pinned = decide(CFG, ["draft"], Acceptance(alpha={"draft": 0.8}), 200, Load(4, pinned=3),
                    RoundCosts(step=cost), Speculation(k=2))
    per_row = expected_tokens_per_round(0.8, 2)
    c = CFG.draft_cost_ratio
    v_free, v_pinned = (4 + 4 * 2) / 4, (4 + 1 * 2) / 4  # 0.01 s per token
    assert abs(free.expected_speedup - per_row / (2 * c + v_free)) < 1e-6
    assert abs(pinned.expected_speedup - (3 + per_row) / 4 / (2 * c + v_pinned)) < 1e-6
    # The one deciding row always follows the decision: pinned never covers every row.
    alone = decide(CFG, ["draft"], Acceptance(alpha={"draft": 0.8}), 200, Load(1, pinned=5),
                   RoundCosts(step=cost), Speculation(k=2))
    assert abs(alone.expected_speedup - per_row / (2 * c + 3.0)) < 1e-6


def test_a_plain_decision_for_lack_of_gain_names_its_standby_method():
    step, draft = roofline_cost(), DraftCostModel()
    for k, rows, s in ((2, 1, 0.10), (6, 1, 0.30), (2, 8, 0.25), (6, 8, 0.70)) * 2:
        draft.calibrate(k, rows, s)
    busy = decide(CFG, ["draft", "ngram"], Acceptance(alpha={"draft": 0.8, "ngram": 0.1}), 200,
                  Load(4), RoundCosts(step=step, draft=draft))
    assert busy.mode == "plain" and busy.why == "no_gain" and busy.standby == "draft"
    short = decide(CFG, ["draft"], Acceptance(alpha={"draft": 0.8}), 5, Load(1),
                   RoundCosts(step=step, draft=draft))
    assert short.mode == "plain" and short.standby is None  # pinned: never speculates
    # On standby the request follows the batch: plain while busy, speculative once light.
    assert revisit(CFG, "draft", OwnRecord(rounds=0, trials=0, kept=0),
                   Acceptance(alpha={"draft": 0.8}), Load(4),
                   RoundCosts(step=step, draft=draft)) == 0
    assert revisit(CFG, "draft", OwnRecord(rounds=0, trials=0, kept=0),
                   Acceptance(alpha={"draft": 0.8}), Load(1),
                   RoundCosts(step=step, draft=draft)) > 0
