"""`specdec bench decode`: speculative vs plain decoding, ours and transformers', one run.

Rows per prompt set: HF plain generate, HF assisted generation (the draft as
assistant_model, num_assistant_tokens=4, constant schedule), our plain, our draft-model
speculation at each k, the same with the draft's confidence stop (k as a cap) at each
threshold, our n-gram speculation. Tokens/s is the median over the set's
prompts; speedups are against our plain and HF plain measured in the same run. With
--batch N our methods run N requests at once (N copies of each prompt); HF rows stay batch 1.
"""

from __future__ import annotations

import gc
import time

import torch

from specdec.engine.assemble import LocalBackend, assemble
from specdec.engine.request import Request
from specdec.engine.spec import DraftGroupSpec, EngineSpec, ModelGroupSpec, RuntimeSpec
from specdec.model.step.generate import dtype_from_name
from specdec.model.step.sampling import SamplingParams
from specdec.pack import hub
from specdec.pack.tokenizer import prompt_ids
from specdec.progress import Progress
from specdec_bench.prompts import PROMPT_SETS
from specdec_bench.table import median, print_table, write_json


def hf_dtype_name(args) -> str:
    """transformers has no "auto" of ours (packed fp16 weights on CPUs without bf16): it runs
    in bf16 on a GPU and in fp32 on a CPU, its faster CPU dtype on machines without native
    bf16 (specdec_bench/RESULTS.md, "Against transformers")."""
    if args.dtype != "auto":
        return args.dtype
    return "bfloat16" if args.device != "cpu" else "float32"


def _hf_rows(args, sets, progress) -> list[dict]:
    dtype = dtype_from_name(hf_dtype_name(args))
    target = hub.transformers_model(hub.resolve(args.target), dtype).to(args.device)
    draft = hub.transformers_model(hub.resolve(args.draft), dtype).to(args.device)
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    rows = []
    for name, prompts in sets.items():
        for method, extra in (("hf_plain", {}), ("hf_assisted", {"assistant_model": draft})):
            # Warm-up per method: on CUDA the first calls pay for context set-up and kernel
            # selection, which would otherwise land in the first measured prompt.
            x = torch.tensor([prompts[0]], device=args.device)
            target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                            max_new_tokens=8, **extra)
            rates = []
            for ids in prompts:
                x = torch.tensor([ids], device=args.device)
                t = time.perf_counter()
                out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=args.max_tokens, **extra)
                if x.device.type == "cuda":
                    torch.cuda.synchronize()
                rates.append((out.shape[1] - x.shape[1]) / (time.perf_counter() - t))
                progress.advance()
            rows.append({"method": method, "k": 4 if extra else 0, "prompt_set": name,
                         "batch": 1, "tokens_per_s": median(rates),
                         "mean_acceptance_length": None})
    del target, draft
    gc.collect()
    return rows


def _our_rows(args, sets, progress) -> list[dict]:
    spec = EngineSpec(
        target=ModelGroupSpec(model=args.target, dtype=args.dtype, step=args.step),
        draft=DraftGroupSpec(model=args.draft, dtype=args.dtype, sampling="greedy",
                               vocab_limit=args.draft_vocab_limit, resources={"num_cpus": 0},
                               step=args.step),
        runtime=RuntimeSpec(max_slots=max(args.batch, 1), max_len=2048), warmup=False)
    engine = assemble(spec, LocalBackend(args.device)).engine
    configs = [("plain", "none", 0, None)] + [("draft", "draft", k, None) for k in args.k] + \
        [("draft_conf", "draft", args.confidence_k, t) for t in args.draft_confidence] + \
        [("ngram", "ngram", args.ngram_k, None)]
    draft = engine.proposers.get("draft")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    # Warm-up of every configuration at the measured batch size: first calls pay for
    # allocations and kernel selection (on CUDA, per new shape), which would otherwise land
    # in the first measured prompt of each row.
    first = sets[next(iter(sets))][0]
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for _, method, k, _ in configs:
        engine.run([Request.pinned(f"warm-{method}-{k}-{b}", first, short, method, k)
                    for b in range(max(args.batch, 1))])
    rows = []
    for name, prompts in sets.items():
        for label, method, k, threshold in configs:
            if draft is not None:  # the early stop is the draft's own setting
                draft.confidence_threshold = threshold
            rates, mal = [], []
            for i, ids in enumerate(prompts):
                reqs = [Request.pinned(f"{name}-{i}-{b}", ids, params, method, k)
                        for b in range(args.batch)]
                before = engine.totals[method].rounds, engine.totals[method].accepted
                t = time.perf_counter()
                outs = engine.run(reqs)
                n = sum(len(o.token_ids) for o in outs.values())
                rates.append(n / (time.perf_counter() - t))
                rounds = engine.totals[method].rounds - before[0]
                if method != "none" and rounds:
                    mal.append(1 + (engine.totals[method].accepted - before[1]) / rounds)
                progress.advance()
            rows.append({"method": label, "k": k, "confidence": threshold,
                         "prompt_set": name, "batch": args.batch, "tokens_per_s": median(rates),
                         "mean_acceptance_length": median(mal) if mal else None})
    return rows


