"""`specdec bench load`: many streaming clients for a while against a running service.

Each client sends streamed requests back to back (mixed prompt sets and output lengths,
greedy and sampled in turn). A 503 is the service saying "full, come back": the client
checks that it carries Retry-After, waits that long and sends the request again (counted
as refused, not failed). Anything else that is not a complete stream is a failure: an error
status, an error event inside the stream, a dropped connection, a stream without [DONE].
While it runs, /health is sampled for the engine's queue and every actor's memory. After
the clients stop, the queue must drain (running and waiting back to 0).

Reported: requests completed, refused (503), failed; TTFT and latency p50/p99; output
tokens/s; peak memory per actor and its growth over the run; time for the queue to drain.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import httpx

from specdec.progress import Progress
from specdec_bench.prompts import PROMPT_SETS
from specdec_bench.table import median, percentile, print_table, write_json


async def _stream(client: httpx.AsyncClient, body: dict) -> dict:
    """One streamed chat request: its outcome, TTFT, latency and tokens."""
    t0 = time.perf_counter()
    first, tokens, done, error = None, 0, False, None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code == 503:
                retry = r.headers.get("retry-after")
                return {"outcome": "refused", "retry_after": retry}
            if r.status_code != 200:
                return {"outcome": "failed", "error": f"HTTP {r.status_code}: "
                                                     f"{(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"].get("message")
                    continue
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif first is None and chunk.get("choices") and \
                        chunk["choices"][0].get("delta", {}).get("content"):
                    first = time.perf_counter()
    except httpx.HTTPError as exc:  # a dropped connection is a failure, never a success
        return {"outcome": "failed", "error": f"{type(exc).__name__}: {exc}"}
    if error or not done:
        return {"outcome": "failed", "error": error or "stream ended without [DONE]"}
    now = time.perf_counter()
    return {"outcome": "ok", "ttft": (first or now) - t0, "latency": now - t0,
            "tokens": tokens}


async def _health(client: httpx.AsyncClient) -> dict:
    try:
        r = await client.get("/health", timeout=10)
        return r.json().get("engine", {}) if r.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


async def _wait_drained(url: str, headers: dict | None, memory: dict[str, list[float]]
                        ) -> float | None:
    """Seconds until running and waiting are back to 0 (None: not within 10 minutes); the
    memory of every actor once drained is sampled too."""
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as c:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 600:
            h = await _health(c)
            if h.get("running") == 0 and h.get("waiting") == 0:
                for actor, m in (h.get("memory_mb") or {}).items():
                    memory.setdefault(actor, []).append(m.get("rss_mb", float("nan")))
                return time.monotonic() - t0
            await asyncio.sleep(1)
    return None


async def run_load(url: str, model: str, clients: int, duration_s: float,
                   lengths: list[int], headers: dict | None = None,
                   progress: Progress | None = None, speculative: dict | None = None) -> dict:
    prompts = [p for _, (_, ps) in PROMPT_SETS.items() for p in ps]
    work = itertools.count()
    results: list[dict] = []
    memory: dict[str, list[float]] = {}
    queue_samples: list[tuple[float, int, int]] = []
    deadline = time.monotonic() + duration_s
    t_start = time.monotonic()

    async def client_loop(i: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=3600, headers=headers) as c:
            while time.monotonic() < deadline:
                n = next(work)
                body = {"model": model, "max_tokens": lengths[n % len(lengths)],
                        "messages": [{"role": "user", "content": prompts[n % len(prompts)]}],
                        "stream": True, "stream_options": {"include_usage": True},
                        "temperature": 0.0 if n % 2 == 0 else 0.7, "seed": n}
                if speculative:
                    body["speculative"] = speculative
                while True:
                    res = await _stream(c, body)
                    results.append(res)
                    if res["outcome"] != "refused":
                        break
                    # Full: wait as told, then send the same request again.
                    await asyncio.sleep(float(res.get("retry_after") or 1))
                    if time.monotonic() >= deadline:
                        break
                if progress:
                    progress.advance()

    async def sampler() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as c:
            while time.monotonic() < deadline:
                h = await _health(c)
                queue_samples.append((time.monotonic() - t_start, h.get("running", -1),
                                      h.get("waiting", -1)))
                for actor, m in (h.get("memory_mb") or {}).items():
                    memory.setdefault(actor, []).append(m.get("rss_mb", float("nan")))
                await asyncio.sleep(5)

    await asyncio.gather(sampler(), *(client_loop(i) for i in range(clients)))
    wall = time.monotonic() - t_start
    drained_s = await _wait_drained(url, headers, memory)  # the clients stopped
    return _report(results, clients, wall, drained_s, queue_samples, memory)


def _report(results: list[dict], clients: int, wall: float, drained_s: float | None,
            queue_samples: list[tuple[float, int, int]], memory: dict[str, list[float]]
            ) -> dict:
    ok = [r for r in results if r["outcome"] == "ok"]
    refused = [r for r in results if r["outcome"] == "refused"]
    failed = [r for r in results if r["outcome"] == "failed"]
    return {
        "clients": clients, "duration_s": round(wall, 1), "completed": len(ok),
        "refused_503": len(refused),
        "refused_without_retry_after": sum(1 for r in refused if not r.get("retry_after")),
        "failed": len(failed), "failures": [r["error"] for r in failed][:10],
        "ttft_p50_s": median([r["ttft"] for r in ok]),
        "ttft_p99_s": percentile([r["ttft"] for r in ok], 99),
        "latency_p50_s": median([r["latency"] for r in ok]),
        "latency_p99_s": percentile([r["latency"] for r in ok], 99),
        "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "queue_drained_s": drained_s,
        "max_waiting_seen": max((w for _, _, w in queue_samples), default=-1),
        "memory_mb": {a: {"first": v[0], "peak": max(v), "last": v[-1]}
                      for a, v in memory.items() if v},
    }


def main(args) -> int:
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else None
    progress = Progress("bench load", unit=" requests")
    report = asyncio.run(run_load(args.url, args.model, args.clients, args.duration,
                                  args.max_tokens, headers, progress))
    progress.close()
    print_table([report], ["clients", "duration_s", "completed", "refused_503",
                           "refused_without_retry_after", "failed", "ttft_p50_s", "ttft_p99_s",
                           "latency_p50_s", "latency_p99_s", "output_tokens_per_s",
                           "queue_drained_s", "max_waiting_seen"],
                title=f"{args.url}: {args.clients} streaming clients for {args.duration:.0f} s")
    print_table([{"actor": a, **m} for a, m in report["memory_mb"].items()],
                ["actor", "first", "peak", "last"], title="memory per actor (RSS, MB)")
    if report["failures"]:
        print("failures:", *report["failures"], sep="\n  ")
    write_json(args.json, [report])
    return 0 if report["failed"] == 0 else 1
