"""The target side of one engine step, behind an interface the engine does not look through.

One step = ONE target forward over a ragged batch (plain rows 1 token, speculative rows
pending + k draft tokens, prefill chunks), then the rejection sampler on the owner's full
logits (an all-greedy batch asks the model for argmax ids only: under tensor parallelism a
reduction of each rank's slice maximum). Only tokens leave the runner, never logits: that keeps the tensor-parallel group's
reply small. `LocalTargetRunner` runs in-process; the Ray group implements the same protocol.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from specdec.model.step.batch import BatchInput
from specdec.model.step.decoder import Decoder
from specdec.model.step.grammar import apply_masks
from specdec.model.step.host_copy import to_device, to_device_all
from specdec.model.step.kv_cache import KVCache
from specdec.model.step.logits_process import RowHistory, process_row
from specdec.model.step.sampling import SamplingParams, make_generator, warp_probs
from specdec.model.step.seeded import race_key, race_pick
from specdec.model.step.static_step import graph_builds
from specdec.spec_decode.calls import CallStats
from specdec.spec_decode.logprobs import TokenLogprob, emitted_logprobs
from specdec.spec_decode.rejection import rejection_sample, row_uniforms


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
    # Overlap (specdec/spec_decode/overlap.py): when every guess is kept, keep the next position's
    # distribution instead of drawing the bonus token; resolve() draws it later, against
    # the draft's guess for that position.
    defer_last: bool = False
    # Where the request's sampling controls read its history (penalties, logit_bias,
    # min_tokens: model/logits_process.py); None for every other row.
    history: RowHistory | None = None
    # Structured output: the grammar's allowed tokens per verified position, bitmasks
    # [num_draft + 1, words] (model/grammar.py); None for every other row.
    masks: torch.Tensor | None = None


@dataclasses.dataclass
class TargetResult:
    seq_id: str
    tokens: list[int]          # kept drafts, then the corrected or bonus token
    num_accepted: int
    deferred: bool = False     # all kept and no bonus drawn: resolve() emits that token
    error: str | None = None   # the row failed (its values went non-finite): no tokens
    # Per emitted token, where the request asked for them (logprobs.py): the target's
    # log-probability and top alternatives at the position that predicted it.
    logprobs: list[TokenLogprob] | None = None

NON_FINITE = "the model's values for this request became non-finite (NaN or infinity)"
NO_TOKEN = "the request's grammar allows no token at this position"


def _failed(seq_id: str, error: str = NON_FINITE) -> TargetResult:
    return TargetResult(seq_id, [], 0, error=error)


@dataclasses.dataclass
class Head:
    """The draft's guess for a deferred position, with the q it was drawn from."""

    token: int
    q_ids: torch.Tensor | None = None     # [m]; None = one-hot q
    q_probs: torch.Tensor | None = None


@dataclasses.dataclass
class Resolved:
    token: int
    accepted: bool             # the head was kept (False: drawn from max(0, p - q) or p)


class TargetRunner(Protocol):
    """Everything the engine asks of the target, in this process or as a Ray group."""

    max_slots: int
    max_len: int
    vocab_size: int
    # The last step's compute time and bytes when it crossed into another process; None
    # when it ran in this one (its wall time is then its compute time).
    last_call: CallStats | None
    # Lost steps so far, and why no request can start now (None: it can).
    failures: int
    down: str | None

    def start_sequence(self, seq_id: str, params: SamplingParams) -> None: ...

    # Slot dst's first n positions become slot src's (a prefix shared by copy), before the
    # next step's forward.
    def copy_prefix(self, src: int, dst: int, n: int) -> None: ...

    def step(self, rows: list[TargetRow]) -> list[TargetResult]: ...

    def end_sequence(self, seq_id: str) -> None: ...

    # Overlap only: the deferred positions of the last step, against the draft's heads.
    def resolve(self, heads: dict[str, Head | None]) -> dict[str, Resolved]: ...


