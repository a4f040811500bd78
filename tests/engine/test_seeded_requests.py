"""A seeded request gives the same tokens whatever decoded it: plain or speculative, any k,
any draft, overlap, alone or in a batch, again and again; and those tokens are exact draws
from the target (fp32, tiny fixture models)."""

from __future__ import annotations

import collections

import pytest
from engine_helpers import (
    BIG_QUEUE,
    contingency_pvalue,
    first_three_counts,
    load,
    make_engine,
    random_prompts,
)

from specdec.engine.request import Request
from specdec.model.step import seeded
from specdec.model.step.generate import plain_generate
from specdec.model.step.sampling import SamplingParams
from specdec.spec_decode import target_runner

WARPS = {"plain": dict(temperature=0.9), "cut": dict(temperature=1.1, top_p=0.9, top_k=20)}


@pytest.mark.parametrize("warp", sorted(WARPS))
def test_a_seeded_request_gives_the_same_tokens_however_it_is_decoded(tiny_llama,
                                                                      tiny_llama_draft, warp):
    prompt, other = random_prompts((7, 11), seed=41)
    params = SamplingParams(max_tokens=28, ignore_eos=True, seed=1234, **WARPS[warp])
    reference = plain_generate(load(tiny_llama), [prompt], params).token_ids[0]
    busy = SamplingParams(temperature=1.0, max_tokens=28, ignore_eos=True)
    runs = {}
    engine = make_engine(tiny_llama, tiny_llama_draft)
    for method, k in (("none", 0), ("draft", 1), ("draft", 2), ("draft", 4), ("ngram", 3)):
        runs[f"{method} k={k}"] = engine.run(
            [Request.pinned("a", prompt, params, method, k)])["a"].token_ids
    # Beside other traffic (its k and batch then change step by step), and again after it,
    # from the prefix cache.
    mixed = engine.run([Request("a", prompt, params, "draft", 3),
                        Request("b", other, busy, "draft", 5),
                        Request("c", prompt + other, busy, "none", 0)])
    runs["busy"] = mixed["a"].token_ids
    runs["again"] = engine.run([Request("a", prompt, params, "draft", 2)])["a"].token_ids
    overlapped = make_engine(tiny_llama, tiny_llama_draft, overlap="on")
    runs["overlap"] = overlapped.run([Request("a", prompt, params, "draft", 3),
                                      Request("b", other, busy, "draft", 3)])["a"].token_ids
    for name, tokens in runs.items():
        assert tokens == reference, name
    spec = engine.totals["draft"]
    assert 0 < spec.accepted < spec.drafted, "guesses both kept and replaced: a real test"
    other_seed = dict(params.__dict__, seed=99)
    assert plain_generate(load(tiny_llama), [prompt],
                          SamplingParams(**other_seed)).token_ids[0] != reference


def test_seeded_tokens_are_exact_draws_from_the_target(tiny_llama, tiny_llama_far_draft):
    """Over many seeds, the first three tokens of seeded speculative requests are
    distributed as unseeded plain sampling's (chi-square on triples and on each position)."""
    n = 3000

    def factory():
        return make_engine(tiny_llama, tiny_llama_far_draft, slots=64, max_len=16,
                           limits=BIG_QUEUE)

    plain, _ = first_three_counts(factory, "none", 0, n, 1.0)
    raced, engine = first_three_counts(factory, "draft", 2, n, 1.0, seed0=10**6)
    spec = engine.totals["draft"]
    assert 0 < spec.accepted < spec.drafted
    assert contingency_pvalue(plain, raced) > 1e-3
    for j in range(3):
        pm, rm = collections.Counter(), collections.Counter()
        for c, src in ((pm, plain), (rm, raced)):
            for key, v in src.items():
                c[key[j]] += v
        assert contingency_pvalue(pm, rm) > 1e-3, f"position {j}"


def test_a_key_that_ignores_the_position_is_caught(monkeypatch, tiny_llama,
                                                   tiny_llama_far_draft):
    """The wrong shortcut, one race per request instead of one per position, makes the
    tokens of a request depend on each other: the triples' test above sees it."""
    real = seeded.race_key

    def same_key(seed, position):
        return real(seed, 0)

    for module in (seeded, target_runner):
        monkeypatch.setattr(module, "race_key", same_key)
    n = 3000

    def factory():
        return make_engine(tiny_llama, tiny_llama_far_draft, slots=64, max_len=16,
                           limits=BIG_QUEUE)

    plain, _ = first_three_counts(factory, "none", 0, n, 1.0)
    raced, _ = first_three_counts(factory, "draft", 2, n, 1.0, seed0=10**6)
    assert contingency_pvalue(plain, raced) < 1e-3
