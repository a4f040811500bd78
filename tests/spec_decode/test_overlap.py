"""Drafting overlapped with verification (specdec/spec_decode/overlap.py) keeps the output
exactly the target's: token-identical under greedy decoding over many rejections and with
continuous batching, the same distribution under sampling; and a lost draft costs no
request. The wrong shortcut (a pre-drafted guess kept after the target disagreed) fails both checks."""

from __future__ import annotations

import collections
import threading
import time

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
from specdec.spec_decode.target_runner import Resolved


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tiny_llama, tiny_llama_far_draft, tiny_qwen2, tiny_qwen2_draft):
    # The llama pair disagrees often (a far draft): many rejections and dropped windows.
    return (tiny_llama, tiny_llama_far_draft) if request.param == "llama" else \
        (tiny_qwen2, tiny_qwen2_draft)


def keep_every_head(engine) -> None:
    """The wrong shortcut: a pre-drafted head guess is kept (and the guesses drafted after
    it are verified next) whatever the target's distribution says."""
    resolve = engine.target.resolve

    def wrong(heads):
        out = resolve(dict(heads))
        return {sid: Resolved(heads[sid].token, True) if heads.get(sid) is not None else r
                for sid, r in out.items()}

    engine.target.resolve = wrong


@pytest.mark.parametrize("k", [1, 2, 4, 6])
@pytest.mark.parametrize("draft_sampling", ["probabilistic", "greedy"])
def test_overlap_greedy_is_token_identical(pair, k, draft_sampling):
    target, draft = pair
    prompts = random_prompts((5, 9, 14, 3, 7, 11), seed=k)
    expected = plain_reference(target, prompts)
    # Fewer slots than requests: rows join and leave while others are mid-overlap.
    engine = make_engine(target, draft, slots=4, draft_sampling=draft_sampling, overlap="on")
    out = engine.run(requests(prompts, greedy(), "draft", k))
    for i, e in enumerate(expected):
        assert out[f"r{i}"].token_ids == e, f"prompt {i}, k={k}"
    spec = engine.totals["draft"]
    overlapped = [r for r in engine.history if r.overlapped]
    assert overlapped, "no step overlapped"
    assert spec.accepted > 0 and spec.accepted < spec.drafted, "rejections untested"


def test_overlap_mixed_with_plain_and_ngram_rows(pair):
    target, draft = pair
    prompts = random_prompts((4, 8, 12, 6, 10, 7), seed=11)
    expected = plain_reference(target, prompts)
    engine = make_engine(target, draft, slots=4, overlap="on")
    methods = [("none", 0), ("draft", 3), ("ngram", 2), ("draft", 5), ("none", 0), ("draft", 1)]
    reqs = [Request(f"r{i}", p, greedy(), m, k)
            for i, (p, (m, k)) in enumerate(zip(prompts, methods, strict=True))]
    out = engine.run(reqs)
    for i, e in enumerate(expected):
        assert out[f"r{i}"].token_ids == e, f"request {i} ({methods[i]})"


def test_overlap_respects_max_len_and_max_tokens(tiny_llama, tiny_llama_draft):
    """Both requests fill the cache to its last position (prompt + max_tokens = max_len):
    the windows drafted near the end stay inside the draft's cache, and the rows stop at
    exactly max_tokens."""
    prompts = random_prompts((20, 30), seed=5)
    engine = make_engine(tiny_llama, tiny_llama_draft, max_len=64, overlap="on")
    reqs = [Request("r0", prompts[0], greedy(44), "draft", 6),
            Request("r1", prompts[1], greedy(34), "draft", 6)]
    out = engine.run(reqs)
    assert out["r0"].token_ids == plain_reference(tiny_llama, prompts[:1], 44)[0]
    assert out["r1"].token_ids == plain_reference(tiny_llama, prompts[1:], 34)[0]
    assert all(o.finish_reason == "length" for o in out.values())


