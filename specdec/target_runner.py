"""The target side of one engine step, behind an interface the engine does not look through.

One step = ONE target forward over a ragged batch (plain rows 1 token, speculative rows
pending + k draft tokens, prefill chunks), then the rejection sampler on the owner's full
logits. Only tokens leave the runner, never logits: that keeps the tensor-parallel group's
reply small. `LocalTargetRunner` runs in-process; the Ray group implements the same protocol.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from specdec.batch import BatchInput
from specdec.kv_cache import KVCache
from specdec.model import Decoder
from specdec.rejection import rejection_sample
from specdec.sampling import SamplingParams, make_generator, warp_probs


@dataclasses.dataclass
class TargetRow:
    seq_id: str
    slot: int
    start: int                 # tokens of this sequence already in the target's cache
    tokens: list[int]          # new tokens: pending context, then the num_draft guesses
    num_draft: int = 0
    # q of the guesses as (ids, probs) [num_draft, m], zero outside ids; None = one-hot q.
    draft_q: tuple[torch.Tensor, torch.Tensor] | None = None
    sample: bool = True        # False for a prefill chunk that does not end the prompt


@dataclasses.dataclass
class TargetResult:
    seq_id: str
    tokens: list[int]          # kept drafts, then the corrected or bonus token
    num_accepted: int


class TargetRunner(Protocol):
    max_slots: int
    max_len: int
    vocab_size: int

    def start_sequence(self, seq_id: str, params: SamplingParams) -> None: ...

    def step(self, rows: list[TargetRow]) -> list[TargetResult]: ...

    def end_sequence(self, seq_id: str) -> None: ...


def verify_step(model: Decoder, cache: KVCache, rows: list[TargetRow],
                params: dict[str, SamplingParams],
                generators: dict[str, torch.Generator]) -> list[TargetResult]:
    """Forward + rejection sampling for one ragged batch (shared by local and TP rank 0)."""
    batch = BatchInput.build([(r.slot, r.start, r.tokens) for r in rows], model.device)
    sampled = [i for i, r in enumerate(rows) if r.sample]
    idx: list[int] = []
    offset = 0
    for r in rows:
        end = offset + len(r.tokens)
        if r.sample:
            idx.extend(range(end - r.num_draft - 1, end))
        offset = end
    logits = model(batch, cache, torch.tensor(idx, dtype=torch.long, device=model.device))
    if not sampled:
        return []
    chosen = [rows[i] for i in sampled]
    if all(params[r.seq_id].greedy for r in chosen):
        return _greedy_rows(chosen, logits)
    return _sample_rows(chosen, logits, params, generators)


def _greedy_rows(rows: list[TargetRow], logits: torch.Tensor) -> list[TargetResult]:
    """All-greedy batches need only the argmax: the same rule as the sampler's greedy path,
    without building probability tensors over the vocabulary."""
    best = logits.argmax(-1).tolist()
    out, off = [], 0
    for r in rows:
        n = r.num_draft
        guesses = r.tokens[len(r.tokens) - n:] if n else []
        target = best[off: off + n + 1]
        off += n + 1
        kept = 0
        while kept < n and guesses[kept] == target[kept]:
            kept += 1
        out.append(TargetResult(r.seq_id, guesses[:kept] + [target[kept]], kept))
    return out


def _sample_rows(rows: list[TargetRow], logits: torch.Tensor,
                 params: dict[str, SamplingParams],
                 generators: dict[str, torch.Generator]) -> list[TargetResult]:
    V = logits.shape[-1]
    k = max(r.num_draft for r in rows)
    R = len(rows)
    row_params = [params[r.seq_id] for r in rows]
    # Warp every position of a row with that row's params, as the draft's were.
    per_pos = [p for r, p in zip(rows, row_params, strict=True) for _ in range(r.num_draft + 1)]
    probs = warp_probs(logits, per_pos)
    target = probs.new_zeros(R, k + 1, V)
    drafts = torch.zeros(R, k, dtype=torch.long)
    any_q = any(r.draft_q is not None for r in rows)
    q = probs.new_zeros(R, k, V) if any_q else None
    off = 0
    for b, r in enumerate(rows):
        n = r.num_draft
        target[b, : n + 1] = probs[off: off + n + 1]
        off += n + 1
        if n:
            guesses = torch.tensor(r.tokens[-n:], dtype=torch.long)
            drafts[b, :n] = guesses
            if q is not None:
                if r.draft_q is None:
                    q[b, torch.arange(n), guesses] = 1.0  # one-hot q
                else:
                    ids, qp = r.draft_q
                    q[b, :n].scatter_(1, ids[:n].long().to(q.device), qp[:n].to(q))
    out, emitted = rejection_sample(
        drafts.to(probs.device), q, target, [generators[r.seq_id] for r in rows],
        num_draft=torch.tensor([r.num_draft for r in rows], device=probs.device),
        greedy=torch.tensor([p.greedy for p in row_params], device=probs.device),
    )
    out, emitted = out.tolist(), emitted.tolist()
    return [TargetResult(r.seq_id, out[b][: emitted[b]], emitted[b] - 1)
            for b, r in enumerate(rows)]


class LocalTargetRunner:
    """The target model in this process."""

    def __init__(self, model: Decoder, max_slots: int, max_len: int) -> None:
        self.model = model
        self.cache = model.new_cache(max_slots, max_len)
        self.max_slots, self.max_len = max_slots, max_len
        self.vocab_size = model.cfg.vocab_size
        self._params: dict[str, SamplingParams] = {}
        self._gens: dict[str, torch.Generator] = {}

    def start_sequence(self, seq_id: str, params: SamplingParams) -> None:
        self._params[seq_id] = params
        self._gens[seq_id] = make_generator(params.seed, "cpu")

    def step(self, rows: list[TargetRow]) -> list[TargetResult]:
        return verify_step(self.model, self.cache, rows, self._params, self._gens)

    def end_sequence(self, seq_id: str) -> None:
        self._params.pop(seq_id, None)
        self._gens.pop(seq_id, None)
