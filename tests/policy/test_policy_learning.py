"""The policy's costs follow the machine: a start-up calibration that lied (a busy machine,
or one too optimistic) is replaced by live steps and probes within a bounded number of
steps; "on" speculates every round whatever the costs say.

The simulated engine below runs the real EnginePolicy against a machine whose true costs
are given: each step asks the policy for k, costs what the machine says, and is observed
as the served engine observes it; the policy's clock is the simulated time."""

from __future__ import annotations

import math

from engine_helpers import greedy, load, make_engine, random_prompts

from specdec.engine.assemble import AssembledEngine
from specdec.engine.calibrate import noise
from specdec.engine.engine import StepRecord
from specdec.engine.request import Request
from specdec.model.step.generate import plain_generate
from specdec.policy.engine_policy import EnginePolicy
from specdec.policy.settings import PolicySettings
from specdec.spec_decode.counters import SpecCounters
from specdec.spec_decode.speculation import Speculation

K_MAX = 6


def quiet_step(tokens: int) -> float:
    """The quiet machine: a 1-row verify of up to 7 tokens costs 1.2 plain steps."""
    return 0.10 if tokens <= 1 else 0.12 + 0.002 * tokens


def quiet_draft(k: int, rows: int) -> float:
    return 0.005 + k * (0.02 + 0.002 * rows)


class Machine:
    """Step costs as a function of (tokens, k, rows), and a clock that runs with them."""

    def __init__(self, step=quiet_step, draft=quiet_draft) -> None:
        self.step, self.draft = step, draft
        self.now = 0.0

    def clock(self) -> float:
        return self.now


def calibrate(policy: EnginePolicy, step, draft) -> None:
    """What specdec/engine/calibrate.py feeds the policy: 1 row and 8 rows, plain and k = 2, 6."""
    for rows in (1, 8):
        for _ in range(3):
            policy.step_cost.calibrate(rows, step(rows))
            policy.step_cost.calibrate(16 * rows, step(16 * rows))  # the grid's prefills
        for k in (2, K_MAX):
            for _ in range(2):
                policy.step_cost.calibrate(rows * (1 + k), step(rows * (1 + k)))
                policy.draft_round_cost.calibrate(k, rows, draft(k, rows))


class OneRowEngine:
    """The engine as the policy sees it (policy/view.py's EngineView: steps, load,
    overlapped): one running request that follows the policy."""

    def __init__(self) -> None:
        self.steps = 0
        self.overlapped = False
        self.req = Request("r", [1, 2, 3], greedy(10_000), "draft", 0)
        self.spec = SpecCounters()
        # Tokens of the row, and how many of them the draft has seen: a draft round after
        # plain steps first feeds the draft what it missed (StepRecord.draft_catchup).
        self.tokens, self.draft_seen = 40, 0  # a 40-token prompt the draft has not seen

    def load(self) -> dict:
        return {"running": 1, "waiting": 0, "pinned_running": 0, "pinned_waiting": 0,
                "free_slots": 7, "prefill_tokens_per_step": 0.0,
                "following": {"draft": 1}, "speculating_on_request": 0}


def serve_steps(policy: EnginePolicy, machine: Machine, n: int,
                ends: list | None = None) -> list[int]:
    """n steps of one row; the k of each, None for a probe step (ends: when each ended)."""
    engine, ks = OneRowEngine(), []
    for _ in range(n):
        k = policy.choose_k(engine, engine.req, engine.spec, 1,
                            catchup=engine.tokens - engine.draft_seen)
        probing = policy.probing() is not None
        verify = machine.step(1 + k)
        drafting = machine.draft(k, 1) if k else 0.0
        catchup = engine.tokens - engine.draft_seen if k else 0
        if k:
            engine.draft_seen = engine.tokens
        engine.tokens += 1 + k  # (as if every guess was kept)
        rec = StepRecord(rows=1, tokens=1 + k, draft_s=drafting, verify_s=verify,
                         draft_rows=1 if k else 0, draft_k=k, draft_model_s=drafting,
                         step_s=verify + drafting, draft_catchup=catchup)
        policy.observe_step(rec)
        machine.now += rec.step_s
        engine.steps += 1
        ks.append(None if probing else k)
        if ends is not None:
            ends.append(machine.now)
    return ks