def test_wrong_shortcut_breaks_greedy_identity(tiny_llama, tiny_llama_far_draft):
    prompts = random_prompts((5, 9, 14), seed=2)
    expected = plain_reference(tiny_llama, prompts)
    engine = make_engine(tiny_llama, tiny_llama_far_draft, overlap="on")
    keep_every_head(engine)
    out = engine.run(requests(prompts, greedy(), "draft", 4))
    assert any(out[f"r{i}"].token_ids != e for i, e in enumerate(expected))


def _counts(draft, overlap, seed0, n=4000, wrong=False, tiny_llama=None):
    def factory():
        engine = make_engine(tiny_llama, draft, slots=64, max_len=16, limits=BIG_QUEUE,
                             overlap=overlap)
        if wrong:
            keep_every_head(engine)
        return engine

    return first_three_counts(factory, "draft" if overlap == "on" else "none",
                              2 if overlap == "on" else 0, n, 1.0, seed0)


def _marginal_pvalues(a, b) -> list[float]:
    out = [contingency_pvalue(a, b)]
    for j in range(3):
        pa, pb = collections.Counter(), collections.Counter()
        for c, src in ((pa, a), (pb, b)):
            for toks, cnt in src.items():
                c[toks[j]] += cnt
        out.append(contingency_pvalue(pa, pb))
    return out


def test_overlap_sampled_tokens_follow_plain_distribution(tiny_llama, tiny_llama_far_draft):
    plain, _ = _counts(tiny_llama_far_draft, "off", 0, tiny_llama=tiny_llama)
    spec, engine = _counts(tiny_llama_far_draft, "on", 10**6, tiny_llama=tiny_llama)
    totals = engine.totals["draft"]
    # Tokens 2 and 3 both went through the overlap path: resolved heads, some kept, some not.
    assert 0.05 * totals.drafted < totals.accepted < totals.drafted
    assert all(r.overlapped for r in engine.history if r.draft_rows or r.max_k)
    pvalues = _marginal_pvalues(plain, spec)
    assert min(pvalues) > 1e-3, pvalues


def test_overlap_sampled_check_catches_the_wrong_shortcut(tiny_llama, tiny_llama_far_draft):
    """The same check, with the same n, fails when pre-drafted guesses are kept after the
    target disagreed: it has the power to see the shortcut."""
    plain, _ = _counts(tiny_llama_far_draft, "off", 0, tiny_llama=tiny_llama)
    wrong, _ = _counts(tiny_llama_far_draft, "on", 10**6, wrong=True, tiny_llama=tiny_llama)
    assert min(_marginal_pvalues(plain, wrong)) < 1e-3


class _DyingDraft:
    """Wraps the local draft: its windows fail from the n-th on (a lost draft actor)."""

    def __init__(self, inner, fail_from: int) -> None:
        self.inner, self.fail_from, self.windows = inner, fail_from, 0
        self.name = inner.name

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start_window(self, inputs):
        self.windows += 1
        if self.windows >= self.fail_from:
            raise RuntimeError("draft actor died")
        return self.inner.start_window(inputs)

    def propose(self, inputs, should_stop=None):
        if self.windows >= self.fail_from:
            raise RuntimeError("draft actor died")
        return self.inner.propose(inputs, should_stop)


def test_lost_draft_mid_overlap_fails_no_request(pair):
    target, draft = pair
    prompts = random_prompts((5, 9, 14, 3), seed=8)
    expected = plain_reference(target, prompts)
    engine = make_engine(target, draft, overlap="on")
    engine.proposers["draft"] = _DyingDraft(engine.proposers["draft"], fail_from=4)
    out = engine.run(requests(prompts, greedy(), "draft", 3))
    for i, e in enumerate(expected):
        assert out[f"r{i}"].finish_reason == "length" and out[f"r{i}"].token_ids == e