def verify_step(model: Decoder, cache: KVCache, rows: list[TargetRow],
                params: dict[str, SamplingParams],
                generators: dict[str, torch.Generator],
                deferred: dict[str, torch.Tensor | int] | None = None) -> list[TargetResult]:
    """Forward + rejection sampling for one ragged batch (shared by local and TP rank 0).
    deferred: where a defer_last row keeps its next-position distribution (greedy rows:
    the argmax id) when all its guesses are kept."""
    batch = BatchInput.build([(r.slot, r.start, r.tokens) for r in rows], model.device)
    sampled = [i for i, r in enumerate(rows) if r.sample]
    idx: list[int] = []
    offset = 0
    for r in rows:
        end = offset + len(r.tokens)
        if r.sample:
            idx.extend(range(end - r.num_draft - 1, end))
        offset = end
    chosen = [rows[i] for i in sampled]
    # All-greedy batches need only the argmax (under TP a reduction, not a logits gather),
    # unless a row wants its log-probabilities.
    wants_lp = any(params[r.seq_id].logprobs is not None for r in chosen)
    processed = any(r.history is not None or r.masks is not None for r in chosen)
    greedy = bool(chosen) and all(params[r.seq_id].greedy for r in chosen)
    # The positions stay on the host: the forward moves them with its other inputs.
    raw = model(batch, cache, torch.tensor(idx, dtype=torch.long),
                argmax=greedy and not (wants_lp or processed))
    if not sampled:
        return []
    if greedy and not (wants_lp or processed):
        return _greedy_rows(chosen, raw.tolist(), deferred)
    logits = _processed(chosen, raw, params) if processed else raw
    if greedy:  # the argmax of the logits, as the model's argmax path takes it
        # -1: the model's values are not finite; -2: its controls (a grammar's mask) left
        # no token. Either fails that row alone.
        best = torch.where(torch.isfinite(raw).all(-1),
                           torch.where(torch.isfinite(logits.amax(-1)), logits.argmax(-1), -2),
                           -1)
        results = _greedy_rows(chosen, best.tolist(), deferred)
    else:
        results = _sample_rows(chosen, logits, params, generators, deferred, raw)
    return _with_logprobs(chosen, results, raw, params) if wants_lp else results


def _processed(rows: list[TargetRow], logits: torch.Tensor,
               params: dict[str, SamplingParams]) -> torch.Tensor:
    """The logits with each processed row's positions run through its sampling controls
    (position j after its history and guesses 0..j-1); other rows as they were."""
    out, off = logits.clone(), 0
    for r in rows:
        n = r.num_draft + 1
        if r.history is not None:
            guesses = r.tokens[len(r.tokens) - r.num_draft:] if r.num_draft else []
            out[off: off + n] = process_row(logits[off: off + n], params[r.seq_id],
                                            r.history, guesses)
        if r.masks is not None:
            masked = apply_masks(out[off: off + n], r.masks)
            # A grammar that can only end where min_tokens holds the end back leaves no
            # token at all: the grammar wins there (the reply ends short of min_tokens, valid).
            dead = ~torch.isfinite(masked).any(-1)
            if dead.any():
                masked[dead] = apply_masks(logits[off: off + n], r.masks)[dead]
            out[off: off + n] = masked
        off += n
    return out


def _with_logprobs(rows: list[TargetRow], results: list[TargetResult], logits: torch.Tensor,
                   params: dict[str, SamplingParams]) -> list[TargetResult]:
    """Attach each asking row's log-probabilities: its emitted token j was predicted at its
    j-th verified position (flat: the row's offset in the logits + j)."""
    asking, positions, tokens, tops, off = [], [], [], [], 0
    for r, res in zip(rows, results, strict=True):
        top = params[r.seq_id].logprobs
        if top is not None and res.error is None:
            asking.append(res)
            positions.append([off + j for j in range(len(res.tokens))])
            tokens.append(res.tokens)
            tops.append(top)
        off += r.num_draft + 1
    for res, lps in zip(asking, emitted_logprobs(logits, positions, tokens, tops), strict=True):
        res.logprobs = lps
    return results


def _greedy_rows(rows: list[TargetRow], best: list[int],
                 deferred: dict | None) -> list[TargetResult]:
    """The sampler's greedy rule on the target's argmax ids alone, without building
    probability tensors over the vocabulary."""
    out, off = [], 0
    for r in rows:
        n = r.num_draft
        guesses = r.tokens[len(r.tokens) - n:] if n else []
        target = best[off: off + n + 1]
        off += n + 1
        if min(target) < 0:
            out.append(_failed(r.seq_id, NON_FINITE if -1 in target else NO_TOKEN))
            continue
        kept = 0
        while kept < n and guesses[kept] == target[kept]:
            kept += 1
        if r.defer_last and kept == n and deferred is not None:
            deferred[r.seq_id] = target[n]  # the next token, settled by resolve()
            out.append(TargetResult(r.seq_id, guesses, kept, deferred=True))
        else:
            out.append(TargetResult(r.seq_id, guesses[:kept] + [target[kept]], kept))
    return out