def settled(ks: list, speculating: bool) -> int:
    """The first step from which every step but the probes speculates (or runs plain)."""
    ok = [k is None or (k > 0) == speculating for k in ks]
    return next(i for i in range(len(ks)) if all(ok[i:]))


def admitted(policy: EnginePolicy) -> str:
    light = {"running": 0, "waiting": 0, "free_slots": 8}
    return policy.admit(light, ["draft"], 20, 200, False, Speculation()).mode


def new_policy(machine: Machine, **settings) -> EnginePolicy:
    settings = {"explore_share": 0.0, "probe_interval_s": 2.0, **settings}
    return EnginePolicy(PolicySettings(**settings), clock=machine.clock)


def test_quiet_machine_speculates_from_the_calibration_on():
    machine = Machine()
    policy = new_policy(machine)
    calibrate(policy, machine.step, machine.draft)
    assert admitted(policy) == "speculative"
    assert settled(serve_steps(policy, machine, 60), True) == 0


def test_a_start_up_three_times_slower_is_corrected_by_the_first_live_steps():
    machine = Machine()
    policy = new_policy(machine)
    calibrate(policy, lambda t: 3 * quiet_step(t), lambda k, r: 3 * quiet_draft(k, r))
    ks = serve_steps(policy, machine, 20)
    assert settled(ks, True) <= 2 and admitted(policy) == "speculative"


def test_a_busy_start_up_that_overpriced_the_verify_is_probed_away():
    """What a busy start did to the default app: verifies measured at 3.5 plain steps and the
    draft 2x dearer, plain steps nearly right. The batch then only runs plain steps, which
    never measure a verify: only a probe does, within one probe interval of serving."""
    machine = Machine()
    policy = new_policy(machine)
    busy_step = lambda t: quiet_step(t) * (1.0 if t <= 1 else 3.0)  # noqa: E731
    calibrate(policy, busy_step, lambda k, r: 2 * quiet_draft(k, r))
    assert admitted(policy) == "plain"
    interval_steps = math.ceil(policy.config.probe_interval_s / quiet_step(1))
    ks = serve_steps(policy, machine, 3 * interval_steps)
    assert ks[0] is None  # nothing live yet: the first step probes
    # Speculating for good within one interval and a few steps after it.
    assert settled(ks, True) <= interval_steps + 5, ks
    assert policy.probes["verify"] >= 1 and admitted(policy) == "speculative"
    # And at the k a quiet start would have chosen.
    quiet = new_policy(Machine())
    calibrate(quiet, quiet_step, quiet_draft)
    def chosen(steps):
        return [k for k in steps if k is not None][-5:]

    assert chosen(ks) == chosen(serve_steps(quiet, Machine(), 60))


def test_without_probes_the_busy_start_would_rule_for_good():
    """The same start with probes off: plain forever. (What the probe test above fixes.)"""
    machine = Machine()
    policy = new_policy(machine, probe_interval_s=0)
    calibrate(policy, lambda t: quiet_step(t) * (1.0 if t <= 1 else 3.0),
              lambda k, r: 2 * quiet_draft(k, r))
    assert set(serve_steps(policy, machine, 200)) == {0} and not policy.probes


def test_an_optimistic_calibration_stops_speculating_where_it_loses():
    """Calibrated with verifies as cheap as a plain step; on the machine they cost 3 plain
    steps and the draft 0.5 of one per guess: speculation loses, and live verify steps say
    so at once."""
    def dear_step(t):
        return 0.10 if t <= 1 else 0.30 + 0.01 * t

    machine = Machine(dear_step, lambda k, r: 0.05 * k)
    policy = new_policy(machine)
    calibrate(policy, lambda t: 0.10, lambda k, r: 0.01 * k)
    assert admitted(policy) == "speculative"
    ks = serve_steps(policy, machine, 50)
    assert settled(ks, False) <= 5, ks
    assert admitted(policy) == "plain"


