"""Q6_K blocks under the q4k format: read as the `gguf` package reads them, packed and
unpacked without loss, and run by the kernel as its scalar reference runs them, tracking
float arithmetic on the same integers, a row's result the same alone and in any batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as reference_dequantize

from specdec.model.checkpoint import kquant_blocks as kb
from specdec.model.formats import q4k, q6k

pytestmark = pytest.mark.skipif(not q4k.available(), reason="needs the kquant kernel")


def random_blocks(n: int, nb: int, seed: int) -> kb.Q6KBlocks:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, nb, generator=g) * 1e-3).half().float()
    scales = torch.randint(-128, 128, (n, nb, 16), generator=g, dtype=torch.int8)
    q = torch.randint(0, 64, (n, nb, 256), generator=g, dtype=torch.uint8)
    return kb.Q6KBlocks(d, scales, q)


def quantize_q6k(w: torch.Tensor) -> kb.Q6KBlocks:
    """Float weights -> Q6_K blocks (symmetric per 16, scales as int8 multiples of d)."""
    n, k = w.shape
    s = w.reshape(n, k // 256, 16, 16)
    sub = s.abs().amax(-1) / 31
    d = (sub.amax(-1) / 127).half().float()
    sc = torch.round(sub / d.clamp(min=1e-12).unsqueeze(-1)).clamp(-128, 127)
    step = (d.unsqueeze(-1) * sc).unsqueeze(-1).clamp(min=1e-12)
    q = (torch.round(s / step).clamp(-32, 31) + 32).to(torch.uint8).reshape(n, k // 256, 256)
    return kb.Q6KBlocks(d, sc.to(torch.int8), q)


def to_gguf_bytes(b: kb.Q6KBlocks) -> np.ndarray:
    """The GGUF Q6_K byte layout (ggml-quants.c), the inverse of kb.q6k_from_gguf."""
    n, nb = b.d.shape
    q = b.q.reshape(-1, 2, 4, 32)                      # [block, half, group, 32]
    low, high = q & 0x0F, q >> 4
    ql = torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)],
                   dim=2).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) |
          (high[:, :, 3] << 6)).reshape(-1, 64)
    sc = b.scales.reshape(-1, 16).view(torch.uint8)
    d = b.d.reshape(-1, 1).half().view(torch.uint8)
    return torch.cat([ql, qh, sc, d], dim=1).reshape(n, nb * kb.Q6_K_BYTES).numpy()


def test_the_gguf_bytes_read_as_the_reference_reads_them_and_pack_round_trips():
    rng = np.random.default_rng(6)
    raw = rng.integers(0, 256, size=(21, 2 * kb.Q6_K_BYTES), dtype=np.uint8)
    raw.reshape(-1, kb.Q6_K_BYTES)[:, 208:210] = np.frombuffer(
        (rng.random(42) * 1e-2).astype(np.float16).tobytes(), np.uint8).reshape(42, 2)
    blocks = kb.q6k_from_gguf(torch.from_numpy(raw.copy()))
    ref = reference_dequantize(raw, Q.Q6_K).astype(np.float32)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(ref).reshape(21, 512))
    assert np.array_equal(to_gguf_bytes(blocks), raw)
    back = q6k.unpack(q6k.pack(blocks), 21)
    for name in ("d", "scales", "q"):
        assert torch.equal(getattr(back, name), getattr(blocks, name)), name


def test_the_kernel_gives_its_reference_and_tracks_float_arithmetic():
    from test_q4k import quantized_activations

    blocks = random_blocks(45, 3, seed=1)             # a last tile of 13 channels
    bias = torch.randn(45)
    lin = q6k.Q6KLinear(blocks, bias)
    x = torch.randn(11, 768) * torch.linspace(0.01, 10, 11)[:, None]
    y = lin(x)
    assert torch.equal(y, lin.reference(x))
    w = blocks.dequantize().double()
    exact = (quantized_activations(x) @ w.T + bias.double()).float()
    torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-4)
    assert lin.nbytes < 45 * 768 * 6.6 / 8 + 4 * 45 + 16 * 3360


def test_a_rows_result_is_bit_identical_alone_and_in_any_batch():
    lin = q6k.Q6KLinear(random_blocks(70, 2, seed=2))
    x = torch.randn(9, 512) * 3
    whole = lin(x)
    for i in range(9):
        assert torch.equal(lin(x[i:i + 1])[0], whole[i])
        assert torch.equal(lin(torch.cat([x[i:i + 1], x * 7]))[0], whole[i])
