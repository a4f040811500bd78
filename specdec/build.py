"""Assemble a single-process engine from model references (CLI, tests, benchmarks)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal

from specdec import hub
from specdec.engine import Engine, EngineConfig
from specdec.generate import load_tokenizer
from specdec.model import Decoder
from specdec.proposers import DraftModelProposer, NgramProposer, Proposer, check_same_tokenizer
from specdec.target_runner import LocalTargetRunner


@dataclasses.dataclass
class LocalEngineSpec:
    target: str
    draft: str | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    max_slots: int = 8
    max_len: int = 2048
    draft_sampling: Literal["probabilistic", "greedy"] = "probabilistic"
    draft_vocab_limit: int | None = None  # draft guesses only among the first N token ids
    draft_confidence: float | None = None  # a draft stops early below this confidence
    ngram_min: int = 2
    ngram_max: int = 5


def eos_ids_of(path: str | Path, tokenizer) -> set[int]:
    """Every token that ends generation: config, generation config and tokenizer agree
    rarely (Qwen instruct models end turns with <|im_end|>, not the config's eos)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def build_local_engine(spec: LocalEngineSpec, **engine_kw) -> tuple[Engine, object]:
    dtype = spec.dtype
    target_path = hub.resolve(spec.target)
    tok = load_tokenizer(target_path)
    target = Decoder.from_checkpoint(target_path, dtype, spec.device)
    proposers: dict[str, Proposer] = {"ngram": NgramProposer(spec.ngram_min, spec.ngram_max)}
    if spec.draft:
        draft_path = hub.resolve(spec.draft)
        check_same_tokenizer(target_path, draft_path)
        draft = Decoder.from_checkpoint(draft_path, dtype, spec.device)
        proposers["draft"] = DraftModelProposer(draft, spec.max_slots, spec.max_len,
                                                spec.draft_sampling, spec.draft_vocab_limit,
                                                spec.draft_confidence)
    runner = LocalTargetRunner(target, spec.max_slots, spec.max_len)
    engine = Engine(runner, proposers, tok, eos_ids_of(target_path, tok),
                    engine_kw.pop("config", None) or EngineConfig(), **engine_kw)
    return engine, tok
