"""Speculative decoding through the engine gives the target's output: token-identical under
greedy decoding, the same distribution under sampling (fp32, tiny fixture models)."""

from __future__ import annotations

import collections

import pytest
from engine_helpers import (
    BIG_QUEUE,
    contingency_pvalue,
    first_three_counts,
    greedy,
    make_engine,
    plain_reference,
    random_prompts,
    requests,
)

from specdec.engine.request import Request
from specdec.model.step.sampling import SamplingParams
from specdec.spec_decode.proposers import DraftModelProposer

PROMPT_LENGTHS = (5, 9, 14, 3)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tiny_llama, tiny_llama_draft, tiny_qwen2, tiny_qwen2_draft):
    return (tiny_llama, tiny_llama_draft) if request.param == "llama" else \
        (tiny_qwen2, tiny_qwen2_draft)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("draft_sampling", ["probabilistic", "greedy"])
def test_greedy_draft_speculation_is_token_identical(pair, k, draft_sampling):
    target, draft = pair
    prompts = random_prompts(PROMPT_LENGTHS, seed=k)
    expected = plain_reference(target, prompts)
    engine = make_engine(target, draft, draft_sampling=draft_sampling)
    out = engine.run(requests(prompts, greedy(), "draft", k))
    for i, e in enumerate(expected):
        assert out[f"r{i}"].token_ids == e, f"prompt {i}, k={k}"
    spec = engine.totals["draft"]
    assert spec.rounds > 0 and spec.accepted > 0, "no draft token was ever kept: weak test"
    assert spec.accepted < spec.drafted, "every draft token was kept: rejections untested"


def test_draft_with_a_limited_vocabulary_stays_exact(pair):
    target, draft = pair
    prompts = random_prompts(PROMPT_LENGTHS, seed=21)
    expected = plain_reference(target, prompts)
    for sampling in ("probabilistic", "greedy"):
        engine = make_engine(target, draft, draft_sampling=sampling, draft_vocab_limit=60)
        out = engine.run(requests(prompts, greedy(), "draft", 3))
        for i, e in enumerate(expected):
            assert out[f"r{i}"].token_ids == e
        assert engine.totals["draft"].accepted > 0


@pytest.mark.parametrize("draft_sampling", ["probabilistic", "greedy"])
def test_draft_confidence_stop_stays_exact_and_shortens_proposals(pair, draft_sampling):
    target, draft = pair
    prompts = random_prompts(PROMPT_LENGTHS, seed=33)
    expected = plain_reference(target, prompts)
    k = 6
    engine = make_engine(target, draft, draft_sampling=draft_sampling, draft_confidence=0.1)
    out = engine.run(requests(prompts, greedy(), "draft", k))
    for i, e in enumerate(expected):
        assert out[f"r{i}"].token_ids == e, f"prompt {i}"
    spec = engine.totals["draft"]
    # Some rounds stopped early and some went on: both paths of the stop were taken.
    assert spec.rounds <= spec.drafted - 1 and spec.drafted < k * spec.rounds
    assert spec.accepted > 0


def test_ngram_speculation_is_token_identical(pair):
    target, _ = pair
    # Repetitive prompts so prompt lookup finds matches.
    base = random_prompts((6, 4), seed=3)
    prompts = [base[0] * 3, base[1] * 4 + base[0]]
    expected = plain_reference(target, prompts, 32)
    engine = make_engine(target)
    out = engine.run(requests(prompts, greedy(32), "ngram", 3))
    for i, e in enumerate(expected):
        assert out[f"r{i}"].token_ids == e
    assert engine.totals["ngram"].rounds > 0


def test_mixed_batch_plain_draft_ngram_at_once(pair):
    target, draft = pair
    prompts = random_prompts((4, 8, 12, 6, 10, 7), seed=11)
    expected = plain_reference(target, prompts)
    engine = make_engine(target, draft, slots=4)  # fewer slots than requests: queueing too
    methods = [("none", 0), ("draft", 3), ("ngram", 2), ("draft", 5), ("none", 0), ("draft", 1)]
    reqs = [Request(f"r{i}", p, greedy(), m, k)
            for i, (p, (m, k)) in enumerate(zip(prompts, methods, strict=True))]
    out = engine.run(reqs)
    for i, e in enumerate(expected):
        assert out[f"r{i}"].token_ids == e, f"request {i} ({methods[i]})"


