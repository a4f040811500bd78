"""The rejection sampler's output distribution is the target's: statistical tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.model.step.sampling import draw_with_uniform
from specdec.policy.cost_model import expected_tokens_per_round
from specdec.spec_decode.rejection import rejection_sample

P = torch.tensor([0.50, 0.25, 0.15, 0.10])
Q = torch.tensor([0.30, 0.40, 0.20, 0.10])
N = 200_000


def pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(p)).double().numpy()
    expected = p.double().numpy()
    expected = expected / expected.sum() * counts.sum()
    # Chi-square is only valid for expected counts >= 5: pool the rare tokens into one bin.
    rare = expected < 5
    if rare.any():
        counts = np.append(counts[~rare], counts[rare].sum())
        expected = np.append(expected[~rare], expected[rare].sum())
    return chisquare(counts, expected).pvalue


def draws(dist: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    # Not torch.multinomial: its float32 sampling is measurably biased at these sample sizes,
    # and the rule is exact only when drafts really follow q.
    return draw_with_uniform(dist.expand(n, -1), torch.rand(n, generator=g))


def toy_round(n: int, g: torch.Generator):
    x = draws(Q, n, g).view(n, 1)
    q = Q.expand(n, 1, 4)
    p = P.expand(n, 2, 4)
    return x, q, p


def test_toy_table_matches_target_and_acceptance():
    g = torch.Generator().manual_seed(1)
    x, q, p = toy_round(N, g)
    out, emitted = rejection_sample(x, q, p, g)
    assert pvalue(out[:, 0], P) > 1e-3
    acceptance = (emitted == 2).double().mean().item()
    assert abs(acceptance - torch.minimum(P, Q).sum().item()) < 0.01  # 0.80


def test_wrong_shortcuts_fail_the_same_check():
    g = torch.Generator().manual_seed(2)
    x, q, p = toy_round(N, g)
    # Shortcut 1: always keep the guess -> the draft's distribution.
    assert pvalue(x[:, 0], P) < 1e-3
    # Shortcut 2: on rejection, resample from p itself instead of the residual.
    u = torch.rand(N, generator=g)
    keep = u < (P[x[:, 0]] / Q[x[:, 0]]).clamp(max=1)
    resampled = draws(P, N, g)
    wrong = torch.where(keep, x[:, 0], resampled)
    assert pvalue(wrong, P) < 1e-3


def random_dists(g, k, V, batch=1):
    p = torch.rand(k + 1, V, generator=g) ** 3
    p = p / p.sum(-1, keepdim=True)
    # A draft that half agrees with the target, so late positions are reached often.
    q = 0.5 * p[:k] + 0.5 * torch.softmax(torch.randn(k, V, generator=g), -1)
    return p, q / q.sum(-1, keepdim=True)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("one_hot_q", [False, True])
def test_each_reached_position_follows_p(k, one_hot_q):
    V, n = 6, 200_000
    g = torch.Generator().manual_seed(1000 + 10 * k + one_hot_q)
    p, q = random_dists(g, k, V)
    # Without a real q the rule is exact for draft tokens from any source independent of the
    # target's draws; here they come from p itself, so late positions are reached often.
    source = p[:k] if one_hot_q else q
    x = torch.stack([draws(source[i], n, g) for i in range(k)], dim=1)
    out, emitted = rejection_sample(x, None if one_hot_q else q.expand(n, k, V),
                                    p.expand(n, k + 1, V), g)
    assert ((out >= 0).sum(1) == emitted).all()
    for j in range(k + 1):
        reached = emitted > j
        assert reached.sum() > 1000, "position rarely reached: the test would be weak"
        assert pvalue(out[reached, j], p[j]) > 1e-3, f"position {j} does not follow p"


@pytest.mark.parametrize("k,expected", [(1, 1.80), (2, 2.44), (4, 3.36), (8, 4.33)])
def test_tokens_per_round_match_formula(k, expected):
    a, V, n = 0.8, 3, 200_000
    # One-hot draft on token 0 and p(0) = a at every position: acceptance exactly a.
    p = torch.tensor([a, 0.1, 0.1]).expand(n, k + 1, V)
    x = torch.zeros(n, k, dtype=torch.long)
    _, emitted = rejection_sample(x, None, p, torch.Generator().manual_seed(k))
    measured = emitted.double().mean().item()
    assert expected_tokens_per_round(a, k) == pytest.approx(expected, abs=0.005)
    assert measured == pytest.approx(expected_tokens_per_round(a, k), rel=0.01)


def test_greedy_rule_and_ragged_k():
    V = 5
    target = torch.zeros(2, 4, V)
    # Row 0 target argmax: 1, 2, 3, 4. Row 1: 0, 0, 0, 0.
    for i, t in enumerate([1, 2, 3, 4]):
        target[0, i, t] = 1.0
    target[1, :, 0] = 1.0
    drafts = torch.tensor([[1, 2, 0], [0, 0, 0]])
    out, emitted = rejection_sample(drafts, None, target, torch.Generator().manual_seed(0),
                                    num_draft=torch.tensor([3, 1]),
                                    greedy=torch.tensor([True, True]))
    # Row 0 keeps 1, 2, then replaces the mismatching 0 by 3.
    assert out[0].tolist() == [1, 2, 3, -1] and emitted[0] == 3
    # Row 1 has k = 1: keeps its 0 and takes the bonus from position 2, ignoring padding.
    assert out[1].tolist() == [0, 0, -1, -1] and emitted[1] == 2


def test_per_row_generators_are_reproducible():
    g = torch.Generator().manual_seed(5)
    p, q = random_dists(g, 3, 7)
    x = torch.randint(0, 7, (4, 3), generator=g)

    def run():
        gens = [torch.Generator().manual_seed(100 + i) for i in range(4)]
        return rejection_sample(x, q.expand(4, 3, 7), p.expand(4, 4, 7), gens)[0]

    assert torch.equal(run(), run())


def test_numpy_agrees_with_seed_formula():
    # Guard the formula itself against a typo: the seed document's table.
    got = [round(expected_tokens_per_round(0.8, k), 2) for k in (1, 2, 4, 8)]
    assert np.allclose(got, [1.80, 2.44, 3.36, 4.33], atol=0.006)
