"""`specdec bench tp`: what the tensor-parallel group costs against the local runner.

Per-step time of a batch-1 decode step (context 200) through: the local runner in this
process; a Ray group at TP=1 (one call per step, no collectives); TP=2 (+ broadcast and two
all_reduces per layer). And memory per shard against the single-process model.
"""

from __future__ import annotations

import gc
import resource
import statistics
import time

import torch

from deployments.actors.procinfo import rss_anon_mb
from deployments.actors.target import RayTargetRunner
from deployments.launch import local_ray
from specdec.engine.spec import ModelGroupSpec, RuntimeSpec
from specdec.model.step.decoder import Decoder
from specdec.model.step.sampling import SamplingParams
from specdec.pack.hub import resolve
from specdec.progress import Progress
from specdec.spec_decode.target_runner import LocalTargetRunner, TargetRow
from specdec_bench.table import print_table, write_json

CONTEXT = 200


def _step_times(runner, steps: int, progress: Progress) -> list[float]:
    runner.start_sequence("s", SamplingParams(temperature=0.0))
    runner.step([TargetRow("s", 0, 0, list(range(100, 100 + CONTEXT)), 0, None, True)])
    times = []
    for i in range(steps):
        t = time.perf_counter()
        runner.step([TargetRow("s", 0, CONTEXT + i, [300 + i], 0, None, True)])
        times.append(time.perf_counter() - t)
        progress.advance()
    runner.end_sequence("s")
    return times


def main(args) -> int:
    dtype = args.dtype
    path = resolve(args.model)
    progress = Progress("bench tp", total=args.steps * (1 + len(args.tp)), unit=" steps")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    local = Decoder.from_checkpoint(path, dtype)
    weights = local.weight_bytes()
    local_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0
    local_anon = rss_anon_mb()
    base = statistics.median(_step_times(LocalTargetRunner(local, 1, 512), args.steps, progress))
    rows = [{"runner": "local", "tp": 1, "step_ms": 1000 * base, "overhead_ms": 0.0,
             "ratio": 1.0, "weights_mb_per_shard": weights / 2**20,
             "peak_rss_mb_per_shard": local_rss, "rss_anon_mb_per_shard": local_anon,
             "threads": torch.get_num_threads()}]
    del local
    gc.collect()
    with local_ray(num_cpus=max(args.tp) + 1):
        for tp in args.tp:
            threads = max(1, args.threads // tp)
            runtime = RuntimeSpec(max_slots=1, max_len=512, gloo_socket_ifname="lo")
            cfg = ModelGroupSpec(model=args.model, tp=tp, dtype=args.dtype, threads=threads,
                                   resources={"num_cpus": threads})
            runner = RayTargetRunner(cfg, runtime)
            t = statistics.median(_step_times(runner, args.steps, progress))
            for s in runner.stats:
                rows.append({"runner": f"ray group rank {s['rank']}", "tp": tp,
                             "step_ms": 1000 * t, "overhead_ms": 1000 * (t - base),
                             "ratio": t / base, "weights_mb_per_shard": s["weights_mb"],
                             "peak_rss_mb_per_shard": s["peak_rss_mb"],
                             "rss_anon_mb_per_shard": s["rss_anon_mb"], "threads": s["threads"]})
            runner.shutdown()
    progress.close()
    print_table(rows, ["runner", "tp", "threads", "step_ms", "overhead_ms", "ratio",
                       "weights_mb_per_shard", "rss_anon_mb_per_shard", "peak_rss_mb_per_shard"],
                title=f"{args.model} {args.dtype}: batch-1 decode step at context {CONTEXT}, "
                      f"median of {args.steps} (torch threads in-process: "
                      f"{torch.get_num_threads()}, per rank: {args.threads}//tp)")
    write_json(args.json, rows)
    return 0
