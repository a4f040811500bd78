"""The draft's k guesses as one fixed-shape function instead of k host-driven forwards.

Eager, a draft round is k forwards, and between two of them the host reads each row's pick
to build the next batch: k host round trips, each a synchronisation on a GPU. Here every
guess is picked on the device and fed straight back as the next forward's input, so the
round is the catch-up step (the tokens the target added, one static step) and then this
loop: k - 1 one-token forwards and k picks over fixed buffers, which `torch.compile` traces
as one graph and CUDA captures as one graph per (rows bucket, key bucket, k), as SGLang
does for its multi-step draft. One copy to the host per round: the picks (and q).

A pick is the eager proposer's, operation for operation: the argmax, or a draw from the
temperature-warped distribution cut to the top m (the q the rejection rule is told), with
uniforms each row drew from its own generator before the loop. So given the same logits the
loop guesses exactly what the eager proposer would. Rows the eager proposer would stop early
(their k, the confidence rule) run to the batch's k here and are cut on the host: the length
of a proposal still depends only on the draft's side, so the rejection rule stays exact.
Top-k and top-p warps are not traced; rows that ask for them draft eagerly.
"""

from __future__ import annotations

import dataclasses

import torch

from specdec.model.step.host_copy import to_device_all
from specdec.model.step.kv_cache import KVCache
from specdec.model.step.sampling import draw_with_uniform
from specdec.model.step.static_step import MIN_KEYS, StaticDecoder, _power_of_two, static_forward


@dataclasses.dataclass(frozen=True)
class LoopShape:
    rows: int        # the rows bucket (a power of two)
    keys: int        # the key axis, long enough for the last guess's position
    k: int           # guesses per row (the batch's largest k)
    sampled: bool    # False: every row greedy (argmax picks, one-hot q)
    top_m: int       # sampled guesses come from this many top tokens (0: all of them)


@dataclasses.dataclass
class Guesses:
    """A round's guesses, on the host: picks [R, k], the probability of each pick, and for
    sampled rounds the q each was drawn from as (ids, probs) [R, k, m]."""

    picks: list[list[int]]
    conf: torch.Tensor
    q_ids: torch.Tensor | None = None
    q_probs: torch.Tensor | None = None


class LoopBuffers:
    """One shape's inputs, allocated once and refilled in place before every round."""

    def __init__(self, shape: LoopShape, vocab: int, scratch: int, device) -> None:
        r = shape.rows
        self.logits0 = torch.zeros(r, vocab, dtype=torch.float32, device=device)
        self.positions = torch.full((r,), -1, dtype=torch.long, device=device)
        self.slots = torch.full((r,), scratch, dtype=torch.long, device=device)
        self.temps = torch.ones(r, dtype=torch.float32, device=device)
        self.greedy = torch.ones(r, dtype=torch.bool, device=device)
        self.u = torch.full((r, shape.k), 0.5, dtype=torch.float32, device=device)
        self.scratch = scratch

    def fill(self, logits0: torch.Tensor, positions: list[int], slots: list[int],
             temps: list[float], greedy: list[bool], u: torch.Tensor) -> None:
        n, dev = len(positions), self.positions.device
        # The host's values cross in one copy per dtype (host_copy.py: why).
        pos_d, slots_d, temps_d, greedy_d, u_d = to_device_all(
            [torch.tensor(positions, dtype=torch.long), torch.tensor(slots, dtype=torch.long),
             torch.tensor(temps, dtype=torch.float32), torch.tensor(greedy, dtype=torch.bool),
             u.float()], dev)
        self.logits0.zero_()[:n].copy_(logits0.float())
        self.positions.fill_(-1)[:n].copy_(pos_d)
        self.slots.fill_(self.scratch)[:n].copy_(slots_d)
        self.temps.fill_(1.0)[:n].copy_(temps_d)
        self.greedy.fill_(True)[:n].copy_(greedy_d)
        self.u.fill_(0.5)[:n].copy_(u_d)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.logits0, self.positions, self.slots, self.temps, self.greedy, self.u


def loop_shape(rows: int, last_position: int, max_len: int, k: int, sampled: bool,
               top_m: int) -> LoopShape:
    keys = min(max_len, _power_of_two(max(last_position + 1, MIN_KEYS)))
    return LoopShape(_power_of_two(rows), keys, k, sampled, top_m)


