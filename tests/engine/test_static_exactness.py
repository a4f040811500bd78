"""The exactness suite through the static step (fixed buffers, padded buckets): greedy
speculation token-identical to plain decoding, sampled speculation distributed as plain
sampling, and a static step whose padding leaks into a real slot caught by the same checks."""

from __future__ import annotations

import collections
import os

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
from specdec.model.step.static_step import StepBuffers

PROMPT_LENGTHS = (5, 9, 14)  # three rows: a bucket of four, one row padded
# static here; the GPU check runs the same suite with SPECDEC_TEST_STEP=captured on CUDA.
STEP = os.environ.get("SPECDEC_TEST_STEP", "static")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tiny_llama, tiny_llama_draft, tiny_qwen2, tiny_qwen2_draft):
    return (tiny_llama, tiny_llama_draft) if request.param == "llama" else \
        (tiny_qwen2, tiny_qwen2_draft)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("draft_sampling", ["probabilistic", "greedy"])
def test_static_greedy_speculation_is_token_identical(pair, k, draft_sampling):
    target, draft = pair
    prompts = random_prompts(PROMPT_LENGTHS, seed=k)
    expected = plain_reference(target, prompts)
    engine = make_engine(target, draft, draft_sampling=draft_sampling, step=STEP)
    out = engine.run(requests(prompts, greedy(), "draft", k))
    for i, e in enumerate(expected):
        assert out[f"r{i}"].token_ids == e, f"prompt {i}, k={k}"
    spec = engine.totals["draft"]
    assert 0 < spec.accepted < spec.drafted, "no rejections or no acceptances: weak test"
    assert engine.target.model.static_steps > 0
    # The draft drafted in loops (specdec/model/step/draft_loop.py), not step by step.
    assert engine.proposers["draft"].model.loop_rounds > 0


def _mixed(target, draft, step):
    """Plain, draft and n-gram rows in one batch: ragged query lengths padded to k + 1."""
    prompts = random_prompts((6, 11, 4, 8), seed=5)
    reqs = [Request("plain", prompts[0], greedy(), "none", 0),
            Request("draft3", prompts[1], greedy(), "draft", 3),
            Request("draft1", prompts[2], greedy(), "draft", 1),
            Request("ngram", prompts[3], greedy(), "ngram", 2)]
    engine = make_engine(target, draft, step=step)
    return engine.run(reqs), plain_reference(target, prompts)


def test_static_mixed_batch_plain_draft_ngram_at_once(pair):
    out, expected = _mixed(*pair, STEP)
    for rid, e in zip(["plain", "draft3", "draft1", "ngram"], expected, strict=True):
        assert out[rid].token_ids == e, rid


def test_padding_written_into_a_real_slot_is_caught(pair, monkeypatch):
    """The wrong shortcut (padded tokens writing slot 0 instead of the scratch slot) must
    make the identity check fail: it has power."""
    init = StepBuffers.__init__

    def leaky(self, bucket, scratch_slot, device):
        init(self, bucket, scratch_slot, device)
        self.scratch = 0

    monkeypatch.setattr(StepBuffers, "__init__", leaky)
    out, expected = _mixed(*pair, STEP)
    assert any(out[rid].token_ids != e
               for rid, e in zip(["plain", "draft3", "draft1", "ngram"], expected, strict=True))


def test_static_sampled_first_three_tokens_follow_plain_distribution(tiny_llama,
                                                                     tiny_llama_far_draft):
    n = 4000

    def factory(step):
        return lambda: make_engine(tiny_llama, tiny_llama_far_draft, slots=64, max_len=16,
                                   limits=BIG_QUEUE, step=step)

    plain, _ = first_three_counts(factory("eager"), "none", 0, n, 1.0)
    spec, engine = first_three_counts(factory(STEP), "draft", 2, n, 1.0)
    totals = engine.totals["draft"]
    assert totals.accepted > 0.05 * totals.drafted
    assert engine.target.model.static_steps > 0
    assert contingency_pvalue(plain, spec) > 1e-3
    for j in range(3):
        pm, sm = collections.Counter(), collections.Counter()
        for c, src in ((pm, plain), (sm, spec)):
            for toks, cnt in src.items():
                c[toks[j]] += cnt
        assert contingency_pvalue(pm, sm) > 1e-3, f"position {j}"