def test_a_window_really_runs_during_the_target_step(tiny_llama, tiny_llama_draft):
    """The draft's forwards happen while the target computes (not after it): the window
    made more than one guess per row although it was stopped right after the step."""
    engine = make_engine(tiny_llama, tiny_llama_draft, overlap="on")
    step = engine.target.step
    started = threading.Event()

    def slow_step(rows):
        time.sleep(0.05)  # a target step long enough for several draft forwards
        started.set()
        return step(rows)

    engine.target.step = slow_step
    engine.run(requests(random_prompts((6,), seed=1), greedy(16), "draft", 6))
    assert started.is_set()
    assert max(r.max_k for r in engine.history) > 1


def test_auto_measures_both_modes_and_keeps_the_faster():
    from specdec.spec_decode.overlap import OverlapChooser

    for overlap_faster in (True, False):
        chooser = OverlapChooser(sample_steps=6, block=2, hold_steps=10)
        seen = set()
        while chooser.choice is None:
            mode = chooser.use_overlap()
            seen.add(mode)
            # Same tokens per step; the faster mode takes 0.1 s, the other 0.2 s.
            chooser.observe(mode, 0.1 if mode == overlap_faster else 0.2, 4)
        assert seen == {False, True} and chooser.choice is overlap_faster
        for _ in range(10):  # held, then measured again
            chooser.observe(chooser.use_overlap(), 0.1, 4)
        assert chooser.choice is None


def test_auto_overlap_is_token_identical_while_switching_modes(pair):
    from specdec.spec_decode.overlap import OverlapChooser

    target, draft = pair
    prompts = random_prompts((5, 9, 14, 3), seed=4)
    expected = plain_reference(target, prompts, 48)
    engine = make_engine(target, draft, overlap="auto")
    engine.overlap.chooser = OverlapChooser(sample_steps=6, block=2, hold_steps=8)
    modes = []
    engine.overlap.on_mode = modes.append
    out = engine.run(requests(prompts, greedy(48), "draft", 3))
    for i, e in enumerate(expected):
        assert out[f"r{i}"].token_ids == e
    assert True in modes and False in modes  # it switched both ways mid-request


def test_guesses_trimmed_below_what_was_drafted_keep_the_window_working(pair, caplog):
    """k falls between steps (the policy's choice, or the end of max_tokens): the next
    step verifies fewer guesses than the draft made, so the draft's cache already holds the
    whole new context. The window still drafts (no failed window, nothing settled plainly)
    and the output stays identical."""
    target, draft = pair
    prompts = random_prompts((5, 9, 14), seed=6)
    expected = plain_reference(target, prompts, 40)
    engine = make_engine(target, draft, overlap="on")
    engine.choose_k = lambda eng, req, spec, running, **_: 6 if eng.steps % 2 else 2
    with caplog.at_level("WARNING"):
        out = engine.run(requests(prompts, greedy(40), "draft", 6))
    for i, e in enumerate(expected):
        assert out[f"r{i}"].token_ids == e
    assert not [r for r in caplog.records if "draft window failed" in r.getMessage()]


def test_the_draft_takes_in_the_prompt_while_the_target_prefills_it(pair):
    """With compute of its own, the draft's catch-up on a long prompt is hidden: it reads
    each chunk while the target computes it, so its first round has nothing left to catch
    up on; and the output is still exactly plain's."""
    from specdec.engine.engine import EngineLimits

    target, draft = pair
    prompt = random_prompts((150,), seed=21)[0]
    engine = make_engine(target, draft, slots=2, overlap="on",
                         limits=EngineLimits(max_tokens_per_step=48))
    out = engine.run([Request("long", prompt, greedy(20), "draft", 3)])["long"]
    assert out.token_ids == plain_reference(target, [prompt], 20)[0]
    steps = list(engine.history)
    prefill_steps = [r for r in steps if r.prefill_tokens]
    assert len(prefill_steps) >= 3                 # chunked, each with a draft window
    first_round = next(r for r in steps if r.draft_rows or (r.overlapped and r.max_k))
    assert first_round.draft_catchup <= 4, first_round
