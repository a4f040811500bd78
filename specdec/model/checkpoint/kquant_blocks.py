"""A GGUF file's K-quant blocks as values: Q4_K and Q6_K tensors read into their fields
(ggml-quants.c's layout), without rounding anything. The checkpoint hands these back for
the formats that run the file's very blocks (formats/q4k.py, formats/q6k.py pack them for
the kernel)."""

from __future__ import annotations

import dataclasses

import torch

from specdec.model.checkpoint.gguf_quants import _k_scale_min

QK = 256          # weights per block
Q4_K_BYTES = 144  # bytes of one GGUF Q4_K block
Q6_K_BYTES = 210  # bytes of one GGUF Q6_K block


class _RowBlocks:
    """A weight's blocks, one row of blocks per output row: every field's first axis is the
    row, its second the block."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * QK

    def rows(self, start: int, stop: int):
        return type(self)(*(getattr(self, f.name)[start:stop] for f in dataclasses.fields(self)))

    @classmethod
    def cat(cls, parts: list):
        return cls(*(torch.cat([getattr(p, f.name) for p in parts])
                     for f in dataclasses.fields(cls)))


@dataclasses.dataclass
class Q4KBlocks(_RowBlocks):
    """A weight [N, K] in Q4_K blocks, unpacked: d, dmin [N, nb] float32 (fp16 values);
    scales, mins [N, nb, 8] uint8 (6 bits); q [N, nb, 256] uint8 (4 bits), columns in order."""

    d: torch.Tensor
    dmin: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    q: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        n, nb = self.d.shape
        scale = (self.d.unsqueeze(-1) * self.scales.float()).unsqueeze(-1)  # [N, nb, 8, 1]
        low = (self.dmin.unsqueeze(-1) * self.mins.float()).unsqueeze(-1)
        q = self.q.reshape(n, nb, 8, 32).float()
        return (scale * q - low).reshape(n, nb * QK)


def q4k_from_gguf(raw: torch.Tensor) -> Q4KBlocks:
    """GGUF Q4_K bytes, [N, nb * 144] uint8 -> the blocks (ggml-quants.c's layout)."""
    n = raw.shape[0]
    b = raw.reshape(-1, Q4_K_BYTES)
    d = b[:, :2].contiguous().view(torch.float16).float()
    dmin = b[:, 2:4].contiguous().view(torch.float16).float()
    scales, mins = _k_scale_min(b[:, 4:16])
    # 4 runs of 32 bytes; each holds two sub-blocks (low nibbles, then high).
    qs = b[:, 16:].reshape(-1, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, -1, QK)
    nb = q.shape[1]
    return Q4KBlocks(d.reshape(n, nb), dmin.reshape(n, nb), scales.to(torch.uint8).reshape(n, nb, 8),
                     mins.to(torch.uint8).reshape(n, nb, 8), q)


@dataclasses.dataclass
class Q6KBlocks(_RowBlocks):
    """A weight [N, K] in Q6_K blocks, unpacked: d [N, nb] float32 (fp16 values); scales
    [N, nb, 16] int8; q [N, nb, 256] uint8 (6 bits, the stored value: weight ~ q - 32)."""

    d: torch.Tensor
    scales: torch.Tensor
    q: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        n, nb = self.d.shape
        scale = (self.d.unsqueeze(-1) * self.scales.float()).unsqueeze(-1)   # [N, nb, 16, 1]
        q = self.q.reshape(n, nb, 16, 16).to(torch.int8) - 32
        return (scale * q.float()).reshape(n, nb * QK)


def q6k_from_gguf(raw: torch.Tensor) -> Q6KBlocks:
    """GGUF Q6_K bytes, [N, nb * 210] uint8 -> the blocks (ggml-quants.c's layout: per block
    128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, an fp16 d)."""
    n = raw.shape[0]
    b = raw.reshape(-1, Q6_K_BYTES)
    ql = b[:, :128].reshape(-1, 2, 1, 64)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = (qh >> shifts) & 0x03
    q = (low | (high << 4)).reshape(n, -1, QK)
    nb = q.shape[1]
    scales = b[:, 192:208].contiguous().view(torch.int8).reshape(n, nb, 16)
    d = b[:, 208:210].contiguous().view(torch.float16).float().reshape(n, nb)
    return Q6KBlocks(d, scales, q)
