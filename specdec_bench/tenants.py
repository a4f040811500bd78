"""A hostile tenant against the default app (serve_config.yaml, two API keys): what it learns
of another tenant's prompt and reply, and whether its heavy requests stall a small one.

Leaks. Alice sends fresh prompts; Mallory then probes each context at positions inside the
prompt and inside the reply with pairs `context[:m] + [c, z]`, c the true next token or a
wrong one (the pair's order random): which of the two is the true one, read from
- `cached_tokens` (the prefix cache's reuse),
- the suffix index's counters (`accepted`, `free_accepted` of a probe speculating from it),
- the time of the reply (a probe of one token: its time to first token).
Each channel's guess is right with some accuracy; a pair then carries 1 - H(accuracy) bits,
reported per 100 probes. Run with `tenancy: shared` (every request one tenant: what the
app did before tenants) and with `tenancy: api_key` (the default with keys), each on a
freshly started app.

Stalls. On the partitioned app, a small request (16 tokens, greedy) alone and beside each
load in turn: large grammars (choice lists and schemas, each new to the replica), a flood
of /health, bodies whose tools carry megabytes (refused); its latency against alone.

    .venv/bin/python -m specdec_bench.tenants [--pairs 24] [--modes shared api_key]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml
from ray import serve

from deployments.app import build_app
from deployments.launch import local_ray
from specdec.ports import free_port
from specdec_bench.prompts import PROMPT_SETS
from specdec_bench.table import print_table

ROOT = Path(__file__).resolve().parents[1]
# Mallory holds many keys and probes each time with one it never used: no probe of hers
# reuses another of hers, so what a probe gets back could only come from someone else.
KEYS = {"alice": "sk-alice-bench-0123",
        **{f"mallory{i}": f"sk-mallory{i}-bench-0123" for i in range(1, 400)}}


def _h2(p: float) -> float:
    return 0.0 if p in (0.0, 1.0) else -p * math.log2(p) - (1 - p) * math.log2(1 - p)


def bits_per_100(right: float, pairs: int) -> float:
    """What the guesses carried: each pair (two probes) 1 - H(accuracy) bits."""
    acc = right / pairs
    return 50 * (1 - _h2(acc))


class App:
    """The application from serve_config.yaml with two tenants' keys and a tenancy, on a
    private Ray; `client(tenant)` talks to it with that tenant's key."""

    def __init__(self, tenancy: str) -> None:
        self.args = yaml.safe_load((ROOT / "serve_config.yaml").read_text()
                                   )["applications"][0]["args"]
        self.args.update({"api_keys": KEYS, "tenancy": tenancy})
        self.model = self.args.get("model_name") or self.args["target"]["model"]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self._ray = local_ray(num_cpus=2, quiet_serve=True)
        self._ray.__enter__()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        threading.Thread(target=serve.run, args=(build_app(self.args),),
                         kwargs={"name": "tenants", "route_prefix": "/"}, daemon=True).start()
        with self.client("alice") as c:
            while True:
                try:
                    if c.get("/health").status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(1)

    def __exit__(self, *exc):
        serve.delete("tenants")
        serve.shutdown()
        self._ray.__exit__(*exc)

    def client(self, tenant: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=600,
                            headers={"authorization": f"Bearer {KEYS[tenant]}"})


def _complete(c: httpx.Client, model: str, **body) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = c.post("/v1/completions", json={"model": model, "temperature": 0, **body})
    took = time.perf_counter() - t0
    r.raise_for_status()
    return r.json(), took


def _ids_of_pieces(model: str) -> dict[str, int]:
    """Each token's text -> its id (a reply's logprobs name its tokens by their text; the
    first id wins where two decode alike, which ASCII code and prose never need)."""
    from specdec.pack.hub import resolve
    from specdec.pack.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve(model))
    out: dict[str, int] = {}
    for i in range(len(tok)):
        out.setdefault(tok.decode([i]), i)
    return out


def victim_contexts(app: App, n_tokens: int) -> list[tuple[list[int], int]]:
    """Alice's prompts and replies as token ids (the reply's own ids, read back from its
    logprobs), each with the prompt's length."""
    out = []
    ids_of = _ids_of_pieces(app.args["target"]["model"])
    with app.client("alice") as c:
        for i, (_, prompts) in enumerate(PROMPT_SETS.values()):
            for j, text in enumerate(prompts):
                text = f"# alice's file {i}.{j}\n{text}"
                ids = c.post("/tokenize", json={"model": app.model, "prompt": text}
                             ).json()["tokens"]
                body, _ = _complete(c, app.model, prompt=ids, max_tokens=n_tokens,
                                    ignore_eos=True, logprobs=0)
                reply = [ids_of[t] for t in body["choices"][0]["logprobs"]["tokens"]]
                out.append((ids + reply, len(ids)))
    return out


