"""The q4k format: GGUF's Q4_K blocks kept as the file stores them and run by our kernel.

The kernel must give what its scalar reference gives (same integers, same float steps),
track float arithmetic on the same 4-bit weights, and keep a row's result bit-identical
alone and in any batch (what a target needs); the loader must keep the file's very blocks;
greedy speculation with a q4k target must equal plain decoding in that format.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import greedy, random_prompts
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as reference_dequantize

from specdec.engine.engine import Engine
from specdec.engine.request import Request
from specdec.model.checkpoint import kquant_blocks as kb
from specdec.model.formats import q4k
from specdec.model.formats.int8_linear import RowInt8Linear
from specdec.model.formats.kquant_choice import RowStackedLinear
from specdec.model.formats.q6k import Q6KLinear
from specdec.model.formats.weight_format import fbgemm_available, resolve_format
from specdec.model.step.decoder import BatchInput, Decoder
from specdec.model.step.generate import plain_generate
from specdec.spec_decode.proposers import DraftModelProposer
from specdec.spec_decode.target_runner import LocalTargetRunner

pytestmark = pytest.mark.skipif(not (fbgemm_available() and q4k.available()),
                                reason="q4k needs its kernel (a C++ compiler) and FBGEMM")


def random_blocks(n: int, k: int, seed: int) -> kb.Q4KBlocks:
    """Every field over its whole range: 6-bit scales and minimums, 4-bit weights."""
    g = torch.Generator().manual_seed(seed)
    nb = k // kb.QK

    def ints(high, *shape):
        return torch.randint(0, high, shape, generator=g, dtype=torch.uint8)

    d = (torch.rand(n, nb, generator=g) * 1e-3).half().float()
    dmin = (torch.rand(n, nb, generator=g) * 1e-3).half().float()
    return kb.Q4KBlocks(d, dmin, ints(64, n, nb, 8), ints(64, n, nb, 8), ints(16, n, nb, 256))


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """The kernel's view of x: int8 per 256 columns of a row, times that block's scale."""
    b = x.reshape(x.shape[0], -1, kb.QK)
    amax = b.abs().amax(dim=-1, keepdim=True)
    scale = amax / 127
    q = torch.round(b * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    return (q.double() * scale.double()).reshape(x.shape)


def to_gguf_bytes(blocks: kb.Q4KBlocks) -> np.ndarray:
    """Q4_K blocks in GGUF's byte layout (ggml-quants.c), the inverse of kb.q4k_from_gguf."""
    n, nb = blocks.d.shape
    sc, mn = blocks.scales.reshape(-1, 8), blocks.mins.reshape(-1, 8)
    packed = torch.zeros(n * nb, 12, dtype=torch.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    q = blocks.q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    d = blocks.d.reshape(-1, 1).half().view(torch.uint8)
    dmin = blocks.dmin.reshape(-1, 1).half().view(torch.uint8)
    raw = torch.cat([d, dmin, packed, qs], dim=1)
    return raw.reshape(n, nb * kb.Q4_K_BYTES).numpy()


def test_the_kernel_gives_its_reference_and_tracks_float_arithmetic():
    blocks = random_blocks(45, 512, seed=1)   # 45: a last tile of 13 channels
    bias = torch.randn(45)
    lin = q4k.Q4KLinear(blocks, bias)
    x = torch.randn(11, 512) * torch.linspace(0.01, 10, 11)[:, None]
    y = lin(x)
    assert torch.equal(y, lin.reference(x))
    w = blocks.dequantize().double()
    exact = (quantized_activations(x) @ w.T + bias.double()).float()
    torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-5)
    rel = (y - (x.double() @ w.T + bias.double()).float()).norm(dim=1) / (x @ w.float().T).norm(dim=1)
    assert rel.max() < 2e-2, rel      # int8 activations per 256 columns
    assert lin.nbytes < 0.6 * 45 * 512 + 4 * 45 + 16 * 2368  # ~4.6 bits a weight


def test_a_rows_result_is_bit_identical_alone_and_in_any_batch():
    lin = q4k.Q4KLinear(random_blocks(70, 768, seed=2))
    x = torch.randn(13, 768) * 3
    whole = lin(x)
    for i in range(13):
        assert torch.equal(lin(x[i:i + 1])[0], whole[i])
        assert torch.equal(lin(x[:i + 1])[i], whole[i])
        assert torch.equal(lin(torch.cat([x[i:i + 1], x * 7]))[0], whole[i])


