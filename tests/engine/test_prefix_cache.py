"""The prefix cache in the engine: every way a request meets it (hit, miss, partial hit,
eviction, a prefix shared by requests running together, an aborted prefill, a rolled-back
speculative tail, a full slot) gives the tokens the cache-free engine gives, in fp32, and
the cache really was used (or not) as the case says."""

from __future__ import annotations

import collections

import pytest
from engine_helpers import contingency_pvalue, greedy, make_engine, random_prompts

from specdec.engine.engine import EngineLimits
from specdec.engine.request import Request
from specdec.model.step.prefix_cache import COPY_MIN_TOKENS
from specdec.model.step.sampling import SamplingParams

METHODS = [("none", 0), ("draft", 3), ("ngram", 2)]


def _pair(target, draft, slots=4, max_len=192, step_budget=512, **kw):
    """The same engine with the cache and without it."""
    return [make_engine(target, draft, slots=slots, max_len=max_len,
                        limits=EngineLimits(prefix_cache=on, max_tokens_per_step=step_budget,
                                            max_waiting=10**5),
                        **kw) for on in (True, False)]


def _run(engine, rid, prompt, method="none", k=0, params=None):
    out = engine.run([Request(rid, prompt, params or greedy(16), method, k)])[rid]
    assert out.error is None, out.error
    return out


@pytest.mark.parametrize("method,k", METHODS)
def test_a_conversation_reuses_its_history_and_says_the_same(tiny_llama, tiny_llama_far_draft,
                                                             method, k):
    on, off = _pair(tiny_llama, tiny_llama_far_draft)
    history = random_prompts((20,), seed=1)[0]
    for turn in range(4):
        a = _run(on, f"t{turn}", history, method, k)
        b = _run(off, f"t{turn}", history, method, k)
        assert a.token_ids == b.token_ids, turn
        assert b.cached_tokens == 0
        if turn:
            # Everything the last turn computed: its prompt and its output, but for the last
            # output token where it was never fed back (a round cut at max_tokens may have).
            assert len(history) - 6 <= a.cached_tokens <= len(history) - 5, turn
        history = history + a.token_ids + random_prompts((5,), seed=10 + turn)[0]
    assert on.prefixes.stats.hits == 3


def test_a_miss_and_a_partial_hit(tiny_llama):
    on, off = _pair(tiny_llama, None)
    p = random_prompts((30,), seed=2)[0]
    _run(on, "a", p)
    _run(off, "a", p)
    unrelated = [x % 90 + 4 for x in reversed(p)]
    assert _run(on, "b", unrelated).cached_tokens == 0
    # Most of what a slot holds (30 + 16 output tokens): continued in place.
    partial = p[:25] + random_prompts((9,), seed=3)[0]
    a, b = _run(on, "c", partial), _run(off, "c", partial)
    assert a.cached_tokens == 25 and a.token_ids == b.token_ids
    # A smaller share of a slot: copied out, the slot kept for its own conversation.
    copies = on.prefixes.stats.copies
    small = partial[:20] + [5, 6, 7]
    a, b = _run(on, "d", small), _run(off, "d", small)
    assert a.cached_tokens == 20 and a.token_ids == b.token_ids
    assert on.prefixes.stats.copies == copies + 1
    # A few tokens in common are recomputed, not worth giving up a slot for.
    tiny = partial[:5] + [9, 9, 9, 9]
    assert _run(on, "e", tiny).cached_tokens == 0


def test_eviction_under_pressure_keeps_the_most_recent(tiny_llama):
    on, off = _pair(tiny_llama, None, slots=2)
    prompts = random_prompts((16, 17, 18, 19), seed=4)
    for i, p in enumerate(prompts):
        assert _run(on, f"p{i}", p).token_ids == _run(off, f"p{i}", p).token_ids
    assert on.prefixes.stats.evictions == 2
    # The first two were evicted by the last two; the last one is still held.
    first, last = prompts[0] + [5, 6], prompts[3] + [5, 6]
    a, b = _run(on, "again0", first), _run(off, "again0", first)
    assert a.cached_tokens == 0 and a.token_ids == b.token_ids
    a, b = _run(on, "again3", last), _run(off, "again3", last)
    assert a.cached_tokens == len(prompts[3]) and a.token_ids == b.token_ids


@pytest.mark.parametrize("method,k", METHODS[:2])
def test_a_prefix_shared_by_requests_running_together(tiny_llama, tiny_llama_draft, method, k):
    """The same system prompt, sent by three clients at once: with prefills chunked, the
    later ones copy what the first one computed instead of computing it again."""
    on, off = _pair(tiny_llama, tiny_llama_draft, step_budget=32)
    system = random_prompts((3 * COPY_MIN_TOKENS + 7,), seed=5)[0]
    tails = random_prompts((6, 9, 4), seed=6)
    for engine in (on, off):
        outs = engine.run([Request(f"c{i}", system + t, greedy(12), method, k)
                           for i, t in enumerate(tails)])
        engine.result = {rid: o.token_ids for rid, o in outs.items()}
        engine.cached = sum(o.cached_tokens for o in outs.values())
    assert on.result == off.result
    assert on.prefixes.stats.copies >= 1 and on.cached >= 2 * COPY_MIN_TOKENS
    assert off.cached == 0


