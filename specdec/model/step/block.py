"""The decoder block, written once: every execution path (the eager ragged forward, the
static and captured step, the row-invariant CPU kernels) runs these functions, and differs
only in its `BlockOps`: how it normalises, activates, rotates and attends.

What a family adds (specdec.model.checkpoint.family) is read here: q/k norms before the
rotary embedding, norms on the attention's and the MLP's outputs, the activation, partial
rotary dimensions, each layer's rotary embedding and window, the attention scale. The
numerics follow transformers' modeling code step for step, so fp32 logits match it.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from specdec.model.checkpoint.rope import Rope
from specdec.model.formats.activation import gate_act


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics regardless of the model dtype, as the reference implementation does.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] by per-token tables [T, 1, dim]; dims past `dim` (partial rotary)
    pass unrotated."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned, kept = x[..., :dim], x[..., dim:]
    return torch.cat((turned * cos + rotate_half(turned) * sin, kept), dim=-1)


class Rotary:
    """cos/sin tables of one rotary embedding, indexed by absolute position (each token
    carries its own), the kind's factor on both already applied."""

    def __init__(self, rope: Rope, max_len: int, dtype, device) -> None:
        inv_freq, scale = rope.tables(max_len)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scale).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scale).to(dtype=dtype, device=device)
        self.full = rope.dim  # rotated dims
        self._at: tuple = (None, None, None)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at each token's position, [T, 1, dim]: gathered once per forward (the
        layers sharing this embedding ask with the same positions tensor)."""
        if self._at[0] is not positions:
            self._at = (positions, self.cos[positions].unsqueeze(1),
                        self.sin[positions].unsqueeze(1))
        return self._at[1], self._at[2]


class BlockOps(Protocol):
    """What an execution path supplies to the block."""

    def norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def act(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def tables(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s cos and sin at each token's position: [T, 1, dim]."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Writes k, v ([T, kv heads, D], rotated) into the cache at each token's slot and
        position, then each token's attention over its keys (the layer's window) ->
        [T, heads * D]."""

    def fused_attend(self, layer: int, qkv: torch.Tensor) -> torch.Tensor | None:
        """Rotation, write and attention in one call where the path has one for this
        layer; None where not."""


class AtenOps:
    """The common ops through ATen (the eager and static paths' norms and activation)."""

    def __init__(self, model) -> None:
        self.model = model

    def norm(self, x, w, eps):
        return rms_norm(x, w, eps)

    def add_norm(self, x, delta, w, eps):
        x = x + delta
        return x, rms_norm(x, w, eps)

    def act(self, gate_up):
        return gate_act(self.model.cfg.family.activation, gate_up,
                        row_invariant=self.model.format.per_row)

    def fused_attend(self, layer, qkv):
        return None


def run_layers(model, x: torch.Tensor, ops: BlockOps) -> torch.Tensor:
    """x: the embedded tokens [T, hidden]; returns the last layer's output (before the
    final norm)."""
    layers, fam = model.layers, model.cfg.family
    h = ops.norm(x, layers[0].w["in_norm"], layers[0].eps)
    for i, layer in enumerate(layers):
        w = layer.w
        a = attention(model, i, layer, h, ops)
        if fam.output_norms:
            a = ops.norm(a, w["attn_out_norm"], layer.eps)
        x, h = ops.add_norm(x, a, w["post_norm"], layer.eps)
        m = model.all_reduce(w["down"](ops.act(w["gate_up"](h))))
        if w["down_b"] is not None:
            m = m + w["down_b"]
        if fam.output_norms:
            m = ops.norm(m, w["mlp_out_norm"], layer.eps)
        if i + 1 < len(layers):
            x, h = ops.add_norm(x, m, layers[i + 1].w["in_norm"], layers[i + 1].eps)
        else:
            x = x + m
    return x


def attention(model, i: int, layer, h: torch.Tensor, ops: BlockOps) -> torch.Tensor:
    D, nq, nkv, w = layer.head_dim, layer.n_q, layer.n_kv, layer.w
    qkv = w["qkv"](h)
    if w["q_norm"] is not None:  # per head, before the rotary embedding
        q = ops.norm(qkv[:, :nq * D].reshape(-1, D), w["q_norm"], layer.eps)
        k = ops.norm(qkv[:, nq * D:(nq + nkv) * D].reshape(-1, D), w["k_norm"], layer.eps)
        qkv = torch.cat((q.view(-1, nq * D), k.view(-1, nkv * D), qkv[:, (nq + nkv) * D:]), 1)
    out = ops.fused_attend(i, qkv)
    if out is None:
        q = qkv[:, : nq * D].view(-1, nq, D)
        k = qkv[:, nq * D: (nq + nkv) * D].view(-1, nkv, D)
        v = qkv[:, (nq + nkv) * D:].view(-1, nkv, D)
        cos, sin = ops.tables(i)
        out = ops.attend(i, rotate(q, cos, sin), rotate(k, cos, sin), v)
    out = model.all_reduce(w["o"](out))
    return out if w["o_b"] is None else out + w["o_b"]


def embed(model, token_ids: torch.Tensor) -> torch.Tensor:
    """The tokens' embeddings in the model's dtype, scaled where the family scales them
    (Gemma: by sqrt(hidden), rounded to the table's dtype as transformers rounds it)."""
    x = model.embed[token_ids].to(model.dtype)
    scale = model.cfg.embed_scale
    return x if scale is None else x * torch.tensor(scale, dtype=x.dtype, device=x.device)
