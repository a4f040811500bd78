"""`specdec bench formats`: each weight format against an fp32 reference of the same GGUF
weights, beside llama.cpp's own computation of the file, measured the same way.

Held-out text (excerpts of this project's own sources, which no model was trained on) is
continued greedily by each contender for `--tokens` tokens. At every generated position
the fp32 reference, teacher-forced on that contender's own text, says which token it would
have chosen: the agreement is the share of positions where the contender's greedy token
is the reference's. The KL divergence KL(reference || contender) is taken over the
contender's top 20 tokens (all llama-server reports), the same truncation for every row;
ours also get the full-vocabulary KL. Step costs: one decode token and a 5-token verify
at a 256-token context, medians (c_plain and v = verify / plain).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from specdec.model.formats.embedding import table_bytes
from specdec.model.step.batch import BatchInput
from specdec.model.step.decoder import Decoder
from specdec.model.step.generate import plain_generate
from specdec.model.step.sampling import SamplingParams
from specdec.pack.tokenizer import load_tokenizer
from specdec_bench.table import median, print_table, write_json

ROOT = Path(__file__).resolve().parents[1]  # the repository root (specdec_bench/..)
SOURCES = ("specdec/spec_decode/rejection.py", "specdec/model/step/kv_cache.py", "specdec/policy/decide.py",
           "specdec/engine/stop.py", "deployments/ingress.py", "deployments/openai_api.py",
           "specdec/spec_decode/proposers.py", "specdec/model/step/sampling.py")
TOP = 20


def held_out_prompts(tok, n: int, length: int) -> list[list[int]]:
    out = []
    for rel in SOURCES[:n]:
        text = (ROOT / rel).read_text()
        ids = tok(text).input_ids
        mid = len(ids) // 3  # past the imports, into the code
        out.append(ids[mid:mid + length])
    return out


def _positions_logits(model: Decoder, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced log-probs of every next token, one sequence at a time (fp32)."""
    out = []
    for ids in seqs:
        b = BatchInput.build([(0, 0, ids)])
        with torch.no_grad():
            logits = model(b, model.new_cache(1, len(ids) + 1),
                           logit_indices=torch.arange(len(ids)))
        out.append(torch.log_softmax(logits.float(), -1))
    return out


def compare(ref_lp: list[torch.Tensor], prompts: list[list[int]], gens: list[list[int]],
            tops: list[list[dict[int, float]]], full: list[torch.Tensor] | None) -> dict:
    """Agreement and KL of a contender's greedy continuations against the reference.
    tops[s][j]: the contender's top log-probs at generated position j of sequence s."""
    agree = total = 0
    kl_top, kl_full = [], []
    for s, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        for j, token in enumerate(g):
            pos = len(p) + j - 1          # the reference's row predicting generated token j
            lr = ref_lp[s][pos]
            agree += int(lr.argmax()) == token
            total += 1
            kl_top.append(sum(math.exp(lr[i].item()) * (lr[i].item() - v)
                              for i, v in tops[s][j].items()))
            if full is not None:
                lc = full[s][pos]
                kl_full.append(float((lr.exp() * (lr - lc)).sum()))
    row = {"positions": total, "agreement": agree / max(total, 1),
           "KL_top20": sum(kl_top) / max(len(kl_top), 1)}
    if kl_full:
        row["KL_full"] = sum(kl_full) / len(kl_full)
    return row


def step_costs(model: Decoder, reps: int = 9) -> tuple[float, float]:
    """Median ms of a 1-token decode step and a 5-token verify at a 256-token context."""
    cache = model.new_cache(1, 300)
    model(BatchInput.build([(0, 0, list(range(100, 356)))]), cache)
    times = {1: [], 5: []}
    for _ in range(reps):
        for n in (1, 5):
            b = BatchInput.build([(0, 256, list(range(400, 400 + n)))])
            t = time.perf_counter()
            model(b, cache, logit_indices=torch.arange(n))
            times[n].append((time.perf_counter() - t) * 1e3)
    return median(times[1]), median(times[5])


