"""The token-attention kernel (specdec/model/formats/kernels/token_attention.cpp): each token attends
alone over its own slot, the same arithmetic whatever shares its batch and whatever the
thread count, and as close to exact attention as SDPA."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.model.formats import token_attention
from specdec.model.formats.kernels.build import attention

pytestmark = pytest.mark.skipif(not token_attention.kernel_available(),
                                reason="no C++ compiler here to build the kernel")

# (query heads, kv heads, head dim): the target's, the draft's, plain MHA, one kv head.
SHAPES = [(12, 2, 128), (14, 2, 64), (4, 4, 32), (8, 1, 64)]
# Key counts around the kernel's chunk boundaries, and a full slot.
LENGTHS = [1, 15, 16, 17, 127, 128, 129, 255, 256, 257, 700, 1024]


def _cache(heads_kv: int, dim: int, dtype, slots: int = 3, length: int = 1024, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # Keys larger than unit scale, as Qwen's biased keys are: scores far from 0 exercise exp.
    k = (torch.randn(slots, length, heads_kv, dim, generator=g) * 4).to(dtype)
    v = torch.randn(slots, length, heads_kv, dim, generator=g).to(dtype)
    return k, v


def _exact(q, k, v, slots, n):
    """float64 attention, one token at a time."""
    out = []
    T, H, D = q.shape
    g = H // k.shape[2]
    for t in range(T):
        kk = k[slots[t], : n[t]].double().repeat_interleave(g, dim=1)  # [n, H, D]
        vv = v[slots[t], : n[t]].double().repeat_interleave(g, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[t].double(), kk) / math.sqrt(D), -1)
        out.append(torch.einsum("hn,nhd->hd", w, vv))
    return torch.stack(out).float()


@pytest.mark.parametrize("heads,heads_kv,dim", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_matches_exact_attention_and_its_scalar_form(heads, heads_kv, dim, dtype):
    ops = attention()
    k, v = _cache(heads_kv, dim, dtype)
    T = len(LENGTHS)
    q = torch.randn(T, heads, dim, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([t % 3 for t in range(T)])
    n = torch.tensor(LENGTHS)
    got = ops.attend(q, k, v, slots, n, 1 / math.sqrt(dim))
    assert torch.allclose(got, _exact(q, k, v, slots, n), atol=2e-5, rtol=1e-4)
    # The SIMD form and the scalar form do the same sums in the same order.
    assert torch.equal(got, ops.attend_reference(q, k, v, slots, n, 1 / math.sqrt(dim)))


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8])
def test_a_token_is_bit_identical_alone_and_in_any_batch(threads):
    """The property a batch-invariant target needs: a decode row, a verify's tokens and a
    prefill chunk's tokens each get the arithmetic they would get alone, at any thread count
    (OpenMP splits the work differently at each)."""
    ops = attention()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        k, v = _cache(2, 128, torch.float16, slots=4)
        g = torch.Generator().manual_seed(2)
        probe = torch.randn(1, 12, 128, generator=g)
        scale = 1 / math.sqrt(128)
        for n_probe in (40, 256, 700):
            alone = ops.attend(probe, k, v, torch.tensor([1]), torch.tensor([n_probe]), scale)
            for size in (2, 5, 19, 64):
                for at in {0, size // 2, size - 1}:
                    q = torch.randn(size, 12, 128, generator=g)
                    q[at] = probe[0]
                    # Its neighbours: other slots, and its own slot (a prefill chunk's tokens).
                    slots = torch.randint(0, 4, (size,), generator=g)
                    n = torch.randint(1, 1024, (size,), generator=g)
                    slots[at], n[at] = 1, n_probe
                    out = ops.attend(q, k, v, slots, n, scale)
                    assert torch.equal(out[at], alone[0]), (n_probe, size, at)
    finally:
        torch.set_num_threads(before)


def test_consecutive_tokens_of_one_slot_as_a_prefill_chunk_sees_them():
    """A chunk's tokens share their keys' loading, never their sums: each equals the token
    decoded alone at its position."""
    ops = attention()
    k, v = _cache(2, 64, torch.float16, slots=1)
    q = torch.randn(300, 14, 64, generator=torch.Generator().manual_seed(3))
    start = 500
    slots, n = torch.zeros(300, dtype=torch.long), torch.arange(start + 1, start + 301)
    chunk = ops.attend(q, k, v, slots, n, 0.125)
    for t in (0, 15, 16, 17, 150, 299):
        one = ops.attend(q[t:t + 1].contiguous(), k, v, slots[t:t + 1], n[t:t + 1], 0.125)
        assert torch.equal(chunk[t], one[0])


def test_fallback_without_the_kernel_keeps_the_rule():
    """Uneven kv-head groups (replicated heads under tensor parallelism) take the per-token
    SDPA path: the same attention, within float rounding."""
    k, v = _cache(2, 64, torch.float16)
    q = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(4))
    slots, n = torch.tensor([0, 1, 2]), torch.tensor([5, 300, 1024])
    per_token = list(zip(slots.tolist(), n.tolist(), strict=True))
    uniform = token_attention.attend(q, k, v, slots, n, per_token)
    spelled = token_attention.attend(q, k, v, slots, n, per_token,
                                     kv_index=torch.tensor([0, 0, 1, 1]))
    assert torch.allclose(uniform, spelled, atol=1e-5)


def test_refuses_what_it_cannot_read():
    ops = attention()
    k, v = _cache(2, 64, torch.float16, slots=2, length=64)
    q = torch.randn(1, 4, 64)
    with pytest.raises(RuntimeError, match="sees 65 keys of 64"):
        ops.attend(q, k, v, torch.tensor([0]), torch.tensor([65]), 1.0)
    with pytest.raises(RuntimeError, match="has slot 2 of 2"):
        ops.attend(q, k, v, torch.tensor([2]), torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="query heads over"):
        ops.attend(torch.randn(1, 3, 64), k, v, torch.tensor([0]), torch.tensor([1]), 1.0)
