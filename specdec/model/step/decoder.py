"""A compact decoder for every family of specdec.model.checkpoint.family, written for serving.

Why not transformers' own forward: it has no per-row cache rollback, its assisted generation
is batch-1 only, and it offers no tensor-parallel split we control. This module takes ragged
batches (each row its own number of new tokens and positions), keeps K/V in fixed slots with
O(1) rollback (see kv_cache.py) and holds only its rank's slice of every parallel weight.

The block itself is specdec.model.step.block (one definition every path runs); this module
holds the weights, the caches and the eager path's attention.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.model.checkpoint.config import DecoderConfig
from specdec.model.checkpoint.rope import Rope
from specdec.model.checkpoint.sharding import ShardSpec
from specdec.model.checkpoint.weights import open_checkpoint
from specdec.model.formats import invariant_layers, kquant_choice, token_attention
from specdec.model.formats.embedding import BlockEmbedding, table_bytes
from specdec.model.formats.linear import Linear
from specdec.model.formats.weight_format import WeightFormat, resolve_format
from specdec.model.step.batch import BatchInput, logits_at
from specdec.model.step.block import AtenOps, Rotary, embed, rms_norm, run_layers
from specdec.model.step.heap import release_free_heap
from specdec.model.step.kv_cache import KVCache

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class Layer:
    """One decoder block: this rank's slices as `Linear`s (qkv, o, gate_up, down) and plain
    tensors (norms, the biases added after a row-parallel all_reduce); no nn.Module."""

    def __init__(self, weights: dict, n_q: int, n_kv: int,
                 kv_index: list[int], head_dim: int, eps: float) -> None:
        self.w = weights
        self.n_q, self.n_kv, self.head_dim, self.eps = n_q, n_kv, head_dim, eps
        group = n_q // n_kv if n_q % n_kv == 0 else 0
        uniform = group > 0 and kv_index == [i // group for i in range(n_q)]
        # Uniform groups use the fused GQA path; an uneven split (replicated KV heads on a
        # rank that straddles two groups) expands K/V to one per query head instead.
        self.kv_gather = None if uniform else torch.tensor(kv_index, dtype=torch.long)


class Decoder:
    def __init__(self, cfg: DecoderConfig, layers: list[Layer], embed: torch.Tensor,
                 norm: torch.Tensor, lm_head: Linear | None, shard: ShardSpec,
                 fmt: WeightFormat, device: torch.device) -> None:
        self.cfg, self.layers, self.shard = cfg, layers, shard
        self.embed, self.norm, self.lm_head = embed, norm, lm_head
        self.format, self.dtype, self.device = fmt, fmt.act_dtype, device
        self.all_reduce: AllReduce = _identity
        # Logits columns this model produces (the vocabulary, or a draft's limit of it).
        self.vocab_out = cfg.vocab_size
        # Tensor-parallel: joins the ranks' vocabulary slices into full logits on rank 0
        # (followers get an empty tensor). Set by the group (specdec.model.step.parallel).
        self.gather_vocab: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Tensor-parallel greedy: the ranks' slice maxima reduced to the global argmax ids on
        # rank 0, so no logits cross between ranks. Set by the group with gather_vocab.
        self.argmax_vocab: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._rotary: list[Rotary] = []  # per layer, for caches of _rotary_len positions
        self._static_tables: tuple = ((), ())
        self._rotary_len = 0
        # Each layer's rotary embedding as an index into static_tables (a plain attribute:
        # a compiled step reads it while tracing).
        ropes = [cfg.rope_of(i) for i in range(cfg.num_layers)]
        self.rope_index = tuple(list(dict.fromkeys(ropes)).index(r) for r in ropes)
        # The batch-invariant formats' layers through our kernels (invariant_layers.py).
        self._invariant_layers = invariant_layers.usable(self)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: torch.dtype | str = torch.float32,
                        device: str | torch.device = "cpu",
                        shard: ShardSpec | None = None, with_lm_head: bool = True,
                        vocab_limit: int | None = None) -> Decoder:
        """dtype: a torch dtype or a weight format name (see specdec.model.formats.weight_format: "auto" picks
        the fastest exact-enough format for the device). with_lm_head=False skips the
        vocabulary projection. vocab_limit: score only the first n token ids (a draft's
        limit). Tensor-parallel (world > 1): every rank projects its slice of the
        vocabulary (vocabulary-parallel), so no rank carries the whole projection."""
        cfg = DecoderConfig.from_checkpoint(path)
        shard = shard or ShardSpec()
        shard.check(cfg)
        device = torch.device(device)
        fmt = resolve_format(dtype, device)
        ck = open_checkpoint(path)
        D = cfg.head_dim
        qh, kvh, inter = shard.q_heads(cfg), shard.kv_heads(cfg), shard.intermediate(cfg)
        q_rows = range(qh.start * D, qh.stop * D)
        kv_rows = range(kvh.start * D, kvh.stop * D)

        def get(name, dtype=fmt.act_dtype, **kw):
            return ck.get(name, dtype=dtype, **kw).to(device).contiguous()

        def weight(name, **kw):  # full precision until the format stores it
            if not fmt.q4k:
                return ck.get(name, **kw).to(device)
            blocks = ck.stored_blocks(name, **kw) if hasattr(ck, "stored_blocks") else None
            if kquant_choice.keeps_blocks(blocks, fmt.round_all_to_q4k):
                return kquant_choice.FileWeight(None, blocks)  # never dequantized
            return kquant_choice.FileWeight(ck.get(name, **kw).to(device), blocks)

        def bias(name, **kw):
            return ck.get(name, **kw).to(device)

        def layer(i: int) -> Layer:
            return Layer(_layer_weights(i, cfg, fmt, get, weight, bias, q_rows, kv_rows, inter),
                         len(qh), len(kvh), shard.kv_index_of_local_q(cfg), D,
                         cfg.rms_norm_eps)

        # On a CPU, layers are read and packed one per core at a time: FBGEMM's int8 and fp16
        # packing runs on one thread, and a start (or the rebuild after a lost worker) waits
        # for all of it. Each layer's weights are its own, so the order of work is free.
        workers = max(1, min(4, torch.get_num_threads())) if device.type == "cpu" else 1
        with ThreadPoolExecutor(max_workers=workers) as pool:
            layers = list(pool.map(layer, range(cfg.num_layers)))
        # The table is only indexed: the file's own blocks where the format is a CPU
        # quantized one (rows dequantized per lookup), else stored as the weights are.
        blocks = ck.block_table("model.embed_tokens.weight") \
            if fmt.per_row and device.type == "cpu" and hasattr(ck, "block_table") else None
        embed = BlockEmbedding(*blocks, cfg.hidden_size, "token_embd.weight") \
            if blocks is not None else get("model.embed_tokens.weight", dtype=fmt.weight_dtype)
        lm_head: Linear | None = None
        n_out = vocab_limit or cfg.vocab_size
        if not 0 < n_out <= cfg.vocab_size:
            raise ValueError(f"vocab limit must be in 1..{cfg.vocab_size}")
        if with_lm_head or shard.world > 1:
            tied = cfg.tie_word_embeddings or not ck.has("lm_head.weight")
            rows = shard.vocab_rows(n_out)
            if not tied:
                table = weight("lm_head.weight", rows=rows)
            elif fmt.q4k:
                # The tied table's own blocks, as the file stores them: through its floats
                # they would be rounded to Q4_K a second time.
                table = weight("model.embed_tokens.weight", rows=rows)
            else:
                table = embed[rows.start:rows.stop]
            lm_head = fmt.linear(table)
        norm = get("model.norm.weight")
        if hasattr(ck, "release"):
            ck.release()
        release_free_heap()
        model = cls(cfg, layers, embed, norm, lm_head, shard, fmt, device)
        model.vocab_out = n_out
        return model

    def limit_vocab(self, n: int) -> Decoder:
        """A view of this model that scores only the first n token ids (layers shared)."""
        if not 0 < n <= self.cfg.vocab_size:
            raise ValueError(f"vocab limit must be in 1..{self.cfg.vocab_size}")
        if n == self.vocab_out:
            return self
        if self.shard.world > 1:  # every rank's slice would change: set it at load time
            raise ValueError("a tensor-parallel model's vocabulary limit is set when its "
                             "shards load (Decoder.from_checkpoint(vocab_limit=...))")
        out = copy.copy(self)
        out.lm_head = self.lm_head.first_rows(n) if self.lm_head is not None else None
        out.vocab_out = n
        return out

    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds (tied tables counted once per storage)."""
        total = 0
        for layer in self.layers:
            for v in layer.w.values():
                if isinstance(v, Linear):
                    total += v.nbytes
                elif v is not None:
                    total += v.numel() * v.element_size()
        total += table_bytes(self.embed)
        total += self.norm.numel() * self.norm.element_size()
        head = self.lm_head
        if head is not None and not (
                isinstance(getattr(head, "weight", None), torch.Tensor)
                and isinstance(self.embed, torch.Tensor)
                and head.weight.untyped_storage().data_ptr()
                == self.embed.untyped_storage().data_ptr()):  # a view of the tied table
            total += head.nbytes
        return total

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        limit = self.cfg.context_limit
        if max_len > limit:
            raise ValueError(
                f"max context {max_len} exceeds what this model supports ({limit} tokens)"
            )
        n_kv = len(self.shard.kv_heads(self.cfg))
        return KVCache(self.cfg.num_layers, num_slots, max_len, n_kv, self.cfg.head_dim,
                       self.format.kv_dtype, self.device)

    def rotary_tables(self, max_len: int) -> list[Rotary]:
        """Each layer's rotary tables for a cache of max_len positions (layers sharing a
        rotary embedding share them); built once per cache length."""
        if self._rotary_len != max_len:
            built: dict[Rope, Rotary] = {}
            for i in range(self.cfg.num_layers):
                rope = self.cfg.rope_of(i)
                if rope not in built:
                    built[rope] = Rotary(rope, max_len, self.dtype, self.device)
            self._rotary = [built[self.cfg.rope_of(i)] for i in range(self.cfg.num_layers)]
            distinct = list(built.values())  # in rope_index order (first use)
            self._static_tables = (tuple(r.cos for r in distinct),
                                   tuple(r.sin for r in distinct))
            self._rotary_len = max_len
        return self._rotary

    def static_tables(self, max_len: int) -> tuple[tuple[torch.Tensor, ...],
                                                   tuple[torch.Tensor, ...]]:
        """The distinct rotary tables (cos, sin), in `rope_index` order: a static step's
        arguments (a captured graph reads fixed tensors)."""
        self.rotary_tables(max_len)
        return self._static_tables

    # ---- forward ------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: BatchInput, cache: KVCache,
                logit_indices: torch.Tensor | None = None, argmax: bool = False
                ) -> torch.Tensor:
        """Run the new tokens of every row; return fp32 logits [N, vocab].

        logit_indices picks which flat tokens get logits (default: each row's last token),
        so a long prefill does not pay for a vocabulary projection at every position.
        argmax: return only the argmax ids [N] (int64) instead, for greedy rows; under
        tensor parallelism that is a reduction of each rank's slice maximum, not a gather
        of every rank's logits.
        """
        if batch.kv_len > cache.max_len:
            raise ValueError(f"sequence length {batch.kv_len} exceeds the cache ({cache.max_len})")
        tables = self.rotary_tables(cache.max_len)
        x = embed(self, batch.token_ids)
        # A batch-invariant format: every token attends alone (one query, no mask, its own
        # keys), so its arithmetic is the same whether it is decoded by itself, verified
        # among k others or prefilled in a batch. A padded batch's longer key axis or a
        # verify's several queries change the kernel's blocking by ~1e-7, and an int8
        # rounding boundary turns that into a different token.
        plan = _PerTokenPlan(batch) if self.format.per_row else _AttentionPlan(batch)
        if self._invariant_layers:
            ops = invariant_layers.InvariantOps(self, batch, plan, cache, tables)
        else:
            ops = EagerOps(self, batch, plan, cache, tables)
        x = run_layers(self, x.contiguous(), ops)
        h = rms_norm(x[logits_at(logit_indices, batch, x.device)], self.norm,
                      self.cfg.rms_norm_eps)
        if self.lm_head is None:  # no projection loaded
            return h.new_empty(h.shape[0], 0, dtype=torch.float32)
        return self.project(h, argmax)

    def project(self, h: torch.Tensor, argmax: bool = False) -> torch.Tensor:
        """Final-normed hidden states [N, hidden] to fp32 logits [N, vocab] (argmax: ids
        [N]). Tensor-parallel: this rank's vocabulary slice, joined on rank 0 (followers
        get an empty tensor), so every rank must call it at the same point."""
        logits = self.lm_head(h).float()
        if self.shard.world > 1:
            return self.argmax_vocab(logits) if argmax else self.gather_vocab(logits)
        if not argmax:
            return logits
        # A row whose values went non-finite (a NaN anywhere upstream) has no argmax: -1,
        # which the target's step turns into that request's error.
        return torch.where(torch.isfinite(h).all(-1), logits.argmax(-1), -1)

    __call__ = forward



