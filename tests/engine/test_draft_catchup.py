"""The draft's catch-up on a long prompt, in sequential steps (the draft shares the target's
cores): a row that will draft from its first round has the draft take in each prompt chunk
in the step that prefills it, so its reply never stalls while the draft prefills; a row
that may never draft never pays the draft's prefill."""

from __future__ import annotations

from engine_helpers import greedy, make_engine, plain_reference, random_prompts

from specdec.engine.engine import EngineLimits
from specdec.engine.request import Request

CHUNK = 48


def _engine(target, draft, **kw):
    return make_engine(target, draft, slots=3, max_len=256,
                       limits=EngineLimits(max_tokens_per_step=CHUNK), **kw)


def test_a_drafting_row_is_caught_up_while_its_prompt_is_prefilled(tiny_llama, tiny_llama_draft):
    prompt = random_prompts((150,), seed=31)[0]
    engine = _engine(tiny_llama, tiny_llama_draft)
    out = engine.run([Request("long", prompt, greedy(20), "draft", 3)])["long"]
    assert out.error is None, out.error
    assert out.token_ids == plain_reference(tiny_llama, [prompt], 20)[0]
    assert out.spec.drafted > 0
    steps = list(engine.history)
    prefill_steps = [r for r in steps if r.prefill_tokens]
    assert len(prefill_steps) >= 3 and not any(r.overlapped for r in steps)
    # Each chunk taken in by the draft in the step that prefilled it, timed apart from
    # any round (no decode row drafted in these steps: no round time)...
    assert all(0 < r.prompt_catchup <= CHUNK and r.prompt_catchup_s > 0
               and r.prompt_catchup_rows == 1 for r in prefill_steps), prefill_steps
    assert not any(r.draft_model_s or r.draft_catchup for r in prefill_steps)
    assert sum(r.prompt_catchup for r in prefill_steps) == len(prompt)
    # ...so the first round has (almost) nothing left to catch up on.
    first_round = next(r for r in steps if r.draft_rows)
    assert first_round.draft_catchup <= 4, first_round


def test_a_row_that_may_never_draft_never_pays_the_drafts_prefill(tiny_llama, tiny_llama_draft):
    """On standby (auto, admitted plain) the row decodes plainly until the policy turns it
    speculative: the draft must not have prefilled its prompt meanwhile."""
    prompt = random_prompts((150,), seed=32)[0]
    engine = _engine(tiny_llama, tiny_llama_draft)
    engine.choose_k = lambda eng, req, spec, running, **_: 0
    out = engine.run([Request("standby", prompt, greedy(12), "draft", 0)])["standby"]
    assert out.token_ids == plain_reference(tiny_llama, [prompt], 12)[0]
    assert out.spec.drafted == 0
    assert not any(r.draft_catchup or r.draft_model_s or r.prompt_catchup
                   for r in engine.history)
    assert engine.proposers["draft"].held_prefix(prompt) == 0


def test_caught_up_rows_in_a_batch_say_what_plain_says(tiny_llama, tiny_llama_draft):
    """Rows caught up in the same batched draft call, beside a row on standby and a row
    already decoding: every one token-identical to plain."""
    prompts = random_prompts((130, 90, 20, 110), seed=33)
    engine = _engine(tiny_llama, tiny_llama_draft)
    reqs = [Request("a", prompts[0], greedy(16), "draft", 3),
            Request("b", prompts[1], greedy(16), "draft", 2),
            Request("c", prompts[2], greedy(16), "draft", 3),
            Request("d", prompts[3], greedy(16), "none", 0)]
    outs = engine.run(reqs)
    want = plain_reference(tiny_llama, prompts, 16)
    for r, w in zip(reqs, want, strict=True):
        assert outs[r.request_id].token_ids == w, r.request_id
    assert engine.proposers["draft"].held_prefix(prompts[3]) == 0
    # A step where the draft both took in a prompt chunk and drafted a round: the two
    # calls timed apart (the round's time alone prices a round).
    both = [r for r in engine.history if r.prompt_catchup and r.draft_rows]
    assert both, "no step mixed a prompt catch-up with a round"
    assert all(0 < r.draft_model_s and 0 < r.prompt_catchup_s
               and r.draft_model_s + r.prompt_catchup_s <= r.draft_s + 1e-9 for r in both)


def test_a_failed_catch_up_leaves_it_to_the_first_round(tiny_llama, tiny_llama_draft):
    """The draft's prompt catch-up fails: the row still says what plain says, and its first
    round catches up (and is priced as a catch-up), not believing the draft holds it."""
    prompt = random_prompts((150,), seed=34)[0]
    engine = _engine(tiny_llama, tiny_llama_draft)
    draft = engine.proposers["draft"]
    real = draft.propose

    def propose(inputs, *a, **kw):
        if any(i.catchup_only for i in inputs):
            raise RuntimeError("draft lost mid-prefill")
        return real(inputs, *a, **kw)

    draft.propose = propose
    out = engine.run([Request("long", prompt, greedy(12), "draft", 3)])["long"]
    assert out.token_ids == plain_reference(tiny_llama, [prompt], 12)[0]
    first_round = next(r for r in engine.history if r.draft_rows)
    assert first_round.draft_catchup >= len(prompt) - 1, first_round
