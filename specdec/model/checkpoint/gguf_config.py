"""A GGUF file's metadata as a Hugging Face config.json dict (what DecoderConfig reads), and
the check that the decoder consumes everything the file says.

llama.cpp's converter stores part of a family's maths outside the keys a reader expects: Llama
3's frequency scaling as a `rope_freqs` tensor with no scaling type, Phi-3's long-context
factors as `rope_factors_long` / `rope_factors_short`, Gemma's (1 + w) norms already shifted.
A file loaded without one of those computes other logits without a word, so every metadata
key under the architecture's prefix and every tensor must be one this module maps (or one
known to change nothing), else the file is refused naming it.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np

from specdec.model.checkpoint.architectures import SUPPORTED_ARCHITECTURES, UnsupportedModel
from specdec.model.checkpoint.family import FAMILIES, Family
from specdec.model.checkpoint.gguf_header import GGUFFormatError, GGUFHeader, plain

# Keys under "{arch}." this reader maps (read in config_dict below), and keys that describe
# the file without changing the maths (llama.cpp writes them; value_length is checked).
_READ = {"context_length", "embedding_length", "block_count", "feed_forward_length",
         "attention.head_count", "attention.head_count_kv", "attention.key_length",
         "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
         "rope.freq_base_swa", "rope.dimension_count", "rope.scaling.type",
         "rope.scaling.factor", "rope.scaling.original_context_length",
         "rope.scaling.attn_factor", "rope.scaling.yarn_attn_factor",
         "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
         "attention.sliding_window", "attention.sliding_window_pattern"}
_INERT = {"vocab_size", "rope.scaling.finetuned", "expert_count", "expert_used_count"}
_RMS_KEY = "attention.layer_norm_rms_epsilon"


@functools.lru_cache(maxsize=8)
def reader(path: str) -> GGUFHeader:
    return GGUFHeader(path)


def _field(r: GGUFHeader, key: str, default=None):
    value = r.fields.get(key)
    return default if value is None else plain(value)


def _number(r: GGUFHeader, key: str, default=None, kind=int, low=1):
    """A numeric metadata value, checked: present (or defaulted), a number, >= low."""
    value = r.fields.get(key)
    if value is None:
        if default is None:
            raise GGUFFormatError(f"{r.path.name}: metadata {key!r} is missing")
        return default
    if isinstance(value, (bool, str, list, np.ndarray)) or not np.isscalar(value):
        raise GGUFFormatError(f"{r.path.name}: metadata {key!r} is {value!r}, not a number")
    value = kind(value)
    if not value >= low:  # (NaN fails too)
        raise GGUFFormatError(f"{r.path.name}: metadata {key!r} is {value}, below {low}")
    return value


def _floats(r: GGUFHeader, name: str) -> list[float]:
    """A small F32 tensor's values (the rope factor tensors)."""
    t = next(t for t in r.tensors if t.name == name)
    if int(t.tensor_type) != 0 or len(t.shape) != 1:
        raise GGUFFormatError(f"{r.path.name}: tensor {name!r} must be a 1-d F32 tensor")
    return [float(x) for x in np.asarray(t.data).view(np.float32)]


def _check_keys(r: GGUFHeader, arch: str) -> None:
    name = r.path.name
    if int(_field(r, "split.count", 1)) > 1:
        raise UnsupportedModel(f"{name} is one part of a split GGUF ({_field(r, 'split.count')}"
                               " files): merge them first (llama.cpp's gguf-split --merge)")
    for key in r.fields:
        if key.startswith(("general.", "tokenizer.", "quantize.", "split.")):
            continue  # what the file is, its tokenizer (read elsewhere), how it was made
        rest = key[len(arch) + 1:] if key.startswith(arch + ".") else None
        if rest is None or rest not in _READ | _INERT:
            raise UnsupportedModel(f"{name}: metadata {key!r} is not something the {arch} "
                                   "decoder implements; serving the file without it would "
                                   "compute other logits, so it is refused")


def _rope_dict(r: GGUFHeader, arch: str, cfg: dict, names: set[str]) -> None:
    """The file's rotary embedding as config.json's keys."""
    kind = _field(r, f"{arch}.rope.scaling.type", "none")
    params: dict = {"rope_theta": cfg["rope_theta"]}
    ctx = _field(r, f"{arch}.rope.scaling.original_context_length")
    if kind == "linear":
        params.update(rope_type="linear",
                      factor=_number(r, f"{arch}.rope.scaling.factor", None, float, 1e-6))
    elif kind == "yarn":
        params.update(rope_type="yarn", original_max_position_embeddings=ctx,
                      factor=_number(r, f"{arch}.rope.scaling.factor", None, float, 1e-6),
                      beta_fast=_field(r, f"{arch}.rope.scaling.yarn_beta_fast"),
                      beta_slow=_field(r, f"{arch}.rope.scaling.yarn_beta_slow"),
                      attention_factor=_field(r, f"{arch}.rope.scaling.yarn_attn_factor"))
    elif kind == "longrope" or "rope_factors_long.weight" in names:
        params.update(rope_type="longrope", original_max_position_embeddings=ctx,
                      long_factor=_floats(r, "rope_factors_long.weight"),
                      short_factor=_floats(r, "rope_factors_short.weight"),
                      attention_factor=_field(r, f"{arch}.rope.scaling.attn_factor"))
    elif kind not in ("none", None):
        raise UnsupportedModel(f"{r.path.name}: rope scaling {kind!r} is not supported "
                               "(none, linear, yarn, longrope)")
    if "rope_freqs.weight" in names:  # Llama 3's scaling, as llama.cpp's converter stores it
        cfg["rope_freq_divisors"] = _floats(r, "rope_freqs.weight")
    cfg["rope_parameters"] = params


