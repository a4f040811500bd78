"""`specdec bench serve`: a concurrency sweep against the running service, over HTTP.

For each sampling temperature (greedy and sampled), each concurrency level and each policy
(always plain, always speculative at a static k, the policy's auto; back to back at each
level, so they see the same machine), N clients send streamed chat requests from mixed
prompt sets and output lengths. With --repeats R each level runs its policies R times, in
an order rotated by one each time (no policy always goes first, after another's warm
batch), and a level reports the median run per policy with the spread of its runs, so a
reader can tell a few percent from the machine's noise. Reported per level: output
tokens/s, TTFT and inter-token latency p50/p90, what the policy chose, and the speedup over
plain the cost model predicted (median of the requests' expected_speedup) next to the one
measured; as a table, JSON and a PNG plot. Also the HTTP + Serve overhead per request,
measured as the latency of a 1-token request against the engine's own time.

With --peer, llama.cpp's llama-server runs beside the service on the GGUF file of the
config's target, with --peer-slots parallel slots (its continuous batching, `-np 8` by
default), and each level also sends the same requests to it (policy "llama.cpp"), so the
sweep compares both servers at every concurrency in one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import time

import httpx

from specdec.progress import Progress
from specdec_bench.prompts import PROMPT_SETS
from specdec_bench.table import median, percentile, print_table, write_json

PEER = "llama.cpp"

POLICIES = {
    "plain": lambda k: {"mode": "off"},
    "speculative": lambda k: {"mode": "on", "method": "draft", "k": k},
    "auto": lambda k: {"mode": "auto"},
    PEER: lambda k: None,  # llama-server: its own decoding, no extension field
}


def _workload(n: int, lengths: list[int]) -> list[tuple[str, int]]:
    prompts = [p for _, (_, ps) in PROMPT_SETS.items() for p in ps]
    pairs = itertools.cycle(itertools.product(prompts, lengths))
    return [next(pairs) for _ in range(n)]


async def _one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
               spec: dict, temperature: float, seed: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if spec is not None:
        body["speculative"] = spec
    if temperature:
        body["seed"] = seed
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    decision = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                decision = chunk.get("spec_decode") or {}
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first or now
                last = now
    total = time.perf_counter() - t0
    ttft = (first or t0) - t0
    itl = ((last - first) / (tokens - 1)) if first and last and tokens > 1 else None
    return {"tokens": tokens, "ttft": ttft, "itl": itl, "latency": total,
            "mode": decision.get("mode"), "method": decision.get("method"),
            "k": decision.get("k"), "k_last": decision.get("k_last_round"),
            "rounds": decision.get("rounds") or 0,
            "expected_speedup": decision.get("expected_speedup")}


async def _level(base: str, model: str, policy: str, k: int, clients: int,
                 per_client: int, lengths: list[int], progress: Progress,
                 temperature: float) -> dict:
    work = _workload(clients * per_client, lengths)
    results: list[dict] = []

    async def client_loop(i: int) -> None:
        # A fresh connection per request: llama-server closes kept-alive connections on
        # its own schedule, and a request sent as one closes fails; both servers alike.
        async with httpx.AsyncClient(base_url=base, timeout=1800,
                                     limits=httpx.Limits(max_keepalive_connections=0)) as c:
            for j in range(per_client):
                prompt, n = work[i * per_client + j]
                results.append(await _one(c, model, prompt, n, POLICIES[policy](k),
                                          temperature, 1000 * i + j))
                progress.advance()

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(i) for i in range(clients)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    if not ok:
        raise RuntimeError(f"{policy} at {clients} clients: every request failed "
                           f"({results[0] if results else 'none sent'})")
    itls = [r["itl"] for r in ok if r["itl"] is not None]
    spec = [r for r in ok if r["mode"] == "speculative"]
    predicted = [r["expected_speedup"] for r in ok if r.get("expected_speedup")]
    return {"policy": policy, "temperature": temperature, "clients": clients,
            "requests": len(results),
            "predicted_speedup": median(predicted) if predicted else None,
            "errors": len(results) - len(ok),
            "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_p50_s": median([r["ttft"] for r in ok]),
            "ttft_p90_s": percentile([r["ttft"] for r in ok], 90),
            "itl_p50_ms": 1000 * median(itls), "itl_p90_ms": 1000 * percentile(itls, 90),
            # What the policy chose at admission: share of requests speculated, and their k.
            "speculative_share": len(spec) / len(ok) if ok else 0.0,
            # What ran: share of requests with a speculative round (a request admitted
            # plain on standby speculates once its batch does; one admitted speculative
            # can go plain).
            "speculated_share": sum(r["rounds"] > 0 for r in ok) / len(ok) if ok else 0.0,
            "ngram_share": sum(r["method"] == "ngram" for r in spec) / len(ok) if ok else 0.0,
            "k_mean": sum(r["k"] for r in spec) / len(spec) if spec else 0.0}


async def http_overhead(base: str, model: str, n: int = 20) -> dict:
    """1-token plain requests: end-to-end HTTP latency against the time the same request
    spent inside the engine replica (reported by the service as spec_decode.engine_s)."""
    lat, inside = [], []
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        for _ in range(n):
            t = time.perf_counter()
            r = await c.post("/v1/completions", json={"model": model, "prompt": "Hi",
                                                      "max_tokens": 1,
                                                      "speculative": {"mode": "off"}})
            r.raise_for_status()
            lat.append(time.perf_counter() - t)
            inside.append(r.json()["spec_decode"]["engine_s"])
    over = [a - b for a, b in zip(lat, inside, strict=True)]
    return {"http_latency_p50_ms": 1000 * median(lat), "engine_p50_ms": 1000 * median(inside),
            "http_plus_serve_overhead_p50_ms": 1000 * median(over),
            "overhead_p90_ms": 1000 * percentile(over, 90)}


def _rotated(policies: list[str], r: int) -> list[str]:
    i = r % len(policies)
    return policies[i:] + policies[:i]


def _median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (the lower middle one for an even count), with
    the throughput replaced by the median and the spread of all runs as (max - min) /
    median: a level whose policies differ by less than their spread is a tie."""
    runs = sorted(runs, key=lambda x: x["output_tokens_per_s"])
    row = dict(runs[(len(runs) - 1) // 2])
    row.pop("repeat", None)
    tps = [x["output_tokens_per_s"] for x in runs]
    row["output_tokens_per_s"] = median(tps)
    row["runs"] = len(runs)
    row["errors"] = sum(x["errors"] for x in runs)
    row["spread"] = (tps[-1] - tps[0]) / row["output_tokens_per_s"] if len(tps) > 1 else 0.0
    return row


def _plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for temperature in sorted({r["temperature"] for r in rows}):
        for policy in POLICIES:
            rs = [r for r in rows if r["policy"] == policy and r["temperature"] == temperature]
            if not rs:
                continue
            x = [r["clients"] for r in rs]
            label = f"{policy}, T={temperature:g}"
            style = "-" if temperature == 0 else "--"
            axes[0].plot(x, [r["output_tokens_per_s"] for r in rs], style, marker="o",
                         label=label)
            axes[1].plot(x, [r["ttft_p50_s"] for r in rs], style, marker="o", label=label)
            axes[2].plot(x, [r["itl_p50_ms"] for r in rs], style, marker="o", label=label)
    for ax, title in zip(axes, ("output tokens/s", "TTFT p50 (s)", "inter-token p50 (ms)"),
                         strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


@contextlib.contextmanager
def _peer(args):
    """llama-server on the target's GGUF file, with args.peer_slots slots (or nothing)."""
    if not args.peer:
        yield None
        return
    from specdec.engine.spec import EngineSpec
    from specdec.model.checkpoint.gguf_file import gguf_in
    from specdec.pack import hub
    from specdec_bench.llama_peer import LlamaServer

    target = gguf_in(hub.resolve(EngineSpec.from_config_file(args.config).target.model))
    if target is None:
        raise SystemExit(f"--peer: the target of {args.config} has no GGUF file")
    threads = args.peer_threads or os.cpu_count() or 2
    with LlamaServer(target, [], threads, slots=args.peer_slots) as server:
        print(f"llama.cpp: {' '.join(server.cmd)}")
        yield server.url


def _add_ratios(rows: list[dict]) -> None:
    """Each row against the others of its level: the better static policy, plain, and
    llama.cpp."""
    for key in {(r["temperature"], r["clients"]) for r in rows}:
        at = {r["policy"]: r for r in rows if (r["temperature"], r["clients"]) == key}
        best_static = max((at[p]["output_tokens_per_s"] for p in ("plain", "speculative")
                           if p in at), default=None)
        for r in at.values():
            if best_static:
                r["vs_best_static"] = r["output_tokens_per_s"] / best_static
            if "plain" in at and at["plain"]["output_tokens_per_s"]:
                r["measured_speedup"] = (r["output_tokens_per_s"]
                                         / at["plain"]["output_tokens_per_s"])
            if PEER in at and at[PEER]["output_tokens_per_s"]:
                r["vs_llama_cpp"] = r["output_tokens_per_s"] / at[PEER]["output_tokens_per_s"]


def main(args) -> int:
    levels = args.clients
    repeats = max(1, args.repeats)
    total = repeats * len(args.temperatures) * len(args.policies) * sum(
        c * args.requests_per_client for c in levels)
    policies = list(args.policies) + ([PEER] if args.peer else [])
    total = total * len(policies) // len(args.policies)
    progress = Progress("bench serve", total=total, unit=" requests")
    runs: list[dict] = []

    async def sweep(peer_url):
        # Level-major: the policies at one level run back to back, under the same machine
        # conditions, so their ratio is fair even when the machine drifts over the sweep.
        for temperature in args.temperatures:
            for c in levels:
                for r in range(repeats):
                    for policy in _rotated(policies, r):
                        base = peer_url if policy == PEER else args.url
                        run = await _level(base, args.model, policy, args.k, c,
                                           args.requests_per_client, args.max_tokens,
                                           progress, temperature)
                        runs.append(run | {"repeat": r})
        return await http_overhead(args.url, args.model)

    with _peer(args) as peer_url:
        overhead = asyncio.run(sweep(peer_url))
    progress.close()
    rows = [_median_run([x for x in runs if x["temperature"] == t and x["clients"] == c
                         and x["policy"] == p])
            for t in args.temperatures for c in levels for p in policies]
    _add_ratios(rows)
    print_table(rows, ["temperature", "policy", "clients", "requests", "errors",
                       "output_tokens_per_s", "vs_best_static", "predicted_speedup",
                       "measured_speedup", "vs_llama_cpp", "spread", "ttft_p50_s",
                       "ttft_p90_s", "itl_p50_ms", "itl_p90_ms", "speculative_share",
                       "speculated_share", "ngram_share", "k_mean"],
                title=f"{args.url} {args.model}: concurrency sweep")
    totals = [{"temperature": t, "policy": p,
               "sum_over_levels_tokens_per_s": sum(
                   r["output_tokens_per_s"] for r in rows
                   if r["policy"] == p and r["temperature"] == t)}
              for t in args.temperatures for p in policies]
    print_table(totals, ["temperature", "policy", "sum_over_levels_tokens_per_s"],
                title="whole sweep")
    print_table([overhead], list(overhead), title="HTTP + Serve overhead per request")
    write_json(args.json, rows + [{"runs": runs}, {"overhead": overhead}])
    if args.plot:
        _plot(rows, args.plot)
    return 0
