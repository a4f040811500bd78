"""GGML's block formats, dequantized with torch: the weights of a GGUF file as floats.

Each quantized GGUF row is a run of fixed-size blocks (32 weights for the "legacy" types,
256 for the K-quants), each carrying its own scale (and for some a minimum). The layouts
below follow ggml-quants.c (dequantize_row_*); tests compare every type against the `gguf`
package's numpy reference, bit for bit. torch instead of that reference because it runs
on every core and never builds float64 intermediates: a 1.5B model's tensors dequantize in
seconds, one tensor at a time, so the loader never holds the model in full precision.
"""

from __future__ import annotations

import torch

QK_K = 256

# ggml type id -> (name, weights per block, bytes per block); from ggml.h / gguf constants.
TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", QK_K, 144),
    13: ("Q5_K", QK_K, 176),
    14: ("Q6_K", QK_K, 210),
    30: ("BF16", 1, 2),
}


class UnsupportedQuant(ValueError):
    pass


def type_name(type_id: int) -> str:
    entry = TYPES.get(type_id)
    return entry[0] if entry else f"ggml type {type_id}"


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 -> (n, 1) float32 read as little-endian fp16."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, m) packed bytes -> (n, 2, m): low nibbles first, then high (ggml's order)."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=1)


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """(n, count // 8) bytes -> (n, count) single bits, little-endian bit order."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).reshape(packed.shape[0], count)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:]).reshape(-1, 32).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _nibbles(b[:, 4:]).reshape(-1, 32).float() + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    high = _bits(b[:, 2:6], 32)
    q = (_nibbles(b[:, 6:]).reshape(-1, 32) | (high << 4)).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    high = _bits(b[:, 4:8], 32)
    return d * (_nibbles(b[:, 8:]).reshape(-1, 32) | (high << 4)).float() + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of 6-bit sub-block scales and minimums of Q4_K / Q5_K -> (n, 8) each."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    # 4 groups of 32 bytes; each gives two 32-weight sub-blocks (low nibbles, then high).
    qs = b[:, 16:].reshape(n, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).float()
    return ((d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48]                       # bit j of byte i: weight i of sub-block j
    qs = b[:, 48:].reshape(n, 4, 32)
    low = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    high = (qh.unsqueeze(1) >> shifts) & 1
    q = (low | (high << 4)).float()
    return ((d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 1, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = (qh >> shifts) & 0x03
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return ((d * scales).unsqueeze(-1) * q).reshape(n, QK_K)


_BLOCKS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
           "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
SUPPORTED = ("F32", "F16", "BF16", *_BLOCKS)


def dequantize(raw: torch.Tensor, type_id: int, shape: tuple[int, ...],
               tensor_name: str = "?") -> torch.Tensor:
    """raw: the tensor's bytes as uint8 (any shape, rows contiguous); shape: torch order
    (rows, columns). Returns float32 of that shape."""
    name = type_name(type_id)
    if name not in SUPPORTED:
        raise UnsupportedQuant(
            f"GGUF tensor {tensor_name!r} is stored as {name}, which is not supported; "
            f"supported types: {', '.join(SUPPORTED)}")
    raw = raw.reshape(-1)
    if name == "F32":
        return raw.view(torch.float32).reshape(shape).clone()
    if name == "F16":
        return raw.view(torch.float16).reshape(shape).float()
    if name == "BF16":
        return raw.view(torch.bfloat16).reshape(shape).float()
    _, per_block, nbytes = TYPES[type_id]
    blocks = raw.reshape(-1, nbytes)
    return _BLOCKS[name](blocks).reshape(shape)