def config_dict(path: str | Path) -> dict:
    """The metadata as a Hugging Face config.json dict (what DecoderConfig reads)."""
    r = reader(str(path))
    arch = _field(r, "general.architecture", "?")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(
            f"{r.path.name}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    fam = FAMILIES[arch]
    _check_keys(r, arch)
    names = {t.name for t in r.tensors}
    heads = _number(r, f"{arch}.attention.head_count")
    hidden = _number(r, f"{arch}.embedding_length")
    heads_kv = _number(r, f"{arch}.attention.head_count_kv", heads)
    if heads % heads_kv:
        raise GGUFFormatError(f"{r.path.name}: {heads} attention heads over {heads_kv} "
                              "kv heads")
    head_dim = _number(r, f"{arch}.attention.key_length", max(hidden // heads, 1))
    if _number(r, f"{arch}.attention.value_length", head_dim) != head_dim:
        raise UnsupportedModel(f"{r.path.name}: value heads of another size than key heads "
                               "are not supported")
    tokens = r.fields.get("tokenizer.ggml.tokens")
    embd = next((t for t in r.tensors if t.name == "token_embd.weight"), None)
    if embd is None or len(embd.shape) != 2:
        raise GGUFFormatError(f"{r.path.name}: no 2-d token_embd.weight tensor")
    layers = _number(r, f"{arch}.block_count")
    cfg = {
        "model_type": arch,
        "vocab_size": int(embd.shape[1]) if tokens is None else len(tokens),
        "hidden_size": hidden,
        "intermediate_size": _number(r, f"{arch}.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _number(r, f"{arch}.{_RMS_KEY}", 1e-6, float, 0.0),
        "rope_theta": _number(r, f"{arch}.rope.freq_base", 10000.0, float, 1e-6),
        "max_position_embeddings": _number(r, f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_output.bias" in names or (
            "blk.0.attn_q.bias" in names and not fam.qkv_bias),
        "mlp_bias": "blk.0.ffn_down.bias" in names,
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
    }
    if cfg["vocab_size"] < 1 or cfg["vocab_size"] != int(embd.shape[1]):
        raise GGUFFormatError(f"{r.path.name}: {cfg['vocab_size']} tokenizer tokens but "
                              f"token_embd.weight has {embd.shape[1]} rows")
    dims = _field(r, f"{arch}.rope.dimension_count")
    if dims is not None and int(dims) != head_dim:
        cfg["partial_rotary_factor"] = int(dims) / head_dim
    _rope_dict(r, arch, cfg, names)
    _windows(r, arch, fam, cfg, layers)
    _check_tensors(r, fam, cfg, names)
    return cfg


def _windows(r: GGUFHeader, arch: str, fam: Family, cfg: dict, layers: int) -> None:
    window = _field(r, f"{arch}.attention.sliding_window")
    if not window:
        return
    cfg["sliding_window"] = int(window)
    if fam.name == "gemma3":
        # llama.cpp's rule for Gemma 3: a pattern (a period, or one flag a layer), else every
        # 6th layer global; the local layers' rotary base, else 10000; the attention scale
        # from the head size, but from hidden / heads for the 27B (62 layers).
        pattern = _field(r, f"{arch}.attention.sliding_window_pattern", 6)
        if isinstance(pattern, (list, np.ndarray)):
            flags = [bool(x) for x in pattern]
        else:
            flags = [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
        cfg["layer_types"] = ["sliding_attention" if f else "full_attention" for f in flags]
        cfg["rope_local_base_freq"] = _field(r, f"{arch}.rope.freq_base_swa", 10000.0)
        cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"]
                                        if layers == 62 else cfg["head_dim"])
    elif fam.name not in ("mistral", "phi3"):
        raise UnsupportedModel(f"{r.path.name}: a sliding window on a {arch} file: which "
                               "layers it applies to is not stored in GGUF metadata")


def consumed_tensors(fam: Family, cfg: dict) -> set[str]:
    """Every tensor name the decoder reads from a file of this family and config."""
    out = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight",
           "rope_factors_long.weight", "rope_factors_short.weight"}
    roles = ["attn_norm", "ffn_norm", "attn_output", "ffn_down", "ffn_up"]
    roles += ["attn_qkv"] if fam.fused_qkv else ["attn_q", "attn_k", "attn_v"]
    roles += [] if fam.fused_gate_up else ["ffn_gate"]
    roles += ["attn_q_norm", "attn_k_norm"] if fam.qk_norm else []
    roles += ["post_attention_norm", "post_ffw_norm"] if fam.output_norms else []
    biases = []
    if fam.qkv_bias or cfg.get("attention_bias"):
        biases += ["attn_qkv"] if fam.fused_qkv else ["attn_q", "attn_k", "attn_v"]
    if cfg.get("attention_bias") and not fam.qkv_bias:
        biases.append("attn_output")
    if cfg.get("mlp_bias"):
        biases += ["ffn_up", "ffn_down"] + ([] if fam.fused_gate_up else ["ffn_gate"])
    for i in range(cfg["num_hidden_layers"]):
        out.update(f"blk.{i}.{role}.weight" for role in roles)
        out.update(f"blk.{i}.{role}.bias" for role in biases)
    return out


_BLOCK = re.compile(r"blk\.(\d+)\.")


def _check_tensors(r: GGUFHeader, fam: Family, cfg: dict, names: set[str]) -> None:
    extra = sorted(names - consumed_tensors(fam, cfg),
                   key=lambda n: (int(m.group(1)) if (m := _BLOCK.match(n)) else -1, n))
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise UnsupportedModel(f"{r.path.name}: tensor {extra[0]!r}{more} is not read by the "
                               f"{fam.name} decoder; serving the file without it would "
                               "compute other logits, so it is refused")
