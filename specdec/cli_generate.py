"""`specdec generate`: one prompt through the model core, as text or a JSON record."""

from __future__ import annotations

import json
import time

from specdec import hub
from specdec.generate import dtype_from_name, load_tokenizer, plain_generate
from specdec.model import Decoder
from specdec.sampling import SamplingParams


def run_generate(args) -> int:
    path = hub.resolve(args.target)
    tok = load_tokenizer(path)
    if args.chat:
        prompt_ids = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True,
            return_dict=False)
    else:
        prompt_ids = tok(args.prompt).input_ids
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    model = Decoder.from_checkpoint(path, dtype_from_name(args.dtype))
    load_s = time.perf_counter() - t0
    res = plain_generate(model, [prompt_ids], params)
    ids = res.token_ids[0]
    text = tok.decode(ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({
            "target": str(path), "method": "none", "dtype": args.dtype,
            "prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
            "text": text, "token_ids": ids,
            "load_s": round(load_s, 3), "prefill_s": round(res.prefill_s, 4),
            "decode_s": round(res.decode_s, 4), "tokens_per_s": round(res.tokens_per_s, 2),
        }))
    else:
        print(text)
    return 0
