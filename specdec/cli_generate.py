"""`specdec generate`: one prompt through the engine, as text or a JSON record."""

from __future__ import annotations

import json
import time

from specdec.build import LocalEngineSpec, build_local_engine
from specdec.request import Request
from specdec.sampling import SamplingParams


def run_generate(args) -> int:
    method = args.method or ("draft" if args.draft else "none")
    if method == "draft" and not args.draft:
        raise ValueError("--method draft needs --draft MODEL")
    k = args.k if method != "none" else 0
    if method != "none" and k < 1:
        raise ValueError("--k must be >= 1 for speculative methods")
    if args.tp > 0:
        # The Ray path lives in deployments/ (specdec itself never imports ray).
        from deployments.launch import generate_with_ray

        return generate_with_ray(args, method, k, lambda engine, tok, load_s: _generate(
            args, method, k, engine, tok, load_s))
    t0 = time.perf_counter()
    engine, tok = build_local_engine(LocalEngineSpec(
        target=args.target, draft=args.draft if method == "draft" else None, dtype=args.dtype,
        max_slots=1, max_len=args.max_len))
    return _generate(args, method, k, engine, tok, time.perf_counter() - t0)


def _generate(args, method, k, engine, tok, load_s) -> int:
    if args.chat:
        prompt_ids = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True,
            return_dict=False)
    else:
        prompt_ids = tok(args.prompt).input_ids
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)

    def stream(out):
        if not args.json:
            print(out.new_text, end="", flush=True)

    t0 = time.perf_counter()
    out = engine.run([Request("cli", prompt_ids, params, method, k, stream)])["cli"]
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({
            "target": args.target, "draft": args.draft, "method": method, "k": k,
            "tp": args.tp, "draft_tp": args.draft_tp if args.draft else None,
            "dtype": args.dtype, "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(out.token_ids), "finish_reason": out.finish_reason,
            "text": out.text, "token_ids": out.token_ids, "load_s": round(load_s, 3),
            "elapsed_s": round(elapsed, 4),
            "tokens_per_s": round(len(out.token_ids) / elapsed, 2) if elapsed else None,
            "spec_decode": out.spec.as_dict(),
        }))
    else:
        print()
    return 0
