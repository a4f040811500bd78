"""Sampling controls through the engine (model/logits_process.py, min_p in sampling.py):
presence, frequency and repetition penalties, logit_bias, min_tokens, stop_token_ids,
min_p. Plain decoding follows an independent reference (transformers' forward and the
rules written out here in plain Python); speculation gives the same tokens under greedy
decoding (each guessed position sees the guesses before it as kept), in one batch where
every row uses another control, and the same distribution under sampling (chi-square)."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from engine_helpers import BIG_QUEUE, contingency_pvalue, make_engine, random_prompts

from specdec.engine.request import Request
from specdec.model.step.sampling import SamplingParams
from specdec.pack.hub import transformers_model

EOS = 2
CONTROLS = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.6),
    "repetition": dict(repetition_penalty=1.8),
    "bias": dict(logit_bias=((7, 4.0), (11, -100.0), (30, 2.5))),
    "mixed": dict(presence_penalty=-0.5, frequency_penalty=0.4, repetition_penalty=1.3),
}


def _reference_step(logits: list[float], prompt, output, c: dict) -> int:
    """The rules written out: bias, repetition over prompt + output, frequency and
    presence over the output; the argmax."""
    x = list(logits)
    for t, b in c.get("logit_bias", ()):
        x[t] += b
    counts = collections.Counter(output)
    rp = c.get("repetition_penalty", 1.0)
    for t in set(prompt) | set(output):
        if rp != 1.0:
            x[t] = x[t] / rp if x[t] > 0 else x[t] * rp
    for t, n in counts.items():
        x[t] -= n * c.get("frequency_penalty", 0.0) + c.get("presence_penalty", 0.0)
    return max(range(len(x)), key=lambda i: (x[i], -i))


@pytest.fixture(scope="module")
def reference(tiny_llama):
    model = transformers_model(tiny_llama, torch.float32)

    def greedy(prompt: list[int], n: int, c: dict) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + out])).logits[0, -1].float().tolist()
            out.append(_reference_step(logits, prompt, out, c))
        return out

    return greedy


def _greedy(max_tokens=20, **c) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **c)


def test_plain_decoding_follows_the_reference_rules(tiny_llama, reference):
    prompts = random_prompts((6, 9, 4, 12, 7), seed=50)
    engine = make_engine(tiny_llama)
    reqs = [Request(f"r{i}", p, _greedy(**c)) for i, (p, c) in
            enumerate(zip(prompts, CONTROLS.values(), strict=True))]
    out = engine.run(reqs)
    for i, (p, c) in enumerate(zip(prompts, CONTROLS.values(), strict=True)):
        assert out[f"r{i}"].token_ids == reference(p, 20, c), list(CONTROLS)[i]
    # The controls changed something: without them the same prompts decode otherwise.
    bare = make_engine(tiny_llama).run([Request(f"r{i}", p, _greedy())
                                        for i, p in enumerate(prompts)])
    changed = sum(bare[f"r{i}"].token_ids != out[f"r{i}"].token_ids for i in range(5))
    assert changed >= 4


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_speculation_is_token_identical_under_every_control(tiny_llama,
                                                                   tiny_llama_draft, k):
    """One batch, a control per row (and one row with none), the draft often wrong: a
    guessed position that ignored the guesses before it would pick other tokens here."""
    prompts = random_prompts((6, 9, 4, 12, 7, 5), seed=51)
    controls = [*CONTROLS.values(), {}]

    def reqs(method, kk):
        return [Request(f"r{i}", p, _greedy(24, **c), method, kk)
                for i, (p, c) in enumerate(zip(prompts, controls, strict=True))]

    plain = make_engine(tiny_llama).run(reqs("none", 0))
    engine = make_engine(tiny_llama, tiny_llama_draft)
    spec = engine.run(reqs("draft", k))
    for i in range(len(prompts)):
        assert spec[f"r{i}"].token_ids == plain[f"r{i}"].token_ids, (list(CONTROLS) + [""])[i]
    t = engine.totals["draft"]
    assert 0 < t.accepted < t.drafted


def test_min_tokens_holds_back_the_end_and_stop_token_ids_end_it(tiny_llama,
                                                                 tiny_llama_draft):
    """EOS pushed to the top by logit_bias: with min_tokens 5 the first five tokens are
    anything else and the sixth is EOS; a stop token id ends a request like EOS does."""
    prompt = random_prompts((7,), seed=52)[0]
    for method, k in (("none", 0), ("draft", 3)):
        engine = make_engine(tiny_llama, tiny_llama_draft, eos_ids=(EOS,))
        held = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5,
                              logit_bias=((EOS, 50.0),))
        eager = SamplingParams(temperature=0.0, max_tokens=20, logit_bias=((EOS, 50.0),))
        out = engine.run([Request("held", prompt, held, method, k),
                          Request("eager", prompt, eager, method, k)])
        assert out["eager"].token_ids == [EOS] and out["eager"].finish_reason == "stop"
        assert len(out["held"].token_ids) == 6 and out["held"].token_ids[-1] == EOS
        assert EOS not in out["held"].token_ids[:5] and out["held"].finish_reason == "stop"
    plain = make_engine(tiny_llama).run([Request("p", prompt, _greedy(20))])["p"].token_ids
    stop_at = plain[3]
    first = plain.index(stop_at)
    for method, k in (("none", 0), ("draft", 3)):
        engine = make_engine(tiny_llama, tiny_llama_draft)
        got = engine.run([Request("s", prompt, _greedy(20, stop_token_ids=(stop_at,)),
                                  method, k)])["s"]
        assert got.token_ids == plain[: first + 1] and got.finish_reason == "stop"


def test_min_p_keeps_only_tokens_near_the_top(tiny_llama, tiny_llama_draft):
    """Every sampled token (plain and speculative) is at least min_p times as likely as the
    most likely one at its position (after temperature 1: the raw logprobs)."""
    prompts = random_prompts((6, 9, 4, 12), seed=53)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, min_p=0.3,
                            logprobs=1)
    for method, k in (("none", 0), ("draft", 3)):
        engine = make_engine(tiny_llama, tiny_llama_draft)
        out = engine.run([Request(f"r{i}", p, params, method, k)
                          for i, p in enumerate(prompts)])
        for o in out.values():
            for lp, alts in o.logprobs:
                assert lp >= math.log(0.3) + alts[0][1] - 1e-5


def _first_three(engine_factory, method, k, n, params):
    engine = engine_factory()
    prompt = [5, 17, 33, 8]
    outs = engine.run([Request(f"s{i}", prompt, params, method, k) for i in range(n)])
    return collections.Counter(tuple(o.token_ids[:3]) for o in outs.values())


def test_sampled_speculation_keeps_the_penalized_distribution(tiny_llama, tiny_llama_draft):
    """Tokens 2 and 3 come from one round of k = 2 guesses; their penalties must count the
    guesses before them. A peaked distribution (temperature 0.4) makes repeats common, so
    the penalties change the first three tokens' distribution a lot."""
    params = SamplingParams(temperature=0.4, max_tokens=4, ignore_eos=True,
                            frequency_penalty=1.0, presence_penalty=0.8)
    plain = _first_three(lambda: make_engine(tiny_llama, limits=BIG_QUEUE), "none", 0, 3000, params)
    spec = _first_three(lambda: make_engine(tiny_llama, tiny_llama_draft, limits=BIG_QUEUE),
                        "draft", 2, 3000, params)
    assert contingency_pvalue(plain, spec) > 1e-3
    bare = _first_three(lambda: make_engine(tiny_llama, limits=BIG_QUEUE), "none", 0, 3000,
                        SamplingParams(temperature=0.4, max_tokens=4, ignore_eos=True))
    assert contingency_pvalue(plain, bare) < 1e-6, "the penalties should change the counts"


def test_out_of_range_controls_are_refused():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                dict(repetition_penalty=0), dict(min_p=1.5), dict(min_tokens=-1),
                dict(logit_bias=((5, 101.0),)), dict(repetition_penalty=float("nan")),
                # Found by the schema fuzzer: a positive logit / 5e-324 is inf, then NaN.
                dict(repetition_penalty=5e-324), dict(temperature=1e-9)):
        with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
            SamplingParams(**bad)
