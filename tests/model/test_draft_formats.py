"""The draft's cheapest weight format: int8 weights with dynamic int8 activations (FBGEMM).
Close to fp32 on the same weights, refused for the target (its rows depend on the batch),
and greedy speculative output with an int8 draft stays token-identical to plain."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy, load, make_engine, random_prompts

from specdec.engine.request import Request
from specdec.engine.spec import EngineSpec
from specdec.model.formats.int8_linear import DynamicInt8Linear
from specdec.model.formats.weight_format import fbgemm_available, resolve_format
from specdec.model.step.decoder import BatchInput, Decoder
from specdec.model.step.generate import plain_generate

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="int8 needs FBGEMM (x86)")


def test_int8_linear_tracks_fp32_on_the_same_weights():
    torch.manual_seed(0)
    w, b = torch.randn(256, 128), torch.randn(256)
    x = torch.randn(5, 128)
    lin = DynamicInt8Linear(w, b)
    ref = x @ w.T + b
    rel = ((lin(x) - ref).norm() / ref.norm()).item()
    assert rel < 3e-2, rel  # 8-bit weights, 7-bit activations
    assert lin.nbytes < 0.3 * w.numel() * 4
    # The vocabulary limit keeps the same integers.
    first = lin.first_rows(100)
    assert torch.equal(first(x), lin(x)[:, :100]) or \
        (first(x) - lin(x)[:, :100]).abs().max() < 1e-5


def test_int8_model_logits_track_fp32(tiny_checkpoint):
    m8 = Decoder.from_checkpoint(tiny_checkpoint, "int8-dynamic")
    assert isinstance(m8.layers[0].w["gate_up"], DynamicInt8Linear)
    ref = Decoder.from_checkpoint(tiny_checkpoint, torch.float32)
    ids = list(range(3, 30))
    b = BatchInput.build([(0, 0, ids)])
    idx = torch.arange(len(ids))
    got = m8(b, m8.new_cache(1, 64), logit_indices=idx)
    exp = ref(b, ref.new_cache(1, 64), logit_indices=idx)
    # Random tiny weights (no outlier structure, 2-4 layers): ~8-9% relative error.
    assert ((got - exp).norm() / exp.norm()).item() < 0.15
    agree = (got.argmax(-1) == exp.argmax(-1)).float().mean().item()
    assert agree > 0.8, agree
    assert m8.weight_bytes() < 0.45 * ref.weight_bytes()


def test_dynamic_int8_is_refused_for_the_target_naming_the_field(tiny_llama):
    with pytest.raises(ValueError, match="target.dtype 'int8-dynamic'"):
        EngineSpec.model_validate({"target": {"model": str(tiny_llama),
                                              "dtype": "int8-dynamic"}})
    EngineSpec.model_validate({"target": {"model": str(tiny_llama)},
                               "draft": {"model": str(tiny_llama), "dtype": "int8-dynamic"}})
    assert resolve_format("int8-dynamic").int8 and not resolve_format("int8-dynamic").per_row


def test_greedy_speculation_with_an_int8_draft_equals_plain(tiny_llama, tiny_llama_far_draft):
    from specdec.spec_decode.proposers import DraftModelProposer

    engine = make_engine(tiny_llama, tiny_llama_far_draft)
    engine.proposers["draft"] = DraftModelProposer(
        Decoder.from_checkpoint(tiny_llama_far_draft, "int8-dynamic"), 8, 192, "probabilistic")
    prompts = random_prompts((5, 9, 13), seed=8)
    out = engine.run([Request(f"r{i}", p, greedy(24), "draft", 4)
                      for i, p in enumerate(prompts)])
    plain = plain_generate(load(tiny_llama), prompts, greedy(24)).token_ids
    assert [out[f"r{i}"].token_ids for i in range(3)] == plain
    assert sum(o.spec.rejections for o in out.values()) > 0  # the draft disagrees
