"""The target's int8 format: int8 weights, int8 activations scaled per row, integer
accumulation. Close to fp32 on the same weights, a row's logits bit-identical alone and in
any batch (the property exactness needs), and greedy speculation token-identical to plain
in that format with a cheap, often-wrong int8 draft."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy, random_prompts

from specdec.engine.engine import Engine
from specdec.engine.request import Request
from specdec.engine.spec import EngineSpec
from specdec.model.formats.int8_linear import (
    DynamicInt8Linear,
    RowInt8Linear,
    activation_levels,
    pack_int8,
)
from specdec.model.formats.weight_format import fbgemm_available
from specdec.model.step.decoder import BatchInput, Decoder
from specdec.model.step.generate import plain_generate
from specdec.spec_decode.proposers import DraftModelProposer, NgramProposer
from specdec.spec_decode.target_runner import LocalTargetRunner

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="int8 needs FBGEMM (x86)")


def _rel_errors(levels: int) -> torch.Tensor:
    torch.manual_seed(0)
    w, b = torch.randn(256, 128), torch.randn(256)
    lin = RowInt8Linear(w, b, levels)
    x = torch.randn(5, 128) * torch.tensor([10.0, 1.0, 0.1, 3.0, 0.01])[:, None]
    x[:, 7] *= 30                             # an outlier channel, as LLM activations have
    ref = x @ lin.weight().T + b              # the same int8 weights, fp32 arithmetic
    assert lin.nbytes < 0.3 * w.numel() * 4
    return (lin(x) - ref).norm(dim=1) / (x @ lin.weight().T).norm(dim=1)


def test_row_int8_tracks_fp32_on_the_same_integer_weights():
    one, two = _rel_errors(1), _rel_errors(2)
    # Every row keeps its own precision, whatever its magnitude beside the others; the
    # outlier leaves one level ~5 bits for the rest, the second level restores them.
    assert one.max().item() < 6e-2, one
    assert two.max().item() < 1e-3, two
    assert two.max() < one.min() / 10


def test_the_activation_range_fits_the_kernel_without_saturating():
    levels, zero = activation_levels()
    packed = pack_int8(torch.full((8, 512), 127.0))
    x = torch.full((1, 512), levels)
    got = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        x, 1.0, zero, packed)
    assert torch.equal(got, torch.full_like(got, levels * 127.0 * 512))


def _last_logits(model, seqs):
    cache = model.new_cache(len(seqs), 64)
    b = BatchInput.build([(i, 0, s) for i, s in enumerate(seqs)])
    starts = torch.tensor([0, *[len(s) for s in seqs]]).cumsum(0)
    return model(b, cache, logit_indices=starts[1:] - 1)


@pytest.mark.parametrize("fmt", ["int8", "w8a8"])
def test_a_rows_logits_are_bit_identical_alone_and_in_any_batch(tiny_checkpoint, fmt):
    m = Decoder.from_checkpoint(tiny_checkpoint, fmt)
    assert isinstance(m.layers[0].w["qkv"], RowInt8Linear)
    row = list(range(3, 20))
    alone = _last_logits(m, [row])[0]
    for others in ([list(range(40, 90))], [[5] * 3, list(range(10, 60, 2)), [90, 91]]):
        assert torch.equal(_last_logits(m, [row, *others])[0], alone)
    # The batch-dependent draft format moves the same row: the check has power.
    d = Decoder.from_checkpoint(tiny_checkpoint, "int8-dynamic")
    assert isinstance(d.layers[0].w["qkv"], DynamicInt8Linear)
    big = [[90 - (i % 7) for i in range(50)]]
    assert not torch.equal(_last_logits(d, [row, *big])[0], _last_logits(d, [row])[0])


def test_int8_is_accepted_for_the_target(tiny_llama):
    spec = EngineSpec.model_validate({"target": {"model": str(tiny_llama), "dtype": "int8"}})
    assert spec.target.dtype == "int8"


def test_greedy_speculation_in_the_served_formats_equals_plain(tiny_llama, tiny_llama_far_draft):
    """Target int8 (per-row), draft int8-dynamic and often wrong: token-identical to plain
    decoding by the same int8 target."""
    target = Decoder.from_checkpoint(tiny_llama, "int8")
    draft = Decoder.from_checkpoint(tiny_llama_far_draft, "int8-dynamic")
    engine = Engine(LocalTargetRunner(target, 8, 192),
                    {"draft": DraftModelProposer(draft, 8, 192, "probabilistic"),
                     "ngram": NgramProposer(1, 3)}, None, ())
    prompts = random_prompts((5, 9, 13, 7), seed=8)
    out = engine.run([Request(f"r{i}", p, greedy(24), "draft", 4)
                      for i, p in enumerate(prompts)])
    plain = plain_generate(target, prompts, greedy(24)).token_ids
    assert [out[f"r{i}"].token_ids for i in range(len(prompts))] == plain
    assert sum(o.spec.rejections for o in out.values()) > 0  # the draft disagrees


@pytest.mark.real_model
def test_the_served_target_format_is_batch_independent_on_the_real_target(qwen_target_path):
    m = Decoder.from_checkpoint(qwen_target_path, "int8")
    row = list(range(1000, 1012))
    alone = _last_logits(m, [row])[0]
    got = _last_logits(m, [row, list(range(2000, 2030)), [3, 4, 5]])[0]
    assert torch.equal(got, alone)
