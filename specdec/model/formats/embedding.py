"""The token embedding table kept in a GGUF file's own quantized blocks.

A step looks up one row per token, so the table needs no float copy: a 1.5B Qwen's table is
151,936 x 1,536, 445 MB in fp16 and 125 MB in the file's Q4_K blocks (the 0.5B draft's: 259
against 89 MB of Q5_0). A lookup gathers the rows' bytes and dequantizes just those, with the
same arithmetic as loading the whole table (specdec/model/checkpoint/gguf_quants.py), so the rows are
what a float table made from the file would hold.
"""

from __future__ import annotations

import torch

from specdec.model.checkpoint.gguf_quants import dequantize


class BlockEmbedding:
    def __init__(self, raw: torch.Tensor, type_id: int, hidden: int, name: str) -> None:
        """raw: [vocab, bytes a row] uint8, owned (not a view of a memory-mapped file)."""
        self.raw, self.type_id, self.hidden, self.name = raw.contiguous(), type_id, hidden, name

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.hidden

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def __getitem__(self, ids) -> torch.Tensor:
        """Rows as float32: ids a tensor of token ids (any shape), or a slice of rows."""
        if isinstance(ids, slice):
            raw = self.raw[ids]
            return dequantize(raw, self.type_id, (raw.shape[0], self.hidden), self.name)
        flat = ids.reshape(-1)
        rows = dequantize(self.raw[flat], self.type_id, (flat.numel(), self.hidden), self.name)
        return rows.view(*ids.shape, self.hidden)


def table_bytes(embed) -> int:
    """Bytes the embedding holds: a float table or its blocks."""
    if isinstance(embed, BlockEmbedding):
        return embed.nbytes
    return embed.numel() * embed.element_size()
