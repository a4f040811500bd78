"""What `specdec bench served` derives from its rows: ratios against the goals, the cost
shape of each speculative row (c, v, tokens per round) and memory per actor."""

from __future__ import annotations


def ratios(rows: list[dict]) -> list[dict]:
    by = {(r["system"], r["config"]): r["tokens_per_s"] for r in rows}
    hf_assisted = {c: v for (s, c), v in by.items() if s == "transformers" and "assisted" in c}
    best_hf = max(hf_assisted.values(), default=None)
    out = []

    def ratio(name, a, b, goal=None):
        if a is not None and b:
            out.append({"ratio": name, "value": a / b, "goal": goal})

    served_plain = by.get(("ours, served", "plain"))
    for (s, c), v in by.items():
        if s == "ours, served":
            ratio(f"served {c} / in process {c}", v, by.get(("ours, in process", c)),
                  ">= 0.9" if c in ("plain", "auto (policy)") or c.startswith("spec") else None)
    for k in sorted({c.split(",")[0] for (s, c) in by if c.endswith("overlapped")}):
        for system in ("ours, in process", "ours, served"):
            ratio(f"{system}: {k} overlapped / sequential (1+1 cores)",
                  by.get((system, f"{k}, 1+1 cores, overlapped")),
                  by.get((system, f"{k}, 1+1 cores, sequential")), ">= 1.3 (own compute)")
        ratio(f"served {k} overlapped (1+1) / in process {k} (config)",
              by.get(("ours, served", f"{k}, 1+1 cores, overlapped")),
              by.get(("ours, in process", k)), ">= 1.0")
    auto = by.get(("ours, served", "auto (policy)"))
    ratio("served auto / served plain", auto, served_plain, ">= 2.0")
    peer = {c: v for (s, c), v in by.items() if s == "llama.cpp"}
    if peer:
        best = max(peer, key=peer.get)
        ratio(f"served auto / llama.cpp best ({best})", auto, peer[best], ">= 1.3")
        ratio("served plain / llama.cpp plain", served_plain, peer.get("plain"), ">= 1.0")
        ratio("in process auto / llama.cpp best", by.get(("ours, in process", "auto (policy)")),
              peer[best])
    ratio("served auto / best transformers assisted", auto, best_hf, ">= 1.3")
    for c, v in hf_assisted.items():
        ratio(f"served auto / transformers {c}", auto, v)
    return out


def cost_shape(rows: list[dict]) -> list[dict]:
    """Per row with a timeline, against its system's plain row: v = the target's compute per
    step over a plain step's, c = one draft forward (a round's draft compute over its
    guesses) over a plain target step, and the tokens one step emitted (per round)."""
    plain = {r["system"]: r["timeline"].get("target_compute_ms") for r in rows
             if r.get("timeline") and r["config"] == "plain"}
    out = []
    for r in rows:
        t = r.get("timeline") or {}
        t1 = plain.get(r["system"])
        if not t or not t1:
            continue
        guesses = t.get("guesses_per_row") or 0
        drafted = r["config"] != "plain" and guesses > 0
        out.append({"system": r["system"], "config": r["config"],
                    "target_step_ms": t.get("target_compute_ms"),
                    "v": t["target_compute_ms"] / t1,
                    "c": t["draft_compute_ms"] / guesses / t1 if drafted else None,
                    "guesses_per_row": guesses if drafted else None,
                    "tokens_per_round": t.get("emitted_per_step")})
    return out


def memory_rows(rows: list[dict]) -> list[dict]:
    """Resident memory of each process: every actor of the served app (from its /health),
    and llama-server's."""
    out = []
    seen = set()
    for r in rows:
        if r.get("memory_mb") and r["system"] not in seen:
            seen.add(r["system"])
            out += [{"system": r["system"], "process": actor, "rss_GB": m["rss_mb"] / 1e3,
                     "peak_rss_GB": (m.get("peak_rss_mb") or float("nan")) / 1e3}
                    for actor, m in r["memory_mb"].items()]
        elif r["system"] == "llama.cpp" and r.get("rss_GB") is not None:
            out.append({"system": "llama.cpp", "process": f"llama-server ({r['config']})",
                        "rss_GB": r["rss_GB"], "peak_rss_GB": None})
    return out