def pick(logits: torch.Tensor, temps: torch.Tensor, greedy: torch.Tensor, u: torch.Tensor,
         sampled: bool, top_m: int):
    """Each row's guess and its probability; sampled: also the q it was drawn from. The same
    operations as DraftModelProposer's eager pick (warp_probs, the top-m cut, the draw)."""
    logits = logits.float()
    if not sampled:
        ids = logits.argmax(-1)
        conf = torch.softmax(logits, -1).gather(1, ids.unsqueeze(1)).squeeze(1)
        return ids, conf, None, None
    vocab = logits.shape[-1]
    warped = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
    # Not F.one_hot: off CUDA it checks its ids' range by reading them on the host.
    one_hot = torch.zeros_like(warped).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    probs = torch.where(greedy.unsqueeze(1), one_hot, warped)
    if top_m and top_m < vocab:
        top, ids = probs.topk(top_m, dim=-1)
        probs = top / top.sum(-1, keepdim=True)
    else:
        ids = torch.arange(vocab, device=logits.device).expand_as(probs)
    local = draw_with_uniform(probs, u).unsqueeze(1)
    picks = ids.gather(1, local).squeeze(1)
    # A greedy row's confidence is its argmax's probability (its warped q is one-hot).
    sure = torch.softmax(logits, -1).gather(1, picks.unsqueeze(1)).squeeze(1)
    return picks, torch.where(greedy, sure, probs.gather(1, local).squeeze(1)), ids, probs


def draft_loop(model, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: tuple,
               sin: tuple, logits0: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor, temps: torch.Tensor, greedy: torch.Tensor,
               u: torch.Tensor, rows: int, keys: int, k: int, sampled: bool, top_m: int):
    """k picks per row from the catch-up logits on: pick, feed the pick back at the next
    position, repeat. Padded rows (position -1) write only the scratch slot. A pure function
    of its tensor arguments; every shape depends only on the LoopShape."""
    picks = [pick(logits0, temps, greedy, u[:, 0], sampled, top_m)]
    pos = positions
    for s in range(1, k):
        logits = static_forward(model, k_cache, v_cache, cos, sin, picks[-1][0], pos, slots,
                                pos.clamp(min=0), slots, rows, 1, keys, False)
        picks.append(pick(logits, temps, greedy, u[:, s], sampled, top_m))
        pos = torch.where(pos >= 0, pos + 1, pos)
    ids = torch.stack([p[0] for p in picks], 1)
    conf = torch.stack([p[1] for p in picks], 1)
    if not sampled:
        return ids, conf
    return (ids, conf, torch.stack([p[2] for p in picks], 1),
            torch.stack([p[3] for p in picks], 1))


def loop_decoder(model) -> StaticDecoder | None:
    """The static decoder that can run a draft model's loop alone, if any: a static or
    captured draft, or a one-rank group's (followers could not follow a loop, so a
    tensor-parallel draft drafts step by step)."""
    if isinstance(model, StaticDecoder):
        return model
    alone = getattr(model, "alone", None)
    inner = alone() if alone is not None else None
    return inner if isinstance(inner, StaticDecoder) else None


def run_loop(static: StaticDecoder, cache: KVCache, logits0: torch.Tensor,
             positions: list[int], slots: list[int], temps: list[float], greedy: list[bool],
             u: torch.Tensor, k: int, sampled: bool, top_m: int) -> Guesses:
    """One round's k guesses per row from the catch-up step's last-token logits [R, V].
    positions: where each row's first guess goes (its context length)."""
    n = len(positions)
    if max(positions) + k - 1 > cache.max_len:
        raise ValueError(f"a {k}-guess loop from position {max(positions)} passes the cache "
                         f"({cache.max_len})")
    shape = loop_shape(n, max(positions) + k - 2, cache.max_len, k, sampled, top_m)
    key = (shape, cache.num_slots - 1, logits0.shape[-1])
    buffers = static.loop_buffers.get(key)
    if buffers is None:
        buffers = static.loop_buffers[key] = LoopBuffers(shape, logits0.shape[-1],
                                                         cache.num_slots - 1, static.device)
    buffers.fill(logits0, positions, slots, temps, greedy, u)
    cos, sin = static.model.static_tables(cache.max_len)
    out = static._run(draft_loop, (static.model, cache.k, cache.v, cos, sin,
                                   *buffers.tensors(), shape.rows, shape.keys, shape.k,
                                   shape.sampled, shape.top_m), key)
    static.loop_rounds += 1
    # The round's one copy to the host, packed as fp32 (ids below 2**24 are exact in it).
    parts = [out[0].float(), out[1]]
    if sampled:
        parts += [out[2].flatten(1).float(), out[3].flatten(1)]
    host = torch.cat(parts, 1)[:n].cpu()
    picks, conf = host[:, :k].long().tolist(), host[:, k: 2 * k]
    if not sampled:
        return Guesses(picks, conf)
    m = out[2].shape[-1]
    q = host[:, 2 * k:]
    return Guesses(picks, conf, q[:, : k * m].long().view(n, k, m),
                   q[:, k * m:].reshape(n, k, m))