def _sample_rows(rows: list[TargetRow], logits: torch.Tensor,
                 params: dict[str, SamplingParams],
                 generators: dict[str, torch.Generator],
                 deferred: dict | None, raw: torch.Tensor | None = None) -> list[TargetResult]:
    """The rejection rule at a fixed [R, k+1] shape on the logits' device. Its inputs (the
    guesses, q, the uniforms, whose positions are whose) are built on the host from what it
    already holds and cross to the device once; the verdicts come back in ONE copy, so a step
    never waits on the device in between (on a GPU each read is a synchronisation)."""
    V, dev = logits.shape[-1], logits.device
    k = max(r.num_draft for r in rows)
    R = len(rows)
    row_params = [params[r.seq_id] for r in rows]
    num_draft = [r.num_draft for r in rows]
    # Warp every position of a row with that row's params, as the draft's were.
    per_pos = [p for r, p in zip(rows, row_params, strict=True) for _ in range(r.num_draft + 1)]
    probs = warp_probs(logits, per_pos)
    # Row b's position j is flat position at[b][j]; past its own k + 1 it repeats its last,
    # which the rule never reads.
    at, off = [], 0
    for n in num_draft:
        at.append([off + min(j, n) for j in range(k + 1)])
        off += n + 1
    drafts = torch.zeros(R, k, dtype=torch.long)
    for b, r in enumerate(rows):
        if r.num_draft:
            drafts[b, : r.num_draft] = torch.tensor(r.tokens[-r.num_draft:])
    q_ids, q_probs = _draft_q(rows, drafts)
    # Seeded rows are verified by equality with their race winners, like greedy rows.
    by_rule = [p.greedy or p.raced for p in row_params]
    raced = _raced(rows, row_params)
    # Everything the host built crosses in one copy per dtype (host_copy.py: why).
    at_d, drafts_d, n_d, greedy_d, u_d, raced_d, *q_d = to_device_all(
        [torch.tensor(at), drafts, torch.tensor(num_draft), torch.tensor(by_rule),
         row_uniforms(num_draft, k + 1, [generators[r.seq_id] for r in rows]), raced,
         *([] if q_ids is None else [q_ids, q_probs])], dev)
    target = probs[at_d]  # [R, k+1, V]
    q = None
    if q_d:
        q = torch.zeros(R, k, V, dtype=torch.float32, device=dev).scatter_add_(2, *q_d)
    # The token each greedy or seeded row must match: argmax p, or the race's winner.
    choice = target.argmax(-1)
    if raced.shape[1]:
        where = raced_d[0], raced_d[1]
        choice[where] = race_pick(target[where], raced_d[2])
    out, emitted = rejection_sample(drafts_d, q, target, num_draft=n_d, greedy=greedy_d,
                                    uniforms=u_d, choice=choice)
    # A deferred greedy or seeded row keeps its next position's chosen token: computed for
    # every row, read for those only, so it rides in the same copy (skipped when no row
    # could defer so).
    if any(r.defer_last and b for r, b in zip(rows, by_rule, strict=True)):
        best = choice[torch.arange(R, device=dev), n_d]
    else:
        best = torch.zeros(R, dtype=torch.long, device=dev)
    # A row whose model values went non-finite (1), or whose controls (a grammar's mask)
    # left no token (2), fails alone; its flag rides in the same copy. (amax keeps NaN.)
    usable = torch.isfinite(logits.amax(-1))[at_d].all(-1)
    finite = usable if raw is None else torch.isfinite(raw.amax(-1))[at_d].all(-1)
    failed = torch.where(finite, torch.where(usable, 0, 2), 1).to(out.dtype)
    packed = torch.cat([out, emitted.unsqueeze(1), best.unsqueeze(1), failed.unsqueeze(1)],
                       1).tolist()  # the copy
    results = []
    for b, r in enumerate(rows):
        n, kept = r.num_draft, packed[b][: k + 1]
        emitted_b, best_b = packed[b][k + 1], packed[b][k + 2]
        if packed[b][k + 3]:
            results.append(_failed(r.seq_id, NON_FINITE if packed[b][k + 3] == 1 else NO_TOKEN))
            continue
        if r.defer_last and emitted_b == n + 1 and deferred is not None:
            # All kept: keep p at the next position instead of the bonus drawn from it.
            deferred[r.seq_id] = best_b if by_rule[b] else target[b, n]
            results.append(TargetResult(r.seq_id, kept[:n], n, deferred=True))
        else:
            results.append(TargetResult(r.seq_id, kept[:emitted_b], emitted_b - 1))
    return results


def _raced(rows: list[TargetRow], row_params: list[SamplingParams]) -> torch.Tensor:
    """[3, S] (row, position column, race key) of every verified position of the seeded rows,
    keyed by the position's index in the sequence (specdec/model/step/seeded.py): the same key,
    so the same token, whatever k or batch this position is verified in."""
    cols: list[tuple[int, int, int]] = []
    for b, (r, p) in enumerate(zip(rows, row_params, strict=True)):
        if p.raced:
            first = r.start + len(r.tokens) - r.num_draft  # the position logits[0] predicts
            cols.extend((b, j, race_key(p.seed, first + j)) for j in range(r.num_draft + 1))
    return torch.tensor(cols, dtype=torch.long).reshape(-1, 3).T


