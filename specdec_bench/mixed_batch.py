"""What a batch costs when only some of its rows speculate, in one process.

    .venv/bin/python -m specdec_bench.mixed_batch [--rows 4] [--k 3] [--repeats 3]

The default pair as serve_config.yaml runs it (target on both cores, the draft borrowing
them, draft vocabulary limit 32768), greedy code prompts, `rows` requests at once of which
n draft k guesses per round and the rest decode plain, n from 0 to rows; output tokens/s,
medians of the repeats (alternated), and the ratio to the all-plain batch. A mixed batch
costs more than either pure one; this is why the policy makes one decision per batch
(standby requests follow it) instead of one per request.
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdec.engine.assemble import LocalBackend, assemble
from specdec.engine.request import Request
from specdec.engine.spec import DraftGroupSpec, EngineSpec, ModelGroupSpec, RuntimeSpec
from specdec.model.step.sampling import SamplingParams
from specdec.pack import hub
from specdec.pack.tokenizer import load_tokenizer, prompt_ids
from specdec_bench.prompts import PROMPT_SETS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    spec = EngineSpec(
        target=ModelGroupSpec(model="qwen2.5-coder-1.5b", threads=2,
                                resources={"num_cpus": 2}),
        draft=DraftGroupSpec(model="qwen2.5-coder-0.5b", threads=2, sampling="greedy",
                               vocab_limit=32768, resources={"num_cpus": 0}),
        runtime=RuntimeSpec(max_slots=args.rows, max_len=1024), warmup=False)
    engine = assemble(spec, LocalBackend("cpu")).engine
    tok = load_tokenizer(hub.resolve("qwen2.5-coder-1.5b"))
    chat, prompts = PROMPT_SETS["code"]
    ids = [prompt_ids(tok, p, chat) for p in prompts]
    ids = [ids[i % len(ids)] for i in range(args.rows)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def run(n_spec: int, tag: str) -> float:
        reqs = [Request.pinned(f"{tag}-{i}", ids[i], params,
                               "draft" if i < n_spec else "none", args.k if i < n_spec else 0)
                for i in range(args.rows)]
        t = time.perf_counter()
        out = engine.run(reqs)
        return sum(len(o.token_ids) for o in out.values()) / (time.perf_counter() - t)

    run(1, "warm-mixed")
    run(args.rows, "warm-all")
    counts = sorted({0, 1, args.rows // 2, args.rows})
    rates: dict[int, list[float]] = {n: [] for n in counts}
    for r in range(args.repeats):
        for n in counts:
            rates[n].append(run(n, f"r{r}-n{n}"))
    base = statistics.median(rates[0])
    print(f"\n{args.rows} rows, k={args.k}, {args.max_tokens} tokens each, greedy code prompts")
    print("speculative rows  tokens/s  runs                     vs all plain")
    for n, v in rates.items():
        runs = ", ".join(f"{x:.2f}" for x in v)
        print(f"{n:<17} {statistics.median(v):8.2f}  {runs:<24} {statistics.median(v) / base:.2f}")


if __name__ == "__main__":
    main()
