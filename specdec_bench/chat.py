"""`specdec bench chat`: what chat users send, ours served (the application config as shipped)
beside llama-server on the very GGUF files, one client, in one run.

- A conversation whose every turn resends the whole history, growing to ~1.5k tokens: per
  turn, time to first token, decode tokens/s after it, end to end, the prompt's size and how
  much of it the server took from its cache.
- Long prompts (a source file and a question; ~0.5k, 1k and 1.8k tokens, each new to the
  server) and a short one: time to first token and decode tokens/s after it.
- Resident memory of the model processes, 8 slots of 2048 tokens, the draft loaded.

Both systems get the same token ids (the chat template is applied here), streamed, timed by
the client. Ours runs in each mode asked for (--modes: off, auto, on); llama-server runs
plain (its defaults: cache_prompt on) and in each --peer-spec mode. Every system is loaded
for the whole run and they take turns request by request (each conversation turn, each long
prompt), so a machine whose speed drifts over minutes moves them alike: their ratios are
fair where back-to-back blocks were not (on this project's shared CPU box the same engine
read 24 and 36 tokens/s ten minutes apart).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import httpx

from specdec.pack import hub
from specdec.pack.tokenizer import chat_ids, load_tokenizer
from specdec.progress import Progress
from specdec_bench.table import median, print_table, write_json

# The conversation: what a user asks, turn by turn; files pasted into it grow the history
# the way a code assistant's does. The files are frozen copies (chat_files/): the workload
# must not change when the project's own modules do (a module that grew tenfold once made
# the third turn overflow the context).
TURNS = [
    ("Here is a module of a project:\n```python\n{file:cost_model.py.txt}\n```\n"
     "What does expected_tokens_per_round compute, and why does a = 1 need its own case?"),
    "Write a unit test for it with pytest, covering k = 0, a = 0 and a = 1.",
    ("Now this one:\n```python\n{file:kv_cache.py.txt}\n```\nHow does a slot "
     "roll back, and what keeps stale entries from being read?"),
    "Could two sequences ever share a slot? Answer in two sentences.",
    "Write a function that copies the first n positions of one slot into another.",
    "Summarize our whole conversation in three bullet points.",
]
LONG_FILE = "decide.py.txt"
FILES = Path(__file__).resolve().parent / "chat_files"  # frozen copies of our sources
SHORT = "Write a Python function that checks whether a string is a palindrome."


def _expand(text: str) -> str:
    while "{file:" in text:
        start = text.index("{file:")
        end = text.index("}", start)
        body = (FILES / text[start + 6:end]).read_text()
        text = text[:start] + body + text[end + 1:]
    return text


def long_prompt(tok, tokens: int, label: str) -> list[int]:
    """A source file cut to about `tokens` tokens with a question, new to the server (its
    first line names the system and the run)."""
    lines = (FILES / LONG_FILE).read_text().splitlines()
    ask = "Explain what each function of this file does, one line each."
    best = None
    for n in range(1, len(lines) + 1):
        code = f"# revision {label}\n" + "\n".join(lines[:n])
        ids = chat_ids(tok, [{"role": "user", "content":
                              f"```python\n{code}\n```\n{ask}"}])
        if len(ids) > tokens:
            break
        best = ids
    return best


# ---- streaming clients: (ttft, decode tokens/s after the first, e2e, tokens, cached) -----

def _ours(c: httpx.Client, model: str, ids: list[int], max_tokens: int, mode: dict,
          ignore_eos: bool) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "speculative": mode}
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    first = None
    text, usage = [], None
    with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"ours: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                if first is None:
                    first = time.perf_counter()
                text.append(chunk["choices"][0].get("text", ""))
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    n = usage["completion_tokens"]
    return {"ttft": first - t0, "e2e": end - t0, "tokens": n, "text": "".join(text),
            "decode": (n - 1) / (end - first) if n > 1 and end > first else None,
            "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def _llama(url: str, ids: list[int], max_tokens: int, ignore_eos: bool) -> dict:
    body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "top_k": 1,
            "stream": True, "cache_prompt": True, "ignore_eos": ignore_eos}
    t0 = time.perf_counter()
    first, text, last = None, [], {}
    with httpx.stream("POST", url + "/completion", json=body, timeout=1800) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("content") is not None and not chunk.get("stop"):
                first = time.perf_counter()
            text.append(chunk.get("content", ""))
            last = chunk
    end = time.perf_counter()
    tm = last.get("timings", {})
    n = tm.get("predicted_n", last.get("tokens_predicted", 0))
    first = first or end
    return {"ttft": first - t0, "e2e": end - t0, "tokens": n, "text": "".join(text),
            "decode": (n - 1) / (end - first) if n > 1 and end > first else None,
            "prompt": len(ids), "cached": len(ids) - tm.get("prompt_n", len(ids))}


# ---- workloads ------------------------------------------------------------------------

class Conversation:
    """One system's conversation: its own replies go into its next turns' history. Its system
    message names the system and the run, so no other system's requests (ours in another
    mode share one server's cache) and no earlier run hold a prefix of it beyond the chat
    template's first tokens."""

    def __init__(self, send, label: str) -> None:
        self.send, self.rows = send, []
        self.messages = [{"role": "system", "content": f"You are a coding assistant ({label})."}]

    def turn(self, tok, n: int, max_tokens: int) -> None:
        self.messages.append({"role": "user", "content": _expand(TURNS[n])})
        r = self.send(chat_ids(tok, self.messages), max_tokens, False)
        self.messages.append({"role": "assistant", "content": r["text"]})
        self.rows.append({"turn": n + 1, **{k: v for k, v in r.items() if k != "text"}})


