"""The OpenAI features in the formats the application serves: Qwen2.5-Coder-0.5B as a q4k
target (batch-independent) and its int4 copy as a draft that disagrees now and then. In one
batch, each request under its own sampling controls, speculative output equals plain
token for token, and log-probabilities are the same numbers whether a token was decoded
plainly or kept from a guess."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.assemble import eos_ids_of
from specdec.engine.engine import Engine, EngineLimits
from specdec.engine.request import Request
from specdec.model.step.decoder import Decoder
from specdec.model.step.sampling import SamplingParams
from specdec.pack.tokenizer import chat_ids, load_tokenizer
from specdec.spec_decode.proposers import DraftModelProposer
from specdec.spec_decode.target_runner import LocalTargetRunner

pytestmark = pytest.mark.real_model

ASKS = ["Write a Python function that merges two sorted lists.",
        "Explain what a hash map is in two sentences.",
        "List the planets of the solar system in order from the sun.",
        "def is_prime(n):\n"]


@pytest.fixture(scope="module")
def served(qwen_draft_path):
    path = qwen_draft_path
    tok = load_tokenizer(path)
    return dict(tok=tok, target=Decoder.from_checkpoint(path, "q4k"),
                draft=Decoder.from_checkpoint(path, "int4"), eos=eos_ids_of(path, tok),
                prompts=[chat_ids(tok, [{"role": "user", "content": a}]) for a in ASKS])


def _run(s, requests):
    engine = Engine(LocalTargetRunner(s["target"], 4, 512),
                    {"draft": DraftModelProposer(s["draft"], 4, 512)}, s["tok"], s["eos"],
                    EngineLimits())
    return engine.run(requests), engine


def test_every_control_in_one_batch_speculative_equals_plain(served):
    tok = served["tok"]
    comma, the = (tok.encode(w, add_special_tokens=False)[0] for w in (",", " the"))
    controls = [dict(presence_penalty=1.2, frequency_penalty=0.6),
                dict(repetition_penalty=1.3, logit_bias=((the, -5.0), (comma, 2.0))),
                dict(min_tokens=30, stop_token_ids=(comma,)),
                dict(min_p=0.2, logprobs=3)]

    def requests(method, k):
        return [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=40, **c),
                        method, k)
                for i, (p, c) in enumerate(zip(served["prompts"], controls, strict=True))]

    plain, _ = _run(served, requests("none", 0))
    spec, engine = _run(served, requests("draft", 3))
    for i in range(len(ASKS)):
        assert spec[f"r{i}"].token_ids == plain[f"r{i}"].token_ids, ASKS[i]
    # The controls bit: min_tokens held the comma back, then it ended the request.
    third = plain["r2"].token_ids
    assert len(third) >= 30 and (third[-1] == comma or len(third) == 40)
    assert comma not in third[:29]
    t = engine.totals["draft"]
    assert t.accepted > 0 and t.drafted > t.accepted  # a draft that disagrees
    # Log-probabilities: the same numbers for the same tokens, plain or kept from a guess.
    a, b = plain["r3"].logprobs, spec["r3"].logprobs
    assert a is not None and len(a) == len(b) == len(plain["r3"].token_ids)
    for (lp_a, alts_a), (lp_b, alts_b) in zip(a, b, strict=True):
        assert lp_b == pytest.approx(lp_a, abs=1e-4)
        assert [t for t, _ in alts_b] == [t for t, _ in alts_a]
        assert [v for _, v in alts_b] == pytest.approx([v for _, v in alts_a], abs=1e-4)
    assert torch.isfinite(torch.tensor([lp for lp, _ in a])).all()
