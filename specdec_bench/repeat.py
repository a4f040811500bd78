"""`specdec bench repeat`: workloads whose output repeats what was seen, and mixed prompts;
ours served (plain, the draft, the suffix index, auto) beside llama-server on the same GGUF
files (plain, its draft, ngram-mod, ngram-cache), one client.

- edit: a ~60-line source file and "return it whole with one change" (the reply copies the
  prompt);
- follow-up: the next turn asks for the previous answer again with another change (the reply
  copies the last reply);
- similar: the same task on different inputs, one after the other (each reply shaped like
  the last);
- mixed: code, prose and SQL prompts, greedy and sampled (where little repeats).

Every system keeps what it learns only from its own requests: llama-server's n-gram pools
live in its process, and each of our modes runs on a freshly deployed application (its
suffix index and prefix cache empty), one mode after another. The machine drifts over
minutes, so every block of ours runs beside llama-server plain, request by request, and
rows are compared through their ratio to the llama-server plain of their own block (the
llama-server modes run as one block with their plain too).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import httpx

from specdec.pack import hub
from specdec.pack.tokenizer import chat_ids, load_tokenizer
from specdec.progress import Progress
from specdec_bench.chat import _ours_served
from specdec_bench.table import median, print_table, write_json

ROOT = Path(__file__).resolve().parents[1]
EDIT_FILE = "specdec/model/step/kv_cache.py"  # 53 lines
EDIT = ("Here is a file of a project:\n```python\n{file}\n```\nReturn the whole file, every "
        "line of it, with the method `{old}` renamed to `{new}`. Only the "
        "code, no explanation.")
FOLLOW = ("Now return that file once more, whole, with a one-line comment above every "
          "function saying what it returns. Only the code.")
SIMILAR = ["Write a Python function `parse_{x}(text)` that parses a {x} given as a string "
           "and returns it as a dict; raise ValueError on bad input. Only the code."]
SIMILAR_INPUTS = ["date", "time", "url", "email address"]
MIXED = [("code", "Write a Python function that merges two sorted lists into one."),
         ("code", "Write a JavaScript function that debounces another function."),
         ("prose", "Tell the story of the first voyage around the world in a paragraph."),
         ("prose", "Explain to a child why the sky is blue."),
         ("sql", "Write an SQL query that lists each customer's total order amount in 2023, "
                 "highest first, from tables customers(id, name) and orders(id, "
                 "customer_id, amount, placed_at).")]
OURS = {"off": {"mode": "off"}, "draft": {"mode": "on", "method": "draft"},
        "suffix": {"mode": "on", "method": "suffix"}, "auto": {"mode": "auto"}}


def _send_ours(c: httpx.Client, model: str, mode: dict):
    def send(ids, max_tokens, temperature, seed):
        body = {"model": model, "prompt": ids, "max_tokens": max_tokens,
                "temperature": temperature, "speculative": mode}
        if temperature:
            body["seed"] = seed
        t0 = time.perf_counter()
        r = c.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"ours: {r.status_code} {r.text[:300]}")
        out = r.json()
        return {"s": time.perf_counter() - t0, "text": out["choices"][0]["text"],
                "tokens": out["usage"]["completion_tokens"]}
    return send


def _send_llama(url: str):
    def send(ids, max_tokens, temperature, seed):
        # Pure temperature sampling, as ours (llama.cpp's default top-k/top-p/min-p off).
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": temperature,
                "top_k": 1 if temperature == 0 else 0, "top_p": 1.0, "min_p": 0.0,
                "seed": seed, "cache_prompt": True}
        t0 = time.perf_counter()
        r = httpx.post(url + "/completion", json=body, timeout=1800)
        r.raise_for_status()
        out = r.json()
        return {"s": time.perf_counter() - t0, "text": out["content"],
                "tokens": out.get("tokens_predicted", 0)}
    return send


def _workload(tok, label: str, max_tokens: int) -> list[tuple[str, list, int, float, bool]]:
    """(workload, messages, max_tokens, temperature, follow-up of the last reply?)"""
    code = (ROOT / EDIT_FILE).read_text()
    items = [("edit", [{"role": "system", "content": f"You are a coding assistant ({label})."},
                       {"role": "user", "content": EDIT.format(
                           file=code, old="copy_prefix", new="copy_slot_prefix")}],
              4 * max_tokens, 0.0, False),
             ("follow-up", [{"role": "user", "content": FOLLOW}], 4 * max_tokens, 0.0, True)]
    for x in SIMILAR_INPUTS:
        items.append(("similar", [{"role": "user", "content": f"({label}) "
                                   + SIMILAR[0].format(x=x)}], max_tokens, 0.0, False))
    for temperature in (0.0, 0.7):
        for kind, prompt in MIXED:
            items.append((f"mixed {kind} t={temperature}", [{"role": "user", "content":
                                                             f"({label}) {prompt}"}],
                          max_tokens // 2, temperature, False))
    return items


def run_block(systems: dict, tok, max_tokens: int, progress, block: str) -> list[dict]:
    """Every system of the block through the workload, taking turns request by request;
    each system's prompts name it and the block (no system reuses another's prefix)."""
    rows = []
    work = {name: _workload(tok, f"{name} in {block}", max_tokens) for name in systems}
    history: dict[str, list] = {name: [] for name in systems}
    for i in range(len(work[next(iter(systems))])):
        for name in (list(systems) if i % 2 == 0 else list(systems)[::-1]):
            workload, messages, n, temperature, follow = work[name][i]
            msgs = history[name] + messages if follow else messages
            r = systems[name](chat_ids(tok, msgs), n, temperature, 1000 + i)
            history[name] = msgs + [{"role": "assistant", "content": r["text"]}]
            rows.append({"system": name, "workload": workload, "tokens": r["tokens"],
                         "seconds": r["s"]})
            progress.advance()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per system and workload group: tokens/s (medians over repeats, the workload's items
    summed), and the ratio to the llama-server plain of the same block."""
    def group(w):
        return w.split(" t=")[0] if not w.startswith("mixed") else \
            ("mixed greedy" if w.endswith("t=0.0") else "mixed sampled")

    acc: dict = {}
    for r in rows:
        key = (r["block"], r["system"], r["rep"], group(r["workload"]))
        t, s = acc.get(key, (0, 0.0))
        acc[key] = (t + r["tokens"], s + r["seconds"])
    per: dict = {}
    for (block, system, _rep, g), (t, s) in acc.items():
        per.setdefault((block, system, g), []).append(t / s)
    out = []
    for (block, system, g), tps in sorted(per.items()):
        if system == "llama-server plain" and block != "llama-server":
            continue
        ref = per.get((block, "llama-server plain", g))
        out.append({"system": system, "workload": g, "tps": round(median(tps), 2),
                    "vs_llama_plain": round(median(tps) / median(ref), 2) if ref else None})
    return out


