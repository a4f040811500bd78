"""`ModelShard`: one rank of a tensor-parallel model, as a Ray actor.

Rank 0 of the target group holds the target runner (forward + rejection sampler); rank 0
of the draft group holds the draft proposer and its copies of the sequences' contexts (the
engine sends only what changed). Other ranks only follow rank 0's broadcasts. The maths
lives in specdec; this file only places it in a process.

Threads: every call that computes runs in the "compute" concurrency group, one thread for
the actor's life, so one OpenMP team serves every forward. (A threaded actor hands calls
to a pool of executor threads in turn; each thread that starts a parallel region gets an
OpenMP team of its own, and the teams of the previous calls still spin or sleep cold.)
Ray's threads keep the OpenMP setting of the process environment, not what
torch.set_num_threads() said in __init__, so the group starts each shard with
OMP_NUM_THREADS in its runtime_env; `threads()` reports what the compute thread gets.
Follower ranks block the compute thread in follow(); pings use the "control" group.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
import torch

from deployments.actors.procinfo import peak_rss_mb, rss_anon_mb, rss_mb
from specdec.model.checkpoint.sharding import ShardSpec
from specdec.model.formats.openmp import omp_max_threads
from specdec.model.step.decoder import Decoder
from specdec.model.step.parallel import Group, LeaderDecoder, follow
from specdec.model.step.static_step import graph_builds
from specdec.model.step.step_mode import with_step
from specdec.pack.hub import resolve
from specdec.ports import free_port
from specdec.spec_decode.proposers import DEFAULT_Q_TOP_M, DraftModelProposer
from specdec.spec_decode.target_runner import (
    Head,
    LocalTargetRunner,
    Resolved,
)
from specdec.spec_decode.wire import ContextDelta, ContextReceiver, pack, unpack


@ray.remote(concurrency_groups={"compute": 1, "control": 2})
class ModelShard:
    def __init__(self, role: str, model: str, dtype: str, rank: int, world: int,
                 max_slots: int, max_len: int, threads: int, extra: dict[str, Any]) -> None:
        cores = os.cpu_count() or 1
        if threads > cores:
            raise ValueError(f"{role}.threads: {threads} threads per rank, but node "
                             f"{ray.util.get_node_ip_address()} has {cores} cores")
        torch.set_num_threads(max(1, threads))
        self.role, self.rank, self.world = role, rank, world
        self.model_ref, self.dtype = model, dtype
        self.max_slots, self.max_len, self.extra = max_slots, max_len, extra
        self.device = "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"
        self.group: Group | None = None
        self.runner: LocalTargetRunner | None = None
        self.proposer: DraftModelProposer | None = None
        self.contexts = ContextReceiver()
        self._stopped: set[int] = set()  # overlap windows told to stop (control thread)
        self._stats_sent: dict | None = None

    @ray.method(concurrency_group="control")
    def address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port("")

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def memory(self) -> dict:
        """This process's memory now and at its peak (MB)."""
        return {"rss_mb": rss_mb(), "peak_rss_mb": peak_rss_mb()}

    @ray.method(concurrency_group="compute")
    def threads(self) -> dict:
        """Threads as a method thread sees them: torch's count and OpenMP's own setting."""
        return {"torch": torch.get_num_threads(), "openmp": omp_max_threads(),
                "env": os.environ.get("OMP_NUM_THREADS")}

    @ray.method(concurrency_group="compute")
    def setup(self, init_method: str, collective_timeout_s: float) -> dict:
        """Join the group, read this rank's slice of the weights, allocate its KV cache."""
        self.group = Group(self.rank, self.world, init_method, self.device, collective_timeout_s)
        path = resolve(self.model_ref)
        rss_before = peak_rss_mb()
        # Every rank projects its slice of the vocabulary (a draft's limit applies to all).
        limit = self.extra.get("vocab_limit") if self.role == "draft" else None
        t_load = time.perf_counter()
        local = Decoder.from_checkpoint(path, self.dtype, self.device,
                                        ShardSpec(self.rank, self.world), vocab_limit=limit)
        load_s = time.perf_counter() - t_load
        self.group.attach(local)
        # Every rank runs the same step (same buckets), so their collectives line up.
        local = with_step(local, self.extra.get("step", "eager"))
        cache = local.new_cache(self.max_slots, self.max_len)
        self.local, self.cache = local, cache
        if self.rank == 0:
            leader = LeaderDecoder(local, self.group, cache)
            if self.role == "target":
                self.runner = LocalTargetRunner(leader, self.max_slots, self.max_len)
            else:
                self.proposer = DraftModelProposer(leader, self.max_slots, self.max_len,
                                                   self.extra.get("sampling", "probabilistic"),
                                                   self.extra.get("vocab_limit"),
                                                   self.extra.get("confidence_threshold"),
                                                   self.extra.get("q_top_m", DEFAULT_Q_TOP_M),
                                                   self.extra.get("prefix_cache", True))
        weights = local.weight_bytes()
        return {"rank": self.rank, "backend": self.group.backend, "device": self.device,
                "weights_mb": weights / 2**20,
                "kv_cache_mb": 2 * cache.k.numel() * cache.k.element_size() / 2**20,
                "peak_rss_mb": peak_rss_mb(), "rss_before_load_mb": rss_before,
                "rss_anon_mb": rss_anon_mb(), "threads": torch.get_num_threads(),
                "vocab_size": local.cfg.vocab_size, "format": local.format.name,
                "load_s": load_s}

    @ray.method(concurrency_group="compute")
    def follow(self) -> int:
        assert self.group is not None and self.rank > 0
        return follow(self.local, self.group, self.cache)

    # ---- rank 0 of the target group -------------------------------------------------------

    @ray.method(concurrency_group="compute")
    def target_step(self, blob: bytes) -> bytes:
        """Packed (rows, sequences started, sequences ended, prefix copies) in; packed
        (results, the seconds spent here, graphs built so far) out: the caller's wall time
        minus those seconds is the call itself."""
        assert self.runner is not None
        rows, started, ended, copies = unpack(blob)
        t0 = time.perf_counter()
        for seq_id in ended:
            self.runner.end_sequence(seq_id)
        for seq_id, params in started.items():
            self.runner.start_sequence(seq_id, params)
        for src, dst, n in copies:
            self.runner.copy_prefix(src, dst, n)
        results = self.runner.step(rows)
        return pack((results, time.perf_counter() - t0, graph_builds(self.runner)))

    # ---- rank 0 of the draft group --------------------------------------------------------

    @ray.method(concurrency_group="compute")
    def draft_propose(self, blob: bytes) -> bytes:
        """Packed (context deltas, sequences released) in; packed (proposals, seconds, graphs
        built so far) out."""
        t0 = time.perf_counter()
        inputs = self._draft_inputs(*unpack(blob))
        proposals = self.proposer.propose(inputs)
        return pack((proposals, time.perf_counter() - t0, graph_builds(self.proposer),
                     self._prefix_stats()))

    @ray.method(concurrency_group="compute")
    def draft_window(self, blob: bytes, window_id: int) -> bytes:
        """Overlap (specdec/spec_decode/overlap.py): draft until stop_window(window_id) arrives on the
        control thread (at least one forward), while the target verifies elsewhere."""
        t0 = time.perf_counter()
        # A stop may arrive before its window starts, or after it ended: keep only the
        # marks of this window and later ones.
        self._stopped = {w for w in self._stopped if w >= window_id}
        inputs = self._draft_inputs(*unpack(blob))
        out = self.proposer.propose(inputs, should_stop=lambda: window_id in self._stopped)
        return pack((out, time.perf_counter() - t0, graph_builds(self.proposer),
                     self._prefix_stats()))

    def _prefix_stats(self) -> dict | None:
        """The draft's prefix-cache counters when they changed since the last reply (they
        change when a sequence starts: not every step's few hundred bytes)."""
        stats = self.proposer.prefixes.stats.as_dict()
        stats["held_tokens"] = self.proposer.prefixes.held_tokens()
        if stats == self._stats_sent:
            return None
        self._stats_sent = stats
        return stats

    def _draft_inputs(self, deltas: list[ContextDelta], released: list[str]):
        """Apply what the engine sent (finished sequences, context deltas, rewinds) and
        return this call's proposer inputs."""
        assert self.proposer is not None
        for seq_id in released:
            self.proposer.release(seq_id)
            self.contexts.release(seq_id)
        inputs = self.contexts.decode(deltas)
        for seq_id, keep in self.contexts.rewound.items():
            self.proposer.accepted(seq_id, keep)
        return inputs

    @ray.method(concurrency_group="control")
    def stop_window(self, window_id: int) -> None:
        self._stopped.add(window_id)

    @ray.method(concurrency_group="compute")
    def target_resolve(self, heads: dict[str, Head | None]) -> dict[str, Resolved]:
        """Overlap: settle the last step's deferred positions against the draft's heads."""
        assert self.runner is not None
        return self.runner.resolve(heads)

    @ray.method(concurrency_group="compute")
    def stop(self) -> None:
        if self.rank == 0 and self.group is not None:
            (self.runner.model if self.runner else self.proposer.model).stop_followers()
        if self.group is not None:
            self.group.destroy()
