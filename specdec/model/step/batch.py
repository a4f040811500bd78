"""One forward's ragged batch: several sequences, each with its own new tokens and positions.

A decode row brings 1 token, a verify row k+1, a prefill chunk many. Linear layers run on the
flat [T] token axis (no padding waste); attention scatters queries into a padded
[B, Qmax] grid so one fused attention call covers the whole batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from specdec.model.step.host_copy import longs_to_device, to_device


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
    # The host's own copies of what a tensor-parallel leader sends its followers: reading
    # them back from the device would wait for it.
    slot_list: list[int]      # [B]
    token_list: list[int]     # [T]

    @property
    def num_rows(self) -> int:
        return len(self.query_lens)

    def last_token_indices(self) -> torch.Tensor:
        """Flat index of each row's last new token (where plain decoding reads logits), on
        the host: the forward moves it with its other inputs."""
        return torch.tensor(self.query_lens, dtype=torch.long).cumsum(0) - 1

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
        slots = [int(s) for s, _, _ in rows]
        # One copy to the device for all six index vectors (host_copy.py: why).
        token_ids, positions, slot_of_token, slot_t, row_of_token, col_of_token = \
            longs_to_device([toks, pos, slot_tok, slots, row_tok, col_tok], device)
        return cls(
            token_ids=token_ids, positions=positions, slot_of_token=slot_of_token,
            slots=slot_t, row_of_token=row_of_token, col_of_token=col_of_token,
            query_lens=lens, starts=starts, max_query=max(lens),
            kv_len=max(s + n for s, n in zip(starts, lens, strict=True)),
            slot_list=slots, token_list=toks,
        )


def logits_at(logit_indices: torch.Tensor | None, batch: BatchInput,
              device: torch.device) -> torch.Tensor:
    """Which flat tokens get logits, on `device` (default: each row's last token). Callers
    build them on the host; one still on the device stays there."""
    if logit_indices is None:
        logit_indices = batch.last_token_indices()
    return to_device(logit_indices, device)
