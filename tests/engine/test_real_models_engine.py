"""Speculation on the real offline models (fp32): greedy output is token-identical to plain
decoding of the target; stop strings; tokenizer compatibility."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.assemble import eos_ids_of
from specdec.engine.engine import Engine
from specdec.engine.request import Request
from specdec.model.step.decoder import Decoder
from specdec.model.step.generate import plain_generate
from specdec.model.step.sampling import SamplingParams
from specdec.pack.tokenizer import IncompatibleDraft, check_same_tokenizer, load_tokenizer
from specdec.spec_decode.proposers import DraftModelProposer, NgramProposer
from specdec.spec_decode.target_runner import LocalTargetRunner

pytestmark = pytest.mark.real_model

CHAT_PROMPTS = [
    "Write a Python function that merges two sorted lists.",
    "Explain what a hash map is in two sentences.",
    "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "List the planets of the solar system in order from the sun.",
]
N_TOKENS = 24


@pytest.fixture(scope="module")
def qwen(qwen_target_path, qwen_draft_path):
    tok = load_tokenizer(qwen_target_path)
    target = Decoder.from_checkpoint(qwen_target_path, torch.float32)
    draft = Decoder.from_checkpoint(qwen_draft_path, torch.float32)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                       add_generation_prompt=True, return_dict=False)
               for p in CHAT_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS)
    eos = eos_ids_of(qwen_target_path, tok)
    expected = plain_generate(target, prompts, params, eos_ids=eos).token_ids
    return dict(tok=tok, target=target, draft=draft, prompts=prompts, params=params,
                eos=eos, expected=expected)


def qwen_engine(q) -> Engine:
    proposers = {"draft": DraftModelProposer(q["draft"], 8, 512), "ngram": NgramProposer(2, 5)}
    return Engine(LocalTargetRunner(q["target"], 8, 512), proposers, q["tok"], q["eos"])


@pytest.mark.parametrize("method,k", [("draft", 1), ("draft", 4), ("ngram", 3)])
def test_qwen_pair_greedy_speculation_equals_plain(qwen, method, k):
    engine = qwen_engine(qwen)
    out = engine.run([Request(f"r{i}", p, qwen["params"], method, k)
                      for i, p in enumerate(qwen["prompts"])])
    for i, e in enumerate(qwen["expected"]):
        got = out[f"r{i}"].token_ids
        assert got == e, f"{CHAT_PROMPTS[i]!r}: {qwen['tok'].decode(got)!r} != " \
                         f"{qwen['tok'].decode(e)!r}"
    assert sum(len(e) for e in qwen["expected"]) >= 6 * 16
    if method == "draft":
        assert engine.totals["draft"].accepted > 0


def test_qwen_pair_mixed_batch(qwen):
    engine = qwen_engine(qwen)
    methods = [("none", 0), ("draft", 4), ("ngram", 3), ("draft", 2), ("none", 0), ("ngram", 5)]
    out = engine.run([Request(f"r{i}", p, qwen["params"], m, k)
                      for i, (p, (m, k)) in enumerate(zip(qwen["prompts"], methods, strict=True))])
    for i, e in enumerate(qwen["expected"]):
        assert out[f"r{i}"].token_ids == e, f"request {i} {methods[i]}"


def test_stop_strings_cut_text_exactly(smollm2_path):
    tok = load_tokenizer(smollm2_path)
    model = Decoder.from_checkpoint(smollm2_path, torch.float32)
    prompt = tok("def fibonacci(n):\n").input_ids
    plain = plain_generate(model, [prompt], SamplingParams(temperature=0, max_tokens=40)).token_ids[0]
    text = tok.decode(plain, skip_special_tokens=True)
    stop = text[12:17]
    assert stop.strip() and text.find(stop) == 12, "pick a stop string that occurs once, late"
    # SmolLM2 as its own draft accepts everything: stops must hold inside a 6-token round.
    for method, k in (("none", 0), ("draft", 6), ("ngram", 3)):
        engine = Engine(LocalTargetRunner(model, 2, 256),
                        {"draft": DraftModelProposer(model, 2, 256), "ngram": NgramProposer()},
                        tok, eos_ids_of(smollm2_path, tok))
        out = engine.run([Request("s", prompt, SamplingParams(
            temperature=0, max_tokens=40, stop=(stop,)), method, k)])["s"]
        assert out.text == text[:12], method
        assert out.finish_reason == "stop"
        assert tok.decode(out.token_ids, skip_special_tokens=True).startswith(text[:12])
        assert out.token_ids == plain[: len(out.token_ids)]


def test_draft_with_another_tokenizer_is_refused(qwen_target_path, qwen_draft_path,
                                                 smollm2_path):
    check_same_tokenizer(qwen_target_path, qwen_draft_path)  # the real pair shares one
    with pytest.raises(IncompatibleDraft, match="draft tokenizer differs"):
        check_same_tokenizer(qwen_target_path, smollm2_path)
