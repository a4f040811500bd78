"""A target served with no draft model (its speculation from the suffix index and n-gram
lookup), from an application config as users deploy it, beside llama-server on the same GGUF
file: one client, prompts neither side has seen, each sent once per mode.

Each of our modes runs on a freshly deployed application (its suffix index and prefix cache
empty); within a block, every prompt goes to ours, then to llama-server plain (which keeps
nothing between requests: `cache_prompt` false), so the machine's drift hits both alike.
llama-server's n-gram mode runs in the first block only: it keeps what it has seen across
requests, and a prompt sent twice would be a replay.

    .venv/bin/python -m specdec_bench.target_only [--config serve_config.gemma3.yaml]
"""

from __future__ import annotations

import argparse
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
from specdec.pack import hub
from specdec.pack.offline import GGUF_NAME
from specdec.ports import free_port
from specdec_bench.llama_peer import LlamaServer
from specdec_bench.prompts import PROMPT_SETS
from specdec_bench.table import print_table

ROOT = Path(__file__).resolve().parents[1]


def _ours(client: httpx.Client, model: str, prompt: str, mode: str, n: int) -> dict:
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, "speculative": {"mode": mode}})
    took = time.perf_counter() - t0
    r.raise_for_status()
    body = r.json()
    return {"tokens_per_s": body["usage"]["completion_tokens"] / took,
            "text": body["choices"][0]["text"], "rounds": body["spec_decode"]["rounds"] or 0}


def _peer(server: LlamaServer, prompt: str, n: int) -> dict:
    t0 = time.perf_counter()
    body = server.complete(prompt, n, ignore_eos=True)
    return {"tokens_per_s": body["tokens_predicted"] / (time.perf_counter() - t0),
            "text": body["content"], "rounds": body.get("timings", {}).get("draft_n", 0)}


def _block(args: dict, mode: str, prompts: list[str], n: int, peers: dict) -> list[dict]:
    port = free_port()
    rows = []
    with local_ray(num_cpus=2, quiet_serve=True):
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        deploy = threading.Thread(target=serve.run, args=(build_app(args),),
                                  kwargs={"name": "bench", "route_prefix": "/"}, daemon=True)
        deploy.start()
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
                while True:
                    try:
                        if client.get("/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.5)
                for i, prompt in enumerate(prompts):
                    sides = [(f"ours {mode}", lambda p=prompt: _ours(
                        client, args["model_name"], p, mode, n))]
                    sides += [(f"llama-server {name}", lambda p=prompt, s=s: _peer(s, p, n))
                              for name, s in peers.items()]
                    for system, call in sides:
                        row = call()
                        rows.append({"system": system, "prompt": i, **row})
                        print(f"  {system:24s} prompt {i}: {row['tokens_per_s']:.1f} tokens/s",
                              flush=True)
        finally:
            deploy.join(timeout=60)
            serve.delete("bench")
            serve.shutdown()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "serve_config.gemma3.yaml"))
    ap.add_argument("--modes", nargs="+", default=["off", "auto"])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--peer-spec", default="ngram-mod")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    args = yaml.safe_load(Path(a.config).read_text())["applications"][0]["args"]
    if args.get("draft"):
        raise SystemExit(f"{a.config} names a draft: this benchmark is for a target alone")
    gguf = hub.resolve(args["target"]["model"]) / GGUF_NAME
    prompts = [p for _, ps in PROMPT_SETS.values() for p in ps]
    rows: list[dict] = []
    with LlamaServer(gguf, [], a.threads) as plain, \
            LlamaServer(gguf, ["--spec-type", a.peer_spec], a.threads) as ngram:
        for s in (plain, ngram):
            s.complete("warm", 4)
        for b, mode in enumerate(a.modes):
            peers = {"plain": plain, a.peer_spec: ngram} if b == 0 else {"plain": plain}
            print(f"block {b + 1}: ours {mode} on a fresh application", flush=True)
            rows += [{**r, "block": b} for r in _block(args, mode, prompts, a.max_tokens, peers)]
    base = {(r["block"], r["prompt"]): r["tokens_per_s"] for r in rows
            if r["system"] == "llama-server plain"}  # beside each request, in its block
    summary = []
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        tps = sorted(r["tokens_per_s"] for r in mine)
        summary.append({"system": system, "requests": len(mine),
                        "median tokens/s": statistics.median(tps),
                        "q1-q3": f"{tps[len(tps) // 4]:.1f}-{tps[3 * len(tps) // 4]:.1f}",
                        "median ratio to llama-server plain (same prompt)": statistics.median(
                            r["tokens_per_s"] / base[r["block"], r["prompt"]] for r in mine),
                        "speculated": sum(r["rounds"] > 0 for r in mine)})
    print_table(summary, list(summary[0]), f"{args['target']['model']}, one client, "
                f"{len(prompts)} fresh prompts, {a.max_tokens} tokens, greedy")
    ours_off = {r["prompt"]: r["text"] for r in rows if r["system"] == "ours off"}
    same = [r["text"] == ours_off[r["prompt"]] for r in rows
            if r["system"].startswith("ours") and r["prompt"] in ours_off]
    print(f"our modes' replies identical to ours off: {sum(same)}/{len(same)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
