"""FBGEMM's packed linear layers as one opaque custom op, so `torch.compile` can trace a
forward that uses them.

The packed weights are TorchScript objects, which the compiler cannot put in a graph. Each
packed layer registers itself here under an integer handle; under compilation its call
becomes `specdec::packed_linear(x, handle)`, an op whose output shape the compiler knows
(the fake implementation) and whose body runs the layer's FBGEMM kernel unchanged. So the
GEMMs stay FBGEMM's while everything between them (norms, rotary, attention, residuals) is
compiled and fused. Eager calls skip the op: same kernel, no dispatcher hop.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_LAYERS: dict[int, weakref.ref] = {}
_NEXT = itertools.count()


def register(layer) -> int:
    """A handle for `layer` (it must have `eager(x)` and `out_features`); held weakly, so a
    dropped model's layers go with it."""
    handle = next(_NEXT)
    _LAYERS[handle] = weakref.ref(layer, lambda _: _LAYERS.pop(handle, None))
    return handle


def _layer(handle: int):
    layer = _LAYERS[handle]()
    if layer is None:
        raise RuntimeError(f"packed layer {handle} is gone")
    return layer


@torch.library.custom_op("specdec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _layer(handle).eager(x)


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _layer(handle).out_features), dtype=torch.float32)


def call(layer, x: torch.Tensor) -> torch.Tensor:
    """The layer's result: through the op while compiling, its kernel directly otherwise."""
    if torch.compiler.is_compiling():
        return packed_linear(x, layer.handle)
    return layer.eager(x)
