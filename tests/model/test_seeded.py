"""The seeded race (specdec/model/step/seeded.py): one hash in three implementations, agreeing bit
for bit, and the race an exact draw from p."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.model.step import seeded
from specdec.model.step.seeded import race_key, race_keys, race_pick, race_pick_among


def _without_kernel(monkeypatch):
    monkeypatch.setattr(seeded, "_kernel", lambda: None)


def test_keys_differ_by_seed_and_position():
    keys = {race_key(s, t) for s in (0, 1, -2, (1 << 64) - 1, 1234) for t in range(50)}
    assert len(keys) == 250
    assert all(-(1 << 63) <= k < (1 << 63) for k in keys)


def test_the_three_hashes_agree_bit_for_bit():
    ops = seeded._kernel()
    if ops is None:
        pytest.skip("no C++ compiler here: the kernel is not part of this machine's path")
    keys = torch.tensor([race_key(s, t) for s in (0, 7, -5, (1 << 63) + 3) for t in (0, 1, 999)])
    ids = torch.cat([torch.arange(300), torch.tensor([151935, 10**6, (1 << 40) + 17])])
    kernel = ops.race_uniforms(keys, ids)
    numpy = torch.from_numpy(seeded.uniforms_np(keys.numpy(), ids.numpy()))
    torch_ops = seeded._uniforms_torch(keys, ids)
    assert torch.equal(kernel, numpy) and torch.equal(kernel, torch_ops)
    assert 0 < kernel.min() and kernel.max() < 1


@pytest.mark.parametrize("fallback", [False, True])
def test_race_pick_matches_its_definition(monkeypatch, fallback):
    """argmax over v of log(u_v) / p_v, zero-probability tokens never winning, a NaN row -1;
    the kernel (with its skip of hopeless tokens) and numpy give the same winners."""
    if fallback:
        _without_kernel(monkeypatch)
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(40, 5000, generator=g) * 3, -1)
    probs[::3, 100:] = 0  # top-k style cuts
    probs[5] = float("nan")
    keys = race_keys([(11, t) for t in range(40)])
    got = race_pick(probs, keys)
    u = torch.from_numpy(seeded.uniforms_np(keys.numpy(), np.arange(5000)))
    scores = torch.where(probs > 0, torch.log(u) / probs, torch.tensor(float("-inf")))
    want = scores.argmax(-1)
    want[5] = -1
    assert got.tolist() == want.tolist()
    assert all(got[i] < 100 for i in range(0, 40, 3) if i != 5 and i % 3 == 0)


def test_race_pick_among_uses_each_ids_own_uniform():
    """The draft's race over its candidates draws the same u per id as the target's over the
    vocabulary: with q equal to p on the candidates, both pick the same token."""
    g = torch.Generator().manual_seed(1)
    V = 64
    probs = torch.softmax(torch.randn(200, V, generator=g) * 2, -1)
    keys = race_keys([(3, t) for t in range(200)])
    top, ids = probs.topk(V, -1)  # every id, in another order
    assert torch.equal(ids.gather(1, race_pick_among(ids, top, keys).unsqueeze(1)).squeeze(1),
                       race_pick(probs, keys))


@pytest.mark.parametrize("fallback", [False, True])
def test_the_race_draws_from_p(monkeypatch, fallback):
    """Over many positions the winners follow p (chi-square), top-k cut tokens never win."""
    if fallback:
        _without_kernel(monkeypatch)
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0, 0.0])
    n = 20000
    winners = race_pick(p.expand(n, -1).contiguous(), race_keys([(99, t) for t in range(n)]))
    counts = collections.Counter(winners.tolist())
    assert set(counts) <= set(range(6))
    observed = [counts.get(v, 0) for v in range(6)]
    assert chisquare(observed, (p[:6] * n).tolist()).pvalue > 1e-3
