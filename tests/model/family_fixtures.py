"""Tiny random checkpoints of each family, made by transformers' own classes, and the same
weights written to GGUF the way llama.cpp's converter writes them (its tensor names, its
metadata keys, Llama's q/k row order, Gemma's norms stored as 1 + w, Llama 3's scaling as a
`rope_freqs` tensor, Phi-3's long-context factors as tensors)."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np
import torch

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False, initializer_range=0.15)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# name -> (model_type, config overrides)
CASES = {
    "llama": ("llama", {}),
    "llama3": ("llama", {"rope_scaling": LLAMA3}),
    "llama-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "qwen2-yarn": ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 32}}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {"sliding_window": 24}),
    "gemma3": ("gemma3_text", {
        "sliding_window": 24, "query_pre_attn_scalar": 16, "tie_word_embeddings": True,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                        "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": 1e4}}}),
    "phi3": ("phi3", {"partial_rotary_factor": 0.5, "original_max_position_embeddings": 32,
                      "max_position_embeddings": 128, "rope_scaling": {
                          "rope_type": "longrope",
                          "short_factor": [1.0, 1.1, 1.3, 1.7],
                          "long_factor": [1.0, 2.0, 5.0, 9.0]}}),
}


def make_family_checkpoint(path: Path, case: str, **changes) -> Path:
    """changes: config values over the case's (a smaller draft of the same family)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from specdec.pack.tiny import save_tiny_tokenizer

    model_type, overrides = CASES[case]
    cfg = CONFIG_MAPPING[model_type](**{**COMMON, **overrides, **changes})
    seed = repr((case, sorted(changes.items()))) if changes else case
    torch.manual_seed(zlib.crc32(seed.encode()))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # Norms and biases drawn too (transformers starts them at 1, 0 or Gemma's 0), so a
        # norm read without its (1 + w) or a bias left out changes the logits.
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.2 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(path)
    save_tiny_tokenizer(path)
    return path


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Llama q/k rows."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GEMMA = {"pre_feedforward_layernorm": "ffn_norm",
          "post_attention_layernorm": "post_attention_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_name(name: str, arch: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in glob:
        return glob[name]
    _, _, i, rest = name.split(".", 3)
    role, suffix = rest.rsplit(".", 1)
    table = {**_LAYER, **_GEMMA} if arch == "gemma3" else _LAYER
    return f"blk.{i}.{table[role]}.{suffix}"


def llama3_rope_freqs(theta: float, dim: int, scaling: dict) -> np.ndarray:
    """The factors llama.cpp's converter (LlamaModel.generate_extra_tensors) stores."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_family_gguf(src: Path, dest: Path, extra_tensors: dict | None = None,
                      extra_keys: dict | None = None) -> Path:
    import json

    import gguf
    from safetensors.torch import load_file

    hf = json.loads((src / "config.json").read_text())
    arch = {"gemma3_text": "gemma3"}.get(hf["model_type"], hf["model_type"])
    w = gguf.GGUFWriter(str(dest), arch)
    D = hf["head_dim"]
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_vocab_size(hf["vocab_size"])
    w.add_eos_token_id(2)
    rope = hf.get("rope_parameters") or {}
    glob = rope.get("full_attention", rope)
    w.add_rope_freq_base(glob.get("rope_theta", 10000.0))
    partial = hf.get("partial_rotary_factor", glob.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(int(D * partial))
    kind = glob.get("rope_type", "default")
    tensors = {}
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(glob["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(glob["factor"])
        w.add_rope_scaling_orig_ctx_len(glob["original_max_position_embeddings"])
    elif kind == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freqs(glob["rope_theta"], D, glob)
    elif kind == "longrope":
        orig = hf["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        scale = hf["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
        tensors["rope_factors_long.weight"] = np.array(glob["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.array(glob["short_factor"], np.float32)
    if hf.get("sliding_window"):
        w.add_sliding_window(hf["sliding_window"])
    if arch == "gemma3":
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in hf["layer_types"]])
    for key, value in (extra_keys or {}).items():
        w.add_float32(key, value)
    for name, t in load_file(str(src / "model.safetensors")).items():
        a = t.float().numpy()
        if arch in ("llama", "mistral") and "q_proj" in name:
            a = _permute(a, hf["num_attention_heads"])
        if arch in ("llama", "mistral") and "k_proj" in name:
            a = _permute(a, hf["num_key_value_heads"])
        if arch == "gemma3" and name.endswith("norm.weight"):
            a = a + 1.0  # the converter's norm shift (Gemma3RMSNorm scales by 1 + w)
        tensors[_gguf_name(name, arch)] = a
    tensors.update(extra_tensors or {})
    for name, a in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest
