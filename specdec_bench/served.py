"""`specdec bench served`: one client, the same greedy prompts, every system in one run.

In this order: llama.cpp's llama-server on the very GGUF files of the config's models
(plain, its draft-model speculation at its defaults and tuned, its n-gram modes; when
`make peer` has built it), transformers' plain `generate` and assisted generation (the
draft as assistant_model, at k = 4 fixed and at its default schedule; in each dtype asked
for, so the peer is shown at its defaults and at its best); our engine in this process (plain, each
static k, the policy's auto), assembled from the application config; then the application
itself served over HTTP from the same config (speculation off, on at each k, auto).

Each row is the median tokens/s over prompts x repeats, with the quartiles so a reader can
tell a 5% difference from noise. The served rows also report the per-step timeline the
engine replica measured (where a step's time goes, per actor) and the bytes that crossed
between the actors per step, and the HTTP + Serve overhead per request.

--paired measures the in-process and served rows alternately, request by request, with
both engines loaded: on a shared machine whose speed drifts over minutes, back-to-back
blocks can differ by 15-20% for the same engine, which would swamp their ratio.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import json
import os
import time

import httpx
import torch

from deployments.launch import local_ray
from specdec.engine.assemble import LocalBackend, assemble
from specdec.engine.spec import EngineSpec
from specdec.engine.timeline import timeline_summary
from specdec.model.step.sampling import SamplingParams
from specdec.pack import hub
from specdec.pack.tokenizer import load_tokenizer, prompt_ids
from specdec.ports import free_port
from specdec.progress import Progress
from specdec.spec_decode.speculation import Speculation
from specdec_bench.prompts import PROMPT_SETS
from specdec_bench.serve import http_overhead
from specdec_bench.served_report import cost_shape, memory_rows, ratios
from specdec_bench.table import median, percentile, print_table, write_json


def _prompts(sets: list[str], per_set: int) -> list[tuple[str, bool]]:
    return [(p, chat) for name in sets for p in PROMPT_SETS[name][1][:per_set]
            for chat in [PROMPT_SETS[name][0]]]


def _row(system: str, config: str, rates: list[float], **extra) -> dict:
    return {"system": system, "config": config, "runs": len(rates),
            "tokens_per_s": median(rates), "q1": percentile(rates, 25),
            "q3": percentile(rates, 75), **extra}


# ---- transformers ------------------------------------------------------------------------

def _hf_rows(args, spec, prompts, progress) -> list[dict]:

    rows = []
    for dtype_name in args.hf_dtypes:
        dtype = getattr(torch, dtype_name)
        target = hub.transformers_model(hub.resolve(spec.target.model), dtype)
        draft = hub.transformers_model(hub.resolve(spec.draft.model), dtype)
        tok = load_tokenizer(hub.resolve(spec.target.model))
        defaults = {k: getattr(draft.generation_config, k) for k in (
            "num_assistant_tokens", "num_assistant_tokens_schedule",
            "assistant_confidence_threshold")}
        fixed4 = {"num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant",
                  "assistant_confidence_threshold": 0.0}
        for config, extra, settings in (
                ("plain", {}, None),
                ("assisted k=4", {"assistant_model": draft}, fixed4),
                (f"assisted default ({defaults['num_assistant_tokens']}, "
                 f"{defaults['num_assistant_tokens_schedule']})",
                 {"assistant_model": draft}, defaults)):
            rates = []
            warm = torch.tensor([prompt_ids(tok, *prompts[0])])
            target.generate(warm, attention_mask=torch.ones_like(warm), do_sample=False,
                            max_new_tokens=8, **extra)  # first calls pay for allocations
            for _ in range(args.repeats):
                for text, chat in prompts:
                    if settings:  # the schedule adapts during a call: reset it every call
                        for key, value in settings.items():
                            setattr(draft.generation_config, key, value)
                    x = torch.tensor([prompt_ids(tok, text, chat)])
                    t = time.perf_counter()
                    out = target.generate(x, attention_mask=torch.ones_like(x),
                                          do_sample=False, max_new_tokens=args.max_tokens,
                                          min_new_tokens=args.max_tokens, **extra)
                    rates.append((out.shape[1] - x.shape[1]) / (time.perf_counter() - t))
                    progress.advance()
            rows.append(_row("transformers", config, rates, dtype=dtype_name))
        del target, draft
        gc.collect()
    return rows


def _peer_rows(args, spec, prompts, progress) -> list[dict]:
    from specdec.model.checkpoint.gguf_file import gguf_in
    from specdec_bench.llama_peer import llama_bin, peer_rows

    target = gguf_in(hub.resolve(spec.target.model))
    draft = gguf_in(hub.resolve(spec.draft.model)) if spec.draft else None
    if args.no_peer or llama_bin() is None or target is None:
        why = "--no-peer" if args.no_peer else "not built (make peer)" if target else \
            "the target is not a GGUF"
        print(f"llama.cpp rows skipped: {why}", flush=True)
        return []
    tok = load_tokenizer(hub.resolve(spec.target.model))
    ids = [prompt_ids(tok, text, chat) for text, chat in prompts]
    return peer_rows(target, draft, ids, args.max_tokens, args.repeats,
                     spec.target.threads or os.cpu_count() or 2, progress)


# ---- our engine, in this process ---------------------------------------------------------

def _modes(ks: list[int]) -> list[tuple[str, Speculation]]:
    return [("plain", Speculation(mode="off"))] + \
        [(f"speculative k={k}", Speculation(mode="on", method="draft", k=k)) for k in ks] + \
        [("auto (policy)", Speculation(mode="auto"))]


@contextlib.contextmanager
def _local_engine(spec):
    """The engine assembled in this process; closed, freed and this process's threads
    restored afterwards (assemble sets them for its spec)."""
    threads = torch.get_num_threads()
    built = assemble(spec, LocalBackend())
    try:
        yield built
    finally:
        built.close()
        del built
        gc.collect()
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _serve_instance():
    """Serve on a free port in a private local Ray (Serve's upkeep as `make serve` runs it);
    yields the base URL."""
    from ray import serve

    port = free_port()
    with local_ray(num_cpus=os.cpu_count() or 2, quiet_serve=True):
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()


def _local_rows(args, spec, prompts, progress, modes=None, label="") -> list[dict]:
    rows = []
    with _local_engine(spec) as built:
        tok = built.tokenizer
        for config, wanted in modes or _modes(args.k):
            rates, mal = [], []
            for _ in range(args.repeats):
                for text, chat in prompts:
                    rate, m = _one_local(built, prompt_ids(tok, text, chat), args.max_tokens, wanted)
                    rates.append(rate)
                    if m:
                        mal.append(m)
                    progress.advance()
            rows.append(_row("ours, in process", config + label, rates, dtype=spec.target.dtype,
                             mean_acceptance_length=median(mal) if mal else None,
                             timeline=timeline_summary(list(built.engine.history))))
    return rows


def _one_local(built, ids: list[int], max_tokens: int, wanted: Speculation
               ) -> tuple[float, float | None]:
    """One greedy request through the in-process engine: (tokens/s, mean acceptance)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    built.engine.history.clear()
    t = time.perf_counter()
    built.submit("bench", ids, params, wanted)
    final = _drain(built.engine, "bench")
    return (len(final.token_ids) / (time.perf_counter() - t),
            final.spec.mean_acceptance_length or None)


def _drain(engine, rid: str):
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


# ---- the served application -------------------------------------------------------------

def _served_rows(args, apps: list[tuple[str, dict, list]], prompts, progress
                 ) -> tuple[list[dict], dict]:
    """Each (label, app args, modes) deployed in turn on one local Ray, then measured."""
    from ray import serve

    from deployments.app import build_app

    rows: list[dict] = []
    overhead: dict = {}
    if not apps:
        return rows, overhead
    with _serve_instance() as url:
        for n, (label, app_args, modes) in enumerate(apps):
            t0 = time.perf_counter()
            serve.run(build_app(app_args), name="specdec", route_prefix="/")
            ready_s = time.perf_counter() - t0
            model = app_args.get("model_name") or app_args["target"]["model"]
            with httpx.Client(base_url=url, timeout=1800) as c:
                for config, wanted in modes:
                    rows.append(_served_row(c, model, args, prompts, progress, wanted,
                                            config + label, app_args))
                if n == 0:
                    overhead = asyncio.run(http_overhead(url, model))
                    overhead["ready_s"] = ready_s
            serve.delete("specdec")
    return rows, overhead


def _paired_rows(args, spec, app_args: dict, prompts, progress
                 ) -> tuple[list[dict], dict]:
    """In-process and served rows measured alternately, request by request: the same
    prompt through the engine in this process, then through the app over HTTP. A machine
    whose speed drifts over minutes (a shared host) then moves both sides alike, so their
    ratio is fair. Both engines are loaded for the whole run; the idle one computes
    nothing (the app's Ray and Serve processes still tick, for both sides alike)."""
    from ray import serve

    from deployments.app import build_app

    model = app_args.get("model_name") or app_args["target"]["model"]
    modes = _modes(args.k)
    local = {c: ([], []) for c, _ in modes}
    served = {c: ([], []) for c, _ in modes}
    with _serve_instance() as url:
        serve.run(build_app(app_args), name="specdec", route_prefix="/")
        with _local_engine(spec) as built, httpx.Client(base_url=url, timeout=1800) as c:
            for _ in range(args.repeats):
                for config, wanted in modes:
                    body = _speculative_field(wanted)
                    for text, chat in prompts:
                        rate, m = _one_local(built, prompt_ids(built.tokenizer, text, chat),
                                             args.max_tokens, wanted)
                        local[config][0].append(rate)
                        local[config][1].extend([m] if m else [])
                        r = _one_http(c, model, text, chat, args.max_tokens, body)
                        served[config][0].append(r["tokens"] / r["latency"])
                        served[config][1].extend([r["mal"]] if r["mal"] else [])
                        progress.advance(2)
            overhead = asyncio.run(http_overhead(url, model))
        serve.delete("specdec")
    dtype = app_args["target"].get("dtype", "auto")
    return [_row(system, config, rates, dtype=dtype, paired=True,
                 mean_acceptance_length=median(mal) if mal else None)
            for system, table in (("ours, in process", local), ("ours, served", served))
            for config, (rates, mal) in table.items()], overhead


def _speculative_field(wanted: Speculation) -> dict:
    """The request's "speculative" extension field for these overrides."""
    return {k: v for k, v in {"mode": wanted.mode, "method": wanted.method,
                              "k": wanted.k}.items() if v is not None}


def _served_row(c, model, args, prompts, progress, wanted, config, app_args) -> dict:
    body_spec = _speculative_field(wanted)
    rates, mal, ttft, over = [], [], [], []
    for _ in range(args.repeats):
        for text, chat in prompts:
            r = _one_http(c, model, text, chat, args.max_tokens, body_spec)
            rates.append(r["tokens"] / r["latency"])
            ttft.append(r["ttft"])
            over.append(r["latency"] - r["engine_s"])
            if r["mal"]:
                mal.append(r["mal"])
            progress.advance()
    engine = c.get("/health").json()["engine"]
    memory = engine.get("memory_mb") or {}
    return _row("ours, served", config, rates, dtype=app_args["target"].get("dtype", "auto"),
                mean_acceptance_length=median(mal) if mal else None,
                ttft_p50_s=median(ttft), overhead_p50_ms=1000 * median(over),
                timeline=engine.get("timeline", {}), memory_mb=memory,
                rss_GB=sum(m["rss_mb"] for m in memory.values()) / 1e3 if memory else None)


def _split(app_args: dict, overlap: str) -> dict:
    """The config with one core each for target and draft (the draft reserves its own), so
    sequential and overlapped speculation compare with the same compute per model."""
    a = copy.deepcopy(app_args)
    a["target"].update(threads=1, resources={**a["target"].get("resources", {}), "num_cpus": 1})
    a["draft"].update(threads=1, resources={**a["draft"].get("resources", {}), "num_cpus": 1})
    a["overlap"] = overlap
    return a


def _split_variants(args, app_args: dict) -> list[tuple[str, dict, list]]:
    if not args.split:
        return []
    modes = [(f"speculative k={k}", Speculation(mode="on", method="draft", k=k))
             for k in args.k]
    return [(", 1+1 cores, sequential", _split(app_args, "off"), modes),
            (", 1+1 cores, overlapped", _split(app_args, "on"), modes)]


def _one_http(c: httpx.Client, model: str, text: str, chat: bool, max_tokens: int,
              spec: dict) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "speculative": spec}
    route = "/v1/chat/completions" if chat else "/v1/completions"
    body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
    t0 = time.perf_counter()
    first, usage, sd = None, {}, {}
    with c.stream("POST", route, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage, sd = chunk["usage"], chunk.get("spec_decode") or {}
            elif first is None and chunk.get("choices"):
                ch = chunk["choices"][0]
                if ch.get("text") or (ch.get("delta") or {}).get("content"):
                    first = time.perf_counter()
    latency = time.perf_counter() - t0
    return {"tokens": usage.get("completion_tokens", 0), "latency": latency,
            "ttft": (first or t0) - t0, "engine_s": sd.get("engine_s") or latency,
            "mal": sd.get("mean_acceptance_length")}


# ---- the run ------------------------------------------------------------------------------

def main(args) -> int:
    import yaml

    doc = yaml.safe_load(open(args.config))
    app_args = doc["applications"][0]["args"]
    spec = EngineSpec.from_config_file(args.config)
    prompts = _prompts(args.sets, args.prompts_per_set)
    variants = _split_variants(args, app_args)
    n_modes = len(args.k) + 2 + sum(len(m) for _, _, m in variants)
    total = len(prompts) * args.repeats * ((0 if args.no_hf else 3 * len(args.hf_dtypes))
                                           + 2 * n_modes + 5)
    progress = Progress("bench served", total=total, unit=" requests")
    rows = _peer_rows(args, spec, prompts, progress)
    rows += [] if args.no_hf else _hf_rows(args, spec, prompts, progress)
    paired_overhead: dict = {}
    if args.paired:
        paired, paired_overhead = _paired_rows(args, spec, app_args, prompts, progress)
        rows += paired
    else:
        rows += _local_rows(args, spec, prompts, progress)
    for label, variant, modes in variants:
        rows += _local_rows(args, EngineSpec.from_app_args(variant),
            prompts, progress, modes, label)
    served, overhead = _served_rows(
        args, ([] if args.paired else [("", app_args, _modes(args.k))]) + variants,
        prompts, progress)
    rows += served
    overhead = paired_overhead or overhead
    progress.close()
    print_table(rows, ["system", "config", "dtype", "runs", "tokens_per_s", "q1", "q3",
                       "mean_acceptance_length", "acceptance", "decode_only_tokens_per_s",
                       "rss_GB", "ttft_p50_s", "overhead_p50_ms"],
                title=f"{args.config}: one client, {args.max_tokens} new tokens, greedy, "
                      f"{len(prompts)} prompts x {args.repeats} repeats (median, quartiles)")
    for note in sorted({r["peer_note"] for r in rows if r.get("peer_note")}):
        print(f"llama.cpp ran with {note}")
    lines = [dict(system=r["system"], config=r["config"], **r["timeline"])
             for r in rows if r.get("timeline")]
    if lines:
        print_table(lines, ["system", "config", "step_ms", "plan_ms", "draft_call_ms",
                            "draft_compute_ms", "target_call_ms", "target_compute_ms", "post_ms",
                            "gap_ms", "resolve_ms", "guesses_per_row", "emitted_per_step",
                            "draft_bytes", "target_bytes"],
                    title="per step (medians over the last steps of each row): where the time "
                          "goes; *_call = seen by the engine, *_compute = inside the actor")
    print_table(cost_shape(rows), ["system", "config", "target_step_ms", "v", "c",
                                   "guesses_per_row", "tokens_per_round"],
                title="cost shape: v = target step / plain step, c = draft forward / plain "
                      "target step, tokens emitted per round")
    print_table(memory_rows(rows), ["system", "process", "rss_GB", "peak_rss_GB"],
                title="memory per process (served: every actor, from /health)")
    print_table([overhead], list(overhead), title="HTTP + Serve overhead per request")
    found = ratios(rows)
    print_table(found, ["ratio", "value", "goal"], title="ratios in this run")
    write_json(args.json, rows + [{"overhead": overhead}, {"ratios": found}])
    return 0
