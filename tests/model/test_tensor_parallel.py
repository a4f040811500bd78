"""Tensor-parallel logits equal the single-process core (fp32), over real gloo groups in
separate processes; TP=3 on a model whose KV heads must be replicated across ranks."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from conftest import make_tiny_checkpoint
from tp_scenarios import run_rank, scenario_logits

from specdec.model.checkpoint.config import DecoderConfig
from specdec.model.checkpoint.sharding import ShardSpec
from specdec.model.step.decoder import Decoder
from specdec.model.step.parallel import pick_argmax
from specdec.ports import free_port


@pytest.fixture(scope="module")
def tiny_gqa6(tmp_path_factory):
    # 6 query heads over 2 KV heads: at TP=3 the middle rank needs both KV heads.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-gqa6"), "qwen2",
                                num_attention_heads=6, num_key_value_heads=2, hidden_size=48)


def run_group(ckpt, world, seqs, tmp_path, vocab_limit=None, step="eager"):
    port = free_port()
    result = tmp_path / f"tp{world}.pt"
    mp.start_processes(run_rank, args=(world, port, str(ckpt), seqs, str(result), vocab_limit,
                                       step),
                       nprocs=world, join=True, start_method="spawn")
    return torch.load(result)


def local_logits(ckpt, seqs):
    m = Decoder.from_checkpoint(ckpt, torch.float32)
    return scenario_logits(m, m.new_cache(4, 128), seqs)


SEQS = [[3, 17, 45, 9, 22, 61, 8, 30, 12], [50, 4, 77, 13, 29, 6, 41], [90, 15, 33, 70, 2, 11]]


@pytest.mark.parametrize("world,fixture", [(2, "tiny_qwen2"), (2, "tiny_llama"),
                                           (3, "tiny_gqa6")])
def test_tp_logits_equal_single_process(world, fixture, request, tmp_path):
    ckpt = request.getfixturevalue(fixture)
    expected = local_logits(ckpt, SEQS)
    got = run_group(ckpt, world, SEQS, tmp_path)
    for mode, e in expected.items():
        diff = (got[mode] - e).abs().max().item()
        assert diff <= 1e-4, f"TP={world} {mode}: max abs diff {diff}"
        assert torch.equal(got[mode].argmax(-1), e.argmax(-1)), mode
        # Greedy forwards: the distributed argmax (slice maxima, no logits gathered).
        ids = got[f"{mode}:argmax"]
        assert ids.dtype == torch.long and torch.equal(ids, e.argmax(-1)), mode


@pytest.mark.parametrize("world,fixture", [(2, "tiny_qwen2"), (3, "tiny_gqa6")])
def test_tp_static_step_equals_single_process_eager(world, fixture, request, tmp_path):
    """Every rank runs the static step (same buckets, so the all_reduces line up), padded
    rows included (the scenario's three-row batch is a bucket of four)."""
    ckpt = request.getfixturevalue(fixture)
    expected = local_logits(ckpt, SEQS)
    got = run_group(ckpt, world, SEQS, tmp_path, step="static")
    for mode, e in expected.items():
        diff = (got[mode] - e).abs().max().item()
        assert diff <= 1e-4, f"TP={world} static {mode}: max abs diff {diff}"
        assert torch.equal(got[f"{mode}:argmax"], e.argmax(-1)), mode
    # What capture under TP rests on: every rank ran the same graphs in the same order
    # (each records its collectives in the order it meets them).
    orders = [torch.load(tmp_path / f"tp{world}.pt.rank{r}") for r in range(world)]
    assert len(orders[0]) >= 4 and all(o == orders[0] for o in orders), orders


def test_kv_heads_are_replicated_where_ranks_straddle_groups():
    cfg = DecoderConfig.from_dict({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 48,
                                   "intermediate_size": 96, "num_hidden_layers": 1,
                                   "num_attention_heads": 6, "num_key_value_heads": 2})
    spans = [(ShardSpec(r, 3).q_heads(cfg), ShardSpec(r, 3).kv_heads(cfg)) for r in range(3)]
    assert [list(q) for q, _ in spans] == [[0, 1], [2, 3], [4, 5]]
    assert [list(kv) for _, kv in spans] == [[0], [0, 1], [1]]
    with pytest.raises(ValueError, match="must divide the model's attention heads"):
        ShardSpec(0, 4).check(cfg)


def test_each_rank_projects_only_its_slice_of_the_vocabulary(tiny_llama, tiny_gqa6):
    """Vocabulary-parallel output layer: the slices partition the ids (uneven where the
    world does not divide the vocabulary), and no rank holds the whole projection."""
    for ckpt, world in ((tiny_llama, 2), (tiny_gqa6, 3)):
        cfg = DecoderConfig.from_checkpoint(ckpt)
        for limit in (None, 61):
            n = limit or cfg.vocab_size
            spans = [ShardSpec(r, world).vocab_rows(n) for r in range(world)]
            assert [i for s in spans for i in s] == list(range(n))
            for r in range(world):
                m = Decoder.from_checkpoint(ckpt, torch.float32, shard=ShardSpec(r, world),
                                            vocab_limit=limit)
                assert m.lm_head.out_features == len(spans[r]) < n and m.vocab_out == n


def test_tp_logits_with_a_draft_vocabulary_limit(tiny_gqa6, tmp_path):
    """A draft's vocabulary limit under TP=3: every rank limits its slice at load, and the
    joined logits equal the single-process model's first 61 columns."""
    expected = local_logits(tiny_gqa6, SEQS)
    got = run_group(tiny_gqa6, 3, SEQS, tmp_path, vocab_limit=61)
    for mode, e in expected.items():
        assert got[mode].shape[-1] == 61
        assert torch.equal(got[f"{mode}:argmax"], e[:, :61].argmax(-1)), mode
        diff = (got[mode] - e[:, :61]).abs().max().item()
        assert diff <= 1e-4, f"{mode}: max abs diff {diff}"


def test_distributed_argmax_breaks_ties_as_the_whole_row_does():
    """Each rank's slice maximum and its global id; the pick must equal torch.argmax over the
    joined row, including ties across ranks (the lowest id wins) and a rank whose slice is
    all -inf (an empty slice)."""
    gen = torch.Generator().manual_seed(0)
    spans = [range(0, 4), range(4, 8), range(8, 10)]
    for trial in range(200):
        row = torch.randint(0, 3, (5, 10), generator=gen).float()  # many exact ties
        if trial % 7 == 0:
            row[:, 8:] = float("-inf")
        best, ids = [], []
        for s in spans:
            v, i = row[:, s.start:s.stop].max(-1)
            best.append(v.double())
            ids.append(i + s.start)
        got = pick_argmax(torch.stack(best), torch.stack(ids))
        assert torch.equal(got, row.argmax(-1)), row


FAMILY_SEQS = [[(7 * i) % 90 + 3 for i in range(40)], *SEQS[:2]]  # the first past a 24-token window


@pytest.fixture(scope="module")
def family_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tp-families")


@pytest.mark.parametrize("case", ["gemma3", "phi3", "qwen3", "llama3"])
def test_tp_logits_of_each_family_equal_single_process(case, family_root, tmp_path):
    """Phi-3's fused q|k|v and gate|up cut per rank, q/k norms on each rank's heads, Gemma's
    output norms after the all_reduce and its windows, Llama 3's scaled RoPE."""
    from family_fixtures import make_family_checkpoint

    ckpt = family_root / case
    if not ckpt.exists():
        make_family_checkpoint(ckpt, case)
    expected = local_logits(ckpt, FAMILY_SEQS)
    got = run_group(ckpt, 2, FAMILY_SEQS, tmp_path)
    for mode, e in expected.items():
        diff = (got[mode] - e).abs().max().item()
        assert diff <= 1e-4, f"{case} TP=2 {mode}: max abs diff {diff}"
