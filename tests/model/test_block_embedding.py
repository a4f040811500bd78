"""The embedding table in the file's own blocks: a lookup gives exactly the rows of the table
dequantized whole, and the quantized CPU formats keep it that way (memory for context, not
for a float copy of a table read one row per token)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from specdec.model.checkpoint.gguf_quants import TYPES, dequantize
from specdec.model.formats.embedding import BlockEmbedding, table_bytes


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0], ids=lambda t: t.name)
def test_rows_are_the_whole_tables_rows(qtype):
    _, per_block, nbytes = TYPES[int(qtype)]
    vocab, hidden = 50, 2 * per_block
    rng = np.random.default_rng(int(qtype))
    raw = torch.from_numpy(rng.integers(0, 256, size=(vocab, hidden // per_block * nbytes),
                                        dtype=np.uint8))
    # Keep the fp16 scales finite (random bytes can spell inf/NaN).
    whole = dequantize(raw, int(qtype), (vocab, hidden))
    finite = torch.isfinite(whole).all(1)
    table = BlockEmbedding(raw, int(qtype), hidden, "token_embd.weight")
    ids = torch.tensor([[3, 7, 7], [0, 49, 12]])
    ids = ids[finite[ids].all(1)]
    torch.testing.assert_close(table[ids], whole[ids], rtol=0, atol=0)
    torch.testing.assert_close(table[10:20], whole[10:20], rtol=0, atol=0, equal_nan=True)
    assert table.shape == (vocab, hidden) and table_bytes(table) == raw.numel()


@pytest.mark.real_model
def test_the_pack_target_keeps_its_table_in_blocks(qwen_target_path):
    from specdec.model.checkpoint.gguf_file import GGUFCheckpoint, gguf_in
    from specdec.model.step.decoder import Decoder

    m = Decoder.from_checkpoint(qwen_target_path, "q4k")
    assert isinstance(m.embed, BlockEmbedding)
    # 151,936 x 1,536 in Q4_K: 125 MB, against 445 MB in fp16.
    assert table_bytes(m.embed) < 140 * 2**20
    ids = torch.tensor([0, 13, 151642, 9999])
    want = GGUFCheckpoint(gguf_in(qwen_target_path)).get("model.embed_tokens.weight")[ids]
    torch.testing.assert_close(m.embed[ids], want, rtol=0, atol=0)
    # A float format keeps a float table.
    assert isinstance(Decoder.from_checkpoint(qwen_target_path, "float16").embed, torch.Tensor)
