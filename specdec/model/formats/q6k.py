"""GGUF's 6-bit K-quant blocks (Q6_K), kept as the file stores them and run by our kernel.

A Q4_K_M file keeps its most sensitive tensors in Q6_K (the output projection, half of the
v and down projections): 256-weight blocks with an fp16 d and sixteen 16-weight sub-blocks
with an int8 scale each, weight = d * scale * (q - 32), q in 0..63 (6.56 bits a weight).
Under `q4k` they run through the same kernel as the Q4_K tensors (kernels/kquant_linear.cpp,
llama.cpp's Q6_K x Q8_K arithmetic): the file's very values, fewer bytes than int8 (the
output projection alone is 15% of a step's reads) and one pass instead of int8's two levels.
"""

from __future__ import annotations

import torch

from specdec.model.checkpoint.kquant_blocks import QK, Q6KBlocks
from specdec.model.formats.kquant_linear import KQuantLinear
from specdec.model.formats.q4k import TILE, pad_to_tiles

BLOB = 3360       # packed bytes per (tile, block): see kernels/kquant_linear.cpp


def pack(blocks: Q6KBlocks) -> torch.Tensor:
    """The kernel's layout: [tiles, nb, 3360] uint8, 16 output channels to a tile (the last
    padded with zero weights: scale 0)."""
    n, nb = blocks.d.shape
    tiles = -(-n // TILE)
    padded = pad_to_tiles(n)

    # column 32j + 16h + 4p + i -> [j][h][p][i]
    q = padded(blocks.q).reshape(tiles, TILE, nb, 8, 2, 4, 4)
    low = q & 0x0F
    byte = low[:, :, :, :, 0] | (low[:, :, :, :, 1] << 4)                 # [T, c, nb, j, p, i]
    qs = byte.permute(0, 2, 3, 4, 1, 5).reshape(tiles, nb, 2048)          # [T, nb, j, p, c, i]
    high = q >> 4                                                          # [T, c, nb, j, h, p, i]
    hbyte = high[:, :, :, :, :, 0] | (high[:, :, :, :, :, 1] << 2) | \
        (high[:, :, :, :, :, 2] << 4) | (high[:, :, :, :, :, 3] << 6)     # [T, c, nb, j, h, i]
    qh = hbyte.permute(0, 2, 3, 4, 1, 5).reshape(tiles, nb, 1024)          # [T, nb, j, h, c, i]
    sc = padded(blocks.scales).reshape(tiles, TILE, nb, 16).permute(0, 2, 3, 1)
    sc = sc.contiguous().view(torch.uint8).reshape(tiles, nb, 256)
    d = padded(blocks.d).half().reshape(tiles, TILE, nb).permute(0, 2, 1).contiguous()
    return torch.cat([qs, qh, sc, d.view(torch.uint8)], dim=2).contiguous()


def unpack(packed: torch.Tensor, n: int) -> Q6KBlocks:
    """The inverse of pack (the first n output channels)."""
    tiles, nb, _ = packed.shape
    qs = packed[:, :, :2048].reshape(tiles, nb, 8, 4, TILE, 4).permute(0, 4, 1, 2, 3, 5)
    low = torch.stack([qs & 0x0F, qs >> 4], dim=4)                         # [T, c, nb, j, h, p, i]
    qh = packed[:, :, 2048:3072].reshape(tiles, nb, 8, 2, TILE, 4).permute(0, 4, 1, 2, 3, 5)
    high = torch.stack([(qh >> (2 * p)) & 0x03 for p in range(4)], dim=5)  # [T, c, nb, j, h, p, i]
    q = (low | (high << 4)).reshape(tiles * TILE, nb, QK)[:n]
    sc = packed[:, :, 3072:3328].contiguous().view(torch.int8).reshape(tiles, nb, 16, TILE)
    sc = sc.permute(0, 3, 1, 2).reshape(tiles * TILE, nb, 16)[:n]
    d = packed[:, :, 3328:3360].contiguous().view(torch.float16).float()  # [T, nb, 16]
    d = d.permute(0, 2, 1).reshape(tiles * TILE, nb)[:n]
    return Q6KBlocks(d, sc, q)


class Q6KLinear(KQuantLinear):
    """y = x W^T + b with W in Q6_K blocks; fp32 in and out."""

    op = "q6k"
    pack = staticmethod(pack)
    unpack = staticmethod(unpack)
