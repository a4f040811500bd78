"""The ops of a batch-invariant model (q4k, int4, int8, w8a8 on a CPU) through our row
kernels, for the block every path runs (specdec.model.step.block): RMSNorm fused with the
residual add before it (kernels/row_ops.cpp), the rotary embedding, the K/V write and every
token's attention in one call where a layer rotates every dimension and has no window
(kernels/token_attention.cpp), the MLP's activation row by row. A row's arithmetic is then
the same by construction whatever its batch and thread count, and a layer is a handful of
calls instead of some thirty small ATen ops (about 3 ms of a 1.5B decode step).
"""

from __future__ import annotations

import functools

import torch

from specdec.model.formats import token_attention
from specdec.model.formats.activation import gate_act


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


class InvariantOps:
    """One forward's ops: its batch, its per-token plan ((slot, keys it sees) of each
    token), the cache and each layer's rotary tables (block.Rotary)."""

    def __init__(self, model, batch, plan, cache, rotary) -> None:
        self.model, self.batch, self.cache, self.rotary = model, batch, cache, rotary
        self.attention, self.rows = _ops()
        self.per_token, self.slots, self.n_keys = plan.per_token, plan.slots, plan.n_keys

    def norm(self, x, w, eps):
        return self.rows.rms_norm(x.contiguous(), w, eps)

    def add_norm(self, x, delta, w, eps):
        return self.rows.add_rms_norm(x, delta.contiguous(), w, eps)

    def act(self, gate_up):
        return gate_act(self.model.cfg.family.activation, gate_up, row_invariant=True)

    def tables(self, layer):
        return self.rotary[layer].at(self.batch.positions)

    def fused_attend(self, i, qkv):
        cfg, layer, r = self.model.cfg, self.model.layers[i], self.rotary[i]
        if cfg.layer_windows[i] is not None or r.full != layer.head_dim:
            return None  # a window or partial rotary: the block rotates, attend() attends
        return self.attention.attend_rotary(
            qkv.contiguous(), r.cos, r.sin, self.batch.positions, self.cache.k[i],
            self.cache.v[i], self.slots, self.n_keys, layer.n_q, layer.n_kv, cfg.attn_scale)

    def attend(self, i, q, k, v):
        self.cache.write(i, self.batch.slot_of_token, self.batch.positions, k, v)
        return token_attention.attend(q, self.cache.k[i], self.cache.v[i], self.slots,
                                      self.n_keys, self.per_token, None,
                                      self.model.cfg.layer_windows[i],
                                      self.model.cfg.attn_scale)
