"""A GGUF file as a checkpoint: the decoder's shape from its metadata, its tensors under the
Hugging Face names the loader asks for, dequantized one tensor at a time.

The file is memory-mapped, so a tensor costs its quantized bytes until it is asked for and
its float32 copy only until the weight format has stored it (see specdec.model.step.decoder): a 1.5B
Q4_K_M file loads without the whole model ever existing in fp16 or fp32.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from specdec.model.checkpoint import kquant_blocks
from specdec.model.checkpoint.family import (
    FAMILIES,
    GGUF_GLOBAL_NAMES,
    GGUF_LAYER_NAMES,
    LAYER,
    fused_part,
)
from specdec.model.checkpoint.gguf_config import config_dict, reader
from specdec.model.checkpoint.gguf_header import GGUFFormatError, plain
from specdec.model.checkpoint.gguf_quants import dequantize, type_name


def gguf_name(hf_name: str) -> str:
    """The GGUF name of a canonical weight name (specdec.model.checkpoint.family)."""
    if hf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[hf_name]
    m = LAYER.match(hf_name)
    if m and m.group(2) in GGUF_LAYER_NAMES:
        return f"blk.{m.group(1)}.{GGUF_LAYER_NAMES[m.group(2)]}{m.group(3) or ''}"
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


def metadata(path: str | Path, key: str, default=None):
    """One metadata value of a GGUF file (e.g. "tokenizer.chat_template")."""
    value = reader(str(path)).fields.get(key)
    return default if value is None else plain(value)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each Llama/Mistral q and k head from rotate-half to
    interleaved rotary pairs; undo it (what transformers' GGUF loader does too)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Each tensor the decoder reads, by GGUF name, in GGUF order (the fastest-varying
    dimension first), as the config says it must be."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D = cfg["head_dim"]
    q = cfg["num_attention_heads"] * D
    kv = cfg["num_key_value_heads"] * D
    out = {"token_embd.weight": (h, v), "output.weight": (h, v), "output_norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        out.update({b + "attn_norm.weight": (h,), b + "ffn_norm.weight": (h,),
                    b + "post_attention_norm.weight": (h,), b + "post_ffw_norm.weight": (h,),
                    b + "attn_q_norm.weight": (D,), b + "attn_k_norm.weight": (D,),
                    b + "attn_q.weight": (h, q), b + "attn_k.weight": (h, kv),
                    b + "attn_v.weight": (h, kv), b + "attn_output.weight": (q, h),
                    b + "attn_qkv.weight": (h, q + 2 * kv), b + "attn_output.bias": (h,),
                    b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,),
                    b + "ffn_gate.weight": (h, inter), b + "ffn_down.weight": (inter, h),
                    b + "ffn_up.weight": (h, 2 * inter if cfg["model_type"] == "phi3"
                                          else inter)})
    return out


class GGUFCheckpoint:
    """The same interface as specdec.model.checkpoint.weights.CheckpointReader, over one
    GGUF file: weights asked for by canonical name (specdec.model.checkpoint.family)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._r = reader(str(self.path))
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
        self.family = FAMILIES[cfg["model_type"]]
        self._permute = {}
        if self.family.gguf_permute_qk:
            self._permute = {"attn_q": cfg["num_attention_heads"],
                             "attn_k": cfg["num_key_value_heads"]}
        D = cfg["head_dim"]
        self._parts = (cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D,
                       cfg["intermediate_size"])

    def _locate(self, name: str) -> tuple[str, int | None, int]:
        """(the GGUF tensor, first row, rows) holding a canonical weight; rows None: all."""
        m = LAYER.match(name)
        fused = m and ((self.family.fused_qkv and m.group(2).startswith("self_attn.")) or
                       (self.family.fused_gate_up and m.group(2).startswith("mlp.")))
        part = fused_part(m.group(2), *self._parts) if fused else None
        if part is None:
            return gguf_name(name), None, 0
        role, first, rows = part
        key = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}[role]
        return f"blk.{m.group(1)}.{key}{m.group(3) or ''}", first, rows

    def has(self, name: str) -> bool:
        try:
            return self._locate(name)[0] in self._tensors
        except KeyError:
            return False

    def nbytes(self, name: str) -> int:
        key, first, rows = self._locate(name)
        t = self._tensors[key]
        return int(t.n_bytes) if first is None else int(t.n_bytes) * rows // int(t.shape[-1])

    def quant_type(self, name: str) -> str:
        return type_name(int(self._tensors[self._locate(name)[0]].tensor_type))

    def _raw(self, name: str):
        """(GGUF name, tensor, shape, bytes as [rows, bytes a row], a 1-d part to cut after
        reading): a fused tensor's part is its rows."""
        key, first, rows = self._locate(name)
        t = self._tensors.get(key)
        if t is None:
            raise GGUFFormatError(f"{self.path.name} has no tensor {key!r} (for {name!r})")
        shape = tuple(int(x) for x in reversed(t.shape))
        raw = np.asarray(t.data).view(np.uint8).reshape(shape[0] if len(shape) > 1 else 1, -1)
        cut = None
        if first is not None and len(shape) > 1:
            raw, shape = raw[first:first + rows], (rows, *shape[1:])
        elif first is not None:
            cut = range(first, first + rows)
        return key, t, shape, raw, cut

    def stored_blocks(self, name: str, rows: range | None = None, cols: range | None = None):
        """What the q4k format keeps of a weight (specdec.model.formats.kquant_choice.kind): its
        Q4_K or Q6_K blocks (the rows and whole blocks of columns asked for), "int8" for a
        tensor stored in another quantized type, or None for float storage (F32/F16/BF16)."""
        key, t, shape, raw, _ = self._raw(name)
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
        key, t, shape, raw, _ = self._raw(name)
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
        key, t, shape, raw, cut = self._raw(name)
        heads = self._permute.get(key.split(".")[-2])
        if rows is not None and heads is None and len(shape) > 1:
            # Blocks run along a row, so a row slice only dequantizes the rows it keeps.
            raw, shape = raw[rows.start:rows.stop], (len(rows), *shape[1:])
            rows = None
        with warnings.catch_warnings():  # a read-only memory map: dequantize never writes
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.ascontiguousarray(raw))
        w = dequantize(data, int(t.tensor_type), shape, key)
        if cut is not None:
            w = w[cut.start:cut.stop]
        if heads is not None:
            w = _unpermute(w, heads)
        if rows is not None:
            w = w[rows.start:rows.stop]
        if cols is not None:
            w = w[:, cols.start:cols.stop]
        return w.to(dtype) if dtype is not None else w
