"""Builders shared by the engine tests (tiny fixture models, no tokenizer)."""

from __future__ import annotations

import collections
import os

import numpy as np
import torch
from scipy.stats import chi2_contingency

from specdec.engine.engine import Engine, EngineLimits
from specdec.engine.request import Request
from specdec.model.step.decoder import Decoder
from specdec.model.step.generate import plain_generate
from specdec.model.step.sampling import SamplingParams
from specdec.model.step.step_mode import with_step
from specdec.spec_decode.proposers import DraftModelProposer, NgramProposer
from specdec.spec_decode.target_runner import LocalTargetRunner

_MODELS: dict = {}
# The engine tests run on CPU; SPECDEC_TEST_DEVICE=cuda runs the same exactness checks with
# every model (and so every cache, logit and sampler tensor) on a GPU.
DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")


def load(path) -> Decoder:
    if path not in _MODELS:
        _MODELS[path] = Decoder.from_checkpoint(path, torch.float32, DEVICE)
    return _MODELS[path]


def make_engine(target_path, draft_path=None, slots=8, max_len=192,
                draft_sampling="probabilistic", eos_ids=(), tokenizer=None,
                limits: EngineLimits | None = None, draft_vocab_limit=None,
                draft_confidence=None, q_top_m=None, proposer_cls=DraftModelProposer,
                overlap="off", step="eager", suffix=None) -> Engine:
    """step: how both models run each forward (specdec/model/step/static_step.py); suffix: a
    SuffixProposer to offer as the `suffix` method."""
    proposers = {"ngram": NgramProposer(1, 3)}
    if suffix is not None:
        proposers["suffix"] = suffix
    if draft_path is not None:
        proposers["draft"] = proposer_cls(with_step(load(draft_path), step), slots, max_len,
                                          draft_sampling, draft_vocab_limit, draft_confidence,
                                          q_top_m)
    return Engine(LocalTargetRunner(with_step(load(target_path), step), slots, max_len),
                  proposers,
                  tokenizer, eos_ids, limits, overlap=overlap)


def random_prompts(lengths, seed=0, vocab=96) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens=24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def requests(prompts, params, method="none", k=0, prefix="r") -> list[Request]:
    return [Request(f"{prefix}{i}", p, params, method, k) for i, p in enumerate(prompts)]


BIG_QUEUE = EngineLimits(max_waiting=10**5)


def plain_reference(target, prompts, max_tokens=24):
    return plain_generate(load(target), prompts, greedy(max_tokens)).token_ids


def first_three_counts(engine_factory, method, k, n, temperature, seed0=None):
    """Counts of the first three tokens of n requests. seed0 None: unseeded requests (the
    rejection rule); else seeds seed0 + i (the seeded race)."""
    engine = engine_factory()
    prompt = [5, 17, 33, 8]
    # max_tokens 4: the first token comes from the prefill, tokens 2-3 from one round of
    # k = 2 drafts (its bonus token is the 4th, not compared).
    reqs = [Request(f"s{i}", prompt, SamplingParams(temperature=temperature, max_tokens=4,
                                                    ignore_eos=True,
                                                    seed=None if seed0 is None else seed0 + i),
                    method, k)
            for i in range(n)]
    outs = engine.run(reqs)
    return collections.Counter(tuple(o.token_ids[:3]) for o in outs.values()), engine


def contingency_pvalue(a: collections.Counter, b: collections.Counter) -> float:
    keys = sorted(set(a) | set(b))
    table = np.array([[a.get(x, 0) for x in keys], [b.get(x, 0) for x in keys]], dtype=float)
    # Pool sparse categories (expected count < 5) into one, where chi-square is valid.
    total = table.sum(0)
    expected_min = total * min(table.sum(1)) / table.sum()
    rare = expected_min < 5
    if rare.any():
        table = np.concatenate([table[:, ~rare], table[:, rare].sum(1, keepdims=True)], axis=1)
    return chi2_contingency(table).pvalue
