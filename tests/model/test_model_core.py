"""Our decoder's logits equal transformers' on the same checkpoint (fp32)."""

from __future__ import annotations

import functools

import pytest
import torch

from specdec.model.checkpoint.architectures import UnsupportedModel
from specdec.model.checkpoint.config import DecoderConfig
from specdec.model.step.batch import BatchInput
from specdec.model.step.decoder import Decoder
from specdec.pack.hub import transformers_model


@functools.cache
def _reference_model(path):
    # Loaded once per checkpoint: every scenario below asks it for several sequences.
    return transformers_model(path, torch.float32)


def reference_logits(path, ids: list[int]) -> torch.Tensor:
    ref = _reference_model(path)
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= atol, f"max abs logit difference {diff} > {atol}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), "argmax differs at some position"


def check_all_modes(path, seqs: list[list[int]], atol: float) -> None:
    """Prefill, step-by-step decode, ragged batch, and rollback, all against HF."""
    model = Decoder.from_checkpoint(path, torch.float32)
    refs = [reference_logits(path, s) for s in seqs]
    cache = model.new_cache(num_slots=4, max_len=128)
    a = seqs[0]

    # Prefill: every position's logits from one forward.
    out = model(BatchInput.build([(0, 0, a)]), cache, logit_indices=torch.arange(len(a)))
    assert_close(out, refs[0], atol)

    # Step-by-step decode in another slot, one token per forward.
    steps = [model(BatchInput.build([(1, i, [t])]), cache) for i, t in enumerate(a)]
    assert_close(torch.cat(steps), refs[0], atol)

    # Ragged batch: three sequences of different lengths in one forward, slots out of order.
    rows = [(3, 0, seqs[0]), (0, 0, seqs[1]), (2, 0, seqs[2])]
    n = sum(len(s) for s in seqs)
    out = model(BatchInput.build(rows), cache, logit_indices=torch.arange(n))
    assert_close(out, torch.cat(refs), atol)

    # Mixed ragged: continue slot 3 by 1 token and slot 0 by 3 tokens in one forward
    # (a decode row next to a verify row).
    ext0, ext1 = seqs[0] + [5], seqs[1] + [7, 8, 9]
    rows = [(3, len(seqs[0]), [5]), (0, len(seqs[1]), [7, 8, 9])]
    out = model(BatchInput.build(rows), cache, logit_indices=torch.arange(4))
    assert_close(out[:1], reference_logits(path, ext0)[-1:], atol)
    assert_close(out[1:], reference_logits(path, ext1)[-3:], atol)

    # Rollback: slot 0 goes back to 4 tokens, then takes different new tokens; stale K/V
    # after position 4 must be overwritten or masked.
    keep = 4
    new = [11, 12, 13]
    out = model(BatchInput.build([(0, keep, new)]), cache, logit_indices=torch.arange(3))
    assert_close(out, reference_logits(path, seqs[1][:keep] + new)[keep:], atol)
    _reference_model.cache_clear()  # a real model's reference is not kept for the session


def test_tiny_models_match_transformers(tiny_checkpoint):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (9, 13, 6)]
    check_all_modes(tiny_checkpoint, seqs, atol=1e-4)


@pytest.mark.real_model
def test_smollm2_matches_transformers(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    seqs = [tok(t).input_ids for t in ("def add(a, b):\n    return",
                                       "The quick brown fox jumps over the lazy dog because",
                                       "Hello, world")]
    check_all_modes(smollm2_path, seqs, atol=1e-3)


def test_bf16_runs_and_tracks_fp32(tiny_llama):
    m32 = Decoder.from_checkpoint(tiny_llama, torch.float32)
    m16 = Decoder.from_checkpoint(tiny_llama, torch.bfloat16)
    ids = list(range(3, 20))
    b = BatchInput.build([(0, 0, ids)])
    idx = torch.arange(len(ids))
    a = m32(b, m32.new_cache(1, 64), logit_indices=idx)
    c = m16(b, m16.new_cache(1, 64), logit_indices=idx)
    assert c.dtype == torch.float32 and m16.layers[0].w["qkv"].weight.dtype == torch.bfloat16
    assert (a - c).abs().max() < 0.1 * a.abs().max()


def test_unsupported_architecture_is_named():
    with pytest.raises(UnsupportedModel, match="gpt2.*supported architectures: llama, mistral, qwen2, qwen3, gemma3, phi3"):
        DecoderConfig.from_dict({"model_type": "gpt2"})


def test_cache_overflow_is_refused(tiny_llama):
    m = Decoder.from_checkpoint(tiny_llama, torch.float32)
    cache = m.new_cache(1, 8)
    with pytest.raises(ValueError, match="exceeds the cache"):
        m(BatchInput.build([(0, 0, list(range(3, 12)))]), cache)
    with pytest.raises(ValueError, match="max context"):
        m.new_cache(1, 10_000)


def test_fp16_packed_weights_compute_like_fp32_on_rounded_weights(tiny_checkpoint):
    """"float16" on a CPU: fp16 weights in FBGEMM's layout, fp32 activations. Its logits
    must equal an fp32 model whose weights were rounded to fp16 (same numbers, same maths)."""
    from specdec.model.formats.linear import PackedFp16Linear
    from specdec.model.formats.weight_format import fbgemm_available, resolve_format

    fmt = resolve_format("float16", "cpu")
    assert fmt.packed == fbgemm_available() and fmt.act_dtype == (
        torch.float32 if fmt.packed else torch.float16)
    if not fmt.packed:
        return  # no FBGEMM on this CPU: "float16" is plain fp16 here, covered elsewhere
    m16 = Decoder.from_checkpoint(tiny_checkpoint, "float16")
    assert isinstance(m16.layers[0].w["gate_up"], PackedFp16Linear)
    ref = Decoder.from_checkpoint(tiny_checkpoint, torch.float32)
    for layer in ref.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = layer.w[name]
            lin.weight = lin.weight.half().float()
    ref.embed = ref.embed.half().float()
    ref.lm_head.weight = ref.lm_head.weight.half().float()
    ids = list(range(3, 30))
    b = BatchInput.build([(0, 0, ids), (1, 0, ids[:7])])
    idx = torch.arange(len(ids) + 7)
    got = m16(b, m16.new_cache(2, 64), logit_indices=idx)
    exp = ref(b, ref.new_cache(2, 64), logit_indices=idx)
    assert (got - exp).abs().max() < 1e-4
    assert m16.weight_bytes() < 0.6 * ref.weight_bytes()


def test_auto_format_follows_the_machine():
    from specdec.model.formats.weight_format import (
        choose_fastest,
        cpu_candidates,
        cpu_has_native_bf16,
        fbgemm_available,
        resolve_format,
    )

    fmt = resolve_format("auto", "cpu")
    expected = (["bfloat16"] if cpu_has_native_bf16() else []) + (
        ["float16"] if fbgemm_available() else [])
    assert cpu_candidates() == (expected or ["float32"])
    assert fmt.name in cpu_candidates()
    # The measured faster one wins, whatever the flags say; a tie keeps the first.
    assert choose_fastest(["bfloat16", "float16"], {"bfloat16": 0.2, "float16": 0.1}.get) \
        == "float16"
    assert choose_fastest(["bfloat16", "float16"], {"bfloat16": 0.1, "float16": 0.3}.get) \
        == "bfloat16"
    assert choose_fastest(["bfloat16", "float16"], {"bfloat16": 0.1, "float16": 0.1}.get) \
        == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_format("int3", "cpu")
