"""The target's log-probabilities of the tokens a step emits, for requests that ask for them.

A token's log-probability is read at the position that predicted it, from the same logits
the rejection rule used: for a plain step its one position, for a verified row position j
for its j-th kept guess and the last for the corrected or bonus token. So a token has the
same log-probability whether it was decoded plainly or kept from a guess (the target's
forward at that position is the same), and speculation changes only how fast they come.

The distribution is the target's raw one (log-softmax of its logits, before temperature,
top-k and top-p), which is what vLLM reports by default and what a client comparing runs at
different temperatures expects to stay put.
"""

from __future__ import annotations

import torch

# A token's log-probability, then its top alternatives as (token id, log-probability),
# most likely first.
TokenLogprob = tuple[float, list[tuple[int, float]]]


def emitted_logprobs(logits: torch.Tensor, positions: list[list[int]],
                     tokens: list[list[int]], tops: list[int]) -> list[list[TokenLogprob]]:
    """logits [N, V] of one step; per row: the flat positions of its emitted tokens, the
    tokens, and how many alternatives it wants. One log-softmax over the rows' positions
    and one copy to the host for all of them."""
    flat = [p for row in positions for p in row]
    if not flat:
        return [[] for _ in positions]
    lp = torch.log_softmax(logits[torch.tensor(flat, device=logits.device)].float(), -1)
    chosen = lp.gather(1, torch.tensor([t for row in tokens for t in row],
                                       device=lp.device).unsqueeze(1)).squeeze(1)
    top = max(tops)
    if top:
        top_lp, top_ids = lp.topk(top, -1)
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    chosen = chosen.tolist()
    out, at = [], 0
    for row, n in zip(positions, tops, strict=True):
        out.append([(chosen[at + j], [(top_ids[at + j][i], top_lp[at + j][i])
                                      for i in range(n)] if n else [])
                    for j in range(len(row))])
        at += len(row)
    return out
