"""A GGUF file as a checkpoint: the decoder's shape from its metadata, its tensors under the
Hugging Face names the loader asks for, dequantized one tensor at a time.

The file is memory-mapped, so a tensor costs its quantized bytes until it is asked for and
its float32 copy only until the weight format has stored it (see specdec.model.step.decoder): a 1.5B
Q4_K_M file loads without the whole model ever existing in fp16 or fp32.
"""

from __future__ import annotations

import functools
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from specdec.model.checkpoint import kquant_blocks
from specdec.model.checkpoint.architectures import SUPPORTED_ARCHITECTURES, UnsupportedModel
from specdec.model.checkpoint.gguf_header import GGUFFormatError, GGUFHeader, plain
from specdec.model.checkpoint.gguf_quants import dequantize, type_name

# Hugging Face name (after "model.layers.{i}.") -> GGUF name (after "blk.{i}.").
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+?)(\.weight|\.bias)?$")


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = _LAYER.match(hf_name)
    if m:
        layer, rest, suffix = m.group(1), m.group(2), m.group(3) or ""
        key = rest + suffix if rest + suffix in _LAYER_NAMES else rest
        if key in _LAYER_NAMES:
            mapped = _LAYER_NAMES[key]
            return f"blk.{layer}.{mapped}" + ("" if key == rest + suffix else suffix)
    raise KeyError(f"no GGUF name for tensor {hf_name!r}")


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf" and Path(path).is_file()


def gguf_in(path: str | Path) -> Path | None:
    """The GGUF a reference loads from: the file itself, or the single .gguf of a directory
    with no safetensors (the offline pack's layout)."""
    path = Path(path)
    if is_gguf(path):
        return path
    if path.is_dir() and not any(path.glob("*.safetensors")):
        files = sorted(path.glob("*.gguf"))
        if len(files) == 1:
            return files[0]
    return None


@functools.lru_cache(maxsize=8)
def _reader(path: str) -> GGUFHeader:
    return GGUFHeader(path)


def _field(reader: GGUFHeader, key: str, default=None):
    value = reader.fields.get(key)
    return default if value is None else plain(value)


def metadata(path: str | Path, key: str, default=None):
    """One metadata value of a GGUF file (e.g. "tokenizer.chat_template")."""
    return _field(_reader(str(path)), key, default)


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


