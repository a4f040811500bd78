"""Builders shared by the engine tests (tiny fixture models, no tokenizer)."""

from __future__ import annotations

import os

import torch

from specdec.engine import Engine, EngineConfig
from specdec.model import Decoder
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.request import Request
from specdec.sampling import SamplingParams
from specdec.target_runner import LocalTargetRunner

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
                config: EngineConfig | None = None, draft_vocab_limit=None,
                draft_confidence=None, q_top_m=None, proposer_cls=DraftModelProposer,
                overlap="off") -> Engine:
    proposers = {"ngram": NgramProposer(1, 3)}
    if draft_path is not None:
        proposers["draft"] = proposer_cls(load(draft_path), slots, max_len, draft_sampling,
                                          draft_vocab_limit, draft_confidence, q_top_m)
    return Engine(LocalTargetRunner(load(target_path), slots, max_len), proposers,
                  tokenizer, eos_ids, config, overlap=overlap)


def random_prompts(lengths, seed=0, vocab=96) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens=24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def requests(prompts, params, method="none", k=0, prefix="r") -> list[Request]:
    return [Request(f"{prefix}{i}", p, params, method, k) for i, p in enumerate(prompts)]