def main(args) -> int:
    from specdec.engine.spec import EngineSpec
    from specdec.model.checkpoint.gguf_file import gguf_in
    from specdec_bench.llama_peer import start_servers

    spec = EngineSpec.from_config_file(args.config)
    tok = load_tokenizer(hub.resolve(spec.target.model))
    target = gguf_in(hub.resolve(spec.target.model))
    draft = gguf_in(hub.resolve(spec.draft.model)) if spec.draft else None
    items = len(_workload(tok, "x", args.max_tokens))
    total = args.repeats * items * (2 * len(args.modes) + 1 + len(args.peer_spec))
    progress = Progress("bench repeat", total=total, unit=" requests")
    rows = []
    with contextlib.ExitStack() as stack:
        peers = start_servers(stack, target, draft, args.peer_spec, args.threads, 8192)
        plain = {"llama-server plain": _send_llama(peers.pop("plain"))}
        for mode in args.modes:  # a fresh application per mode: nothing learned carries
            with _ours_served(args.config) as (c, model, _):
                systems = {f"ours {mode}": _send_ours(c, model, OURS[mode]), **plain}
                for rep in range(args.repeats):
                    rows += [dict(r, block=f"ours {mode}", rep=rep) for r in
                             run_block(systems, tok, args.max_tokens, progress,
                                       f"ours {mode}, run {rep}")]
        systems = {**plain, **{f"llama-server {name}": _send_llama(url)
                               for name, url in peers.items()}}
        for rep in range(args.repeats):
            rows += [dict(r, block="llama-server", rep=rep) for r in
                     run_block(systems, tok, args.max_tokens, progress,
                               f"llama-server, run {rep}")]
    progress.close()
    table = summarize(rows)
    print_table(table, ["system", "workload", "tps", "vs_llama_plain"],
                title=f"{args.config}: one client, output tokens/s over each workload "
                      f"(end to end), medians of {args.repeats}; vs_llama_plain: against "
                      "llama-server plain run beside it in the same block")
    write_json(args.json, {"rows": rows, "table": table})
    return 0
