"""The static step (fixed buffers, padded buckets) equals the eager ragged forward, replays
over the same buffers, and compiles into one graph per bucket without recompiling."""

from __future__ import annotations

import pytest
import torch

from specdec.model.step.batch import BatchInput
from specdec.model.step.decoder import Decoder
from specdec.model.step.static_step import Bucket, StaticDecoder, flatten

# fp32, two layers: the padded grid's longer key axis reassociates the softmax sums.
ATOL = 2e-5


def _pair(path, layout="pad", prefill=None):
    model = Decoder.from_checkpoint(path, torch.float32)
    static = StaticDecoder(model, layout=layout)
    cache, scache = _prefilled(model, static, prefill)
    return model, cache, static, scache


def _prefilled(model, static, prefill, slots=4, max_len=128):
    """An eager cache and a static one, both holding `prefill` rows if given (run eagerly
    in each)."""
    cache, scache = model.new_cache(slots, max_len), static.new_cache(slots, max_len)
    for c in (cache, scache) if prefill else ():
        model(BatchInput.build(prefill), c)
    return cache, scache


def _both(model, cache, static, scache, rows, every_token=True):
    batch = BatchInput.build(rows)
    idx = torch.arange(batch.token_ids.numel()) if every_token else None
    return model(batch, cache, idx), static(batch, scache, idx)


def _close(eager: torch.Tensor, static: torch.Tensor) -> None:
    diff = (eager - static).abs().max().item()
    assert diff <= ATOL, f"max abs logit difference {diff} > {ATOL}"
    assert torch.equal(eager.argmax(-1), static.argmax(-1))


@pytest.mark.parametrize("layout", ["pad", "flat"])
def test_static_equals_eager_plain_verify_mixed_and_rollback(tiny_checkpoint, layout):
    model, cache, static, scache = _pair(tiny_checkpoint, layout)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (7, 12, 5)]
    # Prefill (longer than any static query: the static decoder runs it eager), then the
    # steps under test.
    _both(model, cache, static, scache, [(s, 0, p) for s, p in zip((2, 0, 3), prompts, strict=True)])
    lens = {2: 7, 0: 12, 3: 5}

    def step(rows):
        e, s = _both(model, cache, static, scache, rows)
        _close(e, s)
        for slot, start, toks in rows:
            lens[slot] = start + len(toks)

    # Plain decode: three rows, a bucket of four (one padded row).
    step([(s, lens[s], [9]) for s in (2, 0, 3)])
    # Verify: every row k + 1 = 4 tokens.
    step([(s, lens[s], [4, 5, 6, 7]) for s in (2, 0, 3)])
    # Mixed: a plain row beside verify rows (its tail padded to the query length).
    step([(2, lens[2], [11]), (0, lens[0], [12, 13, 14]), (3, lens[3], [15, 16, 17, 18])])
    # Rollback: slot 0 back by three tokens, new ones written over the stale entries.
    step([(0, lens[0] - 3, [20, 21]), (3, lens[3], [22])])
    # One row alone, default logit positions (each row's last token).
    e, s = _both(model, cache, static, scache, [(2, lens[2], [30, 31])], every_token=False)
    _close(e, s)
    # The prefill (12 tokens of query; 24 tokens) runs eager in the pad layout only.
    assert (static.static_steps, static.eager_steps) == ((5, 1) if layout == "pad" else (6, 0))
    # Padded rows and padded tails wrote only the scratch slot: the real slots' K/V agree.
    for slot, n in lens.items():
        assert torch.allclose(cache.k[:, slot, :n], scache.k[:, slot, :n], atol=ATOL)
        assert torch.allclose(cache.v[:, slot, :n], scache.v[:, slot, :n], atol=ATOL)


def test_greedy_argmax_path_matches(tiny_llama):
    model, cache, static, scache = _pair(tiny_llama,
                                         prefill=[(0, 0, [5, 6, 7, 8]), (1, 0, [9, 10])])
    rows = [(0, 4, [11, 12, 13]), (1, 2, [14])]
    batch = BatchInput.build(rows)
    idx = torch.arange(4)
    assert torch.equal(model(batch, cache, idx, argmax=True),
                       static(batch, scache, idx, argmax=True))


def test_flat_layout_puts_every_token_on_its_own_row():
    b = flatten(BatchInput.build([(2, 5, [7]), (0, 3, [8, 9, 10])]))
    assert b.slots.tolist() == [2, 0, 0, 0] and b.positions.tolist() == [5, 3, 4, 5]
    assert b.query_lens == [1, 1, 1, 1] and b.starts == [5, 3, 4, 5] and b.kv_len == 6
    assert Bucket.of(b, 512) == Bucket(rows=4, query=1, keys=64)


def test_buckets_round_rows_and_keys():
    b = BatchInput.build([(0, 70, [1]), (1, 3, [1, 2, 3])])
    assert Bucket.of(b, 512) == Bucket(rows=2, query=3, keys=128)
    b = BatchInput.build([(0, 0, [1]), (1, 0, [1]), (2, 0, [1])])
    assert Bucket.of(b, 512) == Bucket(rows=4, query=1, keys=64)
    assert Bucket.of(BatchInput.build([(0, 500, [1, 2])]), 512).keys == 512  # capped


