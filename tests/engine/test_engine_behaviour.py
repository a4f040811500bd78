"""Engine behaviour: stops, seeds, capacity, cancellation, streaming, tokenizer checks."""

from __future__ import annotations

import pytest
from engine_helpers import greedy, load, make_engine, random_prompts, requests

from specdec.engine.engine import EngineLimits
from specdec.engine.request import Request
from specdec.errors import CapacityError, EngineError
from specdec.model.step.generate import plain_generate
from specdec.model.step.sampling import SamplingParams


def test_max_tokens_stops_exactly_even_when_a_round_overshoots(tiny_llama, tiny_llama_draft):
    prompts = random_prompts((5, 7, 9), seed=4)
    engine = make_engine(tiny_llama, tiny_llama_draft)
    out = engine.run([Request(f"r{i}", p, greedy(max_tokens=n), "draft", 6)
                      for i, (p, n) in enumerate(zip(prompts, (1, 7, 13), strict=True))])
    assert [len(out[f"r{i}"].token_ids) for i in range(3)] == [1, 7, 13]
    assert all(o.finish_reason == "length" for o in out.values())


def test_eos_stops_at_its_first_occurrence(tiny_llama, tiny_llama_draft):
    prompt = random_prompts((6,), seed=5)[0]
    plain = plain_generate(load(tiny_llama), [prompt], greedy(30)).token_ids[0]
    eos = plain[7]
    first = plain.index(eos)
    engine = make_engine(tiny_llama, tiny_llama_draft, eos_ids={eos})
    params = SamplingParams(temperature=0, max_tokens=30)
    out = engine.run([Request("e", prompt, params, "draft", 5)])["e"]
    assert out.token_ids == plain[: first + 1] and out.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(tiny_llama, tiny_llama_draft):
    prompts = random_prompts((5, 8), seed=6)

    def run(extra_batch: bool):
        engine = make_engine(tiny_llama, tiny_llama_draft)
        params = SamplingParams(temperature=1.0, max_tokens=20, seed=1234, ignore_eos=True)
        reqs = [Request("a", prompts[0], params, "draft", 3)]
        if extra_batch:  # other traffic in the batch must not change a seeded request
            reqs.append(Request("b", prompts[1], SamplingParams(temperature=1.0, max_tokens=20,
                                                                ignore_eos=True), "draft", 5))
        return engine.run(reqs)["a"].token_ids

    first = run(False)
    assert run(False) == first
    assert run(True) == first
    other_seed = make_engine(tiny_llama, tiny_llama_draft).run([Request(
        "a", prompts[0], SamplingParams(temperature=1.0, max_tokens=20, seed=99, ignore_eos=True),
        "draft", 3)])["a"].token_ids
    assert other_seed != first


def test_capacity_refusals_name_the_limit(tiny_llama):
    engine = make_engine(tiny_llama, max_len=32, limits=EngineLimits(max_waiting=1))
    # Too long for the context is the request's fault (400), not a lack of capacity (503).
    with pytest.raises(EngineError, match=r"prompt \(30 tokens\) \+ max_tokens \(8\) exceeds") as e:
        engine.add_request(Request("x", list(range(3, 33)), greedy(8)))
    assert not isinstance(e.value, CapacityError) and e.value.param == "max_tokens"
    with pytest.raises(EngineError, match="prompt is empty"):
        engine.add_request(Request("y", [], greedy(8)))
    with pytest.raises(EngineError, match="'draft' is not available"):
        engine.add_request(Request("z", [5, 6], greedy(8), "draft", 3))
    engine.add_request(Request("a", [5, 6], greedy(4)))
    with pytest.raises(CapacityError, match="queue full"):
        engine.add_request(Request("b", [5, 6], greedy(4)))


def test_cancellation_frees_the_slot(tiny_llama, tiny_llama_draft):
    engine = make_engine(tiny_llama, tiny_llama_draft, slots=2)
    prompts = random_prompts((5, 6, 7), seed=7)
    for r in requests(prompts, greedy(50), "draft", 3):
        engine.add_request(r)
    engine.step()
    engine.step()
    assert engine.load()["running"] == 2 and engine.load()["waiting"] == 1
    engine.abort("r0")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "r0"]
    assert aborted and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert "r2" in engine._running  # the freed slot went to the waiting request
    final = engine.run([])
    assert set(final) == {"r1", "r2"} and all(len(o.token_ids) == 50 for o in final.values())