@pytest.mark.parametrize("draft_sampling,temperature,draft_fixture,confidence,q_top_m", [
    # A draft that often disagrees, so rejections (and the residual draw) are common.
    ("probabilistic", 1.0, "tiny_llama_far_draft", None, None),
    # q = the draft's top-4 distribution, renormalized (what crosses the wire): exact too.
    ("probabilistic", 1.0, "tiny_llama_far_draft", None, 4),
    # One-hot q from a greedy draft: the close draft keeps acceptance reasonable.
    ("greedy", 0.8, "tiny_llama_draft", None, None),
    # Proposal lengths that depend on the draft's own sampled guesses.
    ("probabilistic", 1.0, "tiny_llama_far_draft", 0.05, 16),
])
@pytest.mark.parametrize("vocab_limit", [None, 60])
def test_sampled_first_three_tokens_follow_plain_distribution(tiny_llama, draft_sampling,
                                                              temperature, draft_fixture,
                                                              confidence, q_top_m, vocab_limit,
                                                              request):
    n = 4000
    draft = request.getfixturevalue(draft_fixture)

    def factory():
        return make_engine(tiny_llama, draft, slots=64, max_len=16,
                           draft_sampling=draft_sampling, limits=BIG_QUEUE,
                           draft_vocab_limit=vocab_limit, draft_confidence=confidence,
                           q_top_m=q_top_m)

    plain, _ = first_three_counts(factory, "none", 0, n, temperature)
    spec, engine = first_three_counts(factory, "draft", 2, n, temperature)
    spec_totals = engine.totals["draft"]
    assert spec_totals.accepted > 0.05 * spec_totals.drafted
    assert len(spec_totals.accepted_per_position) == 2 and spec_totals.accepted_per_position[1]
    if confidence is not None:  # the stop cut some proposals short, not all
        assert spec_totals.rounds < spec_totals.drafted < 2 * spec_totals.rounds
    assert contingency_pvalue(plain, spec) > 1e-3
    # Marginals per position too (more power per position than the sparse joint).
    for j in range(3):
        pm = collections.Counter()
        sm = collections.Counter()
        for c, src in ((pm, plain), (sm, spec)):
            for toks, cnt in src.items():
                c[toks[j]] += cnt
        assert contingency_pvalue(pm, sm) > 1e-3, f"position {j}"


def test_contingency_check_catches_the_draft_distribution(tiny_llama, tiny_llama_far_draft):
    """The same check tells the target's sampling from the draft's: it has power."""
    n = 3000

    def target_engine():
        return make_engine(tiny_llama, slots=64, max_len=16, limits=BIG_QUEUE)

    def draft_as_target():
        return make_engine(tiny_llama_far_draft, slots=64, max_len=16, limits=BIG_QUEUE)

    a, _ = first_three_counts(target_engine, "none", 0, n, 1.0)
    b, _ = first_three_counts(draft_as_target, "none", 0, n, 1.0)
    pooled = [collections.Counter() for _ in range(2)]
    for c, src in zip(pooled, (a, b), strict=True):
        for toks, cnt in src.items():
            c[toks[0]] += cnt
    assert contingency_pvalue(*pooled) < 1e-3


def test_greedy_rows_stay_exact_next_to_sampled_rows(pair):
    target, draft = pair
    prompts = random_prompts((5, 9, 7, 6), seed=31)
    expected = plain_reference(target, prompts[:2])
    engine = make_engine(target, draft)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=3)
    reqs = requests(prompts[:2], greedy(), "draft", 4) + \
        [Request(f"s{i}", p, sampled, "draft", 3) for i, p in enumerate(prompts[2:])]
    out = engine.run(reqs)
    assert [out["r0"].token_ids, out["r1"].token_ids] == expected


class _UnnormalizedTopM(DraftModelProposer):
    """A wrong shortcut: sample from the top-m distribution, but send the draft's full
    probabilities of those ids as q (not the renormalized ones the guess was drawn from)."""

    def _top_m(self, probs):
        ids, renormalized = super()._top_m(probs)
        self._raw = probs.gather(1, ids)
        return ids, renormalized

    def propose(self, inputs):
        out = super().propose(inputs)
        for p in out:
            if p.q_probs is not None:
                p.q_probs = p.q_probs * self._raw[0].sum()  # no longer sums to 1
        return out


def test_truncated_q_must_be_the_distribution_sampled_from(tiny_llama, tiny_llama_far_draft):
    """The check that passes for top-m q catches a q that is not what the draft sampled."""
    n = 4000

    def factory(cls):
        return lambda: make_engine(tiny_llama, tiny_llama_far_draft, slots=64, max_len=16,
                                   limits=BIG_QUEUE, q_top_m=4, proposer_cls=cls)

    plain, _ = first_three_counts(factory(DraftModelProposer), "none", 0, n, 1.0)
    wrong, _ = first_three_counts(factory(_UnnormalizedTopM), "draft", 2, n, 1.0)
    pm, wm = collections.Counter(), collections.Counter()
    for c, src in ((pm, plain), (wm, wrong)):
        for toks, cnt in src.items():
            c[toks[1]] += cnt
    assert contingency_pvalue(pm, wm) < 1e-3
