"""Log-probabilities through the engine (spec_decode/logprobs.py): every emitted token's is
the target's raw log-probability at the position that predicted it, with its top
alternatives, the same whether the token was decoded plainly or kept from a guess. Checked
against transformers' own forward over prompt + output (fp32, tiny fixture models), under
batching, greedy and sampled, sequential and overlapped, with a draft that is often wrong."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_engine, random_prompts, requests

from specdec.engine.request import Request
from specdec.model.step.sampling import SamplingParams
from specdec.pack.hub import transformers_model

PROMPTS = (5, 9, 14, 3)
TOP = 4
TOL = 2e-4


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """prompt + output -> the target's log-softmax at each output position [n, V]."""
    model = transformers_model(tiny_llama, torch.float32)

    def lp(prompt: list[int], output: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        return torch.log_softmax(logits, -1)[len(prompt) - 1: len(prompt) + len(output) - 1]

    return lp


def _check(out, prompt, reference, top=TOP):
    got = out.logprobs
    assert got is not None and len(got) == len(out.token_ids) > 0
    ref = reference(prompt, out.token_ids)
    for j, (token, (lp, alts)) in enumerate(zip(out.token_ids, got, strict=True)):
        assert abs(lp - ref[j, token].item()) < TOL, (j, lp, ref[j, token].item())
        assert len(alts) == top
        ref_lp, ref_ids = ref[j].topk(top)
        assert [a[1] for a in alts] == pytest.approx(ref_lp.tolist(), abs=TOL)
        # Ties aside, the same alternatives in the same order.
        assert [a[0] for a in alts][:1] == ref_ids.tolist()[:1]


def _run(engine, params, method, k, prompts):
    out = engine.run(requests(prompts, params, method, k))
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_greedy_logprobs_are_the_targets_whether_speculated_or_not(
        tiny_llama, tiny_llama_draft, reference, overlap):
    prompts = random_prompts(PROMPTS, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=TOP)
    plain = _run(make_engine(tiny_llama), params, "none", 0, prompts)
    engine = make_engine(tiny_llama, tiny_llama_draft, overlap=overlap)
    spec = _run(engine, params, "draft", 3, prompts)
    for p, a, b in zip(prompts, plain, spec, strict=True):
        assert a.token_ids == b.token_ids
        _check(a, p, reference)
        _check(b, p, reference)
        for (la, _), (lb, _) in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(la - lb) < TOL
    totals = engine.totals["draft"]
    assert 0 < totals.accepted < totals.drafted, "guesses both kept and rejected"


def test_sampled_logprobs_are_raw_not_warped(tiny_llama, tiny_llama_draft, reference):
    """temperature and top_p change what is drawn, not the reported distribution: a
    warped p (what the rejection rule uses) would differ from the reference here."""
    prompts = random_prompts(PROMPTS, seed=6)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, ignore_eos=True,
                            logprobs=TOP)
    engine = make_engine(tiny_llama, tiny_llama_draft)
    for out, p in zip(_run(engine, params, "draft", 4, prompts), prompts, strict=True):
        _check(out, p, reference)
    assert engine.totals["draft"].accepted > 0


def test_each_kept_token_has_one_and_only_requests_that_ask_get_them(tiny_llama,
                                                                    tiny_llama_draft):
    """max_tokens cut mid-round (k 4 overshoots 7): the log-probabilities are cut with the
    tokens; a request beside it that did not ask gets none; logprobs=0 gives no
    alternatives; streamed pieces add up to the whole."""
    engine = make_engine(tiny_llama, tiny_llama_draft)
    prompt = random_prompts((8,), seed=7)[0]
    streamed: list = []
    asks = Request("asks", prompt, SamplingParams(temperature=0.0, max_tokens=7,
                                                  ignore_eos=True, logprobs=0), "draft", 4,
                   on_output=lambda o: streamed.extend(o.new_logprobs))
    quiet = Request("quiet", prompt, SamplingParams(temperature=0.0, max_tokens=7,
                                                    ignore_eos=True), "draft", 4)
    out = engine.run([asks, quiet])
    assert len(out["asks"].token_ids) == len(out["asks"].logprobs) == 7
    assert all(alts == [] for _, alts in out["asks"].logprobs)
    assert streamed == out["asks"].logprobs
    assert out["quiet"].logprobs is None and out["quiet"].token_ids == out["asks"].token_ids


def test_logprobs_out_of_range_are_refused():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
