"""Two commits of this repository served side by side from the same application config,
beside llama-server on the same GGUF files, every request sent to each in turn (the order
alternating, ABBA): what a change cost the served app, told apart from a drifting machine.

    .venv/bin/python -m specdec_bench.served_before_after --before 478fb2d [--after HEAD]

Each commit is exported with `git archive` and served by its own process (its own private
Ray, its own port), both loaded for the whole run. Two workloads, as `bench served` and
`bench chat` send them:
- fresh prompts (every prompt set's, each once per app: a prompt sent twice to one app would
  be a replay for its suffix index), greedy, the modes split across the prompts;
- a conversation resending its history, and a long and a short prompt (bench chat's), in
  each mode, each conversation new to both apps.
llama-server plain answers every request too, so each of our rows has a ratio to the peer
measured beside it. Replies of the two commits are compared token for token.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from specdec.pack import hub
from specdec.pack.tokenizer import chat_ids, load_tokenizer
from specdec.ports import free_port
from specdec_bench.chat import SHORT, TURNS, _expand, _llama, _ours, long_prompt
from specdec_bench.llama_peer import LlamaServer
from specdec_bench.prompts import PROMPT_SETS
from specdec_bench.table import print_table, write_json

ROOT = Path(__file__).resolve().parents[1]

# The server each tree runs: only APIs both trees have (a private Ray, Serve on a port).
SERVER = """
import sys, threading, time, yaml
from ray import serve
from deployments.app import build_app
from deployments.launch import local_ray
config, port = sys.argv[1], int(sys.argv[2])
args = yaml.safe_load(open(config))["applications"][0]["args"]
with local_ray(num_cpus=2, quiet_serve=True):
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="specdec", route_prefix="/")
    print("SERVING", flush=True)
    sys.stdin.read()  # until the benchmark closes our stdin
    serve.delete("specdec")
    serve.shutdown()
"""


class TreeServer:
    """One commit's application, served by a process of its own (ours to stop)."""

    def __init__(self, commit: str, config: str, workdir: str) -> None:
        self.tree = Path(workdir) / commit
        self.tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "x", "-C", str(self.tree)], input=archive, check=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(self.tree)}
        self.log = open(self.tree / "server.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(self.tree / config), str(self.port)],
            cwd=self.tree, env=env, stdin=subprocess.PIPE, stdout=self.log,
            stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.tree.name} exited: see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.tree.name} not ready after {timeout} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()


def _fresh(tok, sides: dict, peer, model: str, modes: list[str], n: int) -> list[dict]:
    """Every prompt of every set once per app, the modes taking turns across prompts."""
    rows = []
    prompts = [(p, chat) for chat, ps in PROMPT_SETS.values() for p in ps]
    for i, (text, chat) in enumerate(prompts):
        ids = chat_ids(tok, [{"role": "user", "content": text}]) if chat else tok(text).input_ids
        mode = modes[i % len(modes)]
        order = list(sides) if i % 2 == 0 else list(reversed(sides))  # ABBA
        got = {}
        for side in order:
            got[side] = _ours(sides[side], model, ids, n, {"mode": mode}, True)
        got["llama-server plain"] = _llama(peer.url, ids, n, True)
        for system, r in got.items():
            rows.append({**r, "workload": "fresh prompt", "item": i, "mode": mode,
                         "system": system})
        print(f"  fresh prompt {i} ({mode}): " + ", ".join(
            f"{s} {r['tokens'] / r['e2e']:.1f}" for s, r in got.items()) + " tokens/s",
            flush=True)
    return rows


def _chat(tok, sides: dict, peer, model: str, modes: list[str], n: int,
          sizes: list[int]) -> list[dict]:
    """bench chat's conversation and long prompts, per mode, each new to every system."""
    rows = []
    for mode in modes:
        systems = {s: (lambda ids, m, eos, c=c, mode=mode: _ours(c, model, ids, m, {"mode": mode},
                                                               eos))
                   for s, c in sides.items()}
        systems["llama-server plain"] = lambda ids, m, eos: _llama(peer.url, ids, m, eos)
        # The same conversation for both trees (their caches are their own), new to each
        # system in each mode.
        history = {s: [{"role": "system", "content": f"You are a coding assistant ({mode})."}]
                   for s in systems}
        for t in range(len(TURNS)):
            order = list(systems) if t % 2 == 0 else list(reversed(systems))
            for s in order:
                history[s].append({"role": "user", "content": _expand(TURNS[t])})
                r = systems[s](chat_ids(tok, history[s]), n, False)
                history[s].append({"role": "assistant", "content": r["text"]})
                rows.append({**r, "workload": f"chat turn {t + 1}", "item": t, "mode": mode,
                             "system": s})
            print(f"  chat turn {t + 1} ({mode}) done", flush=True)
        for j, size in enumerate(sizes):
            order = list(systems) if j % 2 == 0 else list(reversed(systems))
            for s in order:
                label = f"{mode}, size {size}"  # new to each system, the same for both trees
                ids = long_prompt(tok, size, label) if size else \
                    chat_ids(tok, [{"role": "user", "content": f"({label}) {SHORT}"}])
                r = systems[s](ids, n, True)
                rows.append({**r, "workload": f"prompt of {size} tokens" if size else
                             "short prompt", "item": 100 + j, "mode": mode, "system": s})
            print(f"  prompt of {size} tokens ({mode}) done", flush=True)
    return rows


