"""Faults inside one engine: a proposer that is down or fails, a step that raises. Nothing
hangs, the failure is counted where it belongs (not against acceptance), the requests of a
failed step end with the reason, and the engine serves the next request."""

from __future__ import annotations

import torch
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


class _RefusingGrammar:
    """A grammar state (GrammarState's interface, llguidance's mask layout) that allows
    every token until `after` tokens are out, then none (an exhausted or inconsistent
    grammar); like llguidance's matcher, taking a refused token raises."""

    def __init__(self, seq, vocab: int, after: int) -> None:
        self.seq, self.vocab, self.after = seq, vocab, after

    def _open(self) -> bool:
        return self.seq.generated < self.after

    def guesses_and_masks(self, guesses):
        words = (self.vocab + 31) // 32
        fill = -1 if self._open() else 0  # every bit set, or none
        return len(guesses), torch.full((len(guesses) + 1, words), fill, dtype=torch.int32)

    def accept(self, tokens):
        if tokens and not self._open():
            raise ValueError(f"token {tokens[0]} broke the grammar")


def test_a_row_whose_grammar_allows_nothing_fails_alone(tiny_llama, tiny_llama_draft):
    """Greedy and sampled: the row with no allowed token fails with that reason; the other
    requests of the same steps finish with the tokens they would have had alone."""
    from specdec.model.step.sampling import SamplingParams
    from specdec.spec_decode.target_runner import NO_TOKEN

    prompts = random_prompts((8, 10, 12), seed=61)
    for temperature in (0.0, 0.8):
        engine = make_engine(tiny_llama, tiny_llama_draft)
        params = SamplingParams(temperature=temperature, seed=5, max_tokens=12,
                                ignore_eos=True)
        alone = engine.run(requests(prompts[1:], params, "draft", 3, prefix="alone"))
        engine.add_request(Request("bad", prompts[0], params, "draft", 3))
        for i, p in enumerate(prompts[1:]):
            engine.add_request(Request(f"ok{i}", p, params, "draft", 3))
        engine.step()
        bad = engine._running["bad"]
        bad.grammar = _RefusingGrammar(bad, engine.vocab_size, after=2)
        final = {}
        while engine.has_work():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        assert final["bad"].finish_reason == "error"
        assert final["bad"].error == NO_TOKEN
        for i in range(len(prompts) - 1):
            assert final[f"ok{i}"].error is None, final[f"ok{i}"]
            assert final[f"ok{i}"].token_ids == alone[f"alone{i}"].token_ids