def probe_leaks(app: App, contexts, pairs: int, rng: random.Random) -> list[dict]:
    """Mallory's pairs: per channel, how often the true candidate is told apart."""
    right = {"cached_tokens": 0.0, "suffix counters": 0.0, "time to first token": 0.0}
    done, key = 0, 0
    while done < pairs:
        ctx, plen = contexts[done % len(contexts)]
        inside_reply = done % 2 == 1 or plen < 24
        # Past 16 tokens: a shared prefix shorter than that is recomputed, not copied.
        lo, hi = (plen + 2, len(ctx) - 2) if inside_reply else (17, plen - 1)
        m = rng.randrange(lo, max(lo + 1, hi))
        true, wrong = ctx[m], (ctx[m] + 1 + rng.randrange(1000)) % 150_000
        order = [true, wrong] if rng.random() < 0.5 else [wrong, true]
        seen = {}
        for cand in order:  # each probe with a key of its own
            with app.client(f"mallory{key + 1}") as c:
                body, took = _complete(c, app.model, prompt=ctx[:m] + [cand, 13],
                                       max_tokens=1)
            with app.client(f"mallory{key + 2}") as c:
                spec, _ = _complete(c, app.model, prompt=ctx[:m] + [cand], max_tokens=8,
                                    speculative={"mode": "on", "method": "suffix", "k": 4})
            key += 2
            sd = spec["spec_decode"]
            seen[cand] = {
                "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"],
                "suffix counters": (sd["accepted"] or 0) + (sd["free_accepted"] or 0),
                "time to first token": -took}  # quicker: more likely cached
        for channel in right:
            a, b = seen[true][channel], seen[wrong][channel]
            right[channel] += 1.0 if a > b else 0.5 if a == b else 0.0
        done += 1
        print(f"  pair {done}/{pairs} (m {m}, {'reply' if inside_reply else 'prompt'}): "
              + ", ".join(f"{k} {seen[true][k]:.3g} vs {seen[wrong][k]:.3g}"
                          for k in right), flush=True)
    return [{"channel": ch, "pairs": pairs, "accuracy": round(r / pairs, 3),
             "bits per 100 probes": round(bits_per_100(r, pairs), 2)}
            for ch, r in right.items()]


def _loads(app: App, stop: threading.Event) -> dict:
    """Each load: a function that keeps sending until stop is set."""
    def grammars():
        with app.client("mallory1") as c:
            i = 0
            while not stop.is_set():
                i += 1
                if i % 2:
                    field = {"choice": [f"option {i}-{j} {'x' * 30}" for j in range(1000)]}
                else:
                    field = {"json": {"type": "object", "properties": {
                        f"p{i}_{j}": {"type": "string", "pattern": "[a-z]{3,9}"}
                        for j in range(1500)}}}
                c.post("/v1/completions", json={"model": app.model, "prompt": "Pick one:",
                                                "max_tokens": 1, "structured_outputs": field})

    def health():
        def one():
            with httpx.Client(base_url=app.url, timeout=60) as c:
                while not stop.is_set():
                    c.get("/health")
        threads = [threading.Thread(target=one) for _ in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def tools():
        big = {"type": "object", "properties": {f"p{j}": {"type": "string", "description":
                                                          "a field " * 50} for j in range(8000)}}
        body = {"model": app.model, "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": big}}]}
        with app.client("mallory1") as c:
            while not stop.is_set():
                c.post("/v1/chat/completions", json=body)

    return {"large grammars": grammars, "/health flood (32 clients)": health,
            "tool-heavy bodies (3.9 MB)": tools}


def probe_stalls(app: App, repeats: int) -> list[dict]:
    rows = []
    prompts = [p for _, ps in PROMPT_SETS.values() for p in ps]

    def small(c, i) -> float:
        _, took = _complete(c, app.model, prompt=f"# request {i}\n{prompts[i % len(prompts)]}",
                            max_tokens=16, ignore_eos=True, speculative={"mode": "off"})
        return took

    with app.client("alice") as c:
        n = 0
        alone = []
        for _ in range(repeats):
            alone.append(small(c, n))
            n += 1
        base = statistics.median(alone)
        rows.append({"beside": "nothing", "median s": round(base, 3), "vs alone": 1.0})
        for name in _loads(app, threading.Event()):
            stop = threading.Event()
            t = threading.Thread(target=_loads(app, stop)[name], daemon=True)
            t.start()
            time.sleep(3)  # the load under way
            took = []
            for _ in range(repeats):
                took.append(small(c, n))
                n += 1
            stop.set()
            t.join(timeout=120)
            med = statistics.median(took)
            rows.append({"beside": name, "median s": round(med, 3),
                         "vs alone": round(med / base, 2)})
            print(f"  beside {name}: {med:.3f} s ({med / base:.2f}x alone)", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=24)
    ap.add_argument("--modes", nargs="+", default=["shared", "api_key"])
    ap.add_argument("--reply-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7, help="small requests per load")
    ap.add_argument("--no-stalls", action="store_true", help="the leaks only")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rng = random.Random(53)
    leaks, stalls = [], []
    for mode in a.modes:
        print(f"tenancy {mode}: starting the app", flush=True)
        with App(mode) as app:
            contexts = victim_contexts(app, a.reply_tokens)
            for row in probe_leaks(app, contexts, a.pairs, rng):
                leaks.append({"tenancy": mode, **row})
            if mode == a.modes[-1] and not a.no_stalls:
                stalls = probe_stalls(app, a.repeats)
    print_table(leaks, list(leaks[0]), "what Mallory learns of Alice's prompts and replies "
                "(pairs of probes, true next token against a wrong one; 0.5 accuracy: nothing)")
    if stalls:
        print_table(stalls, list(stalls[0]), "a small request (16 tokens, greedy) beside "
                    f"each load, tenancy {a.modes[-1]}")
    if a.json:
        Path(a.json).write_text(json.dumps({"leaks": leaks, "stalls": stalls}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
