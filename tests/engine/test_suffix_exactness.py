"""Suffix speculation through the engine (fp32, tiny fixture models): greedy output equals
plain decoding token for token while the index guesses from other requests (often wrongly),
and sampled output keeps the target's distribution while the index changes between rounds
as other requests finish."""

from __future__ import annotations

from engine_helpers import (
    BIG_QUEUE,
    contingency_pvalue,
    first_three_counts,
    greedy,
    make_engine,
    plain_reference,
    random_prompts,
)

from specdec.engine.request import Request
from specdec.spec_decode.suffix import SuffixProposer


def _engine(target, slots=8, **suffix):
    return make_engine(target, slots=slots, limits=BIG_QUEUE,
                       suffix=SuffixProposer(**{"min_count": 1, **suffix}))


def test_greedy_suffix_guesses_from_other_requests_are_token_identical(tiny_llama):
    # Requests that repeat the same spans in different orders: whatever one learned, the
    # others find, continued differently (wrong guesses) as often as alike.
    spans = random_prompts((7, 5, 9, 6), seed=4)
    prompts = [spans[0] + spans[1] + spans[2], spans[1] + spans[0] + spans[3],
               spans[2] + spans[1] + spans[0], spans[3] + spans[3] + spans[1],
               spans[0] + spans[2], spans[1] + spans[3] + spans[0] + spans[2]]
    expected = plain_reference(tiny_llama, prompts, 32)
    engine = _engine(tiny_llama, slots=3)  # fewer slots: later requests learn from earlier
    out = engine.run([Request(f"r{i}", p, greedy(32), "suffix", 4)
                      for i, p in enumerate(prompts)])
    for i, e in enumerate(expected):
        assert out[f"r{i}"].token_ids == e, f"request {i}"
    spec = engine.totals["suffix"]
    assert spec.accepted > 0, "no guess was ever kept: weak test"
    assert spec.accepted < spec.drafted, "every guess was kept: rejections untested"
    assert engine.proposers["suffix"].stats["from_index"] > 0


def test_a_second_request_speculates_from_the_first_ones_output(tiny_llama):
    prompt = random_prompts((8,), seed=9)[0]
    engine = _engine(tiny_llama)
    first = engine.run([Request("a", prompt, greedy(40), "none", 0)])["a"]
    # The same prompt again: the first reply, learned when it finished, is guessed whole.
    again = engine.run([Request("b", prompt, greedy(40), "suffix", 6)])["b"]
    assert again.token_ids == first.token_ids
    spec = engine.totals["suffix"]
    assert spec.accepted >= 30 and spec.rounds <= 12, spec


def test_shared_off_guesses_only_from_the_request_itself(tiny_llama):
    prompt = random_prompts((8,), seed=9)[0]
    engine = _engine(tiny_llama, shared=False)
    engine.run([Request("a", prompt, greedy(40), "none", 0)])
    engine.run([Request("b", prompt, greedy(40), "suffix", 6)])
    assert engine.proposers["suffix"].stats["from_index"] == 0


def test_sampled_suffix_keeps_the_target_distribution(tiny_llama):
    """Every request has the same prompt: each one finished teaches the index a sampled
    continuation, which the next ones are offered as guesses (one-hot q) and mostly refuse."""
    n = 3000
    spec_counts, engine = first_three_counts(lambda: _engine(tiny_llama), "suffix", 2, n, 1.0)
    plain_counts, _ = first_three_counts(lambda: make_engine(tiny_llama, limits=BIG_QUEUE),
                                         "none", 0, n, 1.0)
    spec = engine.totals["suffix"]
    assert spec.drafted > n // 2, spec
    assert 0 < spec.accepted < spec.drafted, spec
    assert contingency_pvalue(spec_counts, plain_counts) > 1e-3


def test_plain_rows_verify_free_guesses_token_identical(tiny_llama):
    """Rows the policy decodes plainly verify the index's confident guesses (free: no
    forward makes them); an explicit plain request (k pinned at 0) never does."""
    spans = random_prompts((9, 6, 8), seed=5)
    prompts = [spans[0] + spans[1], spans[1] + spans[0], spans[0] + spans[1],
               spans[2] + spans[0] + spans[1]]
    expected = plain_reference(tiny_llama, prompts, 32)
    engine = _engine(tiny_llama, slots=2, plain_rows_k=4)
    out = engine.run([Request(f"r{i}", p, greedy(32), "none", 0)
                      for i, p in enumerate(prompts)])
    for i, e in enumerate(expected):
        assert out[f"r{i}"].token_ids == e, f"request {i}"
    free = engine.totals["suffix"]
    assert free.accepted > 0 and free.rounds > 0, free
    assert all(o.spec.drafted == 0 for o in out.values())  # the request's own: plain
    pinned = _engine(tiny_llama, plain_rows_k=4)
    pinned.run([Request("a", prompts[0], greedy(32), "none", 0)])
    pinned.run([Request.pinned("b", prompts[0], greedy(32), "none", 0)])
    assert pinned.totals["suffix"].drafted == 0


def test_sampled_plain_rows_with_free_guesses_keep_the_target_distribution(tiny_llama):
    n = 3000
    counts, engine = first_three_counts(lambda: _engine(tiny_llama, plain_rows_k=2), "none",
                                        0, n, 1.0)
    plain_counts, _ = first_three_counts(lambda: make_engine(tiny_llama, limits=BIG_QUEUE),
                                         "none", 0, n, 1.0)
    free = engine.totals["suffix"]
    assert free.drafted > n // 4 and 0 < free.accepted < free.drafted, free
    assert contingency_pvalue(counts, plain_counts) > 1e-3
