"""One projection of the target in each CPU weight format: our Q4_K and Q6_K kernels against
FBGEMM's int8 (two levels per row, the previous target format) and dynamic int8.

    .venv/bin/python -m specdec_bench.kquant [--rows 1 4 5 8] [--rounds 7] [--threads 2]

The weights are the pack target's own: `--layers` of its gate projections (8960 x 1536,
Q4_K in the file) and its output projection (151936 x 1536, Q6_K), so a round streams more
than the last-level cache holds, as a decode step does. The formats take turns call by call
(their order rotating each round); a cell is the median over rounds of one call's time, and
GB/s is the format's weight bytes over that time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.model.checkpoint.gguf_file import GGUFCheckpoint
from specdec.model.formats import q4k, q6k
from specdec.model.formats.int8_linear import DynamicInt8Linear, RowInt8Linear
from specdec.pack import hub
from specdec.progress import Progress
from specdec_bench.table import print_table


def _contenders(ck: GGUFCheckpoint, name: str, blocks_cls, layers: list[str]) -> dict:
    sources = [ck.stored_blocks(n) for n in layers]
    floats = [s.dequantize() for s in sources]
    return {
        f"{name} (ours)": [blocks_cls(s) for s in sources],
        "int8 (FBGEMM, two levels)": [RowInt8Linear(w) for w in floats],
        "int8-dynamic (FBGEMM)": [DynamicInt8Linear(w) for w in floats],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 5, 8])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = hub.resolve(args.model, fetch_missing=True)
    ck = GGUFCheckpoint(path if str(path).endswith(".gguf") else path / "model.gguf")
    groups = {
        "gate 8960 x 1536 (Q4_K)": _contenders(
            ck, "q4k", q4k.Q4KLinear,
            [f"model.layers.{i}.mlp.gate_proj.weight" for i in range(args.layers)]),
        "output 151936 x 1536 (Q6_K)": _contenders(ck, "q6k", q6k.Q6KLinear, ["lm_head.weight"]),
    }
    rows_out = []
    total = sum(len(g) for g in groups.values()) * len(args.rows) * args.rounds
    prog = Progress("bench kquant", total, "calls")
    for title, contenders in groups.items():
        for m in args.rows:
            x = torch.randn(m, 1536)
            times = {name: [] for name in contenders}
            names = list(contenders)
            for r in range(args.rounds + 1):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    for layer in contenders[name]:
                        t = time.perf_counter()
                        layer(x)
                        if r:  # the first round pays for first touches
                            times[name].append(time.perf_counter() - t)
                    if r:
                        prog.advance()
            base = statistics.median(times["int8 (FBGEMM, two levels)"])
            for name in names:
                s = statistics.median(times[name])
                nbytes = contenders[name][0].nbytes
                rows_out.append({"projection": title, "rows": m, "format": name,
                                 "ms": s * 1e3, "GB/s": nbytes / s / 1e9,
                                 "x int8": base / s})
    prog.close()
    print_table(rows_out, ["projection", "rows", "format", "ms", "GB/s", "x int8"],
                title=f"one projection, {args.threads} threads, median call of {args.rounds} "
                      "rounds")


if __name__ == "__main__":
    main()