def test_packing_round_trips_and_the_gguf_bytes_read_as_the_reference_reads_them():
    blocks = random_blocks(19, 512, seed=3)
    back = q4k.unpack(q4k.pack(blocks), 19)
    for name in ("d", "dmin", "scales", "mins", "q"):
        assert torch.equal(getattr(back, name), getattr(blocks, name)), name
    raw = to_gguf_bytes(blocks)
    ref = torch.from_numpy(reference_dequantize(raw, Q.Q4_K).astype(np.float32))
    got = kb.q4k_from_gguf(torch.from_numpy(raw.copy()))
    assert torch.equal(got.dequantize(), ref.reshape(19, 512))
    assert torch.equal(got.q, blocks.q) and torch.equal(got.scales, blocks.scales)


def test_float_weights_quantize_to_4_bits_per_32_weight_sub_block():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(32, 512, generator=g) * 0.05
    w[3, 100] = 2.0                     # an outlier sets its own sub-block's scale, no other
    b = q4k.quantize(w)
    got = b.dequantize()
    assert (got - w).norm() / w.norm() < 0.1
    assert abs(got[3, 100].item() - 2.0) < 0.05
    err = (got - w).abs().reshape(32, 16, 32).amax(dim=-1)      # per sub-block
    spread = w.reshape(32, 16, 32).amax(-1) - w.reshape(32, 16, 32).amin(-1).clamp(max=0)
    others = torch.ones(32, 16, dtype=torch.bool)
    others[3, 100 // 32] = False
    # About half of a sixteenth of the span (plus the 6-bit rounding of scale and minimum).
    assert (err[others] <= spread[others] / 15).all()


def test_a_partial_last_block_is_zero_padded_and_other_widths_refused():
    g = torch.Generator().manual_seed(5)  # the same draw alone or after other tests
    w = torch.randn(40, 896, generator=g) * 0.05   # 3.5 blocks (the 0.5B's width)
    x = torch.randn(6, 896, generator=g)
    lin = q4k.Q4KLinear(q4k.quantize(w), None, 896)
    assert lin.weight().shape == (40, 896)
    exact = (quantized_activations(torch.nn.functional.pad(x, (0, 128))).double()[:, :896]
             @ lin.weight().double().T).float()
    torch.testing.assert_close(lin(x), exact, rtol=1e-5, atol=1e-5)
    assert torch.equal(lin(x[2:3])[0], lin(x)[2])
    with pytest.raises(ValueError, match="multiples of 32"):
        q4k.quantize(torch.randn(8, 300))


# ---- the format over a model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def q4k_gguf(q4k_pair):
    return q4k_pair[0]


@pytest.fixture(scope="module")
def q4k_pair(tmp_path_factory):
    """(a tiny Qwen2 as a GGUF, its float checkpoint). The GGUF's projections are Q4_K, except
    v (Q6_K in layer 0, kept as such; Q8_0 in layer 1, kept as int8, as is the output) and o
    (F16: quantized to Q4_K here)."""
    from conftest import make_tiny_checkpoint
    from test_gguf import write_gguf
    from test_q6k import quantize_q6k
    from test_q6k import to_gguf_bytes as q6k_bytes

    src = make_tiny_checkpoint(tmp_path_factory.mktemp("q4k-src"), "qwen2", hidden_size=256,
                               intermediate_size=512, num_attention_heads=4,
                               num_key_value_heads=2)
    dest = tmp_path_factory.mktemp("q4k-gguf") / "tiny-q4k.gguf"
    q4 = (lambda t: (to_gguf_bytes(q4k.quantize(t)), Q.Q4_K))  # noqa: E731
    write_gguf(src, dest, "qwen2",
               # attn_output before output: the first suffix that matches decides
               {"attn_output.weight": Q.F16, "attn_v.weight": Q.Q8_0, "output.weight": Q.Q8_0},
               {"blk.0.attn_v.weight": lambda t: (q6k_bytes(quantize_q6k(t)), Q.Q6_K),
                "attn_q.weight": q4, "attn_k.weight": q4, "ffn_gate.weight": q4,
                "ffn_up.weight": q4, "ffn_down.weight": q4})
    return dest, src


def test_the_loader_keeps_the_files_blocks_and_more_bits_as_int8(q4k_gguf):
    from specdec.model.checkpoint.gguf_file import GGUFCheckpoint

    m = Decoder.from_checkpoint(q4k_gguf, "q4k")
    ck = GGUFCheckpoint(q4k_gguf)
    layer = m.layers[1].w
    gate_up = layer["gate_up"]
    assert isinstance(gate_up, q4k.Q4KLinear)
    file_blocks = kb.Q4KBlocks.cat([ck.stored_blocks(f"model.layers.1.mlp.{p}_proj.weight")
                                     for p in ("gate", "up")])
    assert torch.equal(gate_up.weight(), file_blocks.dequantize())
    assert isinstance(layer["qkv"], RowStackedLinear)          # q|k in 4 bits, v in int8
    assert [type(p) for p in layer["qkv"].parts] == [q4k.Q4KLinear, RowInt8Linear]
    v6 = m.layers[0].w["qkv"].parts[1]                          # layer 0's v: Q6_K
    assert isinstance(v6, Q6KLinear)
    assert torch.equal(v6.weight(), ck.stored_blocks("model.layers.0.self_attn.v_proj.weight")
                       .dequantize())
    assert isinstance(m.lm_head, RowInt8Linear)               # Q8_0 in the file
    assert isinstance(layer["o"], q4k.Q4KLinear)              # F16 in the file: quantized
    ref = Decoder.from_checkpoint(q4k_gguf, "float32")         # the same file in fp32
    seq = list(range(3, 40))
    b = BatchInput.build([(0, 0, seq)])
    got = m(b, m.new_cache(1, 64), logit_indices=torch.arange(len(seq)))
    want = ref(b, ref.new_cache(1, 64), logit_indices=torch.arange(len(seq)))
    # A tiny random model amplifies every rounding (int8's own two-level activations land
    # ~12% from fp32 here); a wrong layout or scale would be ~100% off.
    assert ((got - want).norm(dim=1) / want.norm(dim=1)).median() < 0.3
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8


def test_a_tied_output_projection_keeps_the_files_blocks(tmp_path, qwen_target_path):
    """A tied model's token table in Q4_K is also its output projection: the same blocks,
    not the table's floats rounded to Q4_K a second time. The blocks are llama.cpp's (the
    first 256 columns of the pack target's token table): rounded again by our quantizer,
    41% of their weights would change (blocks of our own making round-trip exactly)."""
    from conftest import make_tiny_checkpoint
    from test_gguf import write_gguf

    from specdec.model.checkpoint.gguf_file import GGUFCheckpoint

    real, _ = GGUFCheckpoint(qwen_target_path / "model.gguf").block_table(
        "model.embed_tokens.weight")
    llama_blocks = real[:96, :kb.Q4_K_BYTES].numpy()
    src = make_tiny_checkpoint(tmp_path / "src", "qwen2", hidden_size=256,
                               intermediate_size=512, num_attention_heads=4,
                               num_key_value_heads=2, tie_word_embeddings=True)
    dest = tmp_path / "tied.gguf"
    write_gguf(src, dest, "qwen2", {}, {"token_embd.weight": lambda t: (llama_blocks, Q.Q4_K)})
    ck = GGUFCheckpoint(dest)
    assert not ck.has("lm_head.weight")
    m = Decoder.from_checkpoint(dest, "q4k")
    assert isinstance(m.lm_head, q4k.Q4KLinear)
    assert torch.equal(m.lm_head.weight(),
                       ck.stored_blocks("model.embed_tokens.weight").dequantize())


def test_int4_rounds_the_files_q6k_to_4_bits_and_runs(q4k_gguf):
    """The draft's format: layer 0's Q6_K v is re-quantized to Q4_K from its floats."""
    from specdec.model.checkpoint.gguf_file import GGUFCheckpoint

    m = Decoder.from_checkpoint(q4k_gguf, "int4")
    qkv = m.layers[0].w["qkv"]   # q|k on the file's Q4_K blocks, v re-quantized
    assert [type(p) for p in qkv.parts] == [q4k.Q4KLinear, q4k.Q4KLinear]
    file_v = GGUFCheckpoint(q4k_gguf).get("model.layers.0.self_attn.v_proj.weight")
    got_v = qkv.parts[1].weight()
    assert (got_v - file_v).norm() / file_v.norm() < 0.12
    seq = list(range(3, 30))
    logits = m(BatchInput.build([(0, 0, seq)]), m.new_cache(1, 64))
    assert torch.isfinite(logits).all()


def test_int4_quantizes_fused_q6k_parts_from_their_floats():
    """q|k|v or gate|up all in Q6_K, under int4: the parts are re-quantized to Q4_K from
    their floats, joined in one layer (under q4k the same parts keep their blocks)."""
    from specdec.model.formats.kquant_choice import FileWeight, linear_rows

    gen = torch.Generator().manual_seed(3)

    def q6k_blocks(n: int, nb: int) -> kb.Q6KBlocks:  # what a file would hold
        d = (torch.rand(n, nb, generator=gen) * 1e-3).half().float()
        scales = torch.randint(-128, 128, (n, nb, 16), generator=gen).to(torch.int8)
        return kb.Q6KBlocks(d, scales, torch.randint(0, 64, (n, nb, 256), generator=gen,
                                                      dtype=torch.uint8))

    blocks = [q6k_blocks(16, 1) for _ in range(2)]
    floats = [b.dequantize() for b in blocks]  # what the loader reads for int4
    x = torch.randn(2, 256, generator=gen)
    int4 = linear_rows([FileWeight(f, b) for f, b in zip(floats, blocks, strict=True)], None,
                       round_all_to_q4k=True)
    assert isinstance(int4, q4k.Q4KLinear)
    want = q4k.Q4KLinear(q4k.quantize(torch.cat(floats)), None, 256)(x)
    assert torch.equal(int4(x), want)
    kept = linear_rows([FileWeight(None, b) for b in blocks], None)
    assert isinstance(kept, Q6KLinear)
    assert torch.equal(kept.weight(), kb.Q6KBlocks.cat(blocks).dequantize())


def _last_logits(model, seqs):
    cache = model.new_cache(len(seqs), 96)
    b = BatchInput.build([(i, 0, s) for i, s in enumerate(seqs)])
    starts = torch.tensor([0, *[len(s) for s in seqs]]).cumsum(0)
    return model(b, cache, logit_indices=starts[1:] - 1)


def test_a_q4k_models_logits_are_bit_identical_alone_and_in_any_batch(q4k_gguf):
    m = Decoder.from_checkpoint(q4k_gguf, "q4k")
    row = list(range(3, 20))
    alone = _last_logits(m, [row])[0]
    for others in ([list(range(40, 90))], [[5] * 3, list(range(10, 60, 2)), [90, 91]]):
        assert torch.equal(_last_logits(m, [row, *others])[0], alone)


def test_greedy_speculation_with_a_q4k_target_equals_plain(q4k_pair, tmp_path):
    from conftest import make_perturbed_copy

    gguf_path, src = q4k_pair
    target = Decoder.from_checkpoint(gguf_path, "q4k")
    far = make_perturbed_copy(src, tmp_path / "far-draft", 0.2, 3)   # often wrong
    draft = Decoder.from_checkpoint(far, "int8-dynamic")
    engine = Engine(LocalTargetRunner(target, 8, 192),
                    {"draft": DraftModelProposer(draft, 8, 192, "probabilistic")}, None, ())
    prompts = random_prompts((5, 9, 13, 7), seed=8)
    out = engine.run([Request(f"r{i}", p, greedy(24), "draft", 4)
                      for i, p in enumerate(prompts)])
    plain = plain_generate(target, prompts, greedy(24)).token_ids
    assert [out[f"r{i}"].token_ids for i in range(len(prompts))] == plain
    assert sum(o.spec.rejections for o in out.values()) > 0  # the draft disagrees


def test_the_prefix_cache_in_the_served_formats_changes_no_token(q4k_pair, tmp_path):
    """A q4k target and an int4 draft, as served: follow-up turns that reuse their history,
    alone and in a batch, give the tokens of the same engine without the cache."""
    from conftest import make_perturbed_copy

    from specdec.engine.engine import EngineLimits

    gguf_path, src = q4k_pair
    target = Decoder.from_checkpoint(gguf_path, "q4k")
    far = make_perturbed_copy(src, tmp_path / "far-draft", 0.2, 3)
    draft = Decoder.from_checkpoint(far, "int4")

    def engine(on: bool) -> Engine:
        return Engine(LocalTargetRunner(target, 6, 192),
                      {"draft": DraftModelProposer(draft, 6, 192, "probabilistic",
                                                   prefix_cache=on)},
                      None, (), EngineLimits(prefix_cache=on, max_tokens_per_step=48))

    on, off = engine(True), engine(False)
    firsts = random_prompts((30, 9, 17), seed=9)
    outs = {}
    for e in (on, off):
        got = e.run([Request(f"a{i}", p, greedy(20), "draft", 3)
                     for i, p in enumerate(firsts)])
        outs[e] = [got[f"a{i}"].token_ids for i in range(3)]
    assert outs[on] == outs[off]
    follow = [firsts[i] + outs[on][i] + [4, 5, 6] for i in range(3)]
    for e in (on, off):   # the batch, then one of them alone
        got = e.run([Request(f"b{i}", p, greedy(20), "draft", 3) for i, p in enumerate(follow)])
        alone = e.run([Request("c", follow[1] + [7], greedy(20), "draft", 3)])["c"]
        outs[e] = ([got[f"b{i}"].token_ids for i in range(3)], alone.token_ids,
                   [got[f"b{i}"].cached_tokens for i in range(3)] + [alone.cached_tokens])
    assert outs[on][:2] == outs[off][:2]
    assert all(n >= 9 for n in outs[on][2]) and not any(outs[off][2])


def test_q4k_resolves_to_a_batch_independent_format():
    fmt = resolve_format("q4k")
    assert fmt.q4k and fmt.per_row


@pytest.mark.real_model
def test_the_pack_target_in_q4k_keeps_its_file_blocks_and_is_batch_independent(qwen_target_path):
    from specdec.model.checkpoint.gguf_file import GGUFCheckpoint

    m = Decoder.from_checkpoint(qwen_target_path, "q4k")
    ck = GGUFCheckpoint(qwen_target_path / "model.gguf")
    assert ck.quant_type("model.layers.0.self_attn.o_proj.weight") == "Q4_K"
    o = m.layers[0].w["o"]
    assert isinstance(o, q4k.Q4KLinear)
    assert torch.equal(o.weight(), ck.get("model.layers.0.self_attn.o_proj.weight"))
    assert isinstance(m.lm_head, Q6KLinear)                   # Q6_K in the file, kept
    assert torch.equal(m.lm_head.weight(), ck.get("lm_head.weight"))
    row = list(range(1000, 1012))
    alone = _last_logits(m, [row])[0]
    assert torch.equal(_last_logits(m, [row, list(range(2000, 2030)), [3, 4, 5]])[0], alone)


def test_q4k_under_tensor_parallelism_tracks_one_process(q4k_gguf, tmp_path):
    """TP=2 over gloo: each rank keeps the blocks of its rows, and of its columns where they
    are whole 256-blocks (down: 256 of 512), int8 where a slice cuts a block (o: 128 of 256).
    Activations are quantized per rank's slice, so the ranks' logits are not one process's
    bit for bit; they must be as close to the file's fp32 arithmetic as one process is (a
    tiny random model amplifies every rounding: see the loader test)."""
    import torch.multiprocessing as mp
    from tp_scenarios import run_rank, scenario_logits

    from specdec.ports import free_port

    seqs = [[3, 17, 45, 9, 22, 61, 8, 30, 12], [50, 4, 77, 13, 29, 6, 41], [90, 15, 33, 70, 2]]
    port, result = free_port(), tmp_path / "tp2.pt"
    mp.start_processes(run_rank, args=(2, port, str(q4k_gguf), seqs, str(result), None,
                                       "eager", "q4k"),
                       nprocs=2, join=True, start_method="spawn")
    got = torch.load(result)
    one = Decoder.from_checkpoint(q4k_gguf, "q4k")
    ref = Decoder.from_checkpoint(q4k_gguf, "float32")
    alone = scenario_logits(one, one.new_cache(4, 128), seqs)
    for mode, want in scenario_logits(ref, ref.new_cache(4, 128), seqs).items():
        def err(x):
            return ((x - want).norm(dim=-1) / want.norm(dim=-1)).median()  # noqa: B023
        assert err(got[mode]) < 1.5 * err(alone[mode]) + 0.02, (mode, err(got[mode]))
        assert (got[mode].argmax(-1) == want.argmax(-1)).float().mean() >= 0.75, mode