def test_a_speculating_batch_probes_the_plain_step_it_no_longer_runs():
    """Calibrated with plain steps 3x dearer than they are (and verifies right): the batch
    speculates and never runs a plain step, so only a plain probe can show that plain is
    faster after all."""
    def dear_verify(t):
        return 0.10 if t <= 1 else 0.25 + 0.005 * t

    machine = Machine(dear_verify)
    policy = new_policy(machine)
    calibrate(policy, lambda t: 0.30 if t <= 1 else dear_verify(t), quiet_draft)
    assert admitted(policy) == "speculative"
    interval_steps = math.ceil(policy.config.probe_interval_s / 0.25)
    ks = serve_steps(policy, machine, 3 * interval_steps)
    assert settled(ks, False) <= interval_steps + 5, ks
    assert policy.probes["plain"] >= 1 and admitted(policy) == "plain"


def test_probes_cost_two_steps_per_interval_at_most():
    """One probe per interval, besides one for each shape never measured; a draft probe is
    two steps (the first catches the draft up)."""
    machine = Machine(lambda t: 0.10 if t <= 1 else 0.5)  # speculation never pays
    policy = new_policy(machine, probe_interval_s=5.0)
    calibrate(policy, machine.step, machine.draft)
    ends: list[float] = []
    ks = serve_steps(policy, machine, 500, ends)  # about 50 s of serving
    assert set(ks) == {0, None}
    probes = sum(policy.probes.values())
    assert 0 < probes <= machine.now / 5.0 + 1 + K_MAX and ks.count(None) == 2 * probes
    # Once every shape has run, one per interval: the last 30 s held at most 7 probes.
    late = [k for k, t in zip(ks, ends, strict=True) if t > machine.now - 30]
    assert late.count(None) <= 2 * (30 / 5.0 + 1)


def test_every_shape_a_busy_calibration_priced_is_measured_within_seconds():
    """At the default probe interval (20 s), a busy start that overpriced every verify and
    the draft is re-measured at every k within seconds of serving, not one k per interval:
    a first request or two (a few seconds each) must already speculate at the right k."""
    machine = Machine()
    policy = new_policy(machine, probe_interval_s=20.0)
    calibrate(policy, lambda t: quiet_step(t) * (1.0 if t <= 1 else 3.0),
              lambda k, r: 2 * quiet_draft(k, r))
    assert admitted(policy) == "plain"
    before = policy.report(["draft"])["priced_one_row"]
    assert not any(p["verify_live"] or p["draft_live"] for p in before)
    assert max(p["speedup"] for p in before) < 1.0  # what made the batch run plain
    ends: list[float] = []
    ks = serve_steps(policy, machine, 200, ends)
    first = sum(t < 18.0 for t in ends)  # the steps inside the first interval
    ks = ks[:first]
    measured = {k for k in range(1, K_MAX + 1)
                if policy.step_cost.last_live_at(1 + k) is not None}
    assert measured == set(range(1, K_MAX + 1)), measured
    assert admitted(policy) == "speculative"
    assert settled(ks, True) < first - 20, ks
    after = policy.report(["draft"])["priced_one_row"]
    assert all(p["verify_live"] and p["draft_live"] for p in after)
    assert max(p["speedup"] for p in after) > 1.05


def test_calibration_noise_is_told_from_a_quiet_machine():
    quiet = {16: [0.100, 0.102, 0.099, 0.101], 1: [0.05, 0.051, 0.05]}
    assert not noise(quiet, load_average=2.0, cores=2)["noisy"]
    jumpy = {16: [0.10, 0.19, 0.07, 0.25, 0.11], 1: [0.05, 0.09, 0.04]}
    got = noise(jumpy, load_average=2.0, cores=2)
    assert got["noisy"] and "spread" in got["noise"] and got["spread"] > 0.15
    busy = noise(quiet, load_average=4.2, cores=2)
    assert busy["noisy"] and "load average 4.2 on 2 cores" in busy["noise"]


