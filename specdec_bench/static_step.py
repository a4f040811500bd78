"""Step times of the eager ragged forward against the static step (fixed buffers, padded
buckets: specdec/model/step/static_step.py), run eagerly and through torch.compile, for the
config's target and draft in their configured formats.

    .venv/bin/python -m specdec_bench.static_step [--rows 1 4] [--query 1 4] [--rounds 5]

Each model holds `--context` tokens in every slot; a measured step runs `rows` rows of
`query` tokens at the end of their context (a decode step at query 1, a verify of k = query
- 1), rolled back after each step so every step of a cell has the same bucket. A "mixed"
cell has one plain row (1 token) beside rows - 1 verify rows: the pad layout pads the plain
row to the query length, the flat layout puts every token on a row of its own. The modes
alternate round by round so the machine's drift hits them alike; each cell is the median
over rounds of the median step in the round. A batch-invariant format (the CPU target's
int8) keeps the eager path inside the static decoder, so its rows are said to be eager.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from specdec.engine.spec import EngineSpec
from specdec.model.step.batch import BatchInput
from specdec.model.step.decoder import Decoder
from specdec.model.step.static_step import StaticDecoder
from specdec.pack import hub
from specdec.progress import Progress
from specdec_bench.table import print_table


def _models(spec: EngineSpec) -> list[tuple[str, str, str]]:
    out = [("target", spec.target.model, spec.target.dtype)]
    if spec.draft is not None:
        out.append(("draft", spec.draft.model, spec.draft.dtype))
    return out


def _time_steps(fn, cache, rows: list[tuple[int, int, list[int]]], steps: int) -> float:
    """Median ms of `steps` forwards of the same batch (each overwrites the last: rollback)."""
    batch = BatchInput.build(rows, cache.k.device)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn(batch, cache)
        _sync(cache.k.device)
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


MODES = {"eager": None, "static": ("pad", False), "static-flat": ("flat", False),
         "compiled": ("pad", True), "compiled-flat": ("flat", True),
         "captured": ("pad", None)}  # CUDA graphs: CUDA only


def _step_of(model: Decoder, mode: str):
    if MODES[mode] is None:
        return model
    layout, compiled = MODES[mode]
    if compiled is None:
        from specdec.model.step.cuda_graph import CapturedDecoder

        return CapturedDecoder(model)
    return StaticDecoder(model, compile=compiled, layout=layout)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _cell(model: Decoder, modes: dict, n_rows: int, query: int, mixed: bool, args, progress
          ) -> list[dict]:
    caches = {name: m.new_cache(n_rows, args.context + 16) for name, m in modes.items()}
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 1000, (args.context,), generator=g).tolist()
    for cache in caches.values():
        for slot in range(n_rows):
            model(BatchInput.build([(slot, 0, prompt)], model.device), cache)
    rows = [(s, args.context, [7] * (1 if mixed and s == 0 else query)) for s in range(n_rows)]
    first = {}
    for name, m in modes.items():  # the first call of a bucket: the compile, if any
        t = time.perf_counter()
        m(BatchInput.build(rows, model.device), caches[name])
        _sync(model.device)
        first[name] = time.perf_counter() - t
    per_round: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name, m in modes.items():
            per_round[name].append(_time_steps(m, caches[name], rows, args.steps))
            progress.advance()
    eager = statistics.median(per_round["eager"])
    return [{"rows": n_rows, "query": query, "batch": "mixed" if mixed else "uniform",
             "mode": name,
             "step_ms": statistics.median(v), "q1": min(v), "q3": max(v),
             "vs_eager": eager / statistics.median(v), "first_call_s": first[name]}
            for name, v in per_round.items()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--query", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", choices=["target", "draft"], default=None)
    ap.add_argument("--no-mixed", action="store_true", help="only batches whose rows all "
                    "bring the same number of tokens")
    ap.add_argument("--modes", nargs="+", choices=list(MODES),
                    default=[m for m in MODES if m != "captured"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="both models' format (default: the config's)")
    ap.add_argument("--target", default=None, help="a checkpoint instead of the config's")
    ap.add_argument("--draft", default=None, help="a checkpoint instead of the config's")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    spec = EngineSpec.from_config_file(args.config)
    given = {"target": args.target, "draft": args.draft}
    models = [(role, given[role] or name, args.dtype or dtype)
              for role, name, dtype in _models(spec) if args.only in (None, role)]
    shapes = [(n, q, mixed) for n in args.rows for q in args.query
              for mixed in ((False, True) if n > 1 and q > 1 and not args.no_mixed
                            else (False,))]
    modes_run = ["eager"] + [m for m in args.modes if m != "eager"]
    progress = Progress("static step", total=len(models) * len(shapes) * len(modes_run)
                        * args.rounds, unit=" rounds")
    table = []
    for role, name, dtype in models:
        model = Decoder.from_checkpoint(hub.resolve(name), dtype, args.device)
        eager_inside = model.format.per_row
        modes = {m: _step_of(model, m) for m in modes_run}
        for n_rows, query, mixed in shapes:
            for r in _cell(model, modes, n_rows, query, mixed, args, progress):
                table.append({"model": f"{role} ({dtype})", **r,
                              "path": "eager (batch-invariant format)"
                              if eager_inside and r["mode"] != "eager" else r["mode"]})
    progress.close()
    print_table(table, ["model", "rows", "query", "batch", "path", "step_ms", "q1", "q3",
                        "vs_eager", "first_call_s"],
                title=f"{args.config}: one forward, {args.context} tokens of context, median "
                      f"of {args.rounds} rounds x {args.steps} steps (q1/q3: round min/max)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
