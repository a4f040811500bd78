"""A linear layer over K-quant blocks packed for our kernel (kernels/kquant_linear.cpp): what
the Q4_K and Q6_K layers share. Each names its op and packs and unpacks its own blocks."""

from __future__ import annotations

import torch

from specdec.model.formats import opaque_op
from specdec.model.formats.linear import Linear


class KQuantLinear(Linear):
    """y = x W^T + b, W packed for the kernel op `op` (specdec_kquant.<op>) by `pack`; fp32
    in and out. in_features may be narrower than the blocks (a partial last block)."""

    op = ""
    pack = staticmethod(lambda blocks: NotImplemented)        # blocks -> the kernel's layout
    unpack = staticmethod(lambda packed, n: NotImplemented)   # and back (the first n rows)

    def __init__(self, blocks, bias: torch.Tensor | None = None,
                 in_features: int | None = None) -> None:
        from specdec.model.formats.kernels.build import kquant

        self.kernel = getattr(kquant(), self.op)
        self.packed = self.pack(blocks)
        # in_features: the input width, where the blocks end in zero padding (a partial block).
        self.out_features = blocks.shape[0]
        self.in_features = in_features or blocks.shape[1]
        self.bias = None if bias is None else bias.float().contiguous()
        self.handle = opaque_op.register(self)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return opaque_op.call(self, x)

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if shape[-1] != self.in_features:
            # (The kernel takes any width up to its blocks': a narrower input would read as
            # zeros, silently.)
            raise ValueError(f"{type(self).__name__}: input of width {shape[-1]}, the layer "
                             f"takes {self.in_features}")
        x = x.reshape(-1, shape[-1])
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        y = self.kernel(x, self.packed, self.out_features, self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's scalar form (tests hold the two bit-identical)."""
        from specdec.model.formats.kernels.build import kquant

        ref = getattr(kquant(), self.op + "_reference")
        return ref(x.float().contiguous(), self.packed, self.out_features, self.bias)

    @property
    def nbytes(self) -> int:
        b = 0 if self.bias is None else 4 * self.bias.numel()
        return self.packed.numel() + b

    def weight(self) -> torch.Tensor:
        return self.blocks().dequantize()[:, :self.in_features]

    def blocks(self):
        return self.unpack(self.packed, self.out_features)

    def first_rows(self, n: int) -> KQuantLinear:
        return type(self)(self.blocks().rows(0, n),
                          None if self.bias is None else self.bias[:n], self.in_features)
