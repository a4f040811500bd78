"""GGUF files loaded natively: every supported block type dequantizes bit for bit as the
`gguf` package's reference does, a model written to GGUF loads to the logits transformers
computes from the same file, and what cannot be loaded is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize

from specdec.model.checkpoint.architectures import UnsupportedModel
from specdec.model.checkpoint.config import DecoderConfig
from specdec.model.checkpoint.gguf_quants import SUPPORTED, TYPES, UnsupportedQuant, dequantize
from specdec.model.step.batch import BatchInput
from specdec.model.step.decoder import Decoder

BLOCK_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_every_block_type_dequantizes_as_the_reference(qtype):
    """Random bytes exercise every bit of every field (scales, minimums, high bits)."""
    _, per_block, nbytes = TYPES[int(qtype)]
    rows, blocks = 6, 2
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(rows, blocks * nbytes), dtype=np.uint8)
    # Some random fp16 scales are inf or NaN: both sides must give the same values there.
    ours = dequantize(torch.from_numpy(raw.copy()), int(qtype), (rows, blocks * per_block))
    ref = torch.from_numpy(reference_dequantize(raw, qtype).astype(np.float32))
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda t: t.name)
def test_float_types_read_exactly(qtype):
    x = torch.randn(4, 64)
    np_dtype = {Q.F32: np.float32, Q.F16: np.float16}.get(qtype)
    raw = (x.to(torch.bfloat16).view(torch.uint8) if qtype == Q.BF16
           else torch.from_numpy(x.numpy().astype(np_dtype)).view(torch.uint8))
    ref = torch.from_numpy(reference_dequantize(raw.numpy(), qtype).astype(np.float32))
    torch.testing.assert_close(dequantize(raw, int(qtype), (4, 64)), ref.reshape(4, 64),
                               rtol=0, atol=0)


def test_an_unsupported_type_names_the_tensor_and_the_type():
    with pytest.raises(UnsupportedQuant, match=r"'blk\.3\.ffn_down\.weight' is stored as "
                                               r"ggml type 16.*supported types: F32"):
        dequantize(torch.zeros(64, dtype=torch.uint8), 16, (1, 256), "blk.3.ffn_down.weight")
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= set(SUPPORTED)


def _hf_to_gguf(name: str) -> str:
    from specdec.model.checkpoint.gguf_file import gguf_name

    return gguf_name(name)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Llama q/k rows."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(src, dest, arch: str, qtypes: dict[str, Q], encoders=None) -> None:
    """A checkpoint written to GGUF the way llama.cpp's converter lays it out. qtypes: the
    GGUF type per tensor-name suffix (default F32). encoders: per tensor-name suffix, a
    function of the float tensor giving (its bytes, their type), for the block types the
    `gguf` package cannot quantize (Q4_K, Q6_K); checked first."""
    import gguf
    from safetensors.torch import load_file

    cfg = DecoderConfig.from_checkpoint(src)
    tensors = load_file(str(src / "model.safetensors"))
    w = gguf.GGUFWriter(str(dest), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(2)
    for name, t in tensors.items():
        a = t.float().numpy()
        if arch == "llama" and "q_proj" in name:
            a = _permute(a, cfg.num_heads)
        if arch == "llama" and "k_proj" in name:
            a = _permute(a, cfg.num_kv_heads)
        gname = _hf_to_gguf(name)
        encode = next((e for suffix, e in (encoders or {}).items() if gname.endswith(suffix)),
                      None)
        qtype = next((q for suffix, q in qtypes.items() if gname.endswith(suffix)), Q.F32)
        if encode is not None and a.ndim > 1:
            raw, qtype = encode(torch.from_numpy(a))
            w.add_tensor(gname, raw, raw_dtype=qtype)
        elif qtype == Q.F32 or a.ndim == 1:
            w.add_tensor(gname, a)
        elif qtype == Q.F16:
            w.add_tensor(gname, a.astype(np.float16))
        else:
            w.add_tensor(gname, quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_gguf(request, tmp_path_factory):
    from conftest import make_tiny_checkpoint

    arch = request.param
    # 64 wide: every row a whole number of 32-weight blocks.
    src = make_tiny_checkpoint(tmp_path_factory.mktemp(f"g-{arch}"), arch, hidden_size=64,
                               intermediate_size=128)
    dest = tmp_path_factory.mktemp(f"gguf-{arch}") / f"tiny-{arch}.gguf"
    write_gguf(src, dest, arch, {"attn_q.weight": Q.Q8_0, "attn_k.weight": Q.Q5_0,
                                 "attn_v.weight": Q.Q4_1, "attn_output.weight": Q.F16,
                                 "ffn_gate.weight": Q.Q4_0, "ffn_up.weight": Q.Q5_1,
                                 "ffn_down.weight": Q.Q8_0, "token_embd.weight": Q.Q8_0})
    return dest


def test_a_gguf_model_gives_transformers_logits_for_the_same_file(tiny_gguf):
    """transformers dequantizes and un-permutes the file itself: an independent reader."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                               dtype=torch.float32)
    ours = Decoder.from_checkpoint(tiny_gguf, torch.float32)
    ids = list(range(3, 40))
    with torch.no_grad():
        exp = ref(torch.tensor([ids])).logits[0]
    got = ours(BatchInput.build([(0, 0, ids)]), ours.new_cache(1, 64),
               logit_indices=torch.arange(len(ids)))
    torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)
    assert ours.cfg.vocab_size == 96 and ours.cfg.eos_token_ids == (2,)


