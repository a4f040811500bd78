import torch

from specdec.model.formats.q4k import quantize
from specdec_bench.draft_bits import bits_per_weight, expected_speedup, round_to_bits


def test_four_bits_is_the_int4_formats_own_rounding():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 896, generator=g) * 0.05  # 896: a partial last block, as the draft's
    want = quantize(w).dequantize()[:, :896]
    assert torch.equal(round_to_bits(w, 4), want)


def test_fewer_bits_fewer_levels_and_more_error():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 512, generator=g)
    three, four = round_to_bits(w, 3), round_to_bits(w, 4)
    groups = three.reshape(32, -1, 32)
    assert max(len(torch.unique(grp)) for grp in groups.reshape(-1, 32)) <= 8
    assert (three - w).pow(2).mean() > 2 * (four - w).pow(2).mean()


def test_the_stored_bits_are_q4ks_at_four():
    assert bits_per_weight(4) == 4.5  # llama.cpp's Q4_K: 144 bytes a 256 weights
    assert bits_per_weight(3) == 3.5


def test_the_cost_model_rewards_agreement_and_punishes_cost():
    assert expected_speedup(1.0, 0.0, k_max=4) == (5.0, 4)
    slow, k = expected_speedup(0.0, 0.3)
    assert k == 1 and slow < 1
    assert expected_speedup(0.75, 0.2)[0] > expected_speedup(0.75, 0.3)[0]
    assert expected_speedup(0.8, 0.25)[0] > expected_speedup(0.7, 0.25)[0]
