"""Attention for the batch-invariant formats: every token attends alone over the first n keys
of its own KV slot, all tokens of a layer in one call of our kernel
(kernels/token_attention.cpp), reading the cache's fp16 keys and values as they are.

Why: a batch-invariant target (q4k, int8) must give a token the same arithmetic whether it is
decoded alone, verified among k others or prefilled in a chunk, so it cannot share SDPA's
padded grid. One SDPA call per token per layer kept that property, but cost a call each
(a 512-token prefill chunk: 14,000 calls) and read fp32 keys; at 1,790 tokens of context a
decode step paid 20 ms for its attention where the kernel pays about 5.

Where the kernel cannot be built (no compiler), the same per-token rule runs through SDPA, one
call per token: the same property, slower.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F


@functools.cache
def _ops():
    from specdec.model.formats.kernels.build import KernelUnavailable, attention

    try:
        return attention()
    except KernelUnavailable:
        return None


def kernel_available() -> bool:
    return _ops() is not None


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
           n_keys: torch.Tensor, per_token: list[tuple[int, int]],
           kv_index: torch.Tensor | None = None, window: int | None = None,
           scale: float | None = None) -> torch.Tensor:
    """q [T, heads, dim] float32; keys, values [slots, len, kv heads, dim] (one layer of the
    cache); token t attends over the first n_keys[t] keys of slot slots[t] (per_token: the
    same as host pairs), the last `window` of them where the layer has a window. kv_index:
    the kv head of each query head where the grouping is not uniform (replicated heads
    under tensor parallelism). Returns [T, heads * dim].

    Which computation a token gets depends on its own key count alone (a token past its
    window attends through SDPA, the kernel reading keys from 0), never on its batch."""
    T, nq, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    ops = _ops()
    if ops is None or kv_index is not None or q.device.type != "cpu" or D % 16:
        return _alone(q, keys, values, per_token, range(T), kv_index, window, scale)
    far = [] if window is None else [t for t, (_, n) in enumerate(per_token) if n > window]
    if not far:
        return ops.attend(q.contiguous(), keys, values, slots, n_keys, scale).view(T, nq * D)
    far_set = set(far)
    near = [t for t in range(T) if t not in far_set]
    out = q.new_empty(T, nq * D)
    if near:
        idx = torch.tensor(near)
        out[idx] = ops.attend(q[idx].contiguous(), keys, values, slots[idx], n_keys[idx],
                              scale).view(len(near), nq * D)
    out[torch.tensor(far)] = _alone(q, keys, values, per_token, far, kv_index, window, scale)
    return out


def _alone(q, keys, values, per_token, tokens, kv_index, window, scale) -> torch.Tensor:
    """Each of `tokens` attending alone through SDPA (the rule where the kernel is absent)."""
    _, nq, D = q.shape
    out = []
    for t in tokens:
        slot, n = per_token[t]
        first = max(0, n - window) if window is not None else 0
        k = keys[slot, first:n].transpose(0, 1).to(q.dtype)   # [kv heads, n, dim]
        v = values[slot, first:n].transpose(0, 1).to(q.dtype)
        if kv_index is not None:
            k, v = k[kv_index], v[kv_index]
        nkv = k.shape[0]
        o = F.scaled_dot_product_attention(q[t].view(1, nq, 1, D), k.unsqueeze(0),
                                           v.unsqueeze(0), enable_gqa=nkv != nq, scale=scale)
        out.append(o.reshape(1, nq * D))
    return torch.cat(out)
