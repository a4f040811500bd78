"""`specdec bench core`: plain decoding tokens/s of our core against transformers' generate.

Same model, dtype, prompt and run; batch 1; both forced to emit exactly max_tokens tokens.
Medians over repeats, after one warm-up each, and the ratio ours / HF.
"""

from __future__ import annotations

import gc
import time

import torch

from specdec.model.step.decoder import Decoder
from specdec.model.step.generate import dtype_from_name, plain_generate
from specdec.model.step.sampling import SamplingParams
from specdec.pack import hub
from specdec.pack.tokenizer import load_tokenizer
from specdec.progress import Progress
from specdec_bench.table import median, print_table, write_json

PROMPT = "Write a Python function that checks whether a string is a palindrome.\n"


def _hf_tokens_per_s(path, ids, dtype, n, repeats, progress) -> list[float]:
    from specdec.pack.hub import transformers_model

    ref = transformers_model(path, dtype)
    x = torch.tensor([ids])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
              min_new_tokens=n)
    ref.generate(x, **kw)  # warm-up
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        ref.generate(x, **kw)
        out.append(n / (time.perf_counter() - t))
        progress.advance()
    del ref
    gc.collect()
    return out


def _ours_tokens_per_s(path, ids, dtype, n, repeats, progress) -> list[float]:
    model = Decoder.from_checkpoint(path, dtype)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    plain_generate(model, [ids], params)  # warm-up
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        res = plain_generate(model, [ids], params)
        out.append(len(res.token_ids[0]) / (time.perf_counter() - t))
        progress.advance()
    del model
    gc.collect()
    return out


def main(args) -> int:
    dtype = dtype_from_name(args.dtype)
    rows = []
    progress = Progress("bench core", total=2 * args.repeats * len(args.models), unit=" runs")
    for name in args.models:
        path = hub.resolve(name)
        ids = load_tokenizer(path)(PROMPT).input_ids
        hf = median(_hf_tokens_per_s(path, ids, dtype, args.max_tokens, args.repeats, progress))
        ours = median(_ours_tokens_per_s(path, ids, dtype, args.max_tokens, args.repeats,
                                         progress))
        rows.append({"model": name, "dtype": args.dtype, "new_tokens": args.max_tokens,
                     "hf_tokens_per_s": hf, "ours_tokens_per_s": ours,
                     "ratio_ours_over_hf": ours / hf})
    progress.close()
    print_table(rows, ["model", "dtype", "new_tokens", "hf_tokens_per_s", "ours_tokens_per_s",
                       "ratio_ours_over_hf"],
                title=f"plain decoding, batch 1, median of {args.repeats} (torch threads: "
                      f"{torch.get_num_threads()})")
    write_json(args.json, rows)
    return 0
