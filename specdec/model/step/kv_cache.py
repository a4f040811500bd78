"""A KV cache of fixed slots, one per running sequence.

Slot s holds keys and values for positions 0..L-1 of its sequence. Nothing is ever freed or
shifted: a forward writes its tokens' K/V at (slot, position), and attention only looks at
positions up to the query's own. Rolling a slot back to length L is therefore O(1): the
owner just starts the next forward at position L, which overwrites what followed, and the
causal mask hides anything stale beyond it.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_slots, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_len = max_len

    def bytes_per_token(self) -> int:
        _, _, _, h, d = self.k.shape
        return 2 * self.k.shape[0] * h * d * self.k.element_size()

    def write(self, layer: int, slot_of_token, pos_of_token, k, v) -> None:
        # (Rounded to the cache's dtype here: an fp16 cache under fp32 activations.)
        self.k[layer, slot_of_token, pos_of_token] = k.to(self.k.dtype)
        self.v[layer, slot_of_token, pos_of_token] = v.to(self.v.dtype)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Slot dst's first n positions become slot src's (a prefix shared by copy: see
        specdec/model/step/prefix_cache.py), in every layer."""
        if n > 0 and src != dst:
            self.k[:, dst, :n] = self.k[:, src, :n]
            self.v[:, dst, :n] = self.v[:, src, :n]

    def read(self, layer: int, slots, kv_len: int, single_slot: int | None):
        """Keys/values [B, kv_len, heads, dim] for the given slots (a view for one slot)."""
        if single_slot is not None:
            return (self.k[layer, single_slot, :kv_len].unsqueeze(0),
                    self.v[layer, single_slot, :kv_len].unsqueeze(0))
        return self.k[layer, slots, :kv_len], self.v[layer, slots, :kv_len]
