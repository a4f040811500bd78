"""On a GPU: tokens/s at one row, plain, the draft at each k and auto (the policy, after its
start-up calibration), for each step mode, through the engine the service runs (assembled
from an EngineSpec in this process), with the steps' own times (c, v) and a greedy check
that every speculative output equals the plain one.

    python3 scripts/gpu_decode.py TARGET DRAFT [--steps eager captured] [--k 2 3 4 5 6]

TARGET and DRAFT are checkpoint directories: scripts/gpu_random_pair.py's planted pair
(acceptance set to the real pair's) for speed, its random pair for the bf16 identity check
(small margins, where rounding shows).
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdec.engine.assemble import LocalBackend, assemble
from specdec.engine.spec import DraftGroupSpec, EngineSpec, ModelGroupSpec, RuntimeSpec
from specdec.model.step.sampling import SamplingParams
from specdec.pack.tokenizer import prompt_ids
from specdec.spec_decode.speculation import Speculation
from specdec_bench.prompts import PROMPT_SETS


def _run(built, rid: str, ids: list[int], params: SamplingParams, wanted: Speculation):
    engine = built.engine
    engine.history.clear()  # (a bounded deque: this request's steps are all it holds after)
    t = time.perf_counter()
    _, decision = built.submit(rid, ids, params, wanted)
    final = None
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                final = out
    seconds = time.perf_counter() - t
    steps = list(engine.history)
    return final, seconds, decision, steps


def _step_ms(steps, pick) -> float | None:
    xs = [pick(s) for s in steps if s.prefill_tokens == 0 and pick(s) is not None]
    return round(1000 * statistics.median(xs), 2) if xs else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", nargs="+", default=["eager", "captured"])
    ap.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5, 6])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--no-auto", action="store_true")
    args = ap.parse_args()
    from specdec.pack.tokenizer import load_tokenizer

    tok = load_tokenizer(args.target)
    chat, texts = PROMPT_SETS["code"]
    prompts = [prompt_ids(tok, p, chat) for p in texts[: args.prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    configs = [("plain", Speculation(mode="off"))] + \
        [(f"k={k}", Speculation(mode="on", method="draft", k=k)) for k in args.k] + \
        ([] if args.no_auto else [("auto", Speculation())])
    print(f"{'step':9} {'config':7} {'tokens/s':>9} {'tok/round':>9} {'step ms':>8} "
          f"{'draft ms':>8} {'verify ms':>9} {'same as plain':>13}  decision")
    for step in args.steps:
        spec = EngineSpec(
            target=ModelGroupSpec(model=args.target, dtype=args.dtype, step=step),
            draft=DraftGroupSpec(model=args.draft, dtype=args.dtype, sampling="greedy",
                                   vocab_limit=32768, resources={"num_cpus": 0}, step=step),
            runtime=RuntimeSpec(max_slots=4, max_len=1024), warmup=True)
        t = time.perf_counter()
        built = assemble(spec, LocalBackend(args.device))
        print(f"# step {step}: assembled, warmed up and calibrated in "
              f"{time.perf_counter() - t:.1f} s", flush=True)
        plain_tokens: dict[int, list[int]] = {}
        for label, wanted in configs:
            rates, per_round, recs, same = [], [], [], []
            decision = None
            for i, ids in enumerate(prompts):
                out, seconds, decision, steps = _run(built, f"{step}-{label}-{i}", ids,
                                                     params, wanted)
                rates.append(len(out.token_ids) / seconds)
                if out.spec.rounds:
                    per_round.append(len(out.token_ids) / out.spec.rounds)
                recs += steps
                if label == "plain":
                    plain_tokens[i] = out.token_ids
                else:
                    same.append(out.token_ids == plain_tokens[i])
            rate = statistics.median(rates)
            tpr = f"{statistics.median(per_round):.2f}" if per_round else "-"
            step_ms = _step_ms(recs, lambda s: s.step_s)
            draft_ms = _step_ms(recs, lambda s: s.draft_s if s.draft_rows else None)
            verify_ms = _step_ms(recs, lambda s: s.verify_s)
            print(f"{step:9} {label:7} {rate:9.1f} {tpr:>9} {step_ms!s:>8} {draft_ms!s:>8} "
                  f"{verify_ms!s:>9} {('-' if not same else f'{sum(same)}/{len(same)}'):>13}"
                  f"  {decision.mode} k={decision.k}: {decision.reason}", flush=True)
        built.close()
        del built
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