def test_streaming_callback_sees_every_token_once(tiny_llama, tiny_llama_draft):
    seen: list[int] = []
    events = []

    def on_output(out):
        seen.extend(out.new_token_ids)
        events.append(out.finished)

    engine = make_engine(tiny_llama, tiny_llama_draft)
    req = Request("s", random_prompts((6,), seed=8)[0], greedy(25), "draft", 4, on_output)
    final = engine.run([req])["s"]
    assert seen == final.token_ids
    assert events[-1] is True and events.count(True) == 1 and len(events) > 3


def test_long_prefill_is_chunked_without_starving_decoders(tiny_llama):
    engine = make_engine(tiny_llama, max_len=192,
                         limits=EngineLimits(max_tokens_per_step=40, min_prefill_chunk=8))
    short = Request("short", [5, 6, 7], greedy(20))
    long = Request("long", list(range(3, 93)) + list(range(3, 63)), greedy(5))
    engine.add_request(short)
    engine.step()  # short is decoding now
    engine.add_request(long)
    steps_with_short_progress = 0
    while engine._running.get("long") is None or \
            engine._running["long"].cached < engine._running["long"].prompt_len:
        outs = engine.step()
        steps_with_short_progress += any(o.request_id == "short" for o in outs)
        if not engine.has_work():
            break
    assert steps_with_short_progress >= 3  # the decoder advanced during the 150-token prefill
    final = engine.run([])
    expected = plain_generate(load(tiny_llama), [long.prompt_ids], greedy(5)).token_ids[0]
    assert final["long"].token_ids == expected


def test_standby_requests_follow_the_batch_decision(tiny_llama, tiny_llama_draft):
    """A request admitted plain for lack of gain (a busy batch) is on standby: every row
    follows the batch's one decision per step, so a batch never mixes speculative and plain
    rows the policy could have matched (a mixed batch costs more than either pure one),
    and the row left alone speculates once the others finish; greedy output stays plain's."""
    from specdec.engine.assemble import AssembledEngine
    from specdec.policy.engine_policy import EnginePolicy
    from specdec.policy.settings import PolicySettings

    # No probes: this is about the batch's decision from given costs (probes: test_policy).
    policy = EnginePolicy(PolicySettings(explore_share=0.0, probe_interval_s=0))
    # A roofline target: a verify of 4 rows x k guesses costs 2-4 plain steps, of 1 row
    # none extra; a draft guess costs 0.3 of a plain step. Alone it pays, at 4 rows not.
    for t, s in ((1, 0.16), (2, 0.16), (4, 0.16), (8, 0.30), (16, 0.38), (24, 0.61),
                 (56, 1.37), (128, 2.30)):
        policy.step_cost.calibrate(t, s)
    for k, rows, s in ((2, 1, 0.10), (6, 1, 0.30), (2, 8, 0.25), (6, 8, 0.70)) * 2:
        policy.draft_round_cost.calibrate(k, rows, s)
    engine = make_engine(tiny_llama, tiny_llama_draft)
    engine.choose_k = policy.choose_k
    built = AssembledEngine(engine, None, None, policy, None, None)
    prompts = random_prompts((6, 7, 8, 9), seed=11)
    lengths = (14, 14, 14, 40)
    admitted = [built.submit(f"s{i}", p, greedy(n))
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    first, last = admitted[0][1], admitted[3][1]
    assert first.mode == "speculative"  # priced alone
    assert last.mode == "plain" and last.standby == "draft"  # priced in a batch of 4
    assert admitted[3][0].method == "draft" and admitted[3][0].k == 0
    assert not admitted[3][0].speculation.pins_k
    final = {}
    while engine.has_work():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    decode_steps = [r for r in engine.history if not r.prefill_tokens]
    assert all(r.draft_rows in (0, r.rows) for r in decode_steps)  # never a mixed batch
    assert all(r.draft_rows == 0 for r in decode_steps if r.rows == 4)
    assert any(r.draft_rows == 1 for r in decode_steps if r.rows == 1)
    assert final["s3"].spec.rounds > 0 and final["s0"].spec.rounds == 0
    plain = plain_generate(load(tiny_llama), prompts, greedy(40)).token_ids
    for i, n in enumerate(lengths):
        assert final[f"s{i}"].token_ids == plain[i][:n]
