"""What asking for log-probabilities costs: decode tokens/s of the application config's
engine (in process), greedy, plain (`mode: off`) and speculative (`mode: on`, the draft at
k 3), each without logprobs and with `logprobs: 5`, on short code prompts.

    .venv/bin/python -m specdec_bench.logprobs_cost [--tokens 64] [--repeats 3]

A greedy step without logprobs asks the target for argmax ids only; with them it needs the
logits of the row's positions and a log-softmax over the vocabulary. The four variants take
turns prompt by prompt and repeat by repeat, so a drifting machine moves them alike.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec.progress import Progress
from specdec_bench.in_process import decode_one
from specdec_bench.table import median, print_table, write_json

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def quicksort(arr):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
           "import numpy as np\n\n# compute the mean of each column\n"]


def _decode_tps(built, ids, label: str, mode: str, logprobs: int | None, tokens: int) -> float:
    from specdec.model.step.sampling import SamplingParams
    from specdec.spec_decode.speculation import Speculation

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                            logprobs=logprobs)
    over = Speculation(mode="off") if mode == "off" else Speculation(mode="on", method="draft", k=3)
    done, tps = decode_one(built, label, ids, params, over)
    assert (done.logprobs is not None) == (logprobs is not None)
    return tps


def main(argv=None) -> int:
    from specdec.engine.assemble import LocalBackend, assemble
    from specdec.engine.spec import EngineSpec

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "serve_config.yaml"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    built = assemble(EngineSpec.from_config_file(args.config), LocalBackend())
    variants = [(m, lp) for m in ("off", "on") for lp in (None, 5)]
    got: dict = {v: [] for v in variants}
    progress = Progress("logprobs cost", total=args.repeats * len(PROMPTS) * len(variants),
                        unit=" runs")
    n = 0
    for rep in range(args.repeats):
        for i, text in enumerate(PROMPTS):
            ids = built.tokenizer(text).input_ids
            order = variants if (rep + i) % 2 == 0 else variants[::-1]
            for mode, lp in order:
                got[mode, lp].append(_decode_tps(built, ids, f"r{n}", mode, lp, args.tokens))
                n += 1
                progress.advance()
    progress.close()
    built.close()
    rows = []
    for mode in ("off", "on"):
        without, with_lp = median(got[mode, None]), median(got[mode, 5])
        rows.append({"mode": mode, "tps_without": round(without, 2),
                     "tps_logprobs_5": round(with_lp, 2),
                     "with_vs_without": round(with_lp / without, 3)})
    print_table(rows, ["mode", "tps_without", "tps_logprobs_5", "with_vs_without"],
                title=f"greedy decode tokens/s with and without logprobs, {args.tokens} tokens, "
                      f"medians of {args.repeats} x {len(PROMPTS)} prompts ({args.config}, "
                      "in process)")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
