"""Proposers: whatever guesses the next k tokens cheaply.

The rejection rule needs only the guessed tokens and, ideally, their probabilities q. A
proposal without q (n-gram lookup, greedy draft) is verified with one-hot q, which is still
exact. Plain decoding is "no proposer" (k = 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import get_args

import numpy as np
import torch

from specdec.model.step.batch import BatchInput
from specdec.model.step.decoder import Decoder
from specdec.model.step.draft_loop import loop_decoder, run_loop
from specdec.model.step.host_copy import to_device, to_device_all
from specdec.model.step.prefix_cache import PrefixCache, PrefixStats, common_prefix
from specdec.model.step.sampling import (
    SamplingParams,
    draw_with_uniform,
    make_generator,
    warp_probs,
)
from specdec.model.step.seeded import race_keys, race_pick_among
from specdec.model.step.static_step import graph_builds
from specdec.spec_decode.overlap import ThreadWindow
from specdec.spec_decode.proposal import DraftWindow, Proposal, ProposeInput
from specdec.vocabulary import DraftSampling


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (n from max_n down to min_n) and propose what followed it."""

    name = "ngram"
    available = True
    last_call = None
    overlaps = False

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("ngram sizes need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, inputs: list[ProposeInput]) -> list[Proposal]:
        return [Proposal(self.lookup(i.context, i.k)) for i in inputs]

    def lookup(self, context: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        arr = np.asarray(context, dtype=np.int64)
        L = len(arr)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            pattern = arr[L - n:]
            # Candidate starts s with a token after the match: s + n <= L - 1.
            windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                s = int(hits[-1])
                return arr[s + n: s + n + k].tolist()
        return []

    def accepted(self, seq_id: str, valid_len: int) -> None:
        pass

    def release(self, seq_id: str) -> None:
        pass


@dataclasses.dataclass
class _DraftSeq:
    slot: int
    cached: int                  # tokens of the sequence in the draft's KV cache
    generator: torch.Generator
    base: int = 0                # context length at the last proposal
    guesses: list[int] = dataclasses.field(default_factory=list)  # that proposal
    context: list[int] = dataclasses.field(default_factory=list)  # as last seen

    def held(self) -> list[int]:
        """The context tokens whose K/V the slot holds (guesses not kept excluded)."""
        return self.context[: min(self.valid_after(self.context), len(self.context))]

    def valid_after(self, context: list[int]) -> int:
        """KV entries still right for this context: the old context (the caller rewinds
        explicitly through accepted() if it ever rewrote it) and the guesses it kept."""
        kept = 0
        for g, t in zip(self.guesses, context[self.base:], strict=False):
            if g != t:
                break
            kept += 1
        return min(self.cached, self.base + kept)

    def keep(self, n: int) -> None:
        """Roll back to the first n tokens, O(1): later entries are overwritten next time."""
        self.cached = min(self.cached, n)


# Guesses of a sampled row are drawn from this many of the draft's most likely tokens.
DEFAULT_Q_TOP_M = 64


class DraftModelProposer:
    """A smaller model sharing the target's tokenizer, with its own KV slots.

    sampling="probabilistic" samples each guess from the warped draft distribution and sends
    q; "greedy" proposes the draft's argmax and sends only token ids (one-hot q).

    q_top_m: a sampled guess is drawn from the draft's m most likely tokens, renormalized,
    and exactly that distribution is q. The rejection rule is exact for ANY q the guess was
    really drawn from (keep x with min(1, p(x)/q(x)), else draw from max(0, p - q)): the
    kept-or-corrected token is distributed as p whatever q is, so a truncated q costs only
    acceptance (the mass outside the top m), never exactness, and q crosses a process
    boundary as m (id, prob) pairs instead of a vocabulary row. None keeps the full q.

    confidence_threshold: a row stops drafting (before its k) once the draft's probability
    of its own latest guess falls below it; that guess is still proposed. Guesses after an
    unsure one are rarely accepted, and each costs a draft forward. Exact: the length of a
    proposal depends only on the draft's side, never on the target's verdict.
    """

    name = "draft"
    available = True
    last_call = None
    overlaps = True

    def __init__(self, model: Decoder, max_slots: int, max_len: int,
                 sampling: DraftSampling = "probabilistic",
                 vocab_limit: int | None = None,
                 confidence_threshold: float | None = None,
                 q_top_m: int | None = DEFAULT_Q_TOP_M, prefix_cache: bool = True) -> None:
        if sampling not in get_args(DraftSampling):
            raise ValueError(f"draft sampling must be one of {get_args(DraftSampling)}")
        if confidence_threshold is not None and not 0.0 <= confidence_threshold < 1.0:
            raise ValueError("draft confidence_threshold must be in [0, 1)")
        self.confidence_threshold = confidence_threshold or None
        if vocab_limit is not None:
            if not 0 < vocab_limit <= model.cfg.vocab_size:
                raise ValueError(f"draft vocab_limit must be in 1..{model.cfg.vocab_size}")
            # Narrow the projection once (the layers stay shared): the draft then only
            # scores the kept ids.
            model = model.limit_vocab(vocab_limit)
        if q_top_m is not None and q_top_m < 1:
            raise ValueError("draft q_top_m must be >= 1")
        self.q_top_m = q_top_m
        self.vocab_size = model.cfg.vocab_size  # its embedding rows: the ids it can read
        self.window_threads: int | None = None  # threads of a background window (overlap)
        self.vocab_limit = vocab_limit
        self.model = model
        self.cache = model.new_cache(max_slots, max_len)
        # A static or captured draft runs each round as one loop (specdec/model/step/draft_loop.py).
        self._loop = loop_decoder(model)
        self.sampling = sampling
        self.max_len = max_len
        self._seqs: dict[str, _DraftSeq] = {}
        self._free = list(range(max_slots - 1, -1, -1))
        # Its own prefix cache: a follow-up turn costs the draft only its new tokens too.
        self.prefixes = PrefixCache(max_slots, enabled=prefix_cache)

    @property
    def graph_builds(self) -> int:
        return graph_builds(self.model)

    def _seq(self, inp: ProposeInput) -> _DraftSeq:
        s = self._seqs.get(inp.seq_id)
        if s is None:
            if not self._free:
                raise RuntimeError("draft has no free KV slot")
            seed = None if inp.params.seed is None else inp.params.seed ^ 0x5EED
            running = {r.slot: np.asarray(r.held(), dtype=np.int64)
                       for r in self._seqs.values()}
            choice = self.prefixes.choose(inp.context, self._free, running, inp.tenant)
            self._free.remove(choice.slot)
            if choice.copy_from is not None:
                copy = getattr(self.model, "copy_prefix", None)  # a tensor-parallel leader
                if copy is not None:
                    copy(self.cache, choice.copy_from, choice.slot, choice.reuse)
                else:
                    self.cache.copy_prefix(choice.copy_from, choice.slot, choice.reuse)
            # It starts holding `reuse` tokens of its context, as if proposed from there.
            s = _DraftSeq(choice.slot, choice.reuse, make_generator(seed), base=choice.reuse)
            self._seqs[inp.seq_id] = s
        s.context = inp.context
        return s

    def forget_prefix_stats(self) -> None:
        self.prefixes.stats = PrefixStats()

    def prefix_report(self) -> dict:
        return {**self.prefixes.stats.as_dict(), "held_tokens": self.prefixes.held_tokens()}

    def held_prefix(self, context: list[int], tenant: str | None = None) -> int:
        """Tokens of `context` the draft would not have to compute if it started now for
        `tenant`: what the policy prices a first round's catch-up by."""
        ids = np.asarray(context, dtype=np.int64)
        own = self.prefixes.tenant_of
        slots = [self.prefixes.held(f) for f in self._free if own(f) == tenant] + \
            [np.asarray(r.held(), dtype=np.int64) for r in list(self._seqs.values())
             if own(r.slot) == tenant]
        return max((common_prefix(ids, h) for h in slots), default=0)

    def start_window(self, inputs: list[ProposeInput]) -> DraftWindow:
        """Draft in the background (overlap with the target's step) until stopped: see
        specdec/spec_decode/overlap.py. Each row's k is its cap; at least one guess per row."""
        return ThreadWindow(self.propose, inputs, self.window_threads)

    @torch.inference_mode()
    def propose(self, inputs: list[ProposeInput],
                should_stop: Callable[[], bool] | None = None) -> list[Proposal]:
        """Guesses for each row, up to its k. should_stop is asked before every forward
        after the first: once it says so, every row ends its proposal there (the length
        then depends on the target's timing, never on its verdict: still exact)."""
        requested = inputs
        inputs = [i for i in requested if i.k > 0]
        out = {i.seq_id: Proposal([]) for i in requested}
        if not inputs:
            return [out[i.seq_id] for i in requested]
        seqs = [self._seq(i) for i in inputs]
        for s, i in zip(seqs, inputs, strict=True):
            # O(1) rollback of guesses not kept. A context the cache already holds whole
            # (overlap: the next guesses trimmed below what was drafted) re-feeds its last
            # token, whose logits the first forward needs.
            s.keep(min(s.valid_after(i.context), len(i.context) - 1))
        # Drafting uses the request's warp; a greedy draft proposes argmax (temperature 0).
        dparams = [SamplingParams(temperature=0.0) if self.sampling == "greedy" else i.params
                   for i in inputs]
        tokens: list[list[int]] = [[] for _ in inputs]
        q_ids: list[list[torch.Tensor]] = [[] for _ in inputs]
        q_probs: list[list[torch.Tensor]] = [[] for _ in inputs]
        # Step 0 catches the cache up with the context (a prefill the first time, then the
        # 1-2 tokens the target added last round); later steps feed one guess each.
        rows = [(s.slot, s.cached, i.context[s.cached:]) for s, i in zip(seqs, inputs, strict=True)]
        u = self._uniforms(inputs, seqs, dparams)
        if should_stop is None and self._loops(inputs, dparams):
            looped = self._looped(rows, inputs, seqs, dparams, u)
            for i, s, guesses in zip(inputs, seqs, looped, strict=True):
                out[i.seq_id] = self._finish(i, s, *guesses)
            return [out[i.seq_id] for i in requested]
        live = list(range(len(inputs)))
        for step in range(max(i.k for i in inputs)):
            if step and should_stop is not None and should_stop():
                break
            picks, ids, probs, conf = self._forward_and_pick(
                rows, [dparams[b] for b in live], None if u is None else u[live, step],
                [len(inputs[b].context) + step for b in live])
            sure = self._sure(conf)
            next_rows, next_live = [], []
            for j, b in enumerate(live):
                tokens[b].append(picks[j])
                if probs is not None:
                    q_ids[b].append(ids[j])
                    q_probs[b].append(probs[j])
                if step + 1 < inputs[b].k and sure[j]:
                    pos = len(inputs[b].context) + step
                    next_rows.append((seqs[b].slot, pos, [picks[j]]))
                    next_live.append(b)
            rows, live = next_rows, next_live
            if not live:
                break
        for b, (inp, s) in enumerate(zip(inputs, seqs, strict=True)):
            out[inp.seq_id] = self._finish(inp, s, tokens[b], q_ids[b], q_probs[b])
        return [out[i.seq_id] for i in requested]

    def _loops(self, inputs: list[ProposeInput], dparams: list[SamplingParams]) -> bool:
        """Whether this round can run as one loop: a static draft alone on its rank, every
        warp one the loop traces (temperature only), every guess inside the cache."""
        k = max(i.k for i in inputs)
        return (self._loop is not None
                and all(p.greedy or (p.top_k == 0 and p.top_p == 1 and not p.raced)
                        for p in dparams)
                and all(len(i.context) + k - 1 <= self.cache.max_len for i in inputs))

    @staticmethod
    def _uniforms(inputs: list[ProposeInput], seqs: list[_DraftSeq],
                  dparams: list[SamplingParams]) -> torch.Tensor | None:
        """[R, k] uniforms for a round with sampled rows (None: all greedy): each row draws
        one per guess of its k from its own stream up front, so what a seeded row consumes
        depends on its k alone, not on where the confidence rule cut it or on its batch."""
        if all(p.greedy for p in dparams):
            return None
        u = torch.full((len(inputs), max(i.k for i in inputs)), 0.5)
        for b, (i, s) in enumerate(zip(inputs, seqs, strict=True)):
            u[b, : i.k] = torch.rand(i.k, generator=s.generator)
        return u

    def _looped(self, rows, inputs: list[ProposeInput], seqs: list[_DraftSeq],
                dparams: list[SamplingParams], u: torch.Tensor | None
                ) -> list[tuple[list, list, list]]:
        """The round as the catch-up forward plus one loop: per row (tokens, q ids, q probs)
        as the eager loop below would build them, cut to the row's k and confidence."""
        k = max(i.k for i in inputs)
        sampled = u is not None
        logits0 = self.model(BatchInput.build(rows, self.model.device), self.cache)
        u = torch.full((len(inputs), k), 0.5) if u is None else u
        g = run_loop(self._loop, self.cache, logits0, [len(i.context) for i in inputs],
                     [s.slot for s in seqs], [p.temperature or 1.0 for p in dparams],
                     [p.greedy for p in dparams], u, k, sampled,
                     self.q_top_m or 0)
        out = []
        for b, i in enumerate(inputs):
            n = i.k
            if self.confidence_threshold is not None:
                unsure = (g.conf[b, : n - 1] < self.confidence_threshold).nonzero()
                n = int(unsure[0, 0]) + 1 if len(unsure) else n
            if not sampled:
                out.append((g.picks[b][:n], [], []))
            else:
                out.append((g.picks[b][:n], list(g.q_ids[b, :n]), list(g.q_probs[b, :n])))
        return out

    def _forward_and_pick(self, rows, dparams: list[SamplingParams], u: torch.Tensor | None,
                          positions: list[int]):
        """One draft forward over `rows` and each row's next guess: (picks, q ids, q probs,
        confidence), the q parts None for greedy rows. Guesses come only from the first
        vocab_limit ids (q is zero elsewhere): exact still; the projection was narrowed to
        them at construction. Greedy guesses need only the argmax ids (a reduction under
        TP; one-hot q), unless the confidence rule wants the guess's probability. A seeded
        row guesses the winner of its seeded race under q at positions[j], the token the
        target's race under p will most likely choose (specdec/model/step/seeded.py)."""
        greedy = all(p.greedy for p in dparams)
        ids_only = greedy and self.confidence_threshold is None
        logits = self.model(BatchInput.build(rows, self.model.device), self.cache,
                            argmax=ids_only)
        if ids_only:
            return logits.tolist(), None, None, None
        if greedy:
            best = logits.argmax(-1)
            return best.tolist(), None, None, self._greedy_confidence(logits, best)
        ids, probs = self._top_m(warp_probs(logits, dparams))
        local = draw_with_uniform(probs, to_device(u, probs.device))
        raced = [j for j, p in enumerate(dparams) if p.raced]
        if raced:
            at, keys = to_device_all([torch.tensor(raced), race_keys(
                [(dparams[j].seed, positions[j]) for j in raced])], probs.device)
            local[at] = race_pick_among(ids[at], probs[at], keys)
        local = local.unsqueeze(1)
        picks = ids.gather(1, local).squeeze(1)
        conf = probs.gather(1, local).squeeze(1)
        if self.confidence_threshold is not None and any(p.greedy for p in dparams):
            # A greedy row's confidence is its argmax's probability whatever shares its
            # batch (its warped q is one-hot: always 1).
            # (Its pick is its argmax: warp_probs made its row one-hot there.)
            greedy_rows = to_device(torch.tensor([p.greedy for p in dparams]), conf.device)
            sure = self._greedy_confidence(logits, logits.argmax(-1))
            conf = torch.where(greedy_rows, sure, conf)
        return picks.tolist(), ids, probs, conf

    def _finish(self, inp: ProposeInput, s: _DraftSeq, tokens: list[int],
                q_ids: list[torch.Tensor], q_probs: list[torch.Tensor]) -> Proposal:
        # The last guess was never fed back, so the cache holds context + k - 1 tokens.
        s.cached = len(inp.context) + len(tokens) - 1
        s.base, s.guesses = len(inp.context), tokens
        one_hot = self.sampling == "greedy" or inp.params.greedy or not q_probs
        return Proposal(tokens) if one_hot else Proposal(
            tokens, torch.stack(q_ids).to(torch.int32), torch.stack(q_probs))

    def _top_m(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The distribution guesses are drawn from, as (ids, probs) [R, m]."""
        m = self.q_top_m
        if m is None or m >= probs.shape[-1]:
            ids = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
            return ids, probs
        top, ids = probs.topk(m, dim=-1)
        return ids, top / top.sum(-1, keepdim=True)

    @staticmethod
    def _greedy_confidence(logits: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float(), -1).gather(1, picks.unsqueeze(1)).squeeze(1)

    def _sure(self, conf: torch.Tensor | None) -> list[bool] | _Always:
        """Whether each row's draft is confident enough in its latest guess to go on: its
        probability (greedy: of its argmax; sampled: q of the sampled token)."""
        if self.confidence_threshold is None or conf is None:
            return _ALWAYS
        return (conf >= self.confidence_threshold).tolist()

    def accepted(self, seq_id: str, valid_len: int) -> None:
        s = self._seqs.get(seq_id)
        if s is not None:
            s.keep(valid_len)

    def release(self, seq_id: str) -> None:
        s = self._seqs.pop(seq_id, None)
        if s is not None:
            self.prefixes.release(s.slot, s.held())
            self._free.append(s.slot)


class _Always:
    def __getitem__(self, _) -> bool:
        return True


_ALWAYS = _Always()