def config_dict(path: str | Path) -> dict:
    """The metadata as a Hugging Face config.json dict (what DecoderConfig reads)."""
    r = _reader(str(path))
    arch = _field(r, "general.architecture", "?")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(
            f"{Path(path).name}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    scaling = _field(r, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise UnsupportedModel(f"{Path(path).name}: rope scaling {scaling!r} is not "
                               "supported (only none)")
    names = {t.name for t in r.tensors}
    heads = _number(r, f"{arch}.attention.head_count")
    hidden = _number(r, f"{arch}.embedding_length")
    heads_kv = _number(r, f"{arch}.attention.head_count_kv", heads)
    if heads % heads_kv:
        raise GGUFFormatError(f"{Path(path).name}: {heads} attention heads over {heads_kv} "
                              "kv heads")
    tokens = r.fields.get("tokenizer.ggml.tokens")
    embd = next((t for t in r.tensors if t.name == "token_embd.weight"), None)
    if embd is None or len(embd.shape) != 2:
        raise GGUFFormatError(f"{Path(path).name}: no 2-d token_embd.weight tensor")
    cfg = {
        "model_type": arch,
        "vocab_size": int(embd.shape[1]) if tokens is None else len(tokens),
        "hidden_size": hidden,
        "intermediate_size": _number(r, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _number(r, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": heads_kv,
        "head_dim": _number(r, f"{arch}.attention.key_length", max(hidden // heads, 1)),
        "rms_norm_eps": _number(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, float,
                                0.0),
        "rope_theta": _number(r, f"{arch}.rope.freq_base", 10000.0, float, 1e-6),
        "max_position_embeddings": _number(r, f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names and arch != "qwen2",
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
    }
    if cfg["vocab_size"] < 1 or cfg["vocab_size"] != int(embd.shape[1]):
        raise GGUFFormatError(f"{Path(path).name}: {cfg['vocab_size']} tokenizer tokens but "
                              f"token_embd.weight has {embd.shape[1]} rows")
    window = _field(r, f"{arch}.attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
        cfg["use_sliding_window"] = True
    return cfg


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each Llama/Mistral q and k head from rotate-half to
    interleaved rotary pairs; undo it (what transformers' GGUF loader does too)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Each tensor the decoder reads, by GGUF name, in GGUF order (the fastest-varying
    dimension first), as the config says it must be."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    out = {"token_embd.weight": (h, v), "output.weight": (h, v), "output_norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        out.update({b + "attn_norm.weight": (h,), b + "ffn_norm.weight": (h,),
                    b + "attn_q.weight": (h, q), b + "attn_k.weight": (h, kv),
                    b + "attn_v.weight": (h, kv), b + "attn_output.weight": (q, h),
                    b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,),
                    b + "ffn_gate.weight": (h, inter), b + "ffn_up.weight": (h, inter),
                    b + "ffn_down.weight": (inter, h)})
    return out


class GGUFCheckpoint:
    """The same interface as specdec.model.checkpoint.weights.CheckpointReader, over one GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._r = _reader(str(self.path))
        self._tensors = {t.name: t for t in self._r.tensors}
        cfg = config_dict(self.path)
        # Every tensor the decoder will read has the shape the config says (a wrong one
        # would otherwise surface as a reshape error deep inside a layer, or load quietly).
        for name, want in expected_shapes(cfg).items():
            t = self._tensors.get(name)
            if t is not None and tuple(int(d) for d in t.shape) != want:
                raise GGUFFormatError(
                    f"{self.path.name}: tensor {name!r} has shape {tuple(t.shape)}; a "
                    f"{cfg['model_type']} of hidden size {cfg['hidden_size']}, "
                    f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads of "
                    f"{cfg['head_dim']}, MLP width {cfg['intermediate_size']} and "
                    f"{cfg['vocab_size']} tokens needs {want}")
        self._permute = {}
        if cfg["model_type"] in ("llama", "mistral"):
            self._permute = {"attn_q": cfg["num_attention_heads"],
                             "attn_k": cfg["num_key_value_heads"]}

    def has(self, name: str) -> bool:
        try:
            return gguf_name(name) in self._tensors
        except KeyError:
            return False

    def nbytes(self, name: str) -> int:
        return int(self._tensors[gguf_name(name)].n_bytes)

    def quant_type(self, name: str) -> str:
        return type_name(int(self._tensors[gguf_name(name)].tensor_type))

    def _raw(self, name: str):
        key = gguf_name(name)
        t = self._tensors.get(key)
        if t is None:
            raise GGUFFormatError(f"{self.path.name} has no tensor {key!r} (for {name!r})")
        shape = tuple(int(x) for x in reversed(t.shape))
        raw = np.asarray(t.data).view(np.uint8).reshape(shape[0] if len(shape) > 1 else 1, -1)
        return key, t, shape, raw

    def stored_blocks(self, name: str, rows: range | None = None, cols: range | None = None):
        """What the q4k format keeps of a weight (specdec.model.formats.kquant_choice.kind): its
        Q4_K or Q6_K blocks (the rows and whole blocks of columns asked for), "int8" for a
        tensor stored in another quantized type, or None for float storage (F32/F16/BF16)."""
        key, t, shape, raw = self._raw(name)
        kind = type_name(int(t.tensor_type))
        if kind in ("F32", "F16", "BF16"):
            return None
        reader = {"Q4_K": (kquant_blocks.q4k_from_gguf, kquant_blocks.Q4_K_BYTES),
                  "Q6_K": (kquant_blocks.q6k_from_gguf, kquant_blocks.Q6_K_BYTES)}
        if kind not in reader or self._permute.get(key.split(".")[-2]) is not None:
            return "int8"  # another block type, or q/k rows the loader reorders
        read, nbytes = reader[kind]
        if rows is not None:
            raw = raw[rows.start:rows.stop]
        if cols is not None:
            if cols.start % kquant_blocks.QK or cols.stop % kquant_blocks.QK:
                return "int8"  # a rank's columns cut a block
            raw = raw[:, cols.start // kquant_blocks.QK * nbytes:cols.stop // kquant_blocks.QK * nbytes]
        with warnings.catch_warnings():  # a read-only memory map: only read
            warnings.simplefilter("ignore", UserWarning)
            return read(torch.from_numpy(np.ascontiguousarray(raw)))

    def block_table(self, name: str) -> tuple[torch.Tensor, int] | None:
        """A tensor's quantized bytes as [rows, bytes a row] uint8 (a copy in this process's
        memory) and its ggml type, or None where it is stored as floats or reordered."""
        key, t, shape, raw = self._raw(name)
        if type_name(int(t.tensor_type)) in ("F32", "F16", "BF16") or \
                self._permute.get(key.split(".")[-2]) is not None:
            return None
        return torch.from_numpy(np.array(raw, copy=True)), int(t.tensor_type)

    def release(self) -> None:
        """Drop the file's pages from this process's resident memory once the model is
        built: every tensor the model keeps is a copy, and the pages read while loading
        (the whole file) would otherwise count against the process for its life. Anything
        read later is paged in again."""
        self._r.release()

    def get(self, name: str, rows: range | None = None, cols: range | None = None,
            dtype: torch.dtype | None = None) -> torch.Tensor:
        key, t, shape, raw = self._raw(name)
        heads = self._permute.get(key.split(".")[-2])
        if rows is not None and heads is None and len(shape) > 1:
            # Blocks run along a row, so a row slice only dequantizes the rows it keeps.
            raw, shape = raw[rows.start:rows.stop], (len(rows), *shape[1:])
            rows = None
        with warnings.catch_warnings():  # a read-only memory map: dequantize never writes
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.ascontiguousarray(raw))
        w = dequantize(data, int(t.tensor_type), shape, key)
        if heads is not None:
            w = _unpermute(w, heads)
        if rows is not None:
            w = w[rows.start:rows.stop]
        if cols is not None:
            w = w[:, cols.start:cols.stop]
        return w.to(dtype) if dtype is not None else w
