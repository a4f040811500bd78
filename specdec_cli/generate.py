"""`specdec generate`: one prompt through the engine, as text or a JSON record.

The engine is assembled by specdec.engine.assemble from an EngineSpec: built from the flags, or
read from an application config (`--config serve_config.yaml`: the engine the service
runs). It runs in this process, or with `--tp N` / `--ray` as Ray actor groups.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from specdec.engine.assemble import LocalBackend, assemble
from specdec.engine.request import Request
from specdec.engine.spec import DraftGroupSpec, EngineSpec, ModelGroupSpec, RuntimeSpec
from specdec.model.step.sampling import SamplingParams
from specdec.pack.tokenizer import prompt_ids


def spec_from_args(args) -> EngineSpec:
    if args.config:
        return EngineSpec.from_config_file(args.config, args.app)
    if not args.target:
        raise ValueError("give --target MODEL (or --config serve_config.yaml)")
    cores = os.cpu_count() or 1
    tp = max(args.tp, 1)
    overlap = getattr(args, "overlap", "off")
    draft = None
    target_cores = cores
    if args.draft:
        if overlap != "off":
            # Draft and target compute at the same time: each gets cores of its own.
            draft_cores = args.draft_threads or max(1, cores // 2)
            target_cores = max(1, cores - draft_cores)
            per_rank = max(1, draft_cores // args.draft_tp)
            resources = {"num_cpus": draft_cores / args.draft_tp}
        else:
            # Sequential: the draft borrows the target's cores while the target waits.
            per_rank = args.draft_threads or max(1, cores // args.draft_tp)
            resources = {"num_cpus": 0} if args.draft_tp == 1 else {"num_cpus": per_rank}
        draft = DraftGroupSpec(model=args.draft, tp=args.draft_tp, dtype=args.dtype,
                                 sampling=args.draft_sampling,
                                 vocab_limit=args.draft_vocab_limit,
                                 threads=per_rank, resources=resources)
    target = ModelGroupSpec(model=args.target, tp=tp, dtype=args.dtype,
                              threads=getattr(args, "target_threads", None)
                              or max(1, target_cores // tp),
                              resources={"num_cpus": max(target_cores / tp,
                                                         1 if overlap == "off" else 0.5)})
    return EngineSpec(target=target, draft=draft, warmup=False, overlap=overlap,
                      runtime=RuntimeSpec(max_slots=1, max_len=args.max_len,
                                            gloo_socket_ifname="lo"))


@contextlib.contextmanager
def open_engine(spec: EngineSpec, ray_groups: bool, device: str = "cpu"):
    """The assembled engine: in this process, or its groups as actors in a private Ray."""
    if not ray_groups:
        with assemble(spec, LocalBackend(device)) as built:
            yield built
        return
    # The Ray path lives in deployments/ (specdec itself never imports ray).
    from deployments.actors.placement import bundles_for
    from deployments.launch import local_ray, ray_engine

    bundles, _, _ = bundles_for(spec)
    cpus = sum(b.get("CPU", 0) for b in bundles)
    with local_ray(num_cpus=max(2, int(cpus + 0.999))), ray_engine(spec) as built:
        yield built


def run_generate(args) -> int:
    spec = spec_from_args(args)
    method = args.method or ("draft" if spec.draft is not None else "none")
    if method == "draft" and spec.draft is None:
        raise ValueError("--method draft needs --draft MODEL")
    k = args.k if method != "none" else 0
    if method != "none" and k < 1:
        raise ValueError("--k must be >= 1 for speculative methods")
    t0 = time.perf_counter()
    with open_engine(spec, ray_groups=args.tp > 0 or args.ray) as built:
        return _generate(args, spec, method, k, built, time.perf_counter() - t0)


def _generate(args, spec, method, k, built, load_s) -> int:
    tok = built.tokenizer
    ids = prompt_ids(tok, args.prompt, args.chat)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)

    def stream(out):
        if not args.json:
            print(out.new_text, end="", flush=True)

    t0 = time.perf_counter()
    out = built.engine.run([Request.pinned("cli", ids, params, method, k, on_output=stream)])["cli"]
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({
            "target": spec.target.model, "draft": spec.draft.model if spec.draft else None,
            "method": method, "k": k, "tp": spec.target.tp,
            "draft_tp": spec.draft.tp if spec.draft else None,
            "dtype": spec.target.dtype, "prompt_tokens": len(ids),
            "completion_tokens": len(out.token_ids), "finish_reason": out.finish_reason,
            "text": out.text, "token_ids": out.token_ids, "load_s": round(load_s, 3),
            "elapsed_s": round(elapsed, 4),
            "tokens_per_s": round(len(out.token_ids) / elapsed, 2) if elapsed else None,
            "spec_decode": out.spec.as_dict(),
        }))
    else:
        print()
    return 0