def test_on_speculates_every_round_whatever_the_costs_say(tiny_llama, tiny_llama_far_draft):
    """Costs that rule speculation out (verifies 10x a plain step) and a draft that is
    mostly wrong (the tiny random pair): "on" still drafts every round but the last token's,
    and greedy output stays plain's. "auto" beside it stays plain."""
    policy = EnginePolicy(PolicySettings(explore_share=0.0, probe_interval_s=0))
    for t, s in ((1, 0.1), (2, 1.0), (4, 1.2), (8, 1.5), (16, 2.0), (64, 4.0)):
        policy.step_cost.calibrate(t, s)
    engine = make_engine(tiny_llama, tiny_llama_far_draft)
    engine.choose_k = policy.choose_k
    engine.on_step.append(policy.observe_step)
    engine.on_finished.append(policy.observe_finished)
    built = AssembledEngine(engine, None, None, policy, None, None)
    prompt = random_prompts((7,), seed=21)[0]
    n = 30
    auto_req, auto = built.submit("auto", prompt, greedy(n))
    assert auto.mode == "plain"
    while engine.has_work():
        engine.step()
    req, decision = built.submit("on", prompt, greedy(n), Speculation(mode="on"))
    assert decision.mode == "speculative" and decision.k >= 1 and decision.why == "request"
    assert req.speculation.on and "request asked for speculation" in decision.reason
    steps_before = len(engine.history)
    final = {}
    while engine.has_work():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    out = final["on"]
    decode = [r for r in list(engine.history)[steps_before:] if not r.prefill_tokens]
    assert decode and all(r.draft_rows == 1 for r in decode[:-1])
    assert out.spec.rounds >= len(decode) - 1 and out.spec.rejections > 0
    assert out.token_ids == plain_generate(load(tiny_llama), [prompt], greedy(n)).token_ids[0]


def test_on_without_any_proposer_runs_plain_and_says_why():
    policy = EnginePolicy()
    d = policy.admit({"running": 0, "waiting": 0, "free_slots": 8}, [], 10, 100, False,
                     Speculation(mode="on"))
    assert d.mode == "plain" and d.why == "no_proposer"
    assert "no proposer is available" in d.reason


def test_a_reply_cut_at_max_tokens_does_not_make_later_ones_short():
    """A 4-token request (cut at its max_tokens) says nothing about how long replies run;
    one that ended by itself does."""
    from specdec.engine.request import RequestOutput

    policy = EnginePolicy(PolicySettings(explore_share=0.0))
    light = {"running": 0, "waiting": 0, "free_slots": 8}

    def finished(n: int, reason: str) -> RequestOutput:
        return RequestOutput(request_id="x", new_token_ids=[], new_text="",
                             token_ids=list(range(n)), text="", finished=True,
                             finish_reason=reason, prompt_tokens=20, spec=SpecCounters())

    policy.observe_finished(finished(4, "length"))
    assert policy.admit(light, ["draft"], 20, 96, False, Speculation()).why != "short_output"
    policy.observe_finished(finished(5, "stop"))
    assert policy.admit(light, ["draft"], 20, 96, False, Speculation()).why == "short_output"


def test_a_round_that_first_prefilled_the_draft_is_not_priced_as_a_round():
    """A row's first draft round also feeds the draft its whole prompt: taken as a round's
    cost, every request's first round priced the draft far too dear."""
    policy = EnginePolicy()
    first = StepRecord(rows=1, tokens=3, draft_s=0.2, verify_s=0.1, draft_rows=1, draft_k=2,
                       draft_model_s=0.2, step_s=0.3, draft_catchup=40)
    policy.observe_step(first)
    assert not policy.draft_round_cost.live and policy.step_cost.live
    steady = StepRecord(rows=1, tokens=3, draft_s=0.05, verify_s=0.1, draft_rows=1,
                        draft_k=2, draft_model_s=0.05, step_s=0.15, draft_catchup=3)
    policy.observe_step(steady)
    assert list(policy.draft_round_cost.live) == [(2.0, 1.0)]