class EagerOps(AtenOps):
    """The eager ragged forward's attention: one SDPA call over the padded batch (a mask per
    window), or each token alone (batch-invariant formats without our kernels)."""

    def __init__(self, model: Decoder, batch: BatchInput, plan, cache: KVCache,
                 tables: list[Rotary]) -> None:
        super().__init__(model)
        self.batch, self.plan, self.cache, self.rotary = batch, plan, cache, tables

    def tables(self, layer):
        return self.rotary[layer].at(self.batch.positions)

    def attend(self, i, q, k, v):
        layer, batch, plan, cache = self.model.layers[i], self.batch, self.plan, self.cache
        window = self.model.cfg.layer_windows[i]
        cache.write(i, batch.slot_of_token, batch.positions, k, v)
        if plan.per_token is not None:
            return token_attention.attend(q, cache.k[i], cache.v[i], plan.slots, plan.n_keys,
                                          plan.per_token, layer.kv_gather, window,
                                          self.model.cfg.attn_scale)
        nq, nkv = layer.n_q, layer.n_kv
        keys, values = cache.read(i, batch.slots, batch.kv_len, plan.single_slot)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        if layer.kv_gather is not None:
            keys, values = keys[:, layer.kv_gather], values[:, layer.kv_gather]
        out = F.scaled_dot_product_attention(
            plan.pad(q), keys, values, attn_mask=plan.mask_for(window),
            enable_gqa=layer.kv_gather is None and nq != nkv, scale=self.model.cfg.attn_scale,
        )  # [B, Hq, Qmax, D]
        return plan.unpad(out).reshape(-1, nq * layer.head_dim)


