"""Every family served equal to transformers' own model class (fp32), from its Hugging Face
directory and from a GGUF file laid out as llama.cpp's converter writes it, through the
eager, static and row-invariant paths; what the decoder does not implement is refused by
name, never served wrong."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from family_fixtures import CASES, LLAMA3, make_family_checkpoint, write_family_gguf

from specdec.model.checkpoint.architectures import UnsupportedModel
from specdec.model.checkpoint.config import DecoderConfig
from specdec.model.step.batch import BatchInput
from specdec.model.step.decoder import Decoder
from specdec.model.step.static_step import StaticDecoder

SEQ = 80  # past every fixture's window (24) and original context (32)


@functools.cache
def _checkpoint(case: str, root: str):
    from pathlib import Path

    src = make_family_checkpoint(Path(root) / case, case)
    return src, write_family_gguf(src, Path(root) / f"{case}.gguf")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("families"))


def _reference(src, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_and_decode(model, ids: list[int], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position's logits from one prefill, and from a decode one token at a time in
    another slot beside a 3-token verify row of a third."""
    cache = model.new_cache(3, max_len)
    prefill = model(BatchInput.build([(0, 0, ids)]), cache, logit_indices=torch.arange(len(ids)))
    model(BatchInput.build([(2, 0, ids[:10])]), cache)
    steps = []
    for i, t in enumerate(ids):
        out = model(BatchInput.build([(1, i, [t]), (2, 10, ids[10:13])]), cache,
                    logit_indices=torch.tensor([0]))
        steps.append(out)
    return prefill, torch.cat(steps)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_a_family_gives_transformers_logits(case, source, root):
    src, gguf = _checkpoint(case, root)
    ids = _ids(SEQ)
    ref = _reference(src, ids)
    for fmt in ("float32", "int8"):
        model = Decoder.from_checkpoint(src if source == "hf" else gguf, fmt)
        prefill, decode = _prefill_and_decode(model, ids, 128)
        if fmt == "float32":
            torch.testing.assert_close(prefill, ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(decode, ref, rtol=1e-4, atol=1e-4)
        else:  # int8 weights: close, and a row's logits the same in any batch
            assert (prefill - ref).abs().max() < 0.25
            assert torch.equal(prefill, decode)


@pytest.mark.parametrize("case", ["gemma3", "phi3", "qwen3", "llama3"])
def test_the_static_step_runs_the_same_block(case, root):
    src, _ = _checkpoint(case, root)
    ids = _ids(SEQ, 1)
    ref = _reference(src, ids)
    static = StaticDecoder(Decoder.from_checkpoint(src, torch.float32))
    cache = static.new_cache(2, 128)
    static(BatchInput.build([(0, 0, ids[:-4])]), cache)  # a prefill chunk (eager)
    out = static(BatchInput.build([(0, SEQ - 4, ids[-4:]), (1, 0, ids[:1])]), cache,
                 logit_indices=torch.arange(4))  # a verify row in a static bucket
    assert static.static_steps == 1
    torch.testing.assert_close(out, ref[-4:], rtol=1e-4, atol=1e-4)


def test_phi3_takes_its_short_factors_in_a_cache_within_its_original_context(root):
    """llama.cpp's rule (the cache's length picks the factors); transformers picks by the
    sequence's length, the same choice for sequences within the original context."""
    src, gguf = _checkpoint("phi3", root)
    ids = _ids(30, 2)
    ref = _reference(src, ids)
    for path in (src, gguf):
        model = Decoder.from_checkpoint(path, torch.float32)
        prefill, decode = _prefill_and_decode(model, ids, 32)
        torch.testing.assert_close(prefill, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(decode, ref, rtol=1e-4, atol=1e-4)


def test_a_llama3_gguf_without_its_rope_freqs_would_be_wrong(root):
    """The bug this guards: the converter stores Llama 3's scaling only as rope_freqs; a
    reader that ignores it computes default-RoPE logits."""
    src, gguf = _checkpoint("llama3", root)
    cfg = DecoderConfig.from_checkpoint(gguf)
    assert cfg.rope.freq_divisors and max(cfg.rope.freq_divisors) == LLAMA3["factor"]
    ids = _ids(SEQ)
    ref = _reference(src, ids)
    plain = Decoder.from_checkpoint(_checkpoint("llama", root)[0], torch.float32)
    assert not torch.allclose(plain(BatchInput.build([(0, 0, ids)]), plain.new_cache(1, 128),
                                    logit_indices=torch.arange(SEQ)), ref, atol=1e-2)


def test_a_dynamic_rope_is_served_to_its_context_only(root):
    src, _ = _checkpoint("llama-dynamic", root)
    model = Decoder.from_checkpoint(src, torch.float32)
    assert model.cfg.context_limit == 256
    with pytest.raises(ValueError, match="exceeds what this model supports"):
        model.new_cache(1, 257)


def test_a_gemma3_window_masks_per_layer_instead_of_capping_the_context(root):
    src, _ = _checkpoint("gemma3", root)
    cfg = DecoderConfig.from_checkpoint(src)
    assert cfg.layer_windows == (24, None, 24, 24) and cfg.context_limit == 256
    assert cfg.rope_of(0).theta == 1e4 and cfg.rope_of(1).theta == 1e6
    assert cfg.attn_scale == pytest.approx(16 ** -0.5)


def test_an_unknown_gguf_tensor_is_refused_by_name(root, tmp_path):
    src, _ = _checkpoint("llama", root)
    path = write_family_gguf(src, tmp_path / "extra.gguf",
                             extra_tensors={"blk.0.attn_sinks.weight": np.zeros(4, np.float32)})
    with pytest.raises(UnsupportedModel, match=r"tensor 'blk\.0\.attn_sinks\.weight' is not "
                                               r"read by the llama decoder"):
        Decoder.from_checkpoint(path, torch.float32)


def test_an_unknown_gguf_metadata_key_is_refused_by_name(root, tmp_path):
    src, _ = _checkpoint("gemma3", root)
    path = write_family_gguf(src, tmp_path / "softcap.gguf",
                             extra_keys={"gemma3.final_logit_softcapping": 30.0})
    with pytest.raises(UnsupportedModel, match=r"metadata 'gemma3\.final_logit_softcapping' "
                                               r"is not something the gemma3 decoder"):
        DecoderConfig.from_checkpoint(path)


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                       "long_factor": [1.0] * 8, "original_max_position_embeddings": 32}},
     "rope scaling 'longrope' is not supported for this family"),
    ({"hidden_act": "gelu"}, "activation 'gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "mrope"}}, "rope scaling 'mrope' is not supported"),
])
def test_a_setting_the_block_does_not_implement_is_refused(change, message):
    cfg = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           **change}
    with pytest.raises(UnsupportedModel, match=message):
        DecoderConfig.from_dict(cfg)