def test_a_few_tokens_caught_up_price_neither_a_round_nor_a_catch_up():
    """A round after one the suffix index led catches the draft up on the led tokens,
    riding along the round's forward almost free: taken per token, such samples priced a
    long prompt's catch-up near nothing (review finding)."""
    policy = EnginePolicy()
    for k in (1, 2, 3):  # rounds measured: a catch-up is priced beyond one
        policy.observe_step(StepRecord(rows=1, tokens=k + 1, draft_s=0.03 * k, verify_s=0.1,
                                       draft_rows=1, draft_k=k, draft_model_s=0.03 * k,
                                       step_s=0.1 + 0.03 * k))
    rounds = list(policy.draft_round_cost.live)
    assert policy.draft_round_cost.round_seconds(2, 1) is not None
    policy.observe_step(StepRecord(rows=1, tokens=3, draft_s=0.06, verify_s=0.1,
                                   draft_rows=1, draft_k=2, draft_model_s=0.06, step_s=0.16,
                                   draft_catchup=20))
    assert not policy.catchup_cost.live and list(policy.draft_round_cost.live) == rounds


def test_the_prompt_catch_up_beside_a_prefill_is_timed_apart_from_the_round():
    """The draft's call that takes in a prefilled chunk is a catch-up sample of its own;
    the decode rows' round in the same step is a round sample of its own time only."""
    policy = EnginePolicy()
    for k in (1, 2, 3):  # rounds measured: the catch-up call's own round is priced
        policy.observe_step(StepRecord(rows=1, tokens=k + 1, draft_s=0.025 * k,
                                       verify_s=0.1, draft_rows=1, draft_k=k,
                                       draft_model_s=0.025 * k, step_s=0.1 + 0.025 * k))
    before = len(policy.draft_round_cost.samples)
    policy.observe_step(StepRecord(rows=2, tokens=131, draft_s=0.35, verify_s=0.5,
                                   draft_rows=1, draft_k=2, draft_model_s=0.05, step_s=0.85,
                                   draft_catchup=2, prompt_catchup=128, prompt_catchup_rows=1,
                                   prompt_catchup_s=0.3))
    assert list(policy.draft_round_cost.samples)[before:] == [((2.0, 1.0), 0.05)]
    # Per token: the catch-up call's 0.3 s, less its one round of k 1, over its 128 tokens.
    one = policy.draft_round_cost.round_seconds(1, 1)
    assert len(policy.catchup_cost.live) == 1 and 0 < one < 0.05
    assert abs(policy.catchup_cost.live[0] - (0.3 - one) / 128) < 1e-9


def test_hidden_or_thin_catch_ups_are_no_samples():
    """Overlapped, the draft's catch-up ran beside the target's step and no draft time was
    recorded: hidden, not free. Four rows of 16 prompt tokens each ride along one call
    almost free: not a per-token price of a long prompt either."""
    policy = EnginePolicy()
    policy.observe_step(StepRecord(rows=1, tokens=3, draft_s=0.0, verify_s=0.1, step_s=0.1,
                                   draft_catchup=500, draft_catchup_total=500,
                                   overlapped=True))
    policy.observe_step(StepRecord(rows=4, tokens=64, draft_s=0.05, verify_s=0.2,
                                   step_s=0.25, prompt_catchup=64, prompt_catchup_rows=4,
                                   prompt_catchup_s=0.05))
    assert not policy.catchup_cost.live


def test_standby_is_the_draft_so_its_cost_gets_probed():
    """Near break-even the lookup can price a hair better than a mispriced draft; standing
    by for the lookup, the draft would never be probed again (a busy start for good)."""
    machine = Machine()
    policy = new_policy(machine)
    calibrate(policy, lambda t: quiet_step(t) * (1.0 if t <= 1 else 3.0),
              lambda k, r: 3 * quiet_draft(k, r))
    light = {"running": 0, "waiting": 0, "free_slots": 8}
    d = policy.admit(light, ["draft", "ngram"], 20, 200, False, Speculation())
    assert d.mode == "plain" and d.standby == "draft"


