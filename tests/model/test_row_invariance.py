"""A batch-invariant target's rows do not depend on their batch at any thread count: every op
of the served path (norms, rotary, token attention, the MLP's activation, residuals, the
q4k/q6k projections, the logits) gives a row alone the bits it gets at any position of a
batch of any size, at 1, 2, 3, 4 and 8 threads.

At 3+ threads ATen's F.silu(gate) * up splits a [rows, 8960] tensor among threads mid-row
and finishes each chunk's tail with scalar exp, 1 ulp off the vector path: the activation
kernel of kernels/row_ops.cpp is what these tests hold to."""

from __future__ import annotations

import pytest
import torch

from specdec.model.formats import activation
from specdec.model.step.batch import BatchInput
from specdec.model.step.decoder import Decoder

pytestmark = pytest.mark.skipif(not activation.kernel_available(),
                                reason="the row kernels need a C++ compiler")

THREADS = [1, 2, 3, 4, 8]


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_silu_mul_is_the_same_arithmetic_everywhere():
    ops = activation._ops()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(23, 2 * 8960, generator=g) * 4
    x[0, :5] = torch.tensor([0.0, -0.0, 100.0, -100.0, 89.0])
    got = ops.silu_mul(x)
    assert torch.equal(got, ops.silu_mul_reference(x))
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=2e-6,
                               atol=1e-6)


@pytest.mark.parametrize("threads", THREADS)
def test_silu_mul_row_alone_equals_it_in_any_batch(threads):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(threads)
    row = torch.randn(1, 2 * 8960, generator=g) * 3
    alone = activation.silu_mul(row, row_invariant=True)
    for size in (2, 5, 19, 40):
        for at in {0, size // 2, size - 1}:
            batch = torch.randn(size, 2 * 8960, generator=g) * 3
            batch[at] = row[0]
            assert torch.equal(activation.silu_mul(batch, row_invariant=True)[at], alone[0]), \
                (threads, size, at)


@pytest.fixture(scope="module")
def wide_q4k(tmp_path_factory):
    """A one-layer Qwen2 with the 1.5B's MLP width (8960), its float weights in Q4_K (where
    the Q4_K kernel has no form for this CPU, in int8: what `q4k` serves there)."""
    from conftest import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("wide"), "qwen2", hidden_size=256,
                                intermediate_size=8960, num_attention_heads=4,
                                num_key_value_heads=2, num_hidden_layers=1)
    return Decoder.from_checkpoint(path, "q4k")


def _logits(model, rows):
    """rows: (slot, start, tokens); each row's last token's logits, after its slots were
    filled with the same context."""
    cache = model.new_cache(24, 128)
    ctx = list(range(10, 50))
    for slot in {r[0] for r in rows}:
        model(BatchInput.build([(slot, 0, ctx)]), cache)
    b = BatchInput.build(rows)
    ends = torch.tensor([len(r[2]) for r in rows]).cumsum(0) - 1
    return model(b, cache, logit_indices=ends)


@pytest.mark.parametrize("threads", THREADS)
def test_a_q4k_rows_logits_alone_equal_them_in_any_batch(wide_q4k, threads):
    torch.set_num_threads(threads)
    probe = [7, 8, 9, 11]  # a verify of 4 tokens after 40 of context
    alone = _logits(wide_q4k, [(0, 40, probe)])[0]
    g = torch.Generator().manual_seed(threads)
    for size in (2, 6, 19):
        for at in {0, size // 2, size - 1}:
            rows = [(i, 40, torch.randint(3, 90, (int(torch.randint(1, 6, (1,), generator=g)),),
                                          generator=g).tolist()) for i in range(size)]
            rows[at] = (at, 40, probe)  # every slot holds the same context
            assert torch.equal(_logits(wide_q4k, rows)[at], alone), (threads, size, at)


@pytest.fixture(scope="module")
def gemma3_int8(tmp_path_factory):
    """A Gemma 3 in int8: windowed layers (the block rotates, tokens past the window attend
    alone through SDPA), GeGLU-tanh one row at a time, q/k norms, output norms."""
    from family_fixtures import make_family_checkpoint

    path = make_family_checkpoint(tmp_path_factory.mktemp("gemma3-rows"), "gemma3")
    return Decoder.from_checkpoint(path, "int8")


@pytest.mark.parametrize("threads", THREADS)
def test_a_windowed_gemma3_rows_logits_alone_equal_them_in_any_batch(gemma3_int8, threads):
    torch.set_num_threads(threads)
    probe = [7, 8, 9, 11]  # after 40 of context: past the 24-token window
    alone = _logits(gemma3_int8, [(0, 40, probe)])[0]
    g = torch.Generator().manual_seed(threads)
    for size in (2, 6, 19):
        for at in {0, size // 2, size - 1}:
            rows = [(i, 40, torch.randint(3, 90, (int(torch.randint(1, 6, (1,), generator=g)),),
                                          generator=g).tolist()) for i in range(size)]
            rows[at] = (at, 40, probe)
            assert torch.equal(_logits(gemma3_int8, rows)[at], alone), (threads, size, at)
