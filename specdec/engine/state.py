"""What the engine keeps per step and per running sequence, and its limits: the types the
step loop (specdec/engine/engine.py), the policy and the metrics share."""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Callable

from specdec.engine.request import Request
from specdec.engine.stop import Detokenizer
from specdec.model.step.grammar import GrammarState
from specdec.spec_decode.counters import SpecCounters
from specdec.spec_decode.logprobs import TokenLogprob
from specdec.spec_decode.overlap import Settled
from specdec.spec_decode.proposal import Proposal
from specdec.spec_decode.target_runner import TargetResult


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """What the step loop is held to. Served engines take it from EngineSpec.limits() (the
    validated config, whose defaults are these)."""

    max_tokens_per_step: int = 512   # prefill chunks fill what decode rows leave
    min_prefill_chunk: int = 32      # so a prefill advances even under a full decode batch
    max_waiting: int = 64            # queued requests beyond this are refused (overload)
    # Sequences at once (None: one per KV slot; fewer leaves slots that only keep prefixes).
    max_running: int | None = None
    prefix_cache: bool = True        # start a request from the longest cached prefix


@dataclasses.dataclass(kw_only=True)
class StepRecord:
    """One step's timeline and what it carried: the policy fits its costs on it, metrics
    export it, and `bench served` breaks a request's time down with it."""
    rows: int               # rows in the target forward (decode, speculative, prefill)
    tokens: int             # tokens through the target forward
    draft_s: float          # all proposers, wall time seen by the engine
    verify_s: float         # the target call, wall time seen by the engine
    max_k: int = 0          # the longest draft of the step (draft forwards run in sequence)
    # The draft model's own share: rows it drafted for, the largest k asked of it (its
    # forwards run in sequence, rows batched), and its time. The policy fits its cost on it.
    draft_rows: int = 0
    draft_k: int = 0
    draft_model_s: float = 0.0
    prefill_tokens: int = 0
    plan_s: float = 0.0     # policy and batch building before the draft call
    post_s: float = 0.0     # rejection results applied: stops, detokenizing, streaming
    step_s: float = 0.0     # the whole step
    # Inside the other processes (equal to the wall times when they run in this one):
    # the difference is the call itself (serialization, scheduling, transport).
    draft_compute_s: float = 0.0
    target_compute_s: float = 0.0
    draft_bytes: int = 0    # bytes crossing to and from the draft (0 in-process)
    target_bytes: int = 0
    end: float = 0.0        # time.perf_counter() at the step's end
    mean_k: float = 0.0     # guesses per drafting row this step (the k the policy chose)
    overlapped: bool = False  # the draft worked during the target's step (overlap)
    resolve_s: float = 0.0  # overlap: settling the deferred positions after both finished
    emitted: int = 0        # tokens the step's decode rows emitted
    # Most context tokens a drafted row's draft had to catch up on before guessing (a first
    # round prefills the prompt): the policy prices rounds from steps without a catch-up.
    draft_catchup: int = 0
    draft_catchup_total: int = 0  # the same summed over the rows (one batched forward)
    # Sequential steps: prompt tokens the draft took in beside the target's prefill, in a
    # call of its own (rows it did so for, its time), priced as a catch-up apart from any
    # round (specdec/engine/planner.py::_catch_up).
    prompt_catchup: int = 0
    prompt_catchup_rows: int = 0
    prompt_catchup_s: float = 0.0
    # The step compiled or captured a graph (a new bucket under step compiled/captured):
    # its time was mostly the build, so the policy does not price the shape from it.
    graph_built: bool = False


@dataclasses.dataclass
class Seq:
    req: Request
    slot: int
    tokens: list[int]
    prompt_len: int
    cached: int = 0                  # tokens in the target's KV cache
    detok: Detokenizer | None = None
    spec: SpecCounters = dataclasses.field(default_factory=SpecCounters)
    k_now: int = 0
    finished: bool = False
    admitted: float = 0.0            # time.monotonic() when it got a slot
    first_token: float | None = None
    # Overlap: guesses the draft made during the last step, valid for the current context
    # (their head was kept), to be verified in this step.
    predrafted: Proposal | None = None
    # Context length at this row's last draft call: what the draft has to catch up on
    # before its first guess (the whole prompt on a first round, a plain stretch after it).
    draft_seen: int = 0
    # Prompt tokens whose K/V came from the prefix cache (not computed for this request).
    reused: int = 0
    # Free guesses: a row decoding plainly this step may still verify the suffix index's
    # confident guesses (no forward to make them); up to k_free of them, counted in `free`
    # (not in `spec`, which judges the request's own method).
    k_free: int = 0
    free: SpecCounters = dataclasses.field(default_factory=SpecCounters)
    # Per generated token, where the request asked for them (spec_decode/logprobs.py).
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    # Structured output: the grammar's matcher at the tokens emitted so far.
    grammar: GrammarState | None = None

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def held(self) -> int:
        """Tokens whose K/V the target's slot holds for this sequence: the first `cached`
        (a stop string may cut output the cache already holds: only tokens kept count)."""
        return min(self.cached, len(self.tokens))


@dataclasses.dataclass(kw_only=True)
class StepRun:
    """What running a step's plan gave: the target's results per row, the draft's window
    settled (overlap; empty otherwise), and the target call's times and bytes."""
    results: list[TargetResult]
    settled: Settled
    verify_s: float          # the target call, wall time seen by the engine
    target_compute_s: float  # the same inside the target's processes
    target_bytes: int


# (the engine as the policy sees it: policy/view.py, request, its counters, rows running,
# catchup=tokens the draft has not seen) -> k
KChooser = Callable[..., int]


def pinned_plain(req: Request) -> bool:
    """Plain for good: no method, or plain pinned by the caller (k fixed at 0)."""
    return req.method == "none" or (req.speculation.pins_k and req.k == 0)


def load_report(waiting: int, pinned_waiting: int, running: list[Seq], free_slots: int,
                recent: list[StepRecord]) -> dict:
    """Engine.load(): what the policy, the metrics and /health read of the batch."""
    n = max(len(recent), 1)
    return {
        "running": len(running), "waiting": waiting,
        # Rows that decode plainly whatever the policy decides (the policy prices a
        # speculative batch with them: they wait for every verify, draft nothing).
        "pinned_running": sum(pinned_plain(s.req) for s in running),
        "pinned_waiting": pinned_waiting,
        # Rows that follow the policy's per-step decision, by method (the policy probes
        # a step shape for them), and rows that asked for speculation whatever it costs.
        "following": dict(collections.Counter(
            s.req.method for s in running if not pinned_plain(s.req)
            and not s.req.speculation.pins_k)),
        "speculating_on_request": sum(s.req.speculation.on and not pinned_plain(s.req)
                                      for s in running),
        "free_slots": free_slots,
        "tokens_per_step": sum(r.tokens for r in recent) / n,
        # The typical step's prefill (median over the last 16 steps, idle ones as 0;
        # usually 0): one long prompt must not make every decode step look like a
        # prefill step to the policy.
        "prefill_tokens_per_step": statistics.median(
            [r.prefill_tokens for r in recent] + [0] * (16 - len(recent))),
        "step_s": sum(r.step_s for r in recent) / n,
    }
