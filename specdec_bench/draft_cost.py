"""What a draft guess costs against a target step, and why: the application config's draft
and target forwards (one token, greedy ids, in process), taking turns so a drifting machine
moves both alike, beside the bytes of weights each step reads.

    .venv/bin/python -m specdec_bench.draft_cost [--config serve_config.yaml] [--context 200]

c, the policy's draft cost (a guess's forward over a plain target step), is bounded below
by the two models' weight bytes as long as both steps stream their weights at the same
rate: a lower c then needs fewer draft bytes (a smaller format or model), not a faster
kernel. The table gives both ratios and each step's effective bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.progress import Progress
from specdec_bench.table import print_table, write_json


def _step_bytes(model) -> int:
    """Weight bytes a decode step reads: all but the embedding table, which is indexed."""
    from specdec.model.formats.embedding import table_bytes

    return model.weight_bytes() - table_bytes(model.embed)


def _load(group, vocab_limit=None):
    from specdec.model.step.decoder import Decoder
    from specdec.pack import hub

    return Decoder.from_checkpoint(hub.resolve(group.model), group.dtype,
                                   vocab_limit=vocab_limit)


def _timer(model, context: int):
    """A one-token step at `context` tokens, timed; the context prefilled once."""
    from specdec.model.step.batch import BatchInput

    cache = model.new_cache(1, context + 4096)
    with torch.inference_mode():
        model(BatchInput.build([(0, 0, list(range(100, 100 + context)))], "cpu"), cache)
    pos = [context]

    def step() -> float:
        # The same position each time (its K/V overwritten): the context stays `context`.
        with torch.inference_mode():
            t = time.perf_counter()
            model(BatchInput.build([(0, pos[0], [5])], "cpu"), cache, argmax=True)
            return time.perf_counter() - t
    return step


def main(args) -> int:
    from specdec.engine.spec import EngineSpec

    spec = EngineSpec.from_config_file(args.config)
    if spec.draft is None:
        raise SystemExit(f"{args.config}: no draft")
    torch.set_num_threads(spec.target.threads_per_rank())
    draft = _load(spec.draft, spec.draft.vocab_limit)
    target = _load(spec.target)
    steps = {"draft": _timer(draft, args.context), "target": _timer(target, args.context)}
    times: dict[str, list[float]] = {"draft": [], "target": []}
    progress = Progress("draft_cost", args.repeats)
    for _ in range(args.repeats):
        for name in ("draft", "target"):  # alternating, step by step
            times[name].extend(steps[name]() for _ in range(args.steps))
        progress.advance()
    progress.close()
    nbytes = {"draft": _step_bytes(draft), "target": _step_bytes(target)}
    med = {n: statistics.median(ts) for n, ts in times.items()}
    rows = [{"model": n, "format": getattr(spec, n).dtype,
             "weights read, MB": round(nbytes[n] / 1e6, 1),
             "step, ms": round(med[n] * 1e3, 2),
             "GB/s": round(nbytes[n] / med[n] / 1e9, 1)} for n in ("draft", "target")]
    print_table(rows, list(rows[0]), f"one-token steps at {args.context} tokens of context, "
                f"{spec.target.threads_per_rank()} threads, medians of "
                f"{args.repeats * args.steps}")
    c = med["draft"] / med["target"]
    floor = nbytes["draft"] / nbytes["target"]
    print(f"\nc (draft step / target step) {c:.3f}; weight bytes ratio {floor:.3f} "
          f"(c at equal bandwidth)")
    write_json(args.json, {"rows": rows, "c": c, "bytes_ratio": floor})
    return 0


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=15, help="turns of each model")
    ap.add_argument("--steps", type=int, default=4, help="steps per turn")
    ap.add_argument("--json", default=None)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    raise SystemExit(main(parser.parse_args()))
