"""Plain (non-speculative) decoding with the model core: the reference every speculative
path must match token for token under greedy decoding, and the baseline for benchmarks."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from specdec.model.step.batch import BatchInput
from specdec.model.step.decoder import Decoder
from specdec.model.step.sampling import SamplingParams, make_generator, sample, warp_probs
from specdec.model.step.seeded import race_keys, race_pick


@dataclasses.dataclass
class PlainResult:
    token_ids: list[list[int]]
    prefill_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        n = sum(len(t) for t in self.token_ids)
        return n / (self.prefill_s + self.decode_s) if n else 0.0


def plain_generate(model: Decoder, prompts: Sequence[Sequence[int]],
                   params: SamplingParams | Sequence[SamplingParams],
                   eos_ids: Sequence[int] | None = None) -> PlainResult:
    """Decode every prompt in one batch until max_tokens or eos; one forward per step."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    eos = set(model.cfg.eos_token_ids if eos_ids is None else eos_ids)
    max_len = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params, strict=True))
    cache = model.new_cache(len(prompts), max_len)
    gens = [make_generator(sp.seed, model.device) for sp in params]
    out: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    t0 = time.perf_counter()
    rows = [(i, 0, list(p)) for i, p in enumerate(prompts)]
    prefill_s = None
    while live:
        logits = model(BatchInput.build(rows, model.device), cache)
        probs = warp_probs(logits, [params[i] for i in live])
        toks = sample(probs, [gens[i] for i in live])
        # Seeded rows: the seeded race at the position being produced (seeded.py).
        raced = [j for j, i in enumerate(live) if params[i].raced]
        if raced:
            keys = race_keys([(params[live[j]].seed, len(prompts[live[j]]) + len(out[live[j]]))
                              for j in raced])
            toks[raced] = race_pick(probs[raced], keys.to(probs.device)).to(toks.device)
        toks = toks.tolist()
        if prefill_s is None:
            prefill_s = time.perf_counter() - t0
        rows, still = [], []
        for i, tok in zip(live, toks, strict=True):
            out[i].append(tok)
            done = len(out[i]) >= params[i].max_tokens or (
                tok in eos and not params[i].ignore_eos)
            if not done:
                still.append(i)
                rows.append((i, len(prompts[i]) + len(out[i]) - 1, [tok]))
        live = still
    total = time.perf_counter() - t0
    return PlainResult(out, prefill_s or 0.0, total - (prefill_s or 0.0))


def dtype_from_name(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]