def test_a_busy_start_that_overpriced_only_the_draft_is_probed_away():
    """The verify calibrated right, the draft 3x too dear (a busy start slowed the draft's
    process more): the batch runs plain, so only a probe drafts, and its first round also
    catches the draft up on the plain steps it missed, which is not priced as a round. The
    probe therefore drafts two steps in a row; the second one's round corrects the draft's
    cost, and the batch speculates."""
    machine = Machine()
    policy = new_policy(machine)
    calibrate(policy, quiet_step, lambda k, r: 3 * quiet_draft(k, r))
    assert admitted(policy) == "plain"
    interval_steps = math.ceil(policy.config.probe_interval_s / quiet_step(1))
    ks = serve_steps(policy, machine, 4 * interval_steps)
    assert policy.draft_round_cost.live, "no draft round was ever measured"
    assert settled(ks, True) <= 2 * interval_steps + 5, ks
    assert admitted(policy) == "speculative"


def test_a_draft_probe_drafts_twice_and_only_the_second_round_is_priced():
    machine = Machine()
    policy = new_policy(machine)
    calibrate(policy, quiet_step, lambda k, r: 3 * quiet_draft(k, r))
    engine = OneRowEngine()
    engine.tokens = 200  # a long plain stretch: the draft has seen none of it
    for _ in range(2):
        k = policy.choose_k(engine, engine.req, engine.spec, 1)
        assert k > 0 and policy.probing() == ("verify", "draft", k)
        catchup = engine.tokens - engine.draft_seen
        engine.draft_seen, engine.tokens = engine.tokens, engine.tokens + 1 + k
        policy.observe_step(StepRecord(rows=1, tokens=1 + k, draft_s=0.05, verify_s=0.12,
                                       draft_rows=1, draft_k=k, draft_model_s=0.05,
                                       step_s=0.17, draft_catchup=catchup))
        engine.steps += 1
        machine.now += 0.17
    assert list(policy.draft_round_cost.live) == [(float(k), 1.0)]
    assert sum(policy.probes.values()) == 1  # one probe, two steps


def catchup_calibrated(machine: Machine, per_token: float = 0.002) -> EnginePolicy:
    """A policy calibrated on the quiet machine, with one round that first caught the draft
    up on a 256-token prompt (what specdec/engine/calibrate.py runs)."""
    policy = new_policy(machine)
    calibrate(policy, quiet_step, quiet_draft)
    drafting = quiet_draft(2, 1) + 256 * per_token
    policy.calibrate_step(StepRecord(rows=1, tokens=3, draft_s=drafting,
                                     verify_s=quiet_step(3), draft_rows=1, draft_k=2,
                                     draft_model_s=drafting, step_s=quiet_step(3) + drafting,
                                     draft_catchup=256))
    return policy


def test_a_long_prompt_with_a_short_reply_runs_plain_without_the_drafts_catch_up():
    """1,200 prompt tokens the draft has not seen cost it 2.4 s here; 48 tokens at ~1.3x save
    about a second: plain, and no probe makes this row draft either."""
    machine = Machine()
    policy = catchup_calibrated(machine)
    light = {"running": 0, "waiting": 0, "free_slots": 8}
    short = policy.admit(light, ["draft"], 1200, 48, False, Speculation(), catchup=1200)
    assert short.mode == "plain" and short.why == "catchup", short.reason
    # Nothing of the prompt to catch up on (the draft's cache holds it): speculates.
    warm = policy.admit(light, ["draft"], 1200, 48, False, Speculation(), catchup=2)
    assert warm.mode == "speculative"
    # Running, with a probe due: the row with its 1,200 unseen tokens stays plain.
    engine = OneRowEngine()
    engine.req = Request("r", [1] * 1200, greedy(48), "draft", 0)
    engine.tokens, engine.draft_seen = 1210, 0
    machine.now += 100.0  # every shape is stale: a probe is due
    ks, probes = [], []
    for _ in range(3):
        ks.append(policy.choose_k(engine, engine.req, engine.spec, 1, catchup=1210))
        probes.append(policy.probing())
        engine.steps += 1
    assert ks == [0, 0, 0] and probes[0] is not None


