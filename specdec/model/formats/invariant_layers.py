"""The layers of a batch-invariant model (q4k, int4, int8, w8a8 on a CPU) through our
row-parallel kernels: RMSNorm fused with the residual add before it (kernels/row_ops.cpp),
the rotary embedding, the K/V write and every token's attention in one call
(kernels/token_attention.cpp), the MLP's activation row by row. A row's arithmetic is then
the same by construction whatever its batch and thread count, and a layer is a handful of
calls instead of some thirty small ATen ops (about 3 ms of a 1.5B decode step).
"""

from __future__ import annotations

import functools
import math

import torch

from specdec.model.formats.activation import silu_mul


@functools.cache
def _ops():
    from specdec.model.formats.kernels.build import KernelUnavailable, attention, rows

    try:
        return attention(), rows()
    except KernelUnavailable:
        return None


def usable(model) -> bool:
    """Whether this model's layers can run here: a batch-invariant format on a CPU, uniform
    kv-head groups (not replicated heads under tensor parallelism), head dims the kernels
    take, and the kernels built."""
    return (model.format.per_row and model.device.type == "cpu"
            and model.cfg.head_dim % 16 == 0 and model.dtype == torch.float32
            and all(layer.kv_gather is None for layer in model.layers)
            and _ops() is not None)


def run_layers(model, x: torch.Tensor, batch, plan, cache, rotary) -> torch.Tensor:
    """x: the embedded tokens [T, hidden]; returns the last layer's output (before the
    final norm)."""
    attend, rows = _ops()
    layers = model.layers
    h = rows.rms_norm(x, layers[0].w["in_norm"], layers[0].eps)
    for i, layer in enumerate(layers):
        w, D = layer.w, layer.head_dim
        a = attend.attend_rotary(w["qkv"](h).contiguous(), rotary.cos, rotary.sin, batch.positions,
                                 cache.k[i], cache.v[i], plan.slots, plan.n_keys, layer.n_q,
                                 layer.n_kv, 1.0 / math.sqrt(D))
        a = model.all_reduce(w["o"](a))
        if w["o_b"] is not None:
            a = a + w["o_b"]
        x, h = rows.add_rms_norm(x, a, w["post_norm"], layer.eps)
        m = model.all_reduce(w["down"](silu_mul(w["gate_up"](h), row_invariant=True)))
        if w["down_b"] is not None:
            m = m + w["down_b"]
        if i + 1 < len(layers):
            x, h = rows.add_rms_norm(x, m, layers[i + 1].w["in_norm"], layers[i + 1].eps)
        else:
            x = x + m
    return x