class _PerTokenPlan:
    """Batch-invariant formats: (slot, keys it sees) for each token, attending alone (no
    padded grid or mask to build; specdec/model/formats/token_attention.py)."""

    def __init__(self, batch: BatchInput) -> None:
        # From the host's own lists: reading the index tensors back would wait for the device.
        self.per_token = [(slot, start + j + 1) for slot, start, n in
                          zip(batch.slot_list, batch.starts, batch.query_lens, strict=True)
                          for j in range(n)]
        pairs = torch.tensor(self.per_token, dtype=torch.long).view(-1, 2)
        self.slots, self.n_keys = pairs[:, 0], pairs[:, 1]


class _AttentionPlan:
    """Index maths shared by all layers of one forward: flat tokens <-> padded [B, Qmax]."""

    def __init__(self, batch: BatchInput) -> None:
        self.batch = batch
        B, Q, K = batch.num_rows, batch.max_query, batch.kv_len
        dev = batch.token_ids.device
        self.single_slot = batch.slot_list[0] if B == 1 else None
        self.dense = all(n == Q for n in batch.query_lens)
        qpos = torch.full((B, Q), -1, dtype=torch.long, device=dev)
        qpos[batch.row_of_token, batch.col_of_token] = batch.positions
        keys = torch.arange(K, device=dev)
        self.qpos, self.keys = qpos.unsqueeze(-1), keys.view(1, 1, K)
        self._masks: dict[int | None, torch.Tensor] = {}
        self.mask = self.mask_for(None)
        self.per_token = None

    def mask_for(self, window: int | None) -> torch.Tensor:
        """[B, 1, Q, K]: causal over absolute positions, and within the window."""
        if window not in self._masks:
            mask = self.keys <= self.qpos  # [B, Q, K]
            if window is not None:
                mask &= self.keys > self.qpos - window
            # Padding queries see key 0 only, so softmax stays finite; their output is dropped.
            mask[..., 0] |= self.qpos[..., 0] < 0
            self._masks[window] = mask.unsqueeze(1)
        return self._masks[window]

    def pad(self, q: torch.Tensor) -> torch.Tensor:
        b = self.batch
        if self.dense:
            return q.view(b.num_rows, b.max_query, *q.shape[1:]).transpose(1, 2)
        out = q.new_zeros(b.num_rows, b.max_query, *q.shape[1:])
        out[b.row_of_token, b.col_of_token] = q
        return out.transpose(1, 2)

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        out = out.transpose(1, 2)  # [B, Q, H, D]
        if self.dense:
            return out.reshape(-1, *out.shape[2:])
        return out[self.batch.row_of_token, self.batch.col_of_token]


