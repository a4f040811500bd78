"""On CUDA: how many times a captured verify step and a captured draft round wait for the
device. Each should wait once (its one copy to the host); every other wait is a host stall
in the middle of a step. Counted with torch's sync debug mode (a warning per synchronising
call), after a first call of each shape (the capture) is made uncounted.

    python3 scripts/gpu_sync_check.py TARGET_CKPT DRAFT_CKPT
"""

from __future__ import annotations

import sys
import warnings

import torch

from specdec.model.step.batch import BatchInput
from specdec.model.step.cuda_graph import CapturedDecoder
from specdec.model.step.decoder import Decoder
from specdec.model.step.sampling import SamplingParams, make_generator
from specdec.spec_decode.proposal import ProposeInput
from specdec.spec_decode.proposers import DraftModelProposer
from specdec.spec_decode.target_runner import TargetRow, verify_step


def _waits(fn, *args) -> int:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def verify_waits(path: str) -> dict:
    model = CapturedDecoder(Decoder.from_checkpoint(path, torch.bfloat16, "cuda"))
    cache = model.new_cache(4, 256)
    model(BatchInput.build([(s, 0, list(range(100, 140))) for s in range(4)], "cuda"), cache)
    out = {}
    for label, temp in (("greedy", 0.0), ("sampled", 0.8)):
        params = {f"r{s}": SamplingParams(temperature=temp, seed=s) for s in range(4)}
        gens = {s: make_generator(p.seed) for s, p in params.items()}
        rows = [TargetRow(f"r{s}", s, 40, [7, 8, 9, 10], num_draft=3) for s in range(4)]
        verify_step(model, cache, rows, params, gens)  # captures this bucket
        out[f"verify {label}"] = _waits(verify_step, model, cache, rows, params, gens)
    return out


def draft_waits(path: str) -> dict:
    draft = DraftModelProposer(CapturedDecoder(Decoder.from_checkpoint(path, torch.bfloat16,
                                                                       "cuda")), 4, 256)
    out = {}
    for label, temp in (("greedy", 0.0), ("sampled", 0.8)):
        inputs = [ProposeInput(f"{label}{s}", list(range(100, 140)), 4,
                               SamplingParams(temperature=temp, seed=s)) for s in range(4)]
        draft.propose(inputs)  # the prefill
        draft.propose(inputs)  # captures the catch-up bucket and the loop
        out[f"draft round {label}"] = _waits(draft.propose, inputs)
        for i in inputs:
            draft.release(i.seq_id)
    assert draft._loop.loop_rounds >= 2, "the draft did not run its loop"
    return out


if __name__ == "__main__":
    counts = {**verify_waits(sys.argv[1]), **draft_waits(sys.argv[2])}
    for name, n in counts.items():
        print(f"{name}: {n} wait(s) for the device{'' if n <= 1 else '  <-- more than one'}")
