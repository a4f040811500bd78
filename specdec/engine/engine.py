"""The engine: continuous batching of plain and speculative requests over one target.

Each step: admit waiting requests into free KV slots; ask the proposers for this round's
guesses (one batched call per proposer); run ONE target forward over the ragged batch
(decode rows 1 token, speculative rows 1 + k, prefill chunks with what budget is left);
apply stop rules to what the rejection sampler kept; stream it; tell the proposers how much
was kept. Requests join and leave between steps.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable

from specdec.engine.output import apply_result, make_output
from specdec.engine.planner import Plan, attach_histories, plan_step
from specdec.engine.record import record_step
from specdec.engine.request import Request, RequestOutput
from specdec.engine.scheduler import Scheduler
from specdec.engine.state import (
    EngineLimits,
    KChooser,
    Seq,
    StepRecord,
    StepRun,
    load_report,
)
from specdec.engine.stop import Detokenizer
from specdec.errors import EngineError, ErrorKind, TargetLost
from specdec.model.step.grammar import GrammarSpec, GrammarState, grammar_error
from specdec.model.step.prefix_cache import Choice
from specdec.model.step.static_step import graph_builds
from specdec.policy.view import EngineView
from specdec.spec_decode.counters import SpecCounters
from specdec.spec_decode.overlap import Overlap, Settled
from specdec.spec_decode.proposal import Proposal, Proposer, draft_held_prefix
from specdec.spec_decode.target_runner import TargetResult, TargetRunner

log = logging.getLogger(__name__)


class Engine:
    """The step loop over a scheduler (queue and slots), a planner (k, guesses, the ragged
    batch), the target and the output rules; the policy and the metrics watch it through
    hooks (choose_k, on_step, on_finished, and overlap.on_mode)."""

    def __init__(self, target: TargetRunner, proposers: dict[str, Proposer] | None = None,
                 tokenizer=None, eos_ids: Iterable[int] = (),
                 limits: EngineLimits | None = None, choose_k: KChooser | None = None,
                 overlap: str = "off") -> None:
        self.target = target
        self.proposers = dict(proposers or {})
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.limits = limits or EngineLimits()
        # The policy hook: revisit k between rounds (default: the request's own k).
        self.choose_k = choose_k
        self._policy_view: EngineView | None = None
        # Whether this step's k is a policy probe (a shape run to measure its cost): the
        # probed draft rounds must then run as chosen, not be led by the suffix index.
        self.probing: Callable[[], object] | None = None
        # Ids every model has an embedding row for (a draft may have fewer than its target).
        self.vocab_size = min([target.vocab_size] + [
            v for v in (getattr(p, "vocab_size", None) for p in self.proposers.values())
            if v is not None])
        self.scheduler = Scheduler(target.max_slots, self.limits.max_waiting,
                                   self.limits.max_running, self.limits.prefix_cache)
        self.prefixes = self.scheduler.prefixes
        self._running = self.scheduler.running  # the running sequences, by request id
        self.totals: dict[str, SpecCounters] = collections.defaultdict(SpecCounters)
        self.history: collections.deque[StepRecord] = collections.deque(maxlen=256)
        self.steps = 0
        # Drafting overlapped with verification (specdec/spec_decode/overlap.py): off, on, or
        # auto (measured both ways, the faster kept).
        self.overlap = Overlap(overlap)
        # Observers of every completed step and every finished request (the policy learns
        # its costs and acceptance from them, in one process and served alike).
        self.on_step: list[Callable[[StepRecord], None]] = []
        self.on_finished: list[Callable[[RequestOutput], None]] = []

    # ---- submission (thread-safe) -------------------------------------------------------

    def add_request(self, req: Request) -> None:
        n, m, limit = len(req.prompt_ids), req.params.max_tokens, self.target.max_len
        if n == 0:
            raise EngineError("prompt is empty")
        vocab = self.vocab_size
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            # Refused here, not in the batched forward, where it would fail every request of
            # the step.
            raise EngineError(f"prompt holds token ids outside the models' vocabulary "
                              f"(0..{vocab - 1}): {bad[:5]}", param="prompt")
        if n + m > limit:  # the request's own fault: 400, not a capacity problem
            raise EngineError(
                f"prompt ({n} tokens) + max_tokens ({m}) exceeds the context limit of {limit} "
                "tokens", param="max_tokens")
        if req.params.grammar is not None and req.grammar_start is None:
            req.grammar_start = self.check_grammar(req.params.grammar)
        if req.method != "none" and req.k > 0 and req.method not in self.proposers:
            raise EngineError(f"speculation method {req.method!r} is not available; "
                              f"available: {sorted(self.proposers) or 'none'}")
        self.scheduler.enqueue(req)

    def check_grammar(self, grammar: GrammarSpec, param: str = "response_format") -> object:
        """A grammar the engine can run: it needs the tokenizer (a token's text), and it
        must compile against it (a grammar may name token ids this vocabulary lacks). The
        first one also builds the tokenizer's index (seconds, once). Returns its matcher at
        the start (for Request.grammar_start). Errors name `param`, the request field that
        gave the grammar."""
        if self.tokenizer is None:
            raise EngineError("structured output needs the model's tokenizer", param=param)
        error = grammar_error(grammar)
        if error:
            raise EngineError(f"{param}: the grammar cannot be used: {error}", param=param)
        try:
            state = GrammarState(grammar, self.tokenizer, self.vocab_size, tuple(self.eos_ids))
            state.guesses_and_masks([])
            return state.start
        except ValueError as exc:
            raise EngineError(f"{param}: the grammar cannot be used with this model's "
                              f"tokenizer: {exc}", param=param) from exc

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def load(self) -> dict:
        waiting, pinned_waiting = self.scheduler.waiting_counts()
        return load_report(waiting, pinned_waiting, list(self._running.values()),
                           self.scheduler.free_count(), list(self.history)[-16:])

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step. Whatever goes wrong inside fails the requests it held, with the reason,
        and leaves the engine clean for the next step: never a half-changed state to retry
        on, never a request left waiting for a step that will not come."""
        outputs = [self._finish(seq, "abort") for seq in self.scheduler.take_aborts()]
        self.scheduler.admit(self._start)
        if not self._running:
            return self._observed(outputs, None)
        last = self.history[-1] if self.history else None
        try:
            self._step(outputs)
        except TargetLost as exc:
            log.error("target failed: %s", exc)
            self._fail_all(outputs, f"target failed: {exc}", ErrorKind.TARGET_LOST)
            self.prefixes.clear()  # the group that held the slots' K/V is gone
        except Exception as exc:  # a bug: fail this step's requests, keep serving
            log.exception("engine step failed")
            self._fail_all(outputs, f"internal error in the engine step "
                                    f"({type(exc).__name__}: {exc})", ErrorKind.INTERNAL)
        rec = self.history[-1] if self.history else None
        return self._observed(outputs, rec if rec is not last else None)

    def _observed(self, outputs: list[RequestOutput], rec: StepRecord | None
                  ) -> list[RequestOutput]:
        """Tell the observers (outside the step's error handling: an observer's bug must
        not fail the requests of a step that went well)."""
        try:
            if rec is not None:
                for observe in self.on_step:
                    observe(rec)
            for out in outputs:
                if out.finished:
                    for observe in self.on_finished:
                        observe(out)
        except Exception:  # noqa: BLE001 - observers learn; serving goes on without them
            log.exception("a step observer failed")
        return outputs

    def _fail_all(self, outputs: list[RequestOutput], error: str, kind: ErrorKind) -> None:
        for seq in list(self._running.values()):
            try:
                outputs.append(self._finish(seq, "error", error=error, kind=kind))
            except Exception:  # noqa: BLE001 - its slot is freed all the same
                log.exception("failing request %s", seq.req.request_id)
                self.scheduler.release(seq, keep=False)

    def _step(self, outputs: list[RequestOutput]) -> None:
        """Plan (each row's k, the proposers' guesses, the ragged batch), run (the target's
        forward, the draft's window beside it under overlap, settled after), apply (tokens
        emitted, outputs), then one record of it all."""
        t_start = time.perf_counter()
        builds = self._graph_builds()
        plan = self._plan(self.overlap.for_step(self.proposers.get("draft"), self.target))
        run = self._run(plan)
        t_apply = time.perf_counter()
        self.steps += 1
        graph_built = self._graph_builds() != builds
        emitted = self._apply(plan, run, outputs)
        rec = record_step(plan, run, emitted, t_start, t_apply, graph_built)
        self.history.append(rec)
        drafted = rec.draft_rows or plan.led or any(not w.catchup_only for w in plan.windows)
        self.overlap.observe(rec.overlapped, rec.step_s, rec.emitted, bool(drafted),
                             rec.graph_built)

    def _plan(self, overlapped: bool) -> Plan:
        decode = [s for s in self._running.values() if s.cached >= s.prompt_len]
        prefill = [s for s in self._running.values() if s.cached < s.prompt_len]
        for seq in prefill:
            self._copy_computed_prefix(seq)
        for seq in decode:
            seq.k_now = self._k_for(seq, len(seq.tokens) - seq.cached)
        probing = bool(self.probing and self.probing())  # after k_for: it plans the probe
        for seq in decode:
            seq.k_free = self._k_free(seq, len(seq.tokens) - seq.cached) \
                if not seq.k_now or self._suffix_may_lead(seq, overlapped, probing) else 0
        plan = plan_step(decode, prefill, overlapped, self.proposers, self.target.max_len,
                         self.limits, self.totals)
        attach_histories(plan.rows, self._running, self.eos_ids)
        return plan

    def _run(self, plan: Plan) -> StepRun:
        """The target's forward over the plan's rows, the draft's window (overlap) running
        beside it and settled after; a failed forward never leaves the draft computing into
        the next step."""
        t0 = time.perf_counter()
        draft = self.proposers.get("draft")
        window = self.overlap.start(draft, plan.windows)
        try:
            results = self.target.step(plan.rows)
        except BaseException:
            self.overlap.abandon(window)
            raise
        verify_s = time.perf_counter() - t0
        call = self.target.last_call
        settled = self.overlap.close_window(draft, self.target, window, plan.windows, results)
        return StepRun(results=results, settled=settled, verify_s=verify_s,
                       target_compute_s=call.compute_s if call else verify_s,
                       target_bytes=call.bytes if call else 0)

    def _apply(self, plan: Plan, run: StepRun, outputs: list[RequestOutput]) -> int:
        """Each row's tokens into its sequence, its output into outputs; the tokens the
        decode rows emitted."""
        emitted = 0
        by_id = {r.seq_id: r for r in run.results}
        draft_s = plan.drafting.draft_s + run.settled.draft_s
        for row in plan.rows:
            seq = self._running[row.seq_id]
            if not row.sample:
                seq.cached += len(row.tokens)
                continue
            if plan.num_draft.get(row.seq_id, 0):
                seq.spec.draft_s += draft_s
            seq.spec.verify_s += run.verify_s
            res = by_id[row.seq_id]
            if res.error is not None:  # this row alone failed; the others go on
                outputs.append(self._finish(seq, "error", error=res.error,
                                            kind=ErrorKind.INTERNAL))
                continue
            try:
                settled = self._settled(seq, res, run.settled)
                out = self._advance(seq, row, res, settled, row.seq_id in plan.free,
                                    plan.heads.get(row.seq_id, 0))
            except Exception as exc:  # noqa: BLE001 - this row's (its grammar, say) alone
                log.exception("request %s failed applying its step", row.seq_id)
                outputs.append(self._finish(seq, "error", error=f"internal error applying "
                                            f"the step ({type(exc).__name__}: {exc})",
                                            kind=ErrorKind.INTERNAL))
                continue
            emitted += len(res.tokens) + (1 if settled else 0)
            outputs.append(out)
        return emitted

    def _graph_builds(self) -> tuple[int, ...]:
        return (graph_builds(self.target), *(graph_builds(p) for p in self.proposers.values()))

    @staticmethod
    def _settled(seq: Seq, res: TargetResult, window: Settled):
        """Overlap: the row's settled next token, whether the draft offered a head guess
        and whether it was kept; the rest of the draft's window waits for the next step."""
        if not res.deferred:
            seq.predrafted = None
            return None
        r = window.resolved[seq.req.request_id]
        prop = window.proposals.get(seq.req.request_id)
        seq.predrafted = Proposal(prop.token_ids[1:],
                             None if prop.q_ids is None else prop.q_ids[1:],
                             None if prop.q_probs is None else prop.q_probs[1:]) \
            if r.accepted and prop is not None and len(prop.token_ids) > 1 else None
        return r.token, window.heads.get(seq.req.request_id) is not None, r.accepted

    def _start(self, req: Request, choice: Choice) -> Seq:
        """A running sequence in the chosen slot, starting from the prefix it holds (or will
        hold once the copy from another slot, done before the next forward)."""
        seq = Seq(req, choice.slot, list(req.prompt_ids), len(req.prompt_ids),
                  cached=choice.reuse, admitted=time.monotonic(), reused=choice.reuse)
        if self.tokenizer is not None:
            seq.detok = Detokenizer(self.tokenizer, req.params.stop)
        if req.params.grammar is not None:
            seq.grammar = GrammarState(req.params.grammar, self.tokenizer, self.vocab_size,
                                       tuple(self.eos_ids), start=req.grammar_start)
        draft = self.proposers.get("draft")
        if draft is not None and req.method == "draft":
            # What the draft's own prefix cache holds of the prompt: its first round computes
            # only the rest.
            seq.draft_seen = draft_held_prefix(draft, req.prompt_ids, req.tenant)
        self.target.start_sequence(req.request_id, req.params)
        if choice.copy_from is not None:
            self.target.copy_prefix(choice.copy_from, choice.slot, choice.reuse)
        return seq

    def _copy_computed_prefix(self, seq: Seq) -> None:
        """A prompt still being prefilled takes by copy what another running sequence has
        computed of it since it started (requests that share a system prompt and arrive
        together: the first one's chunks serve the rest)."""
        if len(self._running) < 2:
            return
        found = self.prefixes.source(seq.tokens[: seq.prompt_len], seq.cached,
                                     self.scheduler.running_contents(but=seq),
                                     seq.req.tenant)
        if found is None:
            return
        src, n = found
        self.target.copy_prefix(src, seq.slot, n)
        self.prefixes.copied(n - seq.cached)
        seq.reused += n - seq.cached
        seq.cached = n

    def _view(self) -> EngineView:
        """The engine as the policy sees it, once per step."""
        if self._policy_view is None or self._policy_view.steps != self.steps:
            self._policy_view = EngineView(self.steps, self.load, self.overlap.chosen)
        return self._policy_view

    def _k_for(self, seq: Seq, pending: int) -> int:
        req = seq.req
        if req.method == "none" or req.method not in self.proposers:
            return 0
        if not self.proposers[req.method].available:
            # Down (a draft being rebuilt): a plain round, which says nothing about how
            # often its guesses are kept, so nothing is counted against it.
            return 0
        if self.choose_k is None or req.speculation.pins_k:
            k = req.k
        else:
            # The context the draft has not seen: priced against what the row has left.
            catchup = len(seq.tokens) - seq.draft_seen if req.method == "draft" else 0
            k = self.choose_k(self._view(), req, seq.spec, len(self._running),
                              catchup=catchup)
        if req.speculation.on:  # asked for: a guess every round, whatever the costs say
            k = max(k, 1)
        remaining = req.params.max_tokens - seq.generated
        room = self.target.max_len - seq.cached - pending
        return max(0, min(k, remaining - 1, room))

    def _k_free(self, seq: Seq, pending: int) -> int:
        """Free guesses for a row decoding plainly: the suffix index's, when it offers
        them (suffix.plain_rows), unless the request asked for plain decoding or its free
        guesses have mostly failed (under half of those tested kept: each costs the target a
        verified position)."""
        suffix = self.proposers.get("suffix")
        k = getattr(suffix, "plain_rows_k", 0) if suffix is not None else 0
        req, free = seq.req, seq.free
        if not k or (req.speculation.pins_k and req.k == 0) or not suffix.available:
            return 0
        # Counted over the guesses tested (each round's kept ones and its first rejection),
        # not all verified: one round of 12 with its 4th rejected is 3 of 4, not 3 of 12.
        tested = free.accepted + free.rejections
        if tested >= 8 and free.accepted < 0.5 * tested:
            return 0
        remaining = req.params.max_tokens - seq.generated
        room = self.target.max_len - seq.cached - pending
        return max(0, min(k, remaining - 1, room))

    @staticmethod
    def _suffix_may_lead(seq: Seq, overlapped: bool, probing: bool) -> bool:
        """A drafting row whose method and k the policy chose may take the suffix index's
        guesses instead of the draft's in a round where the index offers at least k of
        them (a confident match: a copied file, a repeated answer), or first, the draft
        extending them, where it offers fewer: they cost no draft forward. Not where the
        caller named the method or k, nor under overlap (the draft has already drafted this
        round during the last step), nor in a policy probe (the probe is there to time the
        draft's round)."""
        req = seq.req
        return req.method == "draft" and not req.speculation.pins_method \
            and not req.speculation.pins_k \
            and not overlapped and not probing

    def _advance(self, seq: Seq, row, res: TargetResult,
                 settled: tuple[int, bool, bool] | None = None,
                 free: bool = False, head: int = 0) -> RequestOutput:
        method = "suffix" if free else seq.req.method
        new, reason = apply_result(seq, row, res, self.proposers.get(method),
                                   self.totals, self.eos_ids, settled, method, head)
        if reason is not None:
            return self._finish(seq, reason, new)
        return make_output(seq, new, finished=False, reason=None)

    def _finish(self, seq: Seq, reason, new: list[int] | None = None,
                error: str | None = None, kind: ErrorKind | None = None) -> RequestOutput:
        rid = seq.req.request_id
        # A failed step may have left the slot half-written: keep nothing of it.
        self.scheduler.release(seq, keep=reason != "error")
        self.target.end_sequence(rid)
        for p in self.proposers.values():
            observe = getattr(p, "observe", None)  # learns from every finished request
            if observe is not None and reason != "error":
                observe(rid, seq.tokens, seq.req.tenant)
            p.release(rid)
        return make_output(seq, new or [], finished=True, reason=reason, error=error,
                           kind=kind)

    # ---- convenience ----------------------------------------------------------------------

    def run(self, requests: list[Request]) -> dict[str, RequestOutput]:
        """Submit requests, step until all finish, return each one's final output."""
        for r in requests:
            self.add_request(r)
        final: dict[str, RequestOutput] = {}
        while self.has_work():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return final