def interleaved(systems: dict, tok, args, progress) -> dict[str, tuple[list, list]]:
    """Every system through the same workload, taking turns request by request: per system
    (conversations, long-prompt rows)."""
    convs: dict[str, list[Conversation]] = {name: [] for name in systems}
    longs: dict[str, list[dict]] = {name: [] for name in systems}
    for rep in range(args.repeats):
        for name, send in systems.items():
            convs[name].append(Conversation(send, f"{name}, run {rep}"))
        for n in range(len(TURNS)):
            for name in systems:
                convs[name][-1].turn(tok, n, args.max_tokens)
                progress.advance()
        for size in args.sizes:
            for name, send in systems.items():
                label = f"{name}, run {rep}, size {size}"  # cold: no prefix of another
                ids = long_prompt(tok, size, label) if size else \
                    chat_ids(tok, [{"role": "user", "content": f"({label}) {SHORT}"}])
                r = send(ids, args.max_tokens, True)
                longs[name].append({"size": size, **{k: v for k, v in r.items()
                                                     if k != "text"}})
                progress.advance()
    return {name: ([c.rows for c in convs[name]], longs[name]) for name in systems}


# ---- systems ----------------------------------------------------------------------------

@contextlib.contextmanager
def _ours_served(config: str):
    """The application from `config`, served on a private local Ray; yields (client, model,
    app args)."""
    import yaml
    from ray import serve

    from deployments.app import build_app
    from specdec_bench.served import _serve_instance

    app_args = yaml.safe_load(open(config))["applications"][0]["args"]
    model = app_args.get("model_name") or app_args["target"]["model"]
    with _serve_instance() as url:
        serve.run(build_app(app_args), name="specdec", route_prefix="/")
        with httpx.Client(base_url=url, timeout=1800) as c:
            yield c, model, app_args
        serve.delete("specdec")


def _summary(system: str, mode: str, conv: list[list[dict]], longs: list[dict]) -> list[dict]:
    out = []
    for turn in range(len(conv[0])):
        runs = [c[turn] for c in conv]
        out.append({"system": system, "mode": mode, "workload": f"turn {turn + 1}",
                    "prompt_tokens": runs[0]["prompt"],
                    "cached": median([r["cached"] for r in runs]),
                    "ttft_s": median([r["ttft"] for r in runs]),
                    "decode_tps": median([r["decode"] for r in runs if r["decode"]]),
                    "e2e_s": median([r["e2e"] for r in runs]),
                    "tokens": median([r["tokens"] for r in runs])})
    for size in sorted({r["size"] for r in longs}):
        runs = [r for r in longs if r["size"] == size]
        out.append({"system": system, "mode": mode,
                    "workload": f"prompt {size or 'short'}",
                    "prompt_tokens": median([r["prompt"] for r in runs]),
                    "cached": median([r["cached"] for r in runs]),
                    "ttft_s": median([r["ttft"] for r in runs]),
                    "decode_tps": median([r["decode"] for r in runs if r["decode"]]),
                    "e2e_s": median([r["e2e"] for r in runs]),
                    "tokens": median([r["tokens"] for r in runs])})
    return out


def ratios(rows: list[dict]) -> list[dict]:
    """Per mode of ours and workload: against llama-server plain, and decode against our
    own short-prompt decode in that mode."""
    peer = {r["workload"]: r for r in rows if r["system"] == "llama-server"
            and r["mode"] == "plain"}
    out = []
    for r in rows:
        if r["system"] != "ours, served":
            continue
        p = peer.get(r["workload"])
        short = next((x for x in rows if x["system"] == r["system"] and x["mode"] == r["mode"]
                      and x["workload"] == "prompt short"), None)

        def div(a, b):
            return round(a / b, 2) if a and b else None

        out.append({"mode": r["mode"], "workload": r["workload"],
                    "ttft_vs_peer": div(r["ttft_s"], p["ttft_s"]) if p else None,
                    "decode_vs_peer": div(r["decode_tps"], p["decode_tps"]) if p else None,
                    "decode_vs_own_short": div(r["decode_tps"], short["decode_tps"])
                    if short else None})
    return out


