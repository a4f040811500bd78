"""A decode, verify or draft forward over fixed buffers: every shape is fixed per bucket.

`Decoder.forward` takes a ragged batch and builds its index maths on the host each step: its
shapes change with every row count, query length and context length, so nothing can be
captured or compiled once and replayed. This step is the same forward as a pure function of
preallocated buffers (token ids, positions, where each token's K/V goes, each row's slot)
and the KV cache, with the batch padded to a bucket:

- rows rounded up to a power of two; padded rows, and the padded tail of a row shorter than
  the bucket's query length (a plain row beside k+1-token verify rows), write their K/V into
  a scratch slot no sequence owns, and their outputs are dropped;
- the query length is the batch's longest (1 for decode, k+1 for verify);
- `layout="flat"` instead puts every token on a row of its own (query length 1, the row's
  slot and position its token's): no padded tails, one query length for every batch (fewer
  graphs to compile), at the price of gathering keys once per token instead of per row;
- the key axis is rounded up to a power of two (at least `MIN_KEYS`): keys past a query's
  own position are masked, so a rolled-back slot's stale entries stay invisible exactly as
  in the eager path (O(1) rollback: the next forward overwrites them).

Within one bucket every step has the same shapes and the same buffer addresses, which is
what `torch.compile` (no recompile) and CUDA graph replay need. The result equals the eager
ragged forward up to float reassociation (tests/model/test_static_step.py states the
tolerance); batch-invariant formats (`per_row`, whose tokens each attend alone so a row's
logits never depend on its neighbours) keep the eager path, since a padded grid would break
that invariance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from specdec.model.step.batch import BatchInput, logits_at
from specdec.model.step.block import AtenOps, embed, rms_norm, run_layers
from specdec.model.step.decoder import Decoder
from specdec.model.step.kv_cache import KVCache

Layout = Literal["pad", "flat"]

MIN_KEYS = 64
MAX_QUERY = 9  # longest static query: a verify of k = 8; longer (prefill chunks) runs eager
MAX_FLAT_TOKENS = 64  # the flat layout's limit on a batch's tokens (keys gathered per token)


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Bucket:
    rows: int
    query: int
    keys: int

    @classmethod
    def of(cls, batch: BatchInput, max_len: int) -> Bucket:
        return cls(_power_of_two(batch.num_rows), batch.max_query,
                   min(max_len, _power_of_two(max(batch.kv_len, MIN_KEYS))))


class StepBuffers:
    """One bucket's inputs, allocated once; every step refills them in place."""

    def __init__(self, bucket: Bucket, scratch_slot: int, device: torch.device) -> None:
        n = bucket.rows * bucket.query
        self.bucket, self.scratch = bucket, scratch_slot

        def longs(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.long, device=device)

        self.token_ids, self.positions = longs(n), longs(n)
        self.write_slot, self.write_pos, self.slots = longs(n), longs(n), longs(bucket.rows)

    def fill(self, batch: BatchInput) -> torch.Tensor:
        """Copy a ragged batch in (device ops only: no host sync); returns each flat token's
        index in the padded [rows * query] layout."""
        q = self.bucket.query
        idx = batch.row_of_token * q + batch.col_of_token
        self.token_ids.zero_().index_copy_(0, idx, batch.token_ids)
        self.positions.fill_(-1).index_copy_(0, idx, batch.positions)
        self.write_slot.fill_(self.scratch).index_copy_(0, idx, batch.slot_of_token)
        self.write_pos.zero_().index_copy_(0, idx, batch.positions)
        self.slots.fill_(self.scratch)[: batch.num_rows].copy_(batch.slots)
        return idx

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.token_ids, self.positions, self.write_slot, self.write_pos, self.slots


def flatten(batch: BatchInput) -> BatchInput:
    """The same tokens, each on a row of its own at its own slot and position: a token still
    sees the K/V its row's earlier tokens write in this forward (writes precede reads in
    every layer), so the result is the ragged forward's."""
    t = batch.token_ids.numel()
    dev = batch.token_ids.device
    return BatchInput(
        token_ids=batch.token_ids, positions=batch.positions, slot_of_token=batch.slot_of_token,
        slots=batch.slot_of_token, row_of_token=torch.arange(t, device=dev),
        col_of_token=torch.zeros(t, dtype=torch.long, device=dev), query_lens=[1] * t,
        starts=[s + j for s, n in zip(batch.starts, batch.query_lens, strict=True)
                for j in range(n)],
        max_query=1, kv_len=batch.kv_len, token_list=batch.token_list,
        slot_list=[s for s, n in zip(batch.slot_list, batch.query_lens, strict=True)
                   for _ in range(n)])


