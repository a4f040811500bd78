"""OpenAI features over HTTP with the official openai client, on the tiny fixture pair
served by Ray (the target a Ray actor group): log-probabilities (each token's is the
target's own, transformers' forward over prompt + output, the same with speculation on and
off, streamed and whole, chat and completions), n choices, /tokenize and /detokenize."""

from __future__ import annotations

import httpx
import pytest
import torch
from openai import OpenAI
from serve_helpers import serve_app, tiny_app_args

from deployments.launch import local_ray
from specdec.pack.hub import transformers_model
from specdec.pack.tokenizer import load_tokenizer

pytestmark = pytest.mark.integration

PROMPT = [5, 17, 33, 8, 41, 12]
TOL = 2e-4


@pytest.fixture(scope="module")
def base(tiny_llama, tiny_llama_draft):
    with local_ray(num_cpus=4):
        with serve_app(tiny_app_args(tiny_llama, tiny_llama_draft)) as url:
            yield url


@pytest.fixture(scope="module")
def client(base):
    return OpenAI(base_url=f"{base}/v1", api_key="unused")


def _reference(path, prompt: list[int], output: list[int]) -> torch.Tensor:
    model = transformers_model(path, torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1: len(prompt) + len(output) - 1]


def _completion(client, mode: str, stream: bool, **kw):
    args = dict(model="tiny", prompt=PROMPT, max_tokens=12, logprobs=3,
                extra_body={"ignore_eos": True, "speculative": {"mode": mode, "k": 3}}, **kw)
    if not stream:
        resp = client.completions.create(**args)
        if mode == "on":  # guesses were verified, not only plain steps
            assert resp.model_extra["spec_decode"]["drafted"] > 0
        return resp.choices[0].logprobs
    tokens, lps, tops, offsets = [], [], [], []
    for c in client.completions.create(stream=True, **args):
        if c.choices and c.choices[0].logprobs is not None:
            lp = c.choices[0].logprobs
            tokens += lp.tokens
            lps += lp.token_logprobs
            tops += lp.top_logprobs
            offsets += lp.text_offset
    return type("Streamed", (), {"tokens": tokens, "token_logprobs": lps,
                                 "top_logprobs": tops, "text_offset": offsets})


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_completion_logprobs_are_the_targets_on_off_streamed_or_not(client, tiny_llama,
                                                                     temperature):
    tok = load_tokenizer(tiny_llama)
    seed = {"seed": 11} if temperature else {}
    runs = {(mode, stream): _completion(client, mode, stream, temperature=temperature, **seed)
            for mode in ("off", "on") for stream in (False, True)}
    whole = runs["off", False]
    ids = tok.convert_tokens_to_ids(whole.tokens)
    assert len(ids) == 12 and None not in ids
    ref = _reference(tiny_llama, PROMPT, ids)
    for j, (t, lp) in enumerate(zip(ids, whole.token_logprobs, strict=True)):
        assert abs(lp - ref[j, t].item()) < TOL
        best = ref[j].topk(3).values.tolist()
        assert sorted(whole.top_logprobs[j].values(), reverse=True) == \
            pytest.approx(best, abs=TOL)
    for key, run in runs.items():
        assert run.tokens == whole.tokens, key
        assert run.token_logprobs == pytest.approx(whole.token_logprobs, abs=TOL), key
        assert run.text_offset == whole.text_offset, key


def test_chat_logprobs_with_the_openai_client(client, base):
    msgs = [{"role": "user", "content": "w5 w6 w7 w8"}]
    args = dict(model="tiny", messages=msgs, max_tokens=10, temperature=0, logprobs=True,
                top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 10
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.logprob - TOL  # the best is at least as likely
        assert bytes(e.bytes).decode() == e.token
    streamed = [e for c in client.chat.completions.create(stream=True, **args)
                if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == \
        [(e.token, round(e.logprob, 4)) for e in content]
    # Without logprobs asked: none reported.
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_tokenize_and_detokenize(base, tiny_llama):
    tok = load_tokenizer(tiny_llama)
    r = httpx.post(f"{base}/tokenize", json={"model": "tiny", "prompt": "w5 w6 w7",
                                             "return_token_strs": True}).json()
    assert r["tokens"] == tok("w5 w6 w7").input_ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 128 and r["token_strs"][-1] == "w7"
    chat = httpx.post(f"{base}/tokenize", json={
        "messages": [{"role": "user", "content": "w5 w6"}]}).json()
    # What the chat route would prefill: its prompt tokens, counted in usage.
    used = httpx.post(f"{base}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}],
        "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert chat["count"] == used
    back = httpx.post(f"{base}/detokenize", json={"model": "tiny", "tokens": r["tokens"]})
    assert back.json()["prompt"] == tok.decode(r["tokens"])
    for path, body, param in [("/tokenize", {"prompt": "w5", "messages": [
            {"role": "user", "content": "w5"}]}, "messages"),
            ("/tokenize", {}, "messages"), ("/detokenize", {"tokens": [5, 10**9]}, "tokens"),
            ("/detokenize", {"tokens": "w5"}, "tokens")]:
        err = httpx.post(f"{base}{path}", json=body)
        assert err.status_code == 400 and err.json()["error"]["param"] == param, err.text
    assert httpx.post(f"{base}/tokenize", json={"model": "gpt-9", "prompt": "w5"}
                      ).status_code == 404


def test_n_choices_each_what_its_seed_gives_alone(client):
    """n = 3 sampled with a seed: choice i is the same request alone with seed + i (the
    seeded race makes that exact), so the choices differ and repeat; streamed, each
    choice's pieces add up to the whole one's text; usage counts the prompt once."""
    args = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0,
                extra_body={"ignore_eos": True, "speculative": {"mode": "on", "k": 2}})
    many = client.completions.create(n=3, seed=40, **args)
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [c.text for c in many.choices]
    alone = [client.completions.create(seed=40 + i, **args).choices[0].text for i in range(3)]
    assert texts == alone and len(set(texts)) > 1
    assert many.usage.prompt_tokens == len(PROMPT)
    assert many.usage.completion_tokens == 30
    streamed = ["", "", ""]
    for c in client.completions.create(n=3, seed=40, stream=True, **args):
        for choice in c.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    chat = client.chat.completions.create(
        model="tiny", n=2, max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": "w5 w6"}])
    assert len(chat.choices) == 2
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy


def test_penalties_and_logit_bias_the_same_with_speculation_on_and_off(client):
    """The openai client's own parameters (penalties, logit_bias) and vLLM's (min_p,
    repetition_penalty, min_tokens via extra_body): greedy output the same with
    speculation on and off, and other than without them."""
    def run(mode: str, controls: bool):
        extra = {"ignore_eos": True, "speculative": {"mode": mode, "k": 3}}
        kw = {}
        if controls:
            kw = dict(presence_penalty=1.2, frequency_penalty=0.5, logit_bias={"7": 3.0})
            extra.update(min_p=0.05, repetition_penalty=1.3, min_tokens=4)
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16,
                                      temperature=0, extra_body=extra, **kw)
        return r.choices[0].text

    off, on, bare = run("off", True), run("on", True), run("off", False)
    assert on == off and off != bare
    stop = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16,
                                     temperature=0, extra_body={"stop_token_ids": [5],
                                                                "logit_bias": {"5": 80}})
    assert stop.choices[0].finish_reason == "stop" and stop.usage.completion_tokens == 1