def _peers(stack: contextlib.ExitStack, args, target, draft) -> dict:
    """llama-server plain and in each --peer-spec mode, one process each, all started."""
    from specdec_bench.llama_peer import start_servers

    urls = start_servers(stack, target, draft, args.peer_spec, args.threads, 4096)
    return {f"llama-server|{name}": lambda ids, n, eos, url=url: _llama(url, ids, n, eos)
            for name, url in urls.items()}


def _memory(args, target, draft, app_mem: dict) -> list[dict]:
    """Resident memory, 8 slots of 2048 tokens with the draft: llama-server's one process
    against our model processes (the target and draft actors; the engine replica apart)."""
    from specdec_bench.llama_peer import LlamaServer

    threads = args.threads or os.cpu_count() or 2
    with LlamaServer(target, ["-md", str(draft), "-td", str(threads),
                              "--spec-type", "draft-simple"],
                     threads, slots=8, ctx_per_slot=2048) as server:
        server.complete(list(range(100, 400)), 16)
        peer = server.rss_bytes() / 2**20
    models = sum(m["rss_mb"] for name, m in app_mem.items() if name != "engine_replica")
    return [{"system": "llama-server (-np 8 -c 16384, -md draft)", "rss_mb": round(peer),
             "peak_mb": None, "vs_peer": 1.0},
            *({"system": f"ours: {name}", "rss_mb": round(m["rss_mb"]),
               "peak_mb": round(m.get("peak_rss_mb") or 0) or None,
               "vs_peer": None} for name, m in sorted(app_mem.items())),
            {"system": "ours: model processes (target + draft)", "rss_mb": round(models),
             "peak_mb": None, "vs_peer": round(models / peer, 2)}]


def main(args) -> int:
    from specdec.engine.spec import EngineSpec
    from specdec.model.checkpoint.gguf_file import gguf_in
    from specdec_bench.llama_peer import llama_bin

    spec = EngineSpec.from_config_file(args.config)
    tok = load_tokenizer(hub.resolve(spec.target.model))
    target = gguf_in(hub.resolve(spec.target.model))
    draft = gguf_in(hub.resolve(spec.draft.model)) if spec.draft else None
    peer = not args.no_peer and llama_bin() is not None and target is not None
    modes = {"off": {"mode": "off"}, "auto": {"mode": "auto"},
             "on": {"mode": "on", "method": "draft"}}
    per_system = args.repeats * (len(TURNS) + len(args.sizes))
    total = per_system * (len(args.modes) + (1 + len(args.peer_spec) if peer else 0))
    if not peer:
        print("llama-server rows skipped: " + ("--no-peer" if args.no_peer else
                                              "not built (make peer)"), flush=True)
    rows = []
    with contextlib.ExitStack() as stack:
        systems = _peers(stack, args, target, draft) if peer else {}
        c, model, _ = stack.enter_context(_ours_served(args.config))
        for mode in args.modes:
            systems[f"ours, served|{mode}"] = \
                lambda ids, n, eos, mode=mode: _ours(c, model, ids, n, modes[mode], eos)
        progress = Progress("bench chat", total=total, unit=" requests")
        results = interleaved(systems, tok, args, progress)
        progress.close()
        engine = c.get("/health").json()["engine"]
    for name, (conv, longs) in results.items():
        system, mode = name.split("|")
        rows += _summary(system, mode, conv, longs)
    print_table(rows, ["system", "mode", "workload", "prompt_tokens", "cached", "ttft_s",
                       "decode_tps", "e2e_s", "tokens"],
                title=f"{args.config}: one client, {args.max_tokens} new tokens a reply "
                      f"(greedy), medians of {args.repeats}, the systems taking turns")
    ratio_rows = ratios(rows)
    if ratio_rows:
        print_table(ratio_rows, ["mode", "workload", "ttft_vs_peer", "decode_vs_peer",
                                 "decode_vs_own_short"],
                    title="ratios in this run: ours / llama-server plain (time to first token: "
                          "lower is better; decode: higher), and our decode / ours on the "
                          "short prompt")
    prefix = engine.get("prefix_cache", {})
    print(f"\nours: prefix cache target {prefix.get('target')}\n      draft {prefix.get('draft')}")
    mem = _memory(args, target, draft, engine.get("memory_mb") or {}) if peer and draft else []
    if mem:
        print_table(mem, ["system", "rss_mb", "peak_mb", "vs_peer"],
                    title="resident memory, MB (8 slots of 2048 tokens; ours after the run)")
    write_json(args.json, {"rows": rows, "ratios": ratio_rows, "memory": mem,
                           "prefix_cache": prefix})
    return 0