@pytest.mark.real_model
def test_the_pack_gemma3_gives_transformers_logits_from_its_own_gguf(gemma3_path):
    """A real checkpoint no fixture made (Gemma 3 270M, Q4_K_M, as llama.cpp converted it),
    past its 512-token window: equal to transformers' own GGUF loading in fp32, and its
    served q4k format agreeing with that on nearly every greedy token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma3_path)
    text = " ".join(f"Item {i}: the {w} of the printing press, {i * 7 % 13} pages."
                    for i, w in enumerate(["history", "design", "spread", "economics"] * 15))
    ids = tok(text).input_ids[:600]
    assert len(ids) == 600
    ref = AutoModelForCausalLM.from_pretrained(gemma3_path, gguf_file="model.gguf",
                                               dtype=torch.float32)
    with torch.no_grad():
        exp = ref(torch.tensor([ids])).logits[0].float()
    del ref
    for fmt in ("float32", "q4k"):
        ours = Decoder.from_checkpoint(gemma3_path, fmt)
        assert ours.cfg.layer_windows.count(512) == 15
        got = ours(BatchInput.build([(0, 0, ids)]), ours.new_cache(1, 1024),
                   logit_indices=torch.arange(len(ids)))
        if fmt == "float32":
            torch.testing.assert_close(got, exp, rtol=1e-3, atol=1e-3)
        else:
            assert (got.argmax(-1) == exp.argmax(-1)).float().mean() > 0.95