def measure_costs(args) -> dict:
    """c (draft step / target step) and v (verify of k+1 tokens / plain step), batch 1."""
    from specdec.model.step.batch import BatchInput
    from specdec.model.step.decoder import Decoder
    from specdec.model.step.step_mode import with_step

    dtype = dtype_from_name(args.dtype)
    out = {}
    for role, ref in (("target", args.target), ("draft", args.draft)):
        m = Decoder.from_checkpoint(hub.resolve(ref), dtype, args.device)
        if role == "draft" and args.draft_vocab_limit:
            m = m.limit_vocab(args.draft_vocab_limit)
        m = with_step(m, args.step)
        cache = m.new_cache(1, 512)
        m(BatchInput.build([(0, 0, list(range(100, 300)))], m.device), cache)
        times = {}
        for n in (1, 5):
            ts = []
            for i in range(6):  # the first (a compile or a capture, once) is not timed
                t = time.perf_counter()
                m(BatchInput.build([(0, 200, list(range(300, 300 + n)))], m.device), cache,
                  torch.arange(n, device=m.device))
                if m.device.type == "cuda":
                    torch.cuda.synchronize()
                if i:
                    ts.append(time.perf_counter() - t)
            times[n] = median(ts)
        out[role] = times
        del m
        gc.collect()
    return {"c": out["draft"][1] / out["target"][1], "v_k4": out["target"][5] / out["target"][1],
            "target_step_ms": 1000 * out["target"][1], "draft_step_ms": 1000 * out["draft"][1]}


def main(args) -> int:
    from specdec.pack.tokenizer import load_tokenizer

    tok = load_tokenizer(hub.resolve(args.target))
    sets = {name: [prompt_ids(tok, p, chat) for p in prompts[: args.prompts_per_set]]
            for name, (chat, prompts) in PROMPT_SETS.items() if name in args.sets}
    n_prompts = sum(len(v) for v in sets.values())
    runs = n_prompts * (len(args.k) + len(args.draft_confidence) + 2) + \
        (0 if args.no_hf else 2 * n_prompts)
    progress = Progress("bench decode", total=runs, unit=" runs")
    rows = [] if args.no_hf else _hf_rows(args, sets, progress)
    rows += _our_rows(args, sets, progress)
    progress.close()
    for name in sets:
        base = {r["method"]: r["tokens_per_s"] for r in rows if r["prompt_set"] == name}
        for r in rows:
            if r["prompt_set"] == name:
                r["speedup_vs_our_plain"] = r["tokens_per_s"] / base["plain"]
                if "hf_plain" in base:
                    r["speedup_vs_hf_plain"] = r["tokens_per_s"] / base["hf_plain"]
                if "hf_assisted" in base:
                    r["speedup_vs_hf_assisted"] = r["tokens_per_s"] / base["hf_assisted"]
    cols = ["prompt_set", "method", "k", "confidence", "batch", "tokens_per_s", "mean_acceptance_length",
            "speedup_vs_our_plain", "speedup_vs_hf_plain", "speedup_vs_hf_assisted"]
    hf = "" if args.no_hf else f" (transformers {hf_dtype_name(args)})"
    print_table(rows, cols, title=f"{args.target} + {args.draft}, {args.dtype}, step "
                                  f"{args.step}{hf}, "
                                  f"{args.max_tokens} new tokens, greedy, medians")
    if args.costs:
        costs = measure_costs(args)
        print_table([costs], list(costs), title="cost ratios (batch 1, context 200)")
    write_json(args.json, rows)
    return 0
