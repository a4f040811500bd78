"""Measure the policy's costs before the first request.

The policy prices a speculative round from the target's step time as a function of the
tokens in its forward and from the draft's round time as a function of k and rows, both
learned from the steps it observes. Until it has seen enough of them it assumes the target
is memory bound (a verify of k+1 tokens per row costs one plain step), which is true of a
GPU at small batches and false of a CPU past a few tokens, where a verify of a few rows
costs several plain steps: from that assumption the policy would speculate at loads where
plain decoding is faster. And steady traffic shows few batch shapes, which alone cannot
separate a fixed cost from a per-token one.

So at start-up, after the warm-up, the engine runs a short grid of batches (1 row and a
full batch; plain and each draft at a short and a long k) and gives those steps to the
policy as its prior (specdec/policy/cost_model.py): live steps of the same shape replace them,
and the policy probes the shapes its batch does not run, so a calibration taken on a busy
machine costs a minute of serving, not the app's life. Only costs are learned here: the
prompts are arbitrary ids, so acceptance (which they would understate) and lengths are not
observed.

A busy machine is also said out loud: the steps of one shape repeat across the grid (every
run starts with a prefill of the same length), so their spread tells a quiet machine from a
noisy one, and the load average tells whether something else ran beside us.

Every run's prompt starts with a token of its own, so the prefix cache reuses nothing: each
run prefills as a new request would. One last run catches the draft up on a long prompt it
has not seen (beside its prefill, as a row that drafts from its first round is): the prior
of what a catch-up costs per token. A slot under 72 tokens leaves no such prior (a catch-up
is priced from the target's step times the draft's cost ratio until one is measured).
"""

from __future__ import annotations

import logging
import os
import statistics
import time

from specdec.engine.engine import Engine
from specdec.engine.request import Request
from specdec.model.step.sampling import SamplingParams
from specdec.policy.engine_policy import EnginePolicy

log = logging.getLogger(__name__)
PROMPT_TOKENS = 16     # a prefill step of a realistic size per row
CATCHUP_TOKENS = 128   # the draft's catch-up run


def _prompt(run: int, vocab: int, n: int = PROMPT_TOKENS) -> list[int]:
    """A prompt no other run shares a prefix with: its first two tokens are the run's own
    (ids from 3, clear of the usual special tokens, below the vocabulary's size)."""
    span = max(vocab - 3, 2)
    head = [3 + (run // span) % span, 3 + run % span]
    return head + [3 + (run * 31 + j) % span for j in range(n - 2)]


def calibrate(engine: Engine, policy: EnginePolicy, k_max: int) -> dict:
    """Run the grid, feed every step to the policy's cost fits as anchors; return what was
    run (rows, method, k, steps) and how long it took."""
    t0 = time.perf_counter()
    slots = engine.scheduler.max_running  # (slots that only keep prefixes run nothing)
    sizes = sorted({1, slots})
    drafts = [m for m, p in engine.proposers.items()
              if m == "draft" and p.available]
    # Speculative runs last three full rounds after the prefill: a row's first round also
    # prefills the draft with its prompt, which the policy does not take as a round's cost.
    grid = [("none", 0, 3)] + [(m, k, 1 + 3 * (k + 1)) for m in drafts
                               for k in sorted({min(2, k_max), k_max})]
    runs = []
    shapes: dict[int, list[float]] = {}

    def observe(rec) -> None:
        policy.calibrate_step(rec)
        if not rec.graph_built:  # a build's time says nothing of the machine's noise
            shapes.setdefault(rec.tokens, []).append(rec.step_s - rec.draft_s)

    engine.on_step.append(observe)
    vocab, n = engine.target.vocab_size, 0
    try:
        for rows in sizes:
            for method, k, max_tokens in grid:
                before = engine.steps
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                        ignore_eos=True)
                engine.run([Request.pinned(f"calibrate-{rows}-{method}-{k}-{i}",
                                           _prompt(n + i, vocab), params, method, k)
                            for i in range(rows)])
                n += rows
                runs.append({"rows": rows, "method": method, "k": k,
                             "steps": engine.steps - before})
        for method in drafts:  # one round that first catches the draft up on a long prompt
            before = engine.steps
            length = min(CATCHUP_TOKENS, engine.target.max_len - 8)
            engine.run([Request.pinned("calibrate-catchup", _prompt(n, vocab, length),
                                       SamplingParams(temperature=0.0, max_tokens=4,
                                                      ignore_eos=True),
                                       method, 2)])
            runs.append({"rows": 1, "method": method, "k": 2, "catchup": length,
                         "steps": engine.steps - before})
    finally:
        engine.on_step.remove(observe)
    out = {"runs": runs, "seconds": round(time.perf_counter() - t0, 2), **noise(shapes)}
    if out["noisy"]:
        log.warning("start-up calibration ran on a busy or noisy machine (%s); its step "
                    "costs are a prior only: live steps and probes replace them within a "
                    "minute of serving", out["noise"])
    return out


NOISY_SPREAD = 0.15  # relative spread of repeats of one shape beyond which costs are noise
BUSY_LOAD = 1.5      # load average per core beyond which something else competes with us


def noise(shapes: dict[int, list[float]], load_average: float | None = None,
          cores: int | None = None) -> dict:
    """How far to trust the calibration: the median, over shapes run 3+ times, of the
    relative spread of their times (median absolute deviation / median), and the machine's
    1-minute load average per core (ours keeps it near 1)."""
    spreads = []
    for times in shapes.values():
        if len(times) >= 3:
            mid = statistics.median(times)
            mad = statistics.median(abs(t - mid) for t in times)
            spreads.append(mad / mid if mid > 0 else 0.0)
    spread = statistics.median(spreads) if spreads else None
    cores = cores or os.cpu_count() or 1
    if load_average is None:
        try:
            load_average = os.getloadavg()[0]
        except OSError:  # not every platform has one
            load_average = None
    per_core = load_average / cores if load_average is not None else None
    reasons = []
    if spread is not None and spread > NOISY_SPREAD:
        reasons.append(f"repeated steps of one shape spread by {spread:.0%}")
    if per_core is not None and per_core > BUSY_LOAD:
        reasons.append(f"load average {load_average:.1f} on {cores} cores")
    return {"spread": None if spread is None else round(spread, 3),
            "load_per_core": None if per_core is None else round(per_core, 2),
            "noisy": bool(reasons), "noise": "; ".join(reasons) or "quiet"}
