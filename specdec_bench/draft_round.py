"""A draft round's time: the eager proposer (k host-driven forwards) against the round as one
loop over fixed buffers (specdec/model/step/draft_loop.py), run statically, through
torch.compile, or captured as CUDA graphs, for the config's draft in its configured format.

    .venv/bin/python -m specdec_bench.draft_round [--rows 1 4] [--k 2 4] [--rounds 5]

Every slot holds `--context` tokens; each measured round proposes k guesses per row from
the same context (the last token re-fed, then k - 1 guesses), so every round of a cell has
the same shapes. The modes alternate round by round so the machine's drift hits them
alike; a cell is the median over rounds of the median round in it. "same" is the share of
rounds whose guesses equal the eager proposer's (greedy rows: the same argmax chain; a
padded key axis can flip a near-tie in low precision).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import get_args

import torch

from specdec.engine.spec import EngineSpec
from specdec.model.step.decoder import Decoder
from specdec.model.step.sampling import SamplingParams
from specdec.pack import hub
from specdec.progress import Progress
from specdec.spec_decode.proposal import ProposeInput
from specdec.spec_decode.proposers import DraftModelProposer
from specdec.vocabulary import StepMode
from specdec_bench.static_step import _step_of, _sync
from specdec_bench.table import print_table

MODES = get_args(StepMode)
SAMPLING = {"greedy": SamplingParams(temperature=0.0),
            "sampled": SamplingParams(temperature=0.8, seed=7)}


def _proposer(model: Decoder, mode: str, d, slots: int, max_len: int) -> DraftModelProposer:
    return DraftModelProposer(_step_of(model, mode), slots, max_len, d.sampling,
                              d.vocab_limit, d.confidence_threshold, d.q_top_m)


def _round(p: DraftModelProposer, inputs: list[ProposeInput]) -> tuple[float, list]:
    t = time.perf_counter()
    out = p.propose(inputs)
    _sync(p.model.device)
    return 1e3 * (time.perf_counter() - t), [o.token_ids for o in out]


def _cell(model, proposers, rows: int, k: int, sampling: str, args, progress) -> list[dict]:
    g = torch.Generator().manual_seed(rows * 10 + k)
    contexts = [torch.randint(100, 1000, (args.context,), generator=g).tolist()
                for _ in range(rows)]
    inputs = [ProposeInput(f"s{i}", c, k, SAMPLING[sampling]) for i, c in enumerate(contexts)]
    first = {}
    for name, p in proposers.items():
        # The prefill round (compiled: the loop's compile), then the first steady round (the
        # catch-up step's bucket, when new): first_round_s is both.
        first[name] = (_round(p, inputs)[0] + _round(p, inputs)[0]) / 1e3
    times = {name: [] for name in proposers}
    same = {name: 0 for name in proposers}
    for _ in range(args.rounds):
        guesses = {}
        for name, p in proposers.items():
            ms = []
            for _ in range(args.steps):
                t, guesses[name] = _round(p, inputs)
                ms.append(t)
            times[name].append(statistics.median(ms))
            same[name] += guesses[name] == guesses["eager"]
            progress.advance()
    eager = statistics.median(times["eager"])
    return [{"rows": rows, "k": k, "rows_sampling": sampling, "mode": name,
             "round_ms": statistics.median(v), "q1": min(v), "q3": max(v),
             "per_guess_ms": statistics.median(v) / k, "vs_eager": eager / statistics.median(v),
             "same": f"{same[name]}/{args.rounds}" if sampling == "greedy" else "-",
             "first_round_s": first[name]} for name, v in times.items()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sampling", nargs="+", choices=list(SAMPLING), default=["greedy"])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=["static", "compiled"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="the draft's format (default: the config's)")
    ap.add_argument("--draft", default=None, help="a checkpoint instead of the config's")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    d = EngineSpec.from_config_file(args.config).draft
    if d is None:
        raise SystemExit(f"{args.config} has no draft")
    dtype = args.dtype or d.dtype
    model = Decoder.from_checkpoint(hub.resolve(args.draft or d.model), dtype, args.device)
    names = ["eager"] + [m for m in args.modes if m != "eager"]
    cells = [(r, k, s) for r in args.rows for k in args.k for s in args.sampling]
    progress = Progress("draft round", total=len(cells) * len(names) * args.rounds,
                        unit=" rounds")
    table = []
    for rows, k, sampling in cells:
        proposers = {m: _proposer(model, m, d, rows, args.context + 16) for m in names}
        table += _cell(model, proposers, rows, k, sampling, args, progress)
    progress.close()
    print_table(table, ["rows", "k", "rows_sampling", "mode", "round_ms", "q1", "q3",
                        "per_guess_ms", "vs_eager", "same", "first_round_s"],
                title=f"{args.config}: draft {args.draft or d.model} ({dtype}), one round of k "
                      f"guesses per row from {args.context} tokens, median of {args.rounds} "
                      f"rounds x {args.steps} (q1/q3: round min/max)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