def test_an_aborted_prefill_leaves_what_it_computed(tiny_llama):
    on, off = _pair(tiny_llama, None, step_budget=32)
    prompt = random_prompts((120,), seed=7)[0]
    on.add_request(Request("gone", prompt, greedy(8)))
    on.step()
    on.step()                       # two chunks of 32 computed
    on.abort("gone")
    assert [o.finish_reason for o in on.step()] == ["abort"]
    a, b = _run(on, "again", prompt), _run(off, "again", prompt)
    assert a.cached_tokens == 64 and a.token_ids == b.token_ids


def test_a_rejected_speculative_tail_is_never_held_as_context(tiny_llama, tiny_llama_far_draft):
    on, off = _pair(tiny_llama, tiny_llama_far_draft)
    prompt = random_prompts((14,), seed=8)[0]
    a = _run(on, "spec", prompt, "draft", 4, greedy(24))
    assert a.spec.rejections > 0          # guesses were rolled back
    slot_tokens = prompt + a.token_ids
    held = [list(on.prefixes.held(s)) for s in range(4)]
    kept = next(h for h in held if h)
    assert kept == slot_tokens[: len(kept)] and len(kept) == len(slot_tokens) - 1
    follow = slot_tokens + [7, 8, 9]
    assert _run(on, "next", follow, "draft", 4).token_ids == \
        _run(off, "next", follow, "draft", 4).token_ids


def test_a_slot_filled_to_max_len_is_reused(tiny_llama):
    on, off = _pair(tiny_llama, None, max_len=64)
    prompt = random_prompts((40,), seed=9)[0]
    first = _run(on, "full", prompt, params=greedy(24))       # 40 + 24 = max_len
    _run(off, "full", prompt, params=greedy(24))
    follow = (prompt + first.token_ids)[:50] + [11, 12]
    a, b = _run(on, "next", follow, params=greedy(12)), _run(off, "next", follow,
                                                              params=greedy(12))
    assert a.cached_tokens == 50 and a.token_ids == b.token_ids


def test_a_batch_of_follow_ups_and_new_requests(tiny_llama, tiny_llama_draft):
    on, off = _pair(tiny_llama, tiny_llama_draft, slots=6)
    firsts = random_prompts((12, 20), seed=11)
    prev = {}
    for engine in (on, off):
        prev[engine] = [_run(engine, f"f{i}", p).token_ids for i, p in enumerate(firsts)]
    assert prev[on] == prev[off]
    batch = [firsts[0] + prev[on][0] + [3, 4], random_prompts((15,), seed=12)[0],
             firsts[1] + prev[on][1] + [9], random_prompts((7,), seed=13)[0]]
    outs = {}
    for engine in (on, off):
        got = engine.run([Request(f"b{i}", p, greedy(16), "draft", 2)
                          for i, p in enumerate(batch)])
        outs[engine] = {rid: o.token_ids for rid, o in got.items()}
        engine.cached = [got[f"b{i}"].cached_tokens for i in range(4)]
    assert outs[on] == outs[off]
    assert on.cached[0] > 12 and on.cached[2] > 20 and on.cached[1] == on.cached[3] == 0


def test_sampled_tokens_keep_their_distribution_over_a_cached_prefix(tiny_llama,
                                                                     tiny_llama_far_draft):
    """Requests whose whole prompt but one token comes from the cache draw their first three
    tokens from the distribution the cache-free engine draws them from (chi-square)."""
    prompt = random_prompts((40,), seed=14)[0]
    n = 1500
    counts, reused = [], []
    for engine in _pair(tiny_llama, tiny_llama_far_draft, slots=16, max_len=48):
        reqs = [Request(f"s{i}", prompt, SamplingParams(temperature=1.0, max_tokens=4,
                                                        ignore_eos=True),
                        "draft", 2) for i in range(n)]
        outs = engine.run(reqs)
        counts.append(collections.Counter(tuple(o.token_ids[:3]) for o in outs.values()))
        reused.append(sum(o.cached_tokens for o in outs.values()))
    assert reused[0] >= (n - 16) * (len(prompt) - 1) and reused[1] == 0
    assert contingency_pvalue(counts[0], counts[1]) > 1e-3


def test_the_draft_reuses_its_own_prefix_after_a_plain_stretch(tiny_llama, tiny_llama_draft):
    """A request that ran plain for a while, then speculated: the draft caught up on the
    plain stretch, and the next turn costs the draft only its new tokens."""
    on, off = _pair(tiny_llama, tiny_llama_draft)
    for engine in (on, off):
        engine.choose_k = lambda eng, req, spec, running, **_: 3 if spec.plain_steps >= 6 else 0
    prompt = random_prompts((18,), seed=15)[0]
    a = _run(on, "first", prompt, "draft", 3, greedy(20))
    b = _run(off, "first", prompt, "draft", 3, greedy(20))
    assert a.token_ids == b.token_ids and a.spec.drafted > 0
    draft = on.proposers["draft"]
    follow = prompt + a.token_ids + [5, 6]
    assert draft.held_prefix(follow) >= len(prompt) + 6   # the catch-up is held too
    before = draft.prefixes.stats.tokens_reused
    a2, b2 = _run(on, "second", follow, "draft", 3), _run(off, "second", follow, "draft", 3)
    assert a2.token_ids == b2.token_ids
    assert draft.prefixes.stats.tokens_reused - before >= len(prompt) + 6
