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


def test_a_llama3_pair_of_other_sizes_and_heads_is_accepted_and_exact(root):
    """What users pair (a Llama-3.2-1B draft for a Llama-3.1-8B target): the same tokenizer,
    another width, depth and head count, a tied output head where the target's is untied.
    The start-up checks accept it, and greedy speculation stays token-identical."""
    from specdec.engine.assemble import check_spec
    from specdec.engine.spec import EngineSpec

    target_path, _ = _pair("llama3", root)
    draft_path = make_family_checkpoint(root / "llama3-small", "llama3", hidden_size=32,
                                        intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        tie_word_embeddings=True)
    shard = {"dtype": "float32", "threads": 1, "resources": {"num_cpus": 0}}
    spec = EngineSpec.model_validate({"target": {"model": str(target_path), **shard},
                                      "draft": {"model": str(draft_path), **shard},
                                      "runtime": {"max_slots": 4, "max_len": 96}})
    check_spec(spec, target_path, draft_path)  # accepted: nothing raised
    target = Decoder.from_checkpoint(target_path, "int8")
    draft = Decoder.from_checkpoint(draft_path, torch.float32)
    assert draft.cfg.tie_word_embeddings and not target.cfg.tie_word_embeddings
    prompts = random_prompts((12, 20))
    expected = plain_generate(target, prompts, greedy(32)).token_ids
    engine = _engine(target, draft)
    out = engine.run(requests(prompts, greedy(32), "draft", 3))
    assert [out[f"r{i}"].token_ids for i in range(2)] == expected
    assert engine.totals["draft"].drafted > 0


def test_a_pair_that_cannot_be_exact_is_refused_naming_why(root, tmp_path):
    from specdec.engine.assemble import ConfigError, check_spec
    from specdec.engine.spec import EngineSpec

    target_path, draft_path = _pair("qwen3", root)
    shard = {"dtype": "float32", "threads": 1, "resources": {"num_cpus": 0}}

    def spec(draft):
        return EngineSpec.model_validate({"target": {"model": str(target_path), **shard},
                                          "draft": {"model": str(draft), **shard},
                                          "runtime": {"max_slots": 4, "max_len": 96}})

    bigger = make_family_checkpoint(tmp_path / "big-vocab", "qwen3", vocab_size=128)
    with pytest.raises(ConfigError, match=r"draft\.model: its vocabulary \(128 ids\) exceeds"):
        check_spec(spec(bigger), target_path, bigger)
    other = tmp_path / "other-tokenizer"
    import shutil

    shutil.copytree(draft_path, other)
    (other / "tokenizer.json").write_text(
        (other / "tokenizer.json").read_text().replace('"w95"', '"zz"'))
    with pytest.raises(ConfigError, match=r"draft\.model: draft tokenizer differs"):
        check_spec(spec(other), target_path, other)
