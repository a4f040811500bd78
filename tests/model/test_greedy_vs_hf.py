"""Greedy generation with our core equals transformers' generate(do_sample=False) (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from specdec.model.step.decoder import Decoder
from specdec.model.step.generate import plain_generate
from specdec.model.step.sampling import SamplingParams
from specdec.pack.hub import transformers_model

PROMPTS = [
    "def quicksort(arr):\n",
    "The three primary colors are",
    "Write a Python function that returns the n-th prime number.\n",
    "import numpy as np\n\n# compute the mean of each column\n",
]


def hf_greedy(path, prompts: list[list[int]], n: int) -> list[list[int]]:
    ref = transformers_model(path, torch.float32)
    outs = []
    for ids in prompts:
        g = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=n)
        outs.append(g[0, len(ids):].tolist())
    return outs


@pytest.mark.real_model
@pytest.mark.parametrize("which", ["smollm2_path", "qwen_draft_path"])
def test_greedy_32_tokens_equal_hf(which, request):
    path = request.getfixturevalue(which)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(p).input_ids for p in PROMPTS]
    expected = hf_greedy(path, prompts, 32)
    model = Decoder.from_checkpoint(path, torch.float32)
    # All prompts in one ragged batch: batching must not change any row's tokens.
    got = plain_generate(model, prompts, SamplingParams(temperature=0, max_tokens=32)).token_ids
    for p, e, g in zip(PROMPTS, expected, got, strict=True):
        assert g == e, f"prompt {p!r}: ours {tok.decode(g)!r} vs HF {tok.decode(e)!r}"
    assert sum(len(e) for e in expected) >= 3 * 16, "the prompts should produce real output"