def test_a_long_reply_after_a_long_prompt_still_speculates():
    machine = Machine()
    policy = catchup_calibrated(machine)
    light = {"running": 0, "waiting": 0, "free_slots": 8}
    d = policy.admit(light, ["draft"], 1200, 2000, False, Speculation(), catchup=1200)
    assert d.mode == "speculative", d.reason
    engine = OneRowEngine()
    engine.req = Request("r", [1] * 1200, greedy(2000), "draft", 0)
    ks = []
    for _ in range(3):  # (the first step may be a probe of the plain step)
        ks.append(policy.choose_k(engine, engine.req, engine.spec, 1, catchup=1200))
        engine.steps += 1
    assert max(ks) > 0, ks
    # "on" pays any catch-up: the request asked for speculation.
    asked = policy.admit(light, ["draft"], 1200, 8, False, Speculation(mode="on"), catchup=1200)
    assert asked.mode == "speculative"


def test_the_catch_up_cost_is_learned_from_live_rounds():
    machine = Machine()
    policy = catchup_calibrated(machine, per_token=0.002)
    assert abs(policy.catchup_cost.seconds(1000) - 2.0) < 0.05
    drafting = quiet_draft(2, 1) + 500 * 0.0005
    for _ in range(5):  # the live machine catches up four times faster
        policy.observe_step(StepRecord(rows=1, tokens=3, draft_s=drafting,
                                       verify_s=quiet_step(3), draft_rows=1, draft_k=2,
                                       draft_model_s=drafting,
                                       step_s=quiet_step(3) + drafting, draft_catchup=500))
    assert abs(policy.catchup_cost.seconds(1000) - 0.5) < 0.05


def gpu_eager_step(tokens: int) -> float:
    """One H200, eager (specdec_bench/RESULTS.md, "On a GPU"): every forward ~16.7 ms,
    bound by the host."""
    return 0.0167


def gpu_eager_draft(k: int, rows: int) -> float:
    return 0.86 * 0.0167 * k  # c = 0.86: the 0.5B draft is host-bound too


def gpu_captured_step(tokens: int) -> float:
    """Captured graphs: the weights' read time; a few more tokens are nearly free."""
    return 0.0020 if tokens <= 1 else 0.0021 + 0.00005 * tokens


def gpu_captured_draft(k: int, rows: int) -> float:
    return 0.0001 + 0.0006 * k * (1 + 0.05 * rows)  # c = 0.3, near the weight ratio


def test_the_captured_step_shape_is_learned_from_live_steps():
    """Eager on a GPU, speculation cannot pay (verify = plain, c = 0.86): plain. Captured,
    a verify costs about a plain step and c falls to 0.3. Started with the eager costs (a
    calibration before the graphs existed), the policy reads the new shape off its live
    steps and probes, and speculates at the k a calibration of the captured step picks."""
    eager = Machine(gpu_eager_step, gpu_eager_draft)
    policy = new_policy(eager, probe_interval_s=20.0)
    calibrate(policy, gpu_eager_step, gpu_eager_draft)
    assert set(serve_steps(policy, eager, 200)) <= {0, None}
    assert max(p["speedup"] for p in policy.report(["draft"])["priced_one_row"]) < 1.0

    captured = Machine(gpu_captured_step, gpu_captured_draft)
    policy = new_policy(captured, probe_interval_s=20.0)
    calibrate(policy, gpu_eager_step, gpu_eager_draft)
    assert admitted(policy) == "plain"
    ks = serve_steps(policy, captured, 3000)  # about 7 s of serving
    assert settled(ks, True) <= 5, ks[:20]
    assert admitted(policy) == "speculative"
    priced = {p["k"]: p for p in policy.report(["draft"])["priced_one_row"]}
    assert all(p["verify_live"] and p["draft_live"] for p in priced.values())
    assert priced[3]["verify_ms"] <= 1.25 * priced[3]["plain_ms"]  # verify ~ plain
    assert priced[3]["draft_ms"] <= 0.4 * 3 * priced[3]["plain_ms"]  # c <= 0.4
    quiet = new_policy(Machine(gpu_captured_step, gpu_captured_draft), probe_interval_s=20.0)
    calibrate(quiet, gpu_captured_step, gpu_captured_draft)
    chosen = [k for k in ks if k is not None][-5:]
    assert chosen == [k for k in serve_steps(quiet, Machine(gpu_captured_step,
                                                            gpu_captured_draft), 60)
                      if k is not None][-5:]
