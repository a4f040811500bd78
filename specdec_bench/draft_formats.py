"""The draft's weight format: its cost c (a draft step over a target step), its acceptance
and the tokens/s it gives, in process, beside plain decoding of the same target.

    .venv/bin/python -m specdec_bench.draft_formats [--formats int8 int8-dynamic float16]

The target runs in serve_config.yaml's format; each draft format is assembled in turn and
runs the same greedy prompts at each k (median tokens/s over prompts x repeats).
"""

from __future__ import annotations

import argparse
import copy
import sys

from specdec.engine.spec import EngineSpec
from specdec.pack.tokenizer import prompt_ids
from specdec.progress import Progress
from specdec.spec_decode.speculation import Speculation
from specdec_bench.served import _local_engine, _one_local, _prompts
from specdec_bench.table import median, print_table


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--formats", nargs="+", default=["int8", "int8-dynamic", "float16"])
    ap.add_argument("--k", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    base = EngineSpec.from_config_file(args.config)
    prompts = _prompts(["code", "chat_code"], 2)
    modes = [("plain", Speculation(mode="off"))] + [
        (f"k={k}", Speculation(mode="on", method="draft", k=k)) for k in args.k]
    progress = Progress("draft formats", total=len(args.formats) * len(modes) * len(prompts)
                        * args.repeats, unit=" requests")
    rows = []
    for fmt in args.formats:
        doc = copy.deepcopy(base.model_dump())
        doc["draft"]["dtype"] = fmt
        spec = EngineSpec.model_validate(doc)
        with _local_engine(spec) as built:
            history = built.engine.history
            for name, wanted in modes:
                rates, mal, draft_ms, target_ms = [], [], [], []
                for _ in range(args.repeats):
                    for text, chat in prompts:
                        rate, m = _one_local(built, prompt_ids(built.tokenizer, text, chat),
                                             args.max_tokens, wanted)
                        rates.append(rate)
                        mal += [m] if m else []
                        for rec in list(history)[-20:]:
                            if rec.draft_k and not rec.draft_catchup and not rec.prefill_tokens:
                                draft_ms.append(1e3 * rec.draft_model_s / rec.max_k)
                            if not rec.prefill_tokens:
                                target_ms.append(1e3 * rec.verify_s)
                        progress.advance()
                rows.append({"draft dtype": fmt, "mode": name, "tokens_per_s": median(rates),
                             "mean_acceptance_length": median(mal) if mal else None,
                             "draft_ms_per_guess": median(draft_ms) if draft_ms else None,
                             "target_step_ms": median(target_ms)})
    progress.close()
    plain = median([r["tokens_per_s"] for r in rows if r["mode"] == "plain"])
    for r in rows:
        r["vs_plain"] = r["tokens_per_s"] / plain
        if r["draft_ms_per_guess"]:
            r["c"] = r["draft_ms_per_guess"] / median(
                [x["target_step_ms"] for x in rows if x["mode"] == "plain"])
    print_table(rows, ["draft dtype", "mode", "tokens_per_s", "vs_plain",
                       "mean_acceptance_length", "draft_ms_per_guess", "target_step_ms", "c"],
                title=f"draft formats, target {base.target.dtype}, one client, "
                      f"{args.max_tokens} tokens, greedy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
