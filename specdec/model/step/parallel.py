"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on GPU).

Every rank holds a `Decoder` built from its own slice of the checkpoint (see sharding.py)
and a KV cache for its own heads. Rank 0 leads: each forward it broadcasts the batch
description (slots, start positions, new tokens) to the followers over a CPU (gloo) control
group, then all ranks run the forward together, meeting in one all_reduce after attention
and one after the MLP. The vocabulary projection is split by rows (vocabulary-parallel):
each rank scores its slice of the ids, and rank 0 gets either the joined logits (sampled
rows) or, for all-greedy batches, only the argmax ids from a reduction of each slice's
maximum. Followers never see sampling, and nothing but tokens leaves rank 0.

`LeaderDecoder` looks like a `Decoder` to whoever drives rank 0 (the target runner, the
draft proposer), so the engine code is the same for one process and for N.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from specdec.model.step.batch import BatchInput
from specdec.model.step.decoder import Decoder
from specdec.model.step.kv_cache import KVCache

_STEP, _STOP, _COPY = 1, 2, 3


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def pick_backend(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


# Followers wait on the control group between requests, possibly for days: its timeout
# must not fire while the service is merely idle. A dead leader is handled by tearing the
# whole group down (the engine replaces every rank), not by this timeout.
_IDLE_TIMEOUT = datetime.timedelta(days=7)


class Group:
    """The process groups of one tensor-parallel model: `compute` carries the all_reduces
    (NCCL on GPUs) under a short timeout, so a lost rank fails a step quickly; `control`
    carries the leader's per-step broadcast (gloo, CPU tensors, so metadata never needs a
    device copy) under a timeout long enough for idle periods."""

    def __init__(self, rank: int, world: int, init_method: str, device: torch.device | str,
                 timeout_s: float) -> None:
        backend = pick_backend(device)
        self.rank, self.world, self.backend = rank, world, backend
        if world == 1:
            # Nothing to talk to: no process group, no collectives.
            self.compute = self.control = None
            return
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        self.compute = dist.group.WORLD
        self.control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)

    def attach(self, local: Decoder) -> Decoder:
        """Wire this rank's model to the group: the all_reduces of its row-parallel layers
        and the two reductions of its vocabulary slice (joined logits, argmax)."""
        local.all_reduce = self.all_reduce_fn()
        local.gather_vocab = self.gather_vocab_fn(local.vocab_out)
        local.argmax_vocab = self.argmax_vocab_fn(local.vocab_out)
        return local

    def all_reduce_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.world == 1:
            return _identity
        group = self.compute

        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x, group=group)
            return x

        return all_reduce

    def gather_vocab_fn(self, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Vocabulary-parallel output layer: each rank holds logits for its slice of the n
        ids (ShardSpec.vocab_rows); rank 0 gets them joined into [rows, n], the others an
        empty tensor. Slices are padded to one size for the collective."""
        from specdec.model.checkpoint.sharding import ShardSpec

        spans = [ShardSpec(r, self.world).vocab_rows(n) for r in range(self.world)]
        per = max(len(s) for s in spans)
        group, rank, world = self.compute, self.rank, self.world

        def gather(x: torch.Tensor) -> torch.Tensor:
            buf = x.new_zeros(x.shape[0], per)
            buf[:, : x.shape[1]] = x
            parts = [torch.empty_like(buf) for _ in range(world)]
            # all_gather rather than gather: every backend (gloo, NCCL) has it.
            dist.all_gather(parts, buf, group=group)
            if rank != 0:
                return x.new_empty(x.shape[0], 0)
            return torch.cat([p[:, : len(s)] for p, s in zip(parts, spans, strict=True)], 1)

        return gather

    def argmax_vocab_fn(self, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Distributed argmax over the vocabulary-parallel output layer: each rank reduces
        its slice to (max, global id) per row and only those 2 numbers a row cross; rank 0
        gets the ids [rows], the others an empty tensor."""
        from specdec.model.checkpoint.sharding import ShardSpec

        offset = ShardSpec(self.rank, self.world).vocab_rows(n).start
        group, rank, world = self.compute, self.rank, self.world

        def argmax(x: torch.Tensor) -> torch.Tensor:
            # float64 carries any vocabulary id exactly, and every fp32 logit.
            if x.shape[1]:
                best, ids = x.max(-1)
                mine = torch.stack([best.double(), (ids + offset).double()])
            else:  # a rank whose slice is empty never wins
                mine = x.new_full((2, x.shape[0]), float("-inf"), dtype=torch.float64)
            parts = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(parts, mine, group=group)
            if rank != 0:
                return torch.empty(0, dtype=torch.long, device=x.device)
            both = torch.stack(parts)  # [world, 2, rows]
            return pick_argmax(both[:, 0], both[:, 1].long())

        return argmax

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def pick_argmax(best: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The global argmax from each rank's slice maximum best[world, rows] at ids[world,
    rows]. Ties go to the lowest id, as torch.argmax over the whole row does (the first
    maximum): slices ascend with rank, and max() is first-occurrence within a slice."""
    winner = best.argmax(0)  # the first (lowest) rank among equal maxima
    return ids.gather(0, winner.unsqueeze(0)).squeeze(0)


def encode_batch(batch: BatchInput) -> torch.Tensor:
    """[B, slots.., starts.., lens.., tokens..] as one int64 tensor."""
    # From the host's own lists: reading the device's copies would wait for the device.
    return torch.tensor([batch.num_rows, *batch.slot_list, *batch.starts, *batch.query_lens,
                         *batch.token_list], dtype=torch.long)


def decode_batch(payload: torch.Tensor, device) -> BatchInput:
    b = int(payload[0])
    slots, starts, lens = payload[1:1 + b], payload[1 + b:1 + 2 * b], payload[1 + 2 * b:1 + 3 * b]
    toks = payload[1 + 3 * b:].tolist()
    rows, off = [], 0
    for s, st, n in zip(slots.tolist(), starts.tolist(), lens.tolist(), strict=True):
        rows.append((s, st, toks[off:off + n]))
        off += n
    return BatchInput.build(rows, device)


class LeaderDecoder:
    """Rank 0's handle on the whole tensor-parallel model; called like a Decoder."""

    def __init__(self, local: Decoder, group: Group, cache: KVCache) -> None:
        self.local, self.group, self.cache = local, group, cache
        self.cfg, self.device, self.dtype = local.cfg, local.device, local.dtype

    def limit_vocab(self, n: int) -> LeaderDecoder:
        return LeaderDecoder(self.local.limit_vocab(n), self.group, self.cache)

    @property
    def graph_builds(self) -> int:  # followers build the same graphs in the same order
        return getattr(self.local, "graph_builds", 0)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        if num_slots > self.cache.num_slots or max_len > self.cache.max_len:
            raise ValueError(f"the group's caches hold {self.cache.num_slots} slots of "
                             f"{self.cache.max_len} tokens; asked for {num_slots} x {max_len}")
        return self.cache

    def __call__(self, batch: BatchInput, cache: KVCache,
                 logit_indices: torch.Tensor | None = None, argmax: bool = False
                 ) -> torch.Tensor:
        if self.group.world > 1:
            # Followers compute their vocabulary slice at the same positions, and take part
            # in the same reduction (gather or argmax): send them both.
            if logit_indices is None:
                logit_indices = batch.last_token_indices()
            idx = logit_indices.to(torch.long).cpu()  # built on the host: no device read
            payload = torch.cat([encode_batch(batch), idx])
            header = torch.tensor([_STEP, payload.numel(), idx.numel(), int(argmax)],
                                  dtype=torch.long)
            dist.broadcast(header, src=0, group=self.group.control)
            dist.broadcast(payload, src=0, group=self.group.control)
        return self.local(batch, cache, logit_indices, argmax=argmax)

    forward = __call__

    def alone(self) -> Decoder | None:
        """This rank's model when no follower shares its steps (a one-rank group): what
        runs a step that is not a single forward, such as the draft's loop."""
        return self.local if self.group.world == 1 else None

    def copy_prefix(self, cache: KVCache, src: int, dst: int, n: int) -> None:
        """Every rank copies its own heads' K/V of a shared prefix (prefix_cache.py)."""
        if self.group.world > 1:
            dist.broadcast(torch.tensor([_COPY, src, dst, n], dtype=torch.long), src=0,
                           group=self.group.control)
        cache.copy_prefix(src, dst, n)

    def stop_followers(self) -> None:
        if self.group.world > 1:
            dist.broadcast(torch.tensor([_STOP, 0, 0, 0], dtype=torch.long), src=0,
                           group=self.group.control)


def follow(local: Decoder, group: Group, cache: KVCache) -> int:
    """A follower's life: run every forward the leader announces until told to stop.
    Returns the number of forwards run. Raises if the group breaks (a rank died)."""
    steps = 0
    while True:
        header = torch.empty(4, dtype=torch.long)
        dist.broadcast(header, src=0, group=group.control)
        if int(header[0]) == _STOP:
            return steps
        if int(header[0]) == _COPY:
            cache.copy_prefix(int(header[1]), int(header[2]), int(header[3]))
            continue
        payload = torch.empty(int(header[1]), dtype=torch.long)
        dist.broadcast(payload, src=0, group=group.control)
        n_idx = int(header[2])
        batch_part, idx = payload[: payload.numel() - n_idx], payload[payload.numel() - n_idx:]
        local(decode_batch(batch_part, local.device), cache, idx,
              argmax=bool(header[3]))
        steps += 1
