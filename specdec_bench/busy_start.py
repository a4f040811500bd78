"""The default app (serve_config.yaml) started on a busy machine and on a quiet one, then
served to one client: does a busy start-up still cost the app its speculation?

For each start: two CPU-bound processes run from the deploy until the service reports ready
(`busy`), and on for `--busy-after` seconds while it serves, or none (`quiet`). One client
sends prompts it has never sent (code, prose and chat-style code, each once), 96 tokens,
greedy, alternating `auto` and `off` request by request (so the machine's drift hits both
alike; `off` follows on the prompt `auto` just had, so only `off` can reuse a cached prefix),
then a few `on` requests (prompts already sent: replays for the suffix index). Printed: time from deploy to
ready and from ready to the first request served, the start-up calibration's own verdict
(noisy or quiet), and per request tokens/s, the decision, rounds and k; then auto / off.

    .venv/bin/python -m specdec_bench.busy_start [--starts busy quiet] [--pairs 8] [--on 4]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
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


def _spin() -> None:
    while True:
        pass


def served(client: httpx.Client, model: str, prompt: str, mode: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "speculative": {"mode": mode}})
    took = time.perf_counter() - t0
    r.raise_for_status()
    body = r.json()
    spec = body["spec_decode"]
    n = body["usage"]["completion_tokens"]
    return {"mode": mode, "tokens_per_s": n / took, "decision": spec["mode"],
            "k": spec["k"], "rounds": spec["rounds"] or 0,
            "tokens_per_round": spec["mean_acceptance_length"], "why": spec["reason"][:60]}


def _fresh_prompts() -> list[str]:
    """Every prompt of the benchmark's sets, each once."""
    return [p for _, prompts in PROMPT_SETS.values() for p in prompts]


def one_start(kind: str, args: dict, pairs: int, on: int, max_tokens: int,
              busy_after: float = 0.0) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    hogs = []
    with local_ray(num_cpus=2, quiet_serve=True):
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.monotonic()
        if kind == "busy":
            hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(2)]
            for h in hogs:
                h.start()
        deploy = threading.Thread(target=serve.run, args=(build_app(args),),
                                  kwargs={"name": "bench", "route_prefix": "/"}, daemon=True)
        deploy.start()
        try:
            with httpx.Client(base_url=base, timeout=600) as client:
                while True:
                    try:
                        if client.get("/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.5)
                ready_s = time.monotonic() - t0

                def quiet_down() -> None:
                    for h in hogs:
                        h.terminate()
                        h.join()

                if busy_after > 0 and hogs:  # the load goes on into serving
                    threading.Timer(busy_after, quiet_down).start()
                else:
                    quiet_down()
                print(f"[{kind}] ready {ready_s:.0f} s after deploy", flush=True)
                prompts = _fresh_prompts()
                first_prompt = prompts.pop()  # not sent again below
                if pairs > len(prompts):
                    raise SystemExit(f"--pairs {pairs}: only {len(prompts)} fresh prompts")
                # The first request, short (4 tokens), the moment it says ready.
                t_ready = time.monotonic()
                served(client, args["model_name"], first_prompt, "auto", 4)
                first_s = time.monotonic() - t_ready
                print(f"[{kind}] first 4-token request served {first_s:.2f} s after ready, "
                      f"{time.monotonic() - t0:.0f} s after deploy", flush=True)
                # What the calibration left the policy believing, before any live draft.
                priced = {"at ready": client.get("/health").json().get("engine", {})
                          .get("priced_one_row", [])}
                rows = []
                for i in range(pairs):
                    for mode in ("auto", "off"):
                        busy = any(h.is_alive() for h in hogs)
                        row = served(client, args["model_name"], prompts[i], mode, max_tokens)
                        rows.append({"start": kind, "n": len(rows) + 1, "busy": busy, **row})
                        print(f"[{kind}] {rows[-1]}", flush=True)
                for i in range(on):
                    busy = any(h.is_alive() for h in hogs)
                    row = served(client, args["model_name"], prompts[i % len(prompts)], "on",
                                 max_tokens)
                    rows.append({"start": kind, "n": len(rows) + 1, "busy": busy, **row})
                    print(f"[{kind}] {rows[-1]}", flush=True)
                health = client.get("/health").json().get("engine", {})
                priced["after the requests"] = health.get("priced_one_row", [])
                print(f"[{kind}] last steps, medians: {health.get('timeline')}", flush=True)
        finally:
            for h in hogs:
                if h.is_alive():
                    h.terminate()
            deploy.join(timeout=60)
            serve.delete("bench")
            serve.shutdown()
    return {"kind": kind, "ready_s": ready_s, "first_served_s": first_s, "rows": rows,
            "calibration": health.get("calibration"), "probes": health.get("probes"),
            "priced": priced}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--starts", nargs="+", default=["busy", "quiet"], choices=["busy", "quiet"])
    p.add_argument("--pairs", type=int, default=8, help="auto/off request pairs")
    p.add_argument("--on", type=int, default=4, help='"on" requests after them')
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--busy-after", type=float, default=0.0,
                   help="seconds the load goes on after ready (busy starts)")
    p.add_argument("--config", default=str(ROOT / "serve_config.yaml"))
    a = p.parse_args()
    os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "1")
    args = yaml.safe_load(Path(a.config).read_text())["applications"][0]["args"]
    results = [one_start(kind, args, a.pairs, a.on, a.max_tokens, a.busy_after)
               for kind in a.starts]
    summary = []
    for res in results:
        rows = res["rows"]
        print_table(rows, ["start", "n", "busy", "mode", "tokens_per_s", "decision", "k", "rounds",
                           "tokens_per_round", "why"], f"{res['kind']} start, one client")
        for when, table in res["priced"].items():
            if table:
                print_table(table, list(table[0]), f"{res['kind']} start: the policy's "
                            f"price of a draft round at one row, {when}")
        auto = [r["tokens_per_s"] for r in rows if r["mode"] == "auto"]
        off = [r["tokens_per_s"] for r in rows if r["mode"] == "off"]
        on = [r for r in rows if r["mode"] == "on"]
        summary.append({
            "start": res["kind"], "ready_s": res["ready_s"],
            "ready_to_first_s": res["first_served_s"],
            "calibration": (res["calibration"] or {}).get("noise"),
            "auto_tok_s": statistics.median(auto), "off_tok_s": statistics.median(off),
            "auto/off": statistics.median(auto) / statistics.median(off),
            "auto_speculated": f"{sum(r['rounds'] > 0 for r in rows if r['mode'] == 'auto')}"
                               f"/{len(auto)}",
            "on_speculated": f"{sum(r['rounds'] > 0 for r in on)}/{len(on)}",
            "probes": res["probes"]})
    print_table(summary, list(summary[0]), "summary (medians over requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
