"""The `q4k` weight format: GGUF's 4-bit K-quant blocks, run by our own int8 kernel.

A Q4_K row is a run of 256-weight blocks, each with an fp16 scale d and minimum dmin and
eight 32-weight sub-blocks with a 6-bit scale and minimum of their own: weight = d * scale
* q - dmin * min, q in 0..15 (4.5 bits a weight). Tensors a GGUF file stores as Q4_K keep
their very blocks (nothing is rounded twice); float weights (safetensors, F16 files, test
fixtures) are quantized to the same blocks here. The kernel (kernels/kquant_linear.cpp)
quantizes each row's activations to int8 per 256 columns and sums u8 x s8 products in
int32: llama.cpp's Q4_K x Q8_K arithmetic, batch-independent, so a target may use it.
"""

from __future__ import annotations

import torch

from specdec.model.checkpoint.kquant_blocks import QK, Q4KBlocks
from specdec.model.formats.kquant_linear import KQuantLinear

TILE = 16        # output channels per SIMD tile
BLOB = 2368      # packed bytes per (tile, block): see kernels/kquant_linear.cpp


def available() -> bool:
    from specdec.model.formats.kernels.build import kquant_available

    return kquant_available()


def quantize(weight: torch.Tensor) -> Q4KBlocks:
    """Float weights [N, K] (K a multiple of 32) -> Q4_K blocks: per 32 weights a scale
    and a minimum (<= 0) spanning them, then each block's 8 scales and 8 minimums as 6-bit
    multiples of its own d and dmin (fp16), as llama.cpp's K-quants store them."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"q4k needs input features in multiples of 32, got {k}")
    # A partial last block is padded with zero weights (their sub-blocks quantize to zero);
    # the kernel pads each row of activations to match.
    w = torch.nn.functional.pad(weight.float(), (0, -k % QK))
    k = w.shape[1]
    w = w.reshape(n, k // QK, 8, 32)
    lo = w.amin(dim=-1).clamp(max=0.0)
    hi = w.amax(dim=-1)
    sub_scale = (hi - lo) / 15.0
    d = (sub_scale.amax(dim=-1) / 63.0).half().float()
    dmin = ((-lo).amax(dim=-1) / 63.0).half().float()
    safe_d = torch.where(d > 0, d, torch.ones_like(d)).unsqueeze(-1)
    safe_dmin = torch.where(dmin > 0, dmin, torch.ones_like(dmin)).unsqueeze(-1)
    scales = torch.round(sub_scale / safe_d).clamp(0, 63)
    mins = torch.round(-lo / safe_dmin).clamp(0, 63)
    step = (d.unsqueeze(-1) * scales).unsqueeze(-1)
    offset = (dmin.unsqueeze(-1) * mins).unsqueeze(-1)
    q = torch.round((w + offset) / torch.where(step > 0, step, torch.ones_like(step)))
    q = torch.where(step > 0, q, torch.zeros_like(q)).clamp(0, 15)
    return Q4KBlocks(d, dmin, scales.to(torch.uint8), mins.to(torch.uint8),
                     q.to(torch.uint8).reshape(n, k // QK, QK))


def pad_to_tiles(n: int):
    """A function giving a tensor of n rows zero rows up to a whole number of tiles."""
    pad = -n % TILE

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t

    return padded


def pack(blocks: Q4KBlocks) -> torch.Tensor:
    """The kernel's layout: [tiles, nb, 2368] uint8, output channels 16 to a tile (the last
    tile padded with zero weights)."""
    n, nb = blocks.d.shape
    tiles = -(-n // TILE)
    padded = pad_to_tiles(n)

    # column 32j + 16h + 4p + i -> [j][h][p][i]; a byte holds h = 0 (low) and h = 1 (high).
    q = padded(blocks.q).reshape(tiles, TILE, nb, 8, 2, 4, 4)
    byte = q[:, :, :, :, 0] | (q[:, :, :, :, 1] << 4)              # [T, c, nb, j, p, i]
    qs = byte.permute(0, 2, 3, 4, 1, 5).reshape(tiles, nb, 2048)    # [T, nb, j, p, c, i]
    sc = padded(blocks.scales).reshape(tiles, TILE, nb, 8).permute(0, 2, 3, 1)
    mn = padded(blocks.mins).reshape(tiles, TILE, nb, 4, 2).permute(0, 2, 3, 1, 4)

    def halves(t: torch.Tensor) -> torch.Tensor:
        h = padded(t).half().reshape(tiles, TILE, nb).permute(0, 2, 1).contiguous()
        return h.view(torch.uint8)                                   # [T, nb, 32]

    return torch.cat([qs, sc.reshape(tiles, nb, 128), mn.reshape(tiles, nb, 128),
                      halves(blocks.d), halves(blocks.dmin)], dim=2).contiguous()


def unpack(packed: torch.Tensor, n: int) -> Q4KBlocks:
    """The inverse of pack (the first n output channels)."""
    tiles, nb, _ = packed.shape
    qs = packed[:, :, :2048].reshape(tiles, nb, 8, 4, TILE, 4).permute(0, 4, 1, 2, 3, 5)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=4)                    # [T, c, nb, j, h, p, i]
    q = q.reshape(tiles * TILE, nb, QK)[:n]
    sc = packed[:, :, 2048:2176].reshape(tiles, nb, 8, TILE).permute(0, 3, 1, 2)
    mn = packed[:, :, 2176:2304].reshape(tiles, nb, 4, TILE, 2).permute(0, 3, 1, 2, 4)

    def floats(t: torch.Tensor) -> torch.Tensor:
        h = t.contiguous().view(torch.float16).float()               # [T, nb, 16]
        return h.permute(0, 2, 1).reshape(tiles * TILE, nb)[:n]

    return Q4KBlocks(floats(packed[:, :, 2304:2336]), floats(packed[:, :, 2336:2368]),
                     sc.reshape(tiles * TILE, nb, 8)[:n], mn.reshape(tiles * TILE, nb, 8)[:n], q)


class Q4KLinear(KQuantLinear):
    """y = x W^T + b with W in Q4_K blocks; fp32 in and out."""

    op = "q4k"
    pack = staticmethod(pack)
    unpack = staticmethod(unpack)
