"""One forward's ragged batch: several sequences, each with its own new tokens and positions.

A decode row brings 1 token, a verify row k+1, a prefill chunk many. Linear layers run on the
flat [T] token axis (no padding waste); attention scatters queries into a padded
[B, Qmax] grid so one fused attention call covers the whole batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass
class BatchInput:
    token_ids: torch.Tensor   # [T] int64, all rows' new tokens, concatenated
    positions: torch.Tensor   # [T] int64, each token's position in its sequence
    slot_of_token: torch.Tensor  # [T] int64
    slots: torch.Tensor       # [B] int64, KV slot of each row
    row_of_token: torch.Tensor   # [T] int64
    col_of_token: torch.Tensor   # [T] int64, index within its row
    query_lens: list[int]
    starts: list[int]         # tokens already in the cache before this forward, per row
    max_query: int
    kv_len: int               # longest context in the batch after this forward

    @property
    def num_rows(self) -> int:
        return len(self.query_lens)

    def last_token_indices(self) -> torch.Tensor:
        """Flat index of each row's last new token (where plain decoding reads logits)."""
        ends = torch.tensor(self.query_lens, dtype=torch.long).cumsum(0) - 1
        return ends.to(self.token_ids.device)

    def row_token_indices(self, row: int) -> torch.Tensor:
        off = sum(self.query_lens[:row])
        return torch.arange(off, off + self.query_lens[row], device=self.token_ids.device)

    @classmethod
    def build(
        cls,
        rows: Sequence[tuple[int, int, Sequence[int]]],
        device: torch.device | str = "cpu",
    ) -> BatchInput:
        """rows: (slot, start position, new token ids) for each sequence of the forward."""
        if not rows:
            raise ValueError("a forward needs at least one row")
        toks: list[int] = []
        pos: list[int] = []
        slot_tok: list[int] = []
        row_tok: list[int] = []
        col_tok: list[int] = []
        for r, (slot, start, ids) in enumerate(rows):
            n = len(ids)
            if n == 0:
                raise ValueError(f"row {r} (slot {slot}) has no new tokens")
            toks.extend(int(t) for t in ids)
            pos.extend(range(start, start + n))
            slot_tok.extend([slot] * n)
            row_tok.extend([r] * n)
            col_tok.extend(range(n))
        lens = [len(ids) for _, _, ids in rows]
        starts = [start for _, start, _ in rows]

        def t(x):
            return torch.tensor(x, dtype=torch.long, device=device)

        return cls(
            token_ids=t(toks), positions=t(pos), slot_of_token=t(slot_tok),
            slots=t([s for s, _, _ in rows]), row_of_token=t(row_tok), col_of_token=t(col_tok),
            query_lens=lens, starts=starts, max_query=max(lens),
            kv_len=max(s + n for s, n in zip(starts, lens, strict=True)),
        )
