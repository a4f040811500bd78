"""Measure the router's costs before the first request.

The policy prices a speculative round from the target's step time as a function of the
tokens in its forward and from the draft's round time as a function of k and rows, both
learned from the steps it observes. Until it has seen enough of them it assumes the target
is memory bound (a verify of k+1 tokens per row costs one plain step), which is true of a
GPU at small batches and false of a CPU past a few tokens: on 2 cores a plain step of 4
rows took 159 ms and a k=4 verify of the same rows 510 ms. Deciding from the assumption,
the router speculated at every load of a concurrency sweep while plain decoding was
20-25% faster from 4 clients up. And steady traffic shows few batch shapes, which alone
cannot separate a fixed cost from a per-token one.

So at start-up, after the warm-up, the engine runs a short grid of batches (1 row and a
full batch; plain and each draft at a short and a long k) and the policy keeps those steps
as anchors of its fits for good. Only costs are learned here: the prompts are arbitrary
ids, so acceptance (which they would understate) and lengths are not observed.
"""

from __future__ import annotations

import time

from specdec.engine import Engine
from specdec.engine_policy import EnginePolicy
from specdec.request import Request
from specdec.sampling import SamplingParams

_PROMPT = list(range(10, 26))  # 16 tokens: a prefill step of a realistic size per row


def calibrate(engine: Engine, policy: EnginePolicy, k_max: int) -> dict:
    """Run the grid, feed every step to the policy's cost fits as anchors; return what was
    run (rows, method, k, steps) and how long it took."""
    t0 = time.perf_counter()
    slots = engine.target.max_slots
    sizes = sorted({1, slots})
    drafts = [m for m, p in engine.proposers.items()
              if m == "draft" and getattr(p, "available", True)]
    grid = [("none", 0, 3)] + [(m, k, k + 2) for m in drafts
                               for k in sorted({min(2, k_max), k_max})]
    runs = []
    observe = policy.calibrate_step
    engine.on_step.append(observe)
    try:
        for rows in sizes:
            for method, k, max_tokens in grid:
                before = engine.steps
                engine.run([Request(f"calibrate-{rows}-{method}-{k}-{i}", _PROMPT,
                                    SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                   ignore_eos=True),
                                    method, k, fixed_k=True) for i in range(rows)])
                runs.append({"rows": rows, "method": method, "k": k,
                             "steps": engine.steps - before})
    finally:
        engine.on_step.remove(observe)
    return {"runs": runs, "seconds": time.perf_counter() - t0}