def _ours(path, fmt: str, prompts, tokens: int, ref_model: Decoder) -> dict:
    t = time.perf_counter()
    model = ref_model if fmt == "float32" else Decoder.from_checkpoint(path, fmt)
    load_s = time.perf_counter() - t
    gens = plain_generate(model, prompts, SamplingParams(temperature=0, max_tokens=tokens),
                          eos_ids=()).token_ids
    own = _positions_logits(model, [p + g for p, g in zip(prompts, gens, strict=True)])
    tops = []
    for s, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        rows = own[s][len(p) - 1:len(p) - 1 + len(g)]
        vals, idx = rows.topk(TOP, dim=-1)
        tops.append([dict(zip(i.tolist(), v.tolist(), strict=True))
                     for i, v in zip(idx, vals, strict=True)])
    ref_own = _positions_logits(ref_model, [p + g for p, g in zip(prompts, gens, strict=True)])
    row = compare(ref_own, prompts, gens, tops, own)
    plain_ms, verify_ms = step_costs(model)
    # A decode step reads every weight but the embedding table (only indexed).
    read = model.weight_bytes() - table_bytes(model.embed)
    row.update(contender=f"ours {fmt}", weights_GB=model.weight_bytes() / 1e9,
               read_GB=read / 1e9, GB_per_s=read / 1e9 / (plain_ms / 1e3),
               load_s=load_s, plain_ms=plain_ms, verify5_ms=verify_ms,
               v=verify_ms / plain_ms)
    return row


def _peer(gguf: Path, prompts, tokens: int, ref_model: Decoder, threads: int) -> dict:
    from specdec_bench.llama_peer import LlamaServer, llama_bin

    gens, tops = [], []
    with LlamaServer(gguf, [], threads) as server:
        for p in prompts:
            r = server.complete(p, tokens, n_probs=TOP, ignore_eos=True)
            probs = r["completion_probabilities"]
            gens.append([c["id"] for c in probs])
            tops.append([{t["id"]: t["logprob"] for t in c["top_logprobs"]} for c in probs])
    ref_lp = _positions_logits(ref_model, [p + g for p, g in zip(prompts, gens, strict=True)])
    row = compare(ref_lp, prompts, gens, tops, None)
    bench = llama_bin("llama-bench")
    if bench is not None:
        row.update(_llama_bench(bench, gguf, threads))
    from specdec.model.checkpoint.gguf_file import GGUFCheckpoint

    row["contender"] = "llama.cpp (its Q4_K x Q8_K dot products)"
    row["weights_GB"] = gguf.stat().st_size / 1e9
    embd = GGUFCheckpoint(gguf).nbytes("model.embed_tokens.weight")
    row["read_GB"] = (gguf.stat().st_size - embd) / 1e9
    row["GB_per_s"] = row["read_GB"] / (row["plain_ms"] / 1e3) if "plain_ms" in row else None
    return row


def _llama_bench(exe: Path, gguf: Path, threads: int) -> dict:
    import json
    import subprocess

    out = subprocess.run([str(exe), "-m", str(gguf), "-t", str(threads), "-p", "1,5", "-n",
                          "16", "-r", "3", "-o", "json"], capture_output=True, text=True,
                         timeout=900)
    ms = {}
    for r in json.loads(out.stdout or "[]"):
        n = r["n_prompt"] or r["n_gen"]
        ms["gen" if r["n_gen"] else n] = r["avg_ns"] / 1e6 / (r["n_gen"] or 1)
    plain = ms.get("gen", float("nan"))
    return {"plain_ms": plain, "verify5_ms": ms.get(5, float("nan")),
            "v": ms.get(5, float("nan")) / ms.get(1, float("nan"))}


def main(args) -> int:
    from specdec.model.checkpoint.gguf_file import gguf_in
    from specdec.pack import hub

    torch.set_num_threads(args.threads)
    path = hub.resolve(args.model)
    gguf = gguf_in(path)
    tok = load_tokenizer(path)
    prompts = held_out_prompts(tok, args.prompts, args.prompt_tokens)
    print(f"reference: {args.model} in float32; {len(prompts)} held-out prompts, "
          f"{args.tokens} greedy tokens each", flush=True)
    ref = Decoder.from_checkpoint(path, torch.float32)
    rows = []
    for fmt in args.formats:
        print(f"  ours {fmt} ...", flush=True)
        rows.append(_ours(path, fmt, prompts, args.tokens, ref))
    if args.peer:
        if gguf is None:
            print("  llama.cpp: skipped (the model is not a GGUF)")
        else:
            print("  llama.cpp ...", flush=True)
            rows.append(_peer(gguf, prompts, args.tokens, ref, args.threads))
    shown = [{**r, "agreement": f"{r['agreement']:.3f}", "KL_top20": f"{r['KL_top20']:.4f}",
              "KL_full": f"{r['KL_full']:.4f}" if "KL_full" in r else ""} for r in rows]
    print_table(shown, ["contender", "positions", "agreement", "KL_top20", "KL_full",
                        "weights_GB", "read_GB", "plain_ms", "GB_per_s", "verify5_ms", "v"],
                title="Weight formats against the fp32 reference of the same weights "
                      "(read_GB: bytes a decode step streams; GB_per_s: read_GB / plain step)")
    write_json(args.json, rows)
    return 0