def test_replay_reuses_the_same_buffers(tiny_llama):
    """Capture needs every step of a bucket to read and write the same addresses: the
    buffers are refilled in place, never reallocated, and a replay over changed contents
    gives the new contents' result."""
    model, cache, static, scache = _pair(tiny_llama,
                                         prefill=[(0, 0, [5, 6, 7]), (1, 0, [8, 9, 10])])
    static(BatchInput.build([(0, 3, [11]), (1, 3, [12])]), scache)
    (buffers,) = static._buffers.values()
    addresses = [t.data_ptr() for t in buffers.tensors()]
    cache_addresses = (scache.k.data_ptr(), scache.v.data_ptr())
    model(BatchInput.build([(0, 3, [11]), (1, 3, [12])]), cache)
    for i, (a, b) in enumerate([(13, 14), (15, 16), (17, 18)]):
        rows = [(0, 4 + i, [a]), (1, 4 + i, [b])]
        e, s = _both(model, cache, static, scache, rows)
        _close(e, s)
        assert [t.data_ptr() for t in buffers.tensors()] == addresses
        assert buffers.token_ids.tolist() == [a, b]
    assert len(static._buffers) == 1
    assert (scache.k.data_ptr(), scache.v.data_ptr()) == cache_addresses


def test_compiled_step_one_graph_per_bucket_no_recompile(tiny_llama):
    """fullgraph=True: a graph break raises. Steps of one bucket (rows, query, keys the
    same; contents and positions changing) compile once; a new bucket compiles once more."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    model = Decoder.from_checkpoint(tiny_llama, torch.float32)
    static = StaticDecoder(model, compile=True, backend=counter)
    cache, scache = _prefilled(model, static, [(0, 0, [5, 6, 7]), (1, 0, [8, 9, 10])])
    for i in range(4):
        e, s = _both(model, cache, static, scache, [(0, 3 + i, [11 + i]), (1, 3 + i, [20 + i])])
        _close(e, s)
    assert counter.frame_count == 1
    e, s = _both(model, cache, static, scache, [(0, 7, [1, 2, 3]), (1, 7, [4, 5, 6])])
    _close(e, s)
    assert counter.frame_count == 2


def test_inductor_compiled_step_equals_eager(tiny_llama):
    """The real compiler (inductor's generated C++ on CPU), not only the graph capture."""
    torch._dynamo.reset()
    model = Decoder.from_checkpoint(tiny_llama, torch.float32)
    static = StaticDecoder(model, compile=True)
    cache, scache = _prefilled(model, static, [(0, 0, [5, 6, 7]), (1, 0, [8, 9, 10])])
    for i in range(3):
        e, s = _both(model, cache, static, scache, [(0, 3 + i, [11 + i]), (1, 3 + i, [20 + i])])
        _close(e, s)


def test_fbgemm_packed_layers_compile_without_a_graph_break(tiny_llama):
    """FBGEMM's packed weights are TorchScript objects a graph cannot hold: they cross as
    the opaque specdec::packed_linear op (fullgraph=True raises on any break)."""
    from torch._dynamo.testing import CompileCounter

    for fmt in ("float16", "int8-dynamic"):
        torch._dynamo.reset()
        counter = CompileCounter()
        model = Decoder.from_checkpoint(tiny_llama, fmt)
        static = StaticDecoder(model, compile=True, backend=counter)
        cache, scache = _prefilled(model, static, [(0, 0, [5, 6, 7])], 2, 64)
        e, s = _both(model, cache, static, scache, [(0, 3, [11])])
        assert counter.frame_count == 1 and counter.op_count > 0
        # One row, no padding: the same kernels on the same numbers.
        assert torch.allclose(e, s, atol=1e-4), fmt


def test_compiled_graph_writes_the_cache_through_the_in_place_op(tiny_llama):
    """A graph that wrote a view of the cache directly would be functionalised into a copy
    of the whole cache every step; the K/V write must be the declared in-place op."""
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = Decoder.from_checkpoint(tiny_llama, torch.float32)
    static = StaticDecoder(model, compile=True, backend=keep)
    cache = static.new_cache(2, 64)
    static(BatchInput.build([(0, 0, [5, 6, 7])]), cache)
    (gm,) = graphs
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("kv_write" in t for t in targets) == model.cfg.num_layers
    assert not any("index_put" in t for t in targets)


def test_a_step_graph_returns_hidden_states_and_serves_greedy_and_sampled(tiny_llama):
    """A captured graph's output stays allocated for the graph's life (cuda_graph.py), so a
    step's graph returns the final hidden states, [rows * query, hidden], and the
    vocabulary projection runs after it on the positions asked for. One bucket's greedy
    (argmax) and sampled (logits) steps then replay the same graph."""
    outputs = []

    class Recording(StaticDecoder):
        def _run(self, fn, args, key):
            out = super()._run(fn, args, key)
            outputs.append(out)
            return out

    model = Decoder.from_checkpoint(tiny_llama, torch.float32)
    static = Recording(model)
    cache, scache = _prefilled(model, static, [(0, 0, [5, 6, 7]), (1, 0, [8, 9, 10])])
    rows = [(0, 3, [11, 12, 13]), (1, 3, [14])]
    batch = BatchInput.build(rows)
    idx = torch.arange(4)
    e, s = model(batch, cache, idx), static(batch, scache, idx)
    _close(e, s)
    # The same step again (the same K/V rewritten at the same places), greedy this time.
    assert torch.equal(model(batch, cache, idx, argmax=True),
                       static(batch, scache, idx, argmax=True))
    assert len(static.graph_order) == 1
    assert [tuple(o.shape) for o in outputs] == [(2 * 3, model.cfg.hidden_size)] * 2
    assert model.cfg.hidden_size < model.cfg.vocab_size  # else the test shows nothing