def _summary(rows: list[dict], before: str, after: str) -> list[dict]:
    out = []
    peer = {(r["workload"], r["mode"], r["item"]): r for r in rows
            if r["system"] == "llama-server plain"}
    for (workload, mode) in dict.fromkeys((r["workload"].split(" turn")[0]
                                           if r["workload"].startswith("chat") else
                                           r["workload"], r["mode"]) for r in rows):
        def mine(system, workload=workload, mode=mode):
            return [r for r in rows if r["system"] == system and r["mode"] == mode and
                    (r["workload"] == workload or r["workload"].startswith(workload + " "))]
        b, a = mine(before), mine(after)
        pairs = list(zip(b, a, strict=True))
        out.append({
            "workload": workload, "mode": mode, "requests": len(pairs),
            "before tok/s": statistics.median(r["tokens"] / r["e2e"] for r in b),
            "after tok/s": statistics.median(r["tokens"] / r["e2e"] for r in a),
            "after/before (paired)": statistics.median(
                (y["tokens"] / y["e2e"]) / (x["tokens"] / x["e2e"]) for x, y in pairs),
            "before/llama": statistics.median(
                (r["tokens"] / r["e2e"]) / (p["tokens"] / p["e2e"]) for r in b
                for p in [peer[r["workload"], r["mode"], r["item"]]]),
            "after/llama": statistics.median(
                (r["tokens"] / r["e2e"]) / (p["tokens"] / p["e2e"]) for r in a
                for p in [peer[r["workload"], r["mode"], r["item"]]]),
            "ttft after/before": statistics.median(y["ttft"] / x["ttft"] for x, y in pairs),
            "identical": f"{sum(x['text'] == y['text'] for x, y in pairs)}/{len(pairs)}"})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--modes", nargs="+", default=["off", "auto"])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--sizes", type=int, nargs="+", default=[0, 1024])
    ap.add_argument("--threads", type=int, default=2, help="llama-server's threads")
    ap.add_argument("--workloads", nargs="+", default=["fresh", "chat"],
                    choices=["fresh", "chat"])
    ap.add_argument("--json", metavar="PATH", default=None)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the servers on TERM too
    args = yaml.safe_load((ROOT / a.config).read_text())["applications"][0]["args"]
    model = args.get("model_name") or args["target"]["model"]
    target = hub.resolve(args["target"]["model"])
    tok = load_tokenizer(target)
    from specdec.pack.offline import GGUF_NAME
    names = {a.before: f"before ({a.before})", a.after: f"after ({a.after})"}
    with tempfile.TemporaryDirectory(prefix="served-ab-") as work:
        servers = {}
        try:
            # One after the other: each calibrates its step costs on a machine the other
            # is not loading (a busy start would skew one side's prices).
            for c in (a.before, a.after):
                t0 = time.monotonic()
                servers[names[c]] = TreeServer(c, a.config, work)
                servers[names[c]].wait_ready()
                print(f"{names[c]} serving ({time.monotonic() - t0:.0f} s)", flush=True)
            with LlamaServer(target / GGUF_NAME, [], a.threads) as peer:
                clients = {name: httpx.Client(base_url=s.url, timeout=1800)
                           for name, s in servers.items()}
                rows = _fresh(tok, clients, peer, model, a.modes, a.max_tokens) \
                    if "fresh" in a.workloads else []
                if "chat" in a.workloads:
                    rows += _chat(tok, clients, peer, model, a.modes, a.max_tokens, a.sizes)
        finally:
            for s in servers.values():
                s.close()
    write_json(a.json, {"rows": rows})  # first: a summary that fails loses nothing
    before, after = names[a.before], names[a.after]
    table = _summary(rows, before, after)
    print_table(table, list(table[0]), f"{a.config} served: {before} and {after} taking "
                f"turns request by request (ABBA), llama-server plain beside each request; "
                f"{a.max_tokens} new tokens, greedy, one client")
    write_json(a.json, {"rows": rows, "summary": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