def test_an_unsupported_architecture_is_refused_by_name(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModel, match=r"gpt2\.gguf: GGUF architecture 'gpt2' is not "
                                               r"supported; supported: llama, mistral, qwen2, qwen3, gemma3, phi3"):
        DecoderConfig.from_checkpoint(path)


def test_a_gguf_file_is_a_model_reference(tiny_gguf, tmp_path):
    from specdec.pack import hub

    assert hub.resolve(str(tiny_gguf)) == tiny_gguf
    with pytest.raises(hub.ModelNotFound, match="does not exist"):
        hub.resolve(str(tmp_path / "missing.gguf"))


@pytest.mark.real_model
def test_the_pack_target_loads_from_its_gguf_without_a_full_precision_copy(qwen_target_path):
    """The pack keeps the Q4_K_M file itself; the int8 target is built tensor by tensor."""
    from specdec.model.checkpoint.gguf_file import GGUFCheckpoint, gguf_in

    gguf = gguf_in(qwen_target_path)
    assert gguf is not None and gguf.name == "model.gguf"
    ck = GGUFCheckpoint(gguf)
    assert ck.quant_type("model.layers.0.mlp.gate_proj.weight") == "Q4_K"
    assert ck.quant_type("lm_head.weight") == "Q6_K"
    assert not list(qwen_target_path.glob("*.safetensors"))


def test_tensor_parallel_slices_of_a_gguf_are_slices_of_the_whole(tiny_gguf):
    """Row slices (q/k/v, gate/up, biases) and column slices (o, down) as shards read them."""
    from specdec.model.checkpoint.gguf_file import GGUFCheckpoint

    ck = GGUFCheckpoint(tiny_gguf)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight"):
        whole = ck.get(name)
        assert torch.equal(ck.get(name, rows=range(8, 24)), whole[8:24])
        assert torch.equal(ck.get(name, cols=range(32, 64)), whole[:, 32:64])
    if ck.has("model.layers.0.self_attn.q_proj.bias"):
        bias = ck.get("model.layers.0.self_attn.q_proj.bias")
        assert torch.equal(ck.get("model.layers.0.self_attn.q_proj.bias", rows=range(4, 12)),
                           bias[4:12])
