"""Faults inside one engine: a proposer that is down or fails, a step that raises. Nothing
hangs, the failure is counted where it belongs (not against acceptance), the requests of a
failed step end with the reason, and the engine serves the next request."""

from __future__ import annotations

from engine_helpers import greedy, make_engine, random_prompts, requests

from specdec.engine.request import Request
from specdec.model.step.generate import plain_generate


def plain(target, prompt, n):
    from engine_helpers import load

    return plain_generate(load(target), [prompt], greedy(n)).token_ids[0]


def test_a_draft_that_is_down_counts_no_failed_guesses_and_speculation_resumes(
        tiny_llama, tiny_llama_draft):
    engine = make_engine(tiny_llama, tiny_llama_draft)
    draft = engine.proposers["draft"]
    prompt = random_prompts((6,), seed=4)[0]
    engine.add_request(Request.pinned("r", prompt, greedy(60), "draft", 3))
    for _ in range(3):
        engine.step()
    draft.available = False           # an outage: the engine must not even ask
    for _ in range(8):
        engine.step()
    during = engine._running["r"].spec
    assert during.empty_proposals == 0 and during.plain_steps >= 8
    rounds_before = during.rounds
    draft.available = True            # back
    out = engine.run([])["r"]
    assert out.spec.rounds > rounds_before and out.spec.empty_proposals == 0
    assert out.token_ids == plain(tiny_llama, prompt, 60)


def test_a_proposer_that_raises_costs_a_plain_round_not_acceptance(tiny_llama, tiny_llama_draft):
    engine = make_engine(tiny_llama, tiny_llama_draft)
    draft = engine.proposers["draft"]
    real, calls = draft.propose, []

    def flaky(inputs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("draft actor died")
        return real(inputs)

    draft.propose = flaky
    prompt = random_prompts((7,), seed=5)[0]
    out = engine.run([Request.pinned("r", prompt, greedy(40), "draft", 3)])["r"]
    assert out.finish_reason == "length" and out.spec.empty_proposals == 0
    assert out.spec.plain_steps >= 1 and out.token_ids == plain(tiny_llama, prompt, 40)


def test_a_step_that_raises_fails_its_requests_and_the_engine_serves_on(tiny_llama,
                                                                       tiny_llama_draft):
    engine = make_engine(tiny_llama, tiny_llama_draft, slots=4)
    target_step, calls = engine.target.step, []

    def broken_once(rows):
        calls.append(1)
        if len(calls) == 4:
            raise ValueError("a bug in a forward")
        return target_step(rows)

    engine.target.step = broken_once
    reqs = requests(random_prompts((5, 6, 7), seed=6), greedy(30), "draft", 2)
    outs = engine.run(reqs)
    assert {o.finish_reason for o in outs.values()} == {"error"}
    assert all(o.error_kind == "internal" and "ValueError" in o.error for o in outs.values())
    assert engine.load()["running"] == 0 and engine.load()["free_slots"] == 4
    again = engine.run([Request("next", [5, 6, 7], greedy(12), "draft", 2)])["next"]
    assert again.finish_reason == "length" and again.token_ids == plain(tiny_llama, [5, 6, 7], 12)
