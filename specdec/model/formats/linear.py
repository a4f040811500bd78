"""Linear layers over float weights: dense (any dtype, any device) and fp16 packed for
FBGEMM (fp32 activations, CPU). The int8 layers are in int8_linear.py; which format a model
runs in is decided in weight_format.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.model.formats import opaque_op


class Linear:
    """y = x W^T + b for one (possibly sharded) weight, whatever its storage."""

    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def first_rows(self, n: int) -> Linear:
        """The same layer limited to its first n outputs (a draft's vocabulary limit)."""
        raise NotImplementedError


class DenseLinear(Linear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight.contiguous(), bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        b = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + b

    def first_rows(self, n: int) -> DenseLinear:
        return DenseLinear(self.weight[:n], None if self.bias is None else self.bias[:n])


class PackedFp16Linear(Linear):
    """fp16 weights in FBGEMM's packed layout, fp32 in and out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        # Round to fp16 first, so the packed values are exactly the fp16 weights.
        w = weight.to(torch.float16).float().contiguous()
        self.bias = None if bias is None else bias.float()
        self._packed = torch.ops.quantized.linear_prepack_fp16(w, self.bias)
        self.handle = opaque_op.register(self)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return opaque_op.call(self, x)

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            x = x.float()
        return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)

    @property
    def nbytes(self) -> int:
        b = 0 if self.bias is None else 4 * self.bias.numel()
        return 2 * self.out_features * self.in_features + b

    def weight(self) -> torch.Tensor:
        return torch.ops.quantized.linear_unpack_fp16(self._packed)[0]

    def first_rows(self, n: int) -> PackedFp16Linear:
        return PackedFp16Linear(self.weight()[:n],
                                None if self.bias is None else self.bias[:n])