@torch.library.custom_op("specdec::kv_write", mutates_args=("k_cache", "v_cache"))
def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int, slot: torch.Tensor,
             pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Layer `layer`'s new K/V into the cache, in place. An op of its own because a compiled
    graph that wrote a view of the cache directly would copy the whole cache back every
    step (functionalised: the view's base is rebuilt); a declared in-place op is written
    where it lies."""
    k_cache[layer].index_put_((slot, pos), k)
    v_cache[layer].index_put_((slot, pos), v)


@kv_write.register_fake
def _kv_write_shape(k_cache, v_cache, layer, slot, pos, k, v) -> None:
    return None


class StaticOps(AtenOps):
    """A static step's attention: the bucket's padded grid, one mask per window, the K/V
    written by `kv_write`."""

    def __init__(self, model, k_cache, v_cache, cos, sin, positions, write_slot, write_pos,
                 slots, rows, query, keys) -> None:
        super().__init__(model)
        self.k_cache, self.v_cache, self.slots = k_cache, v_cache, slots
        self.write_slot, self.write_pos = write_slot, write_pos
        self.rows, self.query, self.keys = rows, query, keys
        at = positions.clamp(min=0)
        self._tables = [(c[at].unsqueeze(1), s[at].unsqueeze(1)) for c, s in zip(cos, sin,
                                                                                    strict=True)]
        self.qpos = positions.view(rows, query, 1)
        self.key_pos = torch.arange(keys, device=positions.device)
        self._masks: dict[int | None, torch.Tensor] = {}

    def tables(self, layer):
        return self._tables[self.model.rope_index[layer]]

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self._masks:
            mask = self.key_pos.view(1, 1, -1) <= self.qpos
            if window is not None:
                mask = mask & (self.key_pos.view(1, 1, -1) > self.qpos - window)
            # Padding queries see key 0 only, so softmax stays finite; their output is dropped.
            mask = mask | ((self.qpos < 0) & (self.key_pos == 0))
            self._masks[window] = mask.unsqueeze(1)  # [rows, 1, query, keys]
        return self._masks[window]

    def attend(self, i, q, k, v):
        layer, rows, query, keys = self.model.layers[i], self.rows, self.query, self.keys
        D, nq, nkv = layer.head_dim, layer.n_q, layer.n_kv
        kv_write(self.k_cache, self.v_cache, i, self.write_slot, self.write_pos, k, v)
        kk = self.k_cache[i, :, :keys].index_select(0, self.slots).transpose(1, 2)
        vv = self.v_cache[i, :, :keys].index_select(0, self.slots).transpose(1, 2)
        if layer.kv_gather is not None:
            kk, vv = kk[:, layer.kv_gather], vv[:, layer.kv_gather]
        out = F.scaled_dot_product_attention(
            q.view(rows, query, nq, D).transpose(1, 2), kk, vv,
            attn_mask=self.mask(self.model.cfg.layer_windows[i]),
            enable_gqa=layer.kv_gather is None and nq != nkv, scale=self.model.cfg.attn_scale)
        return out.transpose(1, 2).reshape(rows * query, nq * D)


def static_hidden(model: Decoder, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cos: tuple[torch.Tensor, ...], sin: tuple[torch.Tensor, ...],
                  token_ids: torch.Tensor, positions: torch.Tensor, write_slot: torch.Tensor,
                  write_pos: torch.Tensor, slots: torch.Tensor, rows: int, query: int,
                  keys: int) -> torch.Tensor:
    """Final-normed hidden states [rows * query, hidden] of every padded position: what a
    step's graph computes. A pure function of its tensor arguments and the model's weights;
    shapes depend only on (rows, query, keys). cos, sin: the model's `static_tables`.

    The vocabulary projection stays outside (`Decoder.project`, on the positions that need
    logits), as vLLM keeps it outside its graphs: a captured graph's output stays allocated
    for the graph's life, and [rows * query, vocab] fp32 logits are ~200x the hidden states
    for a 150k vocabulary (136 MB at 32 rows x 7 tokens, per bucket), where hidden states
    are under 1 MB. It also lets greedy and sampled steps of a bucket share one graph."""
    ops = StaticOps(model, k_cache, v_cache, cos, sin, positions, write_slot, write_pos,
                    slots, rows, query, keys)
    x = run_layers(model, embed(model, token_ids), ops)
    return rms_norm(x, model.norm, model.cfg.rms_norm_eps)


def static_forward(model: Decoder, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   cos: tuple, sin: tuple, token_ids: torch.Tensor,
                   positions: torch.Tensor, write_slot: torch.Tensor, write_pos: torch.Tensor,
                   slots: torch.Tensor, rows: int, query: int, keys: int, argmax: bool
                   ) -> torch.Tensor:
    """Logits [rows * query, vocab] (argmax: ids) of every padded position, projection
    included: the draft loop's forwards, whose logits are picked inside its graph."""
    return model.project(static_hidden(model, k_cache, v_cache, cos, sin, token_ids,
                                       positions, write_slot, write_pos, slots, rows, query,
                                       keys), argmax)


StepFn = Callable[..., torch.Tensor]


def graph_builds(obj) -> int:
    """Graphs compiled or captured so far by a model, or by the runner or proposer holding
    one (0: eager, which builds none). The engine compares it across a step to mark the
    steps whose time was a build."""
    return getattr(obj, "graph_builds", 0)


class StaticDecoder:
    """Called like a `Decoder` (same arguments, same results): batches that fit a bucket run
    `static_hidden` over that bucket's buffers, optionally through `torch.compile`, and the
    positions that need logits are projected after it; the rest (prefill chunks,
    batch-invariant formats) run the model's eager forward.

    Its caches carry one slot more than asked for: the scratch slot padded tokens write to.
    """

    def __init__(self, model: Decoder, compile: bool = False, backend="inductor",
                 layout: Layout = "pad") -> None:
        self.model, self.layout = model, layout
        self.cfg, self.device, self.dtype = model.cfg, model.device, model.dtype
        self.format, self.vocab_out = model.format, model.vocab_out
        self.compiled, self.backend = compile, backend
        self._compiled: dict[StepFn, StepFn] = {}
        self._buffers: dict[tuple[Bucket, int], StepBuffers] = {}
        self.loop_buffers: dict[tuple, object] = {}  # the draft loop's (draft_loop.py)
        # Each graph's (function, shape) in the order first run: what a capture records, so
        # under tensor parallelism every rank's list must be the same, or the collectives
        # recorded in their graphs would not line up.
        self.graph_order: list[tuple] = []
        self._noted: set[tuple] = set()
        # Graphs compiled or captured so far: a step that built one measured the build (a
        # compile takes seconds, a capture tens of ms), not the step, and its time must not
        # teach the policy what that shape costs (graph_builds below).
        self.graph_builds = 0
        self.static_steps = self.eager_steps = self.loop_rounds = 0

    def limit_vocab(self, n: int) -> StaticDecoder:
        return StaticDecoder(self.model.limit_vocab(n), self.compiled, self.backend,
                             self.layout)

    def weight_bytes(self) -> int:
        return self.model.weight_bytes()

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return self.model.new_cache(num_slots + 1, max_len)

    def fits(self, batch: BatchInput) -> bool:
        if self.model.format.per_row or self.model.lm_head is None:
            return False
        if self.layout == "flat":
            return batch.token_ids.numel() <= MAX_FLAT_TOKENS
        return batch.max_query <= MAX_QUERY

    @torch.inference_mode()
    def __call__(self, batch: BatchInput, cache: KVCache,
                 logit_indices: torch.Tensor | None = None, argmax: bool = False
                 ) -> torch.Tensor:
        if not self.fits(batch):
            self.eager_steps += 1
            return self.model(batch, cache, logit_indices, argmax=argmax)
        if batch.kv_len > cache.max_len:
            raise ValueError(f"sequence length {batch.kv_len} exceeds the cache ({cache.max_len})")
        logit_indices = logits_at(logit_indices, batch, self.device)
        if self.layout == "flat":
            batch = flatten(batch)  # the same flat token order: logit_indices still hold
        bucket = Bucket.of(batch, cache.max_len)
        scratch = cache.num_slots - 1
        buffers = self._buffers.get((bucket, scratch))
        if buffers is None:
            buffers = self._buffers[(bucket, scratch)] = StepBuffers(bucket, scratch,
                                                                      self.device)
        idx = buffers.fill(batch)
        cos, sin = self.model.static_tables(cache.max_len)
        hidden = self._run(static_hidden, (self.model, cache.k, cache.v, cos,
                                           sin, *buffers.tensors(), bucket.rows,
                                           bucket.query, bucket.keys),
                           (bucket, buffers.scratch))
        self.static_steps += 1
        # Every rank projects its vocabulary slice here, outside the graph (static_hidden:
        # why); under tensor parallelism this is where the ranks' slices meet.
        return self.model.project(hidden[idx[logit_indices]], argmax)

    forward = __call__

    def _note(self, fn: StepFn, key: tuple) -> tuple:
        graph = (fn.__name__, *key)
        if graph not in self._noted:
            self._noted.add(graph)
            self.graph_order.append(graph)
            self.graph_builds += self.builds_graphs
        return graph

    @property
    def builds_graphs(self) -> bool:
        """Whether a new bucket costs a build (compile), beyond allocating its buffers."""
        return self.compiled

    def _run(self, fn: StepFn, args: tuple, key: tuple):
        """fn(*args), compiled once per function when asked (one graph per bucket: key)."""
        self._note(fn, key)
        if not self.compiled:
            return fn(*args)
        done = self._compiled.get(fn)
        if done is None:
            # fullgraph: a graph break would silently leave the step half-eager;
            # dynamic=False: one specialised graph per bucket, which is what capture replays.
            done = self._compiled[fn] = torch.compile(fn, fullgraph=True, dynamic=False,
                                                      backend=self.backend)
        return done(*args)

