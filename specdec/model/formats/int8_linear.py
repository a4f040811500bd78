"""int8 weights x int8 activations with one activation scale per row: batch-independent.

FBGEMM's dynamic int8 linear quantizes a whole batch with one activation scale, so a row's
result moves when other rows join it, which a target must never allow. Here every row is divided by its own absmax first and the kernel is handed a
fixed scale of 1, so its u8 x s8 products accumulate in int32 (exact, in any order) and
the row's scale is multiplied back afterwards: every step of a row's arithmetic sees that
row alone. The kernel is FBGEMM's static quantized linear with an fp32 output
(`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`).

One int8 level per row ("w8a8") agrees less often with an fp32 reference of the same
weights than llama.cpp's own arithmetic of the file does (`specdec bench formats`): a row's
few outlier channels set its scale and leave the rest about 5 bits. "int8" therefore sends
each row twice through the same GEMM call, as its int8 rounding and then its rounding error
quantized again with a scale of its own (~15 bits in all): the weights are still read once.

8-bit activations need a kernel that accumulates u8 x s8 pairs without saturating: AVX2's
vpmaddubsw sums pairs into int16 and saturates above 32767 (255 x 127 x 2 does); AVX512
VNNI's vpdpbusd does not. A probe with the worst case decides once per process; where
it saturates, activations keep 7 bits (127 x 127 x 2 fits).
"""

from __future__ import annotations

import functools
import warnings

import torch

from specdec.model.formats import opaque_op
from specdec.model.formats.linear import Linear


def pack_int8(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """FBGEMM's packed int8 weights, one symmetric scale per output channel."""
    w = weight.float().contiguous()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13;
        warnings.simplefilter("ignore", UserWarning)  # FBGEMM's packing still takes them
        q = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long),
                                       0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, bias)


class PackedInt8Linear(Linear):
    """FBGEMM-packed int8 weights (one scale per output channel) and an fp32 bias; the
    subclasses differ only in how they quantize activations."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.float()

    @property
    def nbytes(self) -> int:
        b = 0 if self.bias is None else 4 * self.bias.numel()
        return self.out_features * self.in_features + 8 * self.out_features + b

    def weight(self) -> torch.Tensor:
        return torch.ops.quantized.linear_unpack(self._packed)[0].dequantize()


class DynamicInt8Linear(PackedInt8Linear):
    """int8 weights per output channel (symmetric), activations quantized per call; fp32
    in and out (FBGEMM). Batch-dependent: see the module docstring."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        self._packed = pack_int8(weight, self.bias)
        self.handle = opaque_op.register(self)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return opaque_op.call(self, x)

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            x = x.float()
        # reduce_range: 7-bit activations, which FBGEMM's AVX2 kernels need to avoid
        # overflowing their 16-bit intermediate sums.
        return torch.ops.quantized.linear_dynamic(x, self._packed, True)

    def first_rows(self, n: int) -> DynamicInt8Linear:
        # Per-row scales: the kept rows requantize to the same integers.
        return DynamicInt8Linear(self.weight()[:n],
                                 None if self.bias is None else self.bias[:n])


@functools.cache
def activation_levels() -> tuple[float, int]:
    """(largest magnitude of a scaled row, zero point) for this machine's kernel."""
    w = torch.full((16, 256), 127.0)
    packed = pack_int8(w)  # scale 1: the weights are the integers 127
    x = torch.full((1, 256), 127.0)
    got = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        x, 1.0, 128, packed)
    exact = 127.0 * 127.0 * 256
    return (127.0, 128) if torch.allclose(got, torch.full_like(got, exact)) else (63.0, 64)


_GEMM = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32


class RowInt8Linear(PackedInt8Linear):
    """int8 weights per output channel; activations per row, in `levels` int8 levels (2:
    the row, then its rounding error)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 levels: int = 2) -> None:
        super().__init__(weight, bias)
        # Packed without the bias: it is added after the row's scale comes back, in fp32.
        self._packed = pack_int8(weight)
        self._max, self._zero = activation_levels()
        self.levels = levels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            x = x.float()
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        s1 = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / self._max
        if self.levels == 1:
            y = _GEMM(x / s1, 1.0, self._zero, self._packed) * s1
        else:
            # Integers already: the kernel's own rounding (scale 1) leaves them as they are.
            q1 = torch.round(x / s1)
            rest = x - q1 * s1
            s2 = rest.abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / self._max
            n = x.shape[0]
            both = _GEMM(torch.cat([q1, rest / s2]), 1.0, self._zero, self._packed)
            y = both[:n] * s1 + both[n:] * s2
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def first_rows(self, n: int) -> RowInt8Linear:
        return RowInt8Linear(self.weight()[:n], None if self.bias is None else self.bias[:n],
                             self.levels)