def _layer_weights(i: int, cfg, fmt, get, weight, bias, q_rows, kv_rows, inter) -> dict:
    """Layer i's weights, this rank's slices, in the model's format: q|k|v and gate|up
    fused, one matmul each instead of three and two."""
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    fam = cfg.family
    return {
        "in_norm": get(p + "input_layernorm.weight"),
        "post_norm": get(p + "post_attention_layernorm.weight"),
        # Per-head q/k norms (Qwen 3, Gemma 3): the same weight on every rank's heads.
        "q_norm": get(a + "q_norm.weight") if fam.qk_norm else None,
        "k_norm": get(a + "k_norm.weight") if fam.qk_norm else None,
        # Norms on the attention's and the MLP's output (Gemma 3), after the all_reduce.
        "attn_out_norm": get(p + "attn_output_norm.weight") if fam.output_norms else None,
        "mlp_out_norm": get(p + "mlp_output_norm.weight") if fam.output_norms else None,
        # Fused q|k|v and gate|up: one matmul each instead of three and two.
        "qkv": fmt.linear_rows(
            [weight(a + "q_proj.weight", rows=q_rows),
             weight(a + "k_proj.weight", rows=kv_rows),
             weight(a + "v_proj.weight", rows=kv_rows)],
            torch.cat([bias(a + "q_proj.bias", rows=q_rows),
                       bias(a + "k_proj.bias", rows=kv_rows),
                       bias(a + "v_proj.bias", rows=kv_rows)])
            if cfg.qkv_bias else None),
        "o": fmt.linear(weight(a + "o_proj.weight", cols=q_rows)),
        # Row-parallel biases are added once, after the all_reduce.
        "o_b": get(a + "o_proj.bias") if cfg.o_bias else None,
        "gate_up": fmt.linear_rows(
            [weight(m + "gate_proj.weight", rows=inter),
             weight(m + "up_proj.weight", rows=inter)],
            torch.cat([bias(m + "gate_proj.bias", rows=inter),
                       bias(m + "up_proj.bias", rows=inter)])
            if cfg.mlp_bias else None),
        "down": fmt.linear(weight(m + "down_proj.weight", cols=inter)),
        "down_b": get(m + "down_proj.bias") if cfg.mlp_bias else None,
    }
