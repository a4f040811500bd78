"""The static step captured as CUDA graphs: each bucket's forward recorded once, replayed
every step, so a step costs its kernels' time instead of the host issuing them one by one
(eager, every forward of a 1-2B model is bound by the host on a fast GPU).

Why `torch.cuda.CUDAGraph` and not `torch.compile(mode="reduce-overhead")`: the step writes
the KV cache in place, and compile's CUDA-graph trees skip any graph that mutates an input
which is not a parameter; captured by hand, the cache is simply memory the graph writes.
Every bucket's graph shares one memory pool (as nano-vllm and vLLM do), so the buckets
together cost about one step's activations, not one each.

What capture needs, the static step already gives: fixed shapes per bucket, the same buffer
and cache addresses every step (inputs are refilled in place before each replay), no host
synchronisation inside the forward. Under tensor parallelism every rank captures the same
buckets in the same order, so the NCCL all-reduces recorded in each graph line up.
"""

from __future__ import annotations

import torch

from specdec.model.step.decoder import Decoder
from specdec.model.step.static_step import StaticDecoder, StepFn

_WARMUP = 2  # uncaptured runs first: allocator pools, cuBLAS workspaces, lazy kernel loads


class CapturedDecoder(StaticDecoder):
    def __init__(self, model: Decoder) -> None:
        if model.device.type != "cuda":
            raise ValueError("step: captured needs a CUDA device (CPU: static or compiled)")
        super().__init__(model)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self._pool = None
        self.captures = 0

    builds_graphs = True  # every new bucket is captured

    def limit_vocab(self, n: int) -> CapturedDecoder:
        # Not the base's: a draft's vocabulary limit must keep its steps captured.
        return CapturedDecoder(self.model.limit_vocab(n))

    def _run(self, fn: StepFn, args: tuple, key: tuple):
        graph_key = self._note(fn, key)
        got = self._graphs.get(graph_key)
        if got is None:
            got = self._graphs[graph_key] = self._capture(fn, args)
        graph, out = got
        graph.replay()
        return out

    def _capture(self, fn: StepFn, args: tuple) -> tuple[torch.cuda.CUDAGraph, object]:
        # The warm-up runs compute this very step (same inputs, so the same K/V written at
        # the same places): the replay that follows writes them once more, identically.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(_WARMUP):
                fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a Ray actor's other threads (health checks, metrics) may touch CUDA
        # while this one captures; only this thread's calls are held to capture's rules.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = fn(*args)
        self._pool = graph.pool()
        self.captures += 1
        return graph, out
