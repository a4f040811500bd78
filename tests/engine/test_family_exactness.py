"""Speculation stays exact on the new families: greedy speculative output token-identical to
plain decoding past the fixtures' windows, in fp32 and in the served CPU formats, and a
sampled Gemma 3 round following the target's distribution."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from engine_helpers import (
    BIG_QUEUE,
    contingency_pvalue,
    first_three_counts,
    greedy,
    random_prompts,
    requests,
)

from specdec.engine.engine import Engine
from specdec.model.step.decoder import Decoder
from specdec.model.step.generate import plain_generate
from specdec.pack.tiny import make_perturbed_copy
from specdec.spec_decode.proposers import DraftModelProposer, NgramProposer
from specdec.spec_decode.target_runner import LocalTargetRunner

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from family_fixtures import make_family_checkpoint  # noqa: E402

_PAIRS: dict = {}


def _pair(case: str, root: Path) -> tuple[Path, Path]:
    if case not in _PAIRS:
        target = make_family_checkpoint(root / case, case)
        _PAIRS[case] = target, make_perturbed_copy(target, root / f"{case}-draft", 0.05, 5)
    return _PAIRS[case]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("family-pairs")


def _engine(target: Decoder, draft: Decoder, slots=8, max_len=96, limits=None) -> Engine:
    proposers = {"ngram": NgramProposer(1, 3),
                 "draft": DraftModelProposer(draft, slots, max_len, "probabilistic")}
    return Engine(LocalTargetRunner(target, slots, max_len), proposers, None, (), limits)


@pytest.mark.parametrize("case", ["gemma3", "qwen3", "phi3", "llama3"])
@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_greedy_speculation_is_token_identical(case, fmt, root):
    target_path, draft_path = _pair(case, root)
    target = Decoder.from_checkpoint(target_path, fmt)
    draft = Decoder.from_checkpoint(draft_path, torch.float32)
    prompts = random_prompts((20, 9, 30))  # with 40 tokens: past the 24-token window
    expected = plain_generate(target, prompts, greedy(40)).token_ids
    engine = _engine(target, draft)
    out = engine.run(requests(prompts, greedy(40), "draft", 3))
    for i, e in enumerate(expected):
        assert out[f"r{i}"].token_ids == e, f"{case} {fmt}: prompt {i}"
    spec = engine.totals["draft"]
    assert 0 < spec.accepted < spec.drafted, "no rejections or no acceptances: a weak test"


def test_sampled_gemma3_rounds_follow_the_plain_distribution(root):
    target_path, _ = _pair("gemma3", root)
    far = make_perturbed_copy(target_path, root / "gemma3-far", 0.3, 7)
    target = Decoder.from_checkpoint(target_path, torch.float32)
    draft = Decoder.from_checkpoint(far, torch.float32)

    def factory():
        return _engine(target, draft, slots=64, max_len=16, limits=BIG_QUEUE)

    plain, _ = first_three_counts(factory, "none", 0, 3000, 1.0)
    spec, engine = first_three_counts(factory, "draft", 2, 3000, 1.0)
    totals = engine.totals["draft"]
    assert 0.05 * totals.drafted < totals.accepted < 0.95 * totals.drafted
    assert contingency_pvalue(plain, spec) > 1e-3
