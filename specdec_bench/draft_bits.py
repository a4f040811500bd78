"""What a draft with fewer bits a weight would keep: its agreement with the target and the
speedup the cost model gives it, before anyone writes its kernel.

    .venv/bin/python -m specdec_bench.draft_bits [--bits 4 3] [--c 0.282]

A draft step reads its weights once, so its cost c falls with their bytes; but a draft
rounded further agrees with the target less often, and every disagreement ends a round.
The target (the application config's format) writes its own greedy replies to mixed
prompts (code, prose, SQL); the draft, with each projection rounded to `bits` in Q4_K's
block structure (a scale and a minimum per 32 weights, 6-bit multiples of a per-256
fp16 d), reads the same tokens, teacher-forced. Agreement is how often its argmax is the
target's token (a greedy round's per-guess acceptance); at temperature 0.7, sum(min(p,
q)) is a sampled round's. c at `bits` scales the measured c (specdec_bench.draft_cost) by
the bytes ratio, as if the step's overhead shrank with its bytes (the best case), and the
speedup over plain is the cost model's best over k: E[tokens a round] / (1 + k c).
"""

from __future__ import annotations

import argparse

import torch

from specdec.progress import Progress
from specdec_bench.table import print_table, write_json

QK = 256      # weights per block (one fp16 d and dmin)
GROUP = 32    # weights per sub-block (its own 6-bit scale and minimum)


def round_to_bits(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """Float weights [N, K] (K a multiple of 32) rounded to `bits` in Q4_K's structure, back
    as floats. At 4 bits this is q4k.quantize's rounding, value for value."""
    levels = 2 ** bits - 1
    n, k = weight.shape
    w = torch.nn.functional.pad(weight.float(), (0, -k % QK))
    w = w.reshape(n, -1, QK // GROUP, GROUP)
    lo = w.amin(dim=-1).clamp(max=0.0)
    sub_scale = (w.amax(dim=-1) - lo) / levels
    d = (sub_scale.amax(dim=-1) / 63.0).half().float()
    dmin = ((-lo).amax(dim=-1) / 63.0).half().float()
    scales = torch.round(sub_scale / torch.where(d > 0, d, 1.0).unsqueeze(-1)).clamp(0, 63)
    mins = torch.round(-lo / torch.where(dmin > 0, dmin, 1.0).unsqueeze(-1)).clamp(0, 63)
    step = (d.unsqueeze(-1) * scales).unsqueeze(-1)
    offset = (dmin.unsqueeze(-1) * mins).unsqueeze(-1)
    q = torch.round((w + offset) / torch.where(step > 0, step, 1.0))
    q = torch.where(step > 0, q, 0.0).clamp(0, levels)
    return (step * q - offset).reshape(n, -1)[:, :k]


def bits_per_weight(bits: int) -> float:
    """Stored bits a weight: the weights, 8 6-bit scales and minimums, two fp16 per block."""
    return (QK * bits + 8 * 6 * 2 + 2 * 16) / QK


def expected_speedup(alpha: float, c: float, k_max: int = 8) -> tuple[float, int]:
    """The cost model's best speedup over plain decoding and its k, for a per-guess
    acceptance alpha and a guess costing c of a target step."""
    best = max((sum(alpha ** i for i in range(k + 1)) / (1 + k * c), k)
               for k in range(1, k_max + 1))
    return round(best[0], 3), best[1]


def _rounded(draft, bits: int):
    from specdec.model.formats.linear import DenseLinear

    for layer in draft.layers:
        for key in ("qkv", "o", "gate_up", "down"):
            lin = layer.w[key]
            layer.w[key] = DenseLinear(round_to_bits(lin.weight, bits), lin.bias)
    draft.lm_head = DenseLinear(round_to_bits(draft.lm_head.weight, bits), None)
    return draft


def _all_logits(model, ids: list[int]) -> torch.Tensor:
    from specdec.model.step.batch import BatchInput

    cache = model.new_cache(1, len(ids) + 8)
    return model(BatchInput.build([(0, 0, ids)], "cpu"), cache,
                 logit_indices=torch.arange(len(ids)))


def _greedy_reply(target, ids: list[int], tokens: int) -> list[int]:
    from specdec.model.step.batch import BatchInput

    cache = target.new_cache(1, len(ids) + tokens + 8)
    out, pos, new = list(ids), 0, list(ids)
    for _ in range(tokens):
        nxt = int(target(BatchInput.build([(0, pos, new)], "cpu"), cache, argmax=True)[0])
        pos, new = pos + len(new), [nxt]
        out.append(nxt)
    return out


def main(argv=None) -> int:
    from specdec.engine.spec import EngineSpec
    from specdec.model.step.decoder import Decoder
    from specdec.pack import hub
    from specdec.pack.tokenizer import chat_ids, load_tokenizer
    from specdec_bench.repeat import MIXED

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 3])
    ap.add_argument("--tokens", type=int, default=96, help="the target's reply per prompt")
    ap.add_argument("--c", type=float, default=0.282,
                    help="the draft's measured c at 4 bits (specdec_bench.draft_cost)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    spec = EngineSpec.from_config_file(args.config)
    if spec.draft is None:
        raise SystemExit(f"{args.config}: no draft")
    torch.set_num_threads(spec.target.threads_per_rank())
    tpath, dpath = hub.resolve(spec.target.model), hub.resolve(spec.draft.model)
    vocab = spec.draft.vocab_limit
    target = Decoder.from_checkpoint(tpath, spec.target.dtype)
    tok = load_tokenizer(tpath)
    progress = Progress("draft bits", total=len(MIXED) * (1 + len(args.bits) + 1),
                        unit=" passes")
    seqs = []
    for _, prompt in MIXED:
        ids = chat_ids(tok, [{"role": "user", "content": prompt}])
        seqs.append((len(ids), _greedy_reply(target, ids, args.tokens)))
        progress.advance()
    targets = [_all_logits(target, s)[:, :vocab] for _, s in seqs]
    rows = []
    for bits in [None, *args.bits]:
        draft = Decoder.from_checkpoint(dpath, "float32", vocab_limit=vocab)
        if bits is not None:
            draft = _rounded(draft, bits)
        agree = accept = n = 0
        for (n0, s), tl in zip(seqs, targets, strict=True):
            dl = _all_logits(draft, s)[n0 - 1:-1]
            agree += (dl.argmax(-1) == torch.tensor(s[n0:])).sum().item()
            p = torch.softmax(tl[n0 - 1:-1] / 0.7, -1)
            accept += torch.minimum(p, torch.softmax(dl / 0.7, -1)).sum().item()
            n += len(s) - n0
            progress.advance()
        alpha = agree / n
        row = {"draft": "checkpoint floats" if bits is None else f"{bits}-bit",
               "bits/weight": 32.0 if bits is None else bits_per_weight(bits),
               "greedy agreement": round(alpha, 3), "sampled acceptance": round(accept / n, 3)}
        if bits is not None:
            c = args.c * bits_per_weight(bits) / bits_per_weight(4)
            row["c (best case)"] = round(c, 3)
            row["speedup"], row["best k"] = expected_speedup(alpha, c)
        rows.append(row)
    progress.close()
    print_table(rows, list(rows[-1]), title=(
        f"the draft ({spec.draft.model}) rounded to fewer bits against the target "
        f"({spec.target.model}, {spec.target.dtype}): {len(MIXED)} mixed prompts, "
        f"{args.tokens} target tokens each, teacher-forced"))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