def _draft_q(rows: list[TargetRow], drafts: torch.Tensor
             ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """q as (ids, probs) [R, k, m], to be added onto zeros over the vocabulary in one kernel
    on the device (padding adds 0 to id 0); None: every row one-hot, which the rule takes as
    None. Rows are padded to one width where the draft's q lies: the host, for a draft in
    another process or one that drafted in a loop; the device, for an eager draft beside the
    target (moving it to the host would wait for the device)."""
    given = [r.draft_q for r in rows if r.draft_q is not None]
    if not given:
        return None, None
    R, k = drafts.shape
    m = max(ids.shape[-1] for ids, _ in given)
    home = given[0][0].device
    ids = torch.zeros(R, k, m, dtype=torch.long, device=home)
    qp = torch.zeros(R, k, m, dtype=torch.float32, device=home)
    if home.type != "cpu":
        drafts = to_device(drafts, home)
    for b, r in enumerate(rows):
        n = r.num_draft
        if not n:
            continue
        if r.draft_q is None:  # one-hot q at the guess
            ids[b, :n, 0], qp[b, :n, 0] = drafts[b, :n], 1.0
        else:
            rid, rp = r.draft_q
            ids[b, :n, : rid.shape[-1]] = rid[:n].to(home, torch.long)
            qp[b, :n, : rp.shape[-1]] = rp[:n].to(home, torch.float32)
    return ids, qp


def resolve_heads(heads: dict[str, Head | None], deferred: dict[str, torch.Tensor | int],
                  params: dict[str, SamplingParams],
                  generators: dict[str, torch.Generator]) -> dict[str, Resolved]:
    """Settle each deferred position: its head guess kept with probability min(1, p/q)
    (greedy: kept iff it is the argmax), else a draw from max(0, p - q); no head: a draw
    from p. The rule of rejection.py with k = 1, whose bonus is never used."""
    out: dict[str, Resolved] = {}
    for seq_id, head in heads.items():
        p = deferred.pop(seq_id)
        if isinstance(p, int):  # greedy
            out[seq_id] = Resolved(p, head is not None and head.token == p)
            continue
        x = head.token if head is not None else 0
        n = 1 if head is not None else 0
        # The host's inputs in one copy per dtype; the verdict back in one read.
        x_d, n_d, u_d = to_device_all([torch.tensor([[x]]), torch.tensor([n]),
                                       row_uniforms([n], 2, [generators[seq_id]])], p.device)
        q = None
        if head is not None:
            q = torch.zeros(1, 1, p.shape[-1], dtype=p.dtype, device=p.device)
            if head.q_probs is None:
                q[0, 0, x] = 1.0
            else:
                q[0, 0].scatter_(0, to_device(head.q_ids.long(), p.device),
                                 to_device(head.q_probs, p.device).to(p.dtype))
        target = torch.stack([p, p]).unsqueeze(0)  # [1, 2, V]; position 2 is never used
        toks, emitted = rejection_sample(x_d, q, target, num_draft=n_d, uniforms=u_d)
        token, emitted = torch.stack([toks[0, 0], emitted[0]]).tolist()
        # A kept head is followed by the (unused) bonus: two emitted.
        out[seq_id] = Resolved(token, head is not None and emitted == 2)
    return out


class LocalTargetRunner:
    """The target model in this process."""

    last_call = None
    failures = 0
    down = None

    def __init__(self, model: Decoder, max_slots: int, max_len: int) -> None:
        self.model = model
        self.cache = model.new_cache(max_slots, max_len)
        self.max_slots, self.max_len = max_slots, max_len
        self.vocab_size = model.cfg.vocab_size
        self._params: dict[str, SamplingParams] = {}
        self._gens: dict[str, torch.Generator] = {}
        self._deferred: dict[str, torch.Tensor | int] = {}

    def start_sequence(self, seq_id: str, params: SamplingParams) -> None:
        self._params[seq_id] = params
        self._gens[seq_id] = make_generator(params.seed, "cpu")

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        copy = getattr(self.model, "copy_prefix", None)  # a tensor-parallel leader: all ranks
        if copy is not None:
            copy(self.cache, src, dst, n)
        else:
            self.cache.copy_prefix(src, dst, n)

    def step(self, rows: list[TargetRow]) -> list[TargetResult]:
        return verify_step(self.model, self.cache, rows, self._params, self._gens,
                           self._deferred)

    @property
    def graph_builds(self) -> int:
        return graph_builds(self.model)

    def resolve(self, heads: dict[str, Head | None]) -> dict[str, Resolved]:
        return resolve_heads(heads, self._deferred, self._params, self._gens)

    def end_sequence(self, seq_id: str) -> None:
        self._params.pop(seq_id, None)
        self._gens.pop(seq_id, None)
        self._deferred.pop(seq_id, None)
