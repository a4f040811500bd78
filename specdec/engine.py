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
import threading
import time
from collections.abc import Callable, Iterable

from specdec.engine_state import (
    EngineConfig,
    KChooser,
    Seq,
    StepRecord,
    load_report,
    pinned_plain,
)
from specdec.metrics import SpecCounters
from specdec.overlap import OverlapChooser, settle, use_overlap
from specdec.proposers import Proposal, ProposeInput, Proposer
from specdec.request import CapacityError, EngineError, Request, RequestOutput, TargetLost
from specdec.stop import Detokenizer
from specdec.target_runner import TargetResult, TargetRow, TargetRunner

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, target: TargetRunner, proposers: dict[str, Proposer] | None = None,
                 tokenizer=None, eos_ids: Iterable[int] = (),
                 config: EngineConfig | None = None, choose_k: KChooser | None = None,
                 overlap: str = "off") -> None:
        if overlap not in ("off", "on", "auto"):
            raise ValueError("overlap must be off, on or auto")
        self.target = target
        self.proposers = dict(proposers or {})
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.config = config or EngineConfig()
        # The policy hook: revisit k between rounds (default: the request's own k).
        self.choose_k = choose_k
        self._lock = threading.Lock()
        self._waiting: collections.deque[Request] = collections.deque()
        self._aborts: set[str] = set()
        self._running: dict[str, Seq] = {}
        self._free_slots = list(range(target.max_slots - 1, -1, -1))
        self.totals: dict[str, SpecCounters] = collections.defaultdict(SpecCounters)
        self.history: collections.deque[StepRecord] = collections.deque(maxlen=256)
        self.steps = 0
        # Drafting overlapped with verification (specdec/overlap.py): off, on, or auto
        # (measured both ways, the faster kept).
        self.overlap = overlap
        self.overlap_chooser = OverlapChooser() if overlap == "auto" else None
        # Called when a step's mode differs from the last one's (auto: the caller's thread
        # plan differs between sequential and overlapped steps).
        self.on_mode: Callable[[bool], None] | None = None
        self._last_mode: bool | None = None
        # Observers of every completed step and every finished request (the policy learns
        # its costs and acceptance from them, in one process and served alike).
        self.on_step: list[Callable[[StepRecord], None]] = []
        self.on_finished: list[Callable[[RequestOutput], None]] = []

    # ---- submission (thread-safe) -------------------------------------------------------

    def add_request(self, req: Request) -> None:
        n, m, limit = len(req.prompt_ids), req.params.max_tokens, self.target.max_len
        if n == 0:
            raise EngineError("prompt is empty")
        if n + m > limit:  # the request's own fault: 400, not a capacity problem
            raise EngineError(
                f"prompt ({n} tokens) + max_tokens ({m}) exceeds the context limit of {limit} "
                "tokens", param="max_tokens")
        if req.method != "none" and req.k > 0 and req.method not in self.proposers:
            raise EngineError(f"speculation method {req.method!r} is not available; "
                              f"available: {sorted(self.proposers) or 'none'}")
        with self._lock:
            if len(self._waiting) >= self.config.max_waiting:
                raise CapacityError(f"queue full ({self.config.max_waiting} waiting requests)")
            req.arrival = time.monotonic()
            self._waiting.append(req)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running)

    def load(self) -> dict:
        with self._lock:
            waiting = len(self._waiting)
            pinned_waiting = sum(map(pinned_plain, self._waiting))
        return load_report(waiting, pinned_waiting, list(self._running.values()),
                           len(self._free_slots), list(self.history)[-16:])

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step. Whatever goes wrong inside fails the requests it held, with the reason,
        and leaves the engine clean for the next step: never a half-changed state to retry
        on, never a request left waiting for a step that will not come."""
        outputs: list[RequestOutput] = []
        self._apply_aborts(outputs)
        self._admit()
        if not self._running:
            return self._observed(outputs, None)
        last = self.history[-1] if self.history else None
        try:
            self._step(outputs)
        except TargetLost as exc:
            log.error("target failed: %s", exc)
            self._fail_all(outputs, f"target failed: {exc}", "target_lost")
        except Exception as exc:  # a bug: fail this step's requests, keep serving
            log.exception("engine step failed")
            self._fail_all(outputs, f"internal error in the engine step "
                                    f"({type(exc).__name__}: {exc})", "internal")
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

    def _fail_all(self, outputs: list[RequestOutput], error: str, kind: str) -> None:
        for seq in list(self._running.values()):
            try:
                outputs.append(self._finish(seq, "error", error=error, kind=kind))
            except Exception:  # noqa: BLE001 - its slot is freed all the same
                log.exception("failing request %s", seq.req.request_id)
                self._running.pop(seq.req.request_id, None)
                if seq.slot not in self._free_slots:
                    self._free_slots.append(seq.slot)

    def _use_overlap(self) -> bool:
        return use_overlap(self.overlap, self.overlap_chooser, self.proposers.get("draft"),
                           self.target)

    def _step(self, outputs: list[RequestOutput]) -> None:
        t_start = time.perf_counter()
        rec = StepRecord(0, 0, 0.0, 0.0)
        rec.overlapped = self._use_overlap()
        if rec.overlapped != self._last_mode and self.on_mode is not None:
            self.on_mode(rec.overlapped)
        self._last_mode = rec.overlapped
        rows, num_draft, windows = self._plan(rec)
        t0 = time.perf_counter()
        window = None
        if windows:  # the draft starts now and works while the target verifies
            try:
                window = self.proposers["draft"].start_window(windows)
            except Exception as exc:  # noqa: BLE001 - a lost draft: plain draws this step
                log.warning("draft window failed to start: %s", exc)
        try:
            results = self.target.step(rows)
        except BaseException:
            if window is not None:  # never leave the draft computing into the next step
                window.stop()
                try:
                    window.result()
                except Exception:  # noqa: BLE001 - the step's failure is what matters
                    pass
            raise
        t1 = time.perf_counter()
        rec.verify_s = t1 - t0
        resolved, heads, window_out = settle(self.proposers.get("draft"), self.target,
                                              window, windows, results, rec)
        t2 = time.perf_counter()
        call = getattr(self.target, "last_call", None)
        rec.target_compute_s = call.compute_s if call else rec.verify_s
        rec.target_bytes = call.bytes if call else 0
        rec.rows, rec.tokens = len(rows), sum(len(r.tokens) for r in rows)
        rec.prefill_tokens = sum(len(r.tokens) for r in rows if r.seq_id not in num_draft)
        if not windows:  # (overlap: _settle recorded how far the draft got instead)
            rec.max_k = max(num_draft.values(), default=0)
            drafted = [n for n in num_draft.values() if n]
            rec.mean_k = sum(drafted) / len(drafted) if drafted else 0.0
        self.steps += 1
        by_id = {r.seq_id: r for r in results}
        for row in rows:
            seq = self._running[row.seq_id]
            if not row.sample:
                seq.cached += len(row.tokens)
                continue
            if num_draft.get(row.seq_id, 0):
                seq.spec.draft_s += rec.draft_s
            seq.spec.verify_s += rec.verify_s
            res = by_id[row.seq_id]
            extra = None
            if res.deferred:  # overlap: the settled next token, and the draft's head
                r = resolved[row.seq_id]
                extra = (r.token, heads.get(row.seq_id) is not None, r.accepted)
                prop = window_out.get(row.seq_id)
                seq.ahead = Proposal(prop.token_ids[1:],
                                     None if prop.q_ids is None else prop.q_ids[1:],
                                     None if prop.q_probs is None else prop.q_probs[1:]) \
                    if r.accepted and prop is not None and len(prop.token_ids) > 1 else None
            else:
                seq.ahead = None
            rec.emitted += len(res.tokens) + (1 if extra else 0)
            outputs.append(self._advance(seq, row, res, extra))
        rec.end = time.perf_counter()
        rec.post_s, rec.step_s = rec.end - t2, rec.end - t_start
        self.history.append(rec)
        if self.overlap_chooser is not None and (windows or rec.draft_rows):
            self.overlap_chooser.observe(rec.overlapped, rec.step_s, rec.emitted)

    def _apply_aborts(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            if aborts:
                self._waiting = collections.deque(r for r in self._waiting
                                                  if r.request_id not in aborts)
        for rid in aborts:
            seq = self._running.get(rid)
            if seq is not None:
                outputs.append(self._finish(seq, "abort"))

    def _admit(self) -> None:
        while self._free_slots:
            with self._lock:
                if not self._waiting:
                    return
                req = self._waiting.popleft()
            seq = Seq(req, self._free_slots.pop(), list(req.prompt_ids), len(req.prompt_ids),
                       admitted=time.monotonic())
            if self.tokenizer is not None:
                seq.detok = Detokenizer(self.tokenizer, req.params.stop)
            self.target.start_sequence(req.request_id, req.params)
            self._running[req.request_id] = seq

    def _k_for(self, seq: Seq, pending: int) -> int:
        req = seq.req
        if req.method == "none" or req.method not in self.proposers:
            return 0
        if not getattr(self.proposers[req.method], "available", True):
            # Down (a draft being rebuilt): a plain round, which says nothing about how
            # often its guesses are kept, so nothing is counted against it.
            return 0
        if self.choose_k is None or req.fixed_k:
            k = req.k
        else:
            k = self.choose_k(self, req, seq.spec, len(self._running))
        if req.speculate:  # asked for: a guess every round, whatever the costs say
            k = max(k, 1)
        remaining = req.params.max_tokens - seq.generated
        room = self.target.max_len - seq.cached - pending
        return max(0, min(k, remaining - 1, room))

    def _plan(self, rec: StepRecord
              ) -> tuple[list[TargetRow], dict[str, int], list[ProposeInput]]:
        """This step's target rows, the number of guesses of each decode row, and (overlap)
        what the draft drafts during the target's step. Fills the planning and drafting
        parts of rec."""
        t_plan = time.perf_counter()
        decode = [s for s in self._running.values() if s.cached >= s.prompt_len]
        prefill = [s for s in self._running.values() if s.cached < s.prompt_len]
        asks: dict[str, list[ProposeInput]] = collections.defaultdict(list)
        windows: list[ProposeInput] = []
        overlapped: dict[str, list[int]] = {}
        for seq in decode:
            seq.k_now = self._k_for(seq, len(seq.tokens) - seq.cached)
            if seq.k_now and seq.req.method == "draft":
                rec.draft_catchup = max(rec.draft_catchup, len(seq.tokens) - seq.draft_seen)
                seq.draft_seen = len(seq.tokens)
            if rec.overlapped and seq.req.method == "draft" and seq.k_now:
                # This step verifies the guesses drafted during the last one; the draft
                # goes on from their end, as if they will all be kept.
                ahead = seq.ahead.token_ids[: seq.k_now] if seq.ahead else []
                context = seq.tokens + ahead
                # The draft's cache holds context + (guesses - 1) positions: stay in it.
                window_k = min(seq.k_now, self.target.max_len - len(context) + 1)
                if window_k > 0:
                    overlapped[seq.req.request_id] = ahead
                    windows.append(ProposeInput(seq.req.request_id, context, window_k,
                                                seq.req.params))
                    continue
                seq.ahead = None
                asks[seq.req.method].append(
                    ProposeInput(seq.req.request_id, seq.tokens, seq.k_now, seq.req.params))
            elif seq.k_now:
                seq.ahead = None
                asks[seq.req.method].append(
                    ProposeInput(seq.req.request_id, seq.tokens, seq.k_now, seq.req.params))
            else:
                seq.ahead = None
        t0 = time.perf_counter()
        rec.plan_s = t0 - t_plan
        proposals = {}
        failed: set[str] = set()
        for method, inputs in asks.items():
            t_method = time.perf_counter()
            proposer = self.proposers[method]
            try:
                got = proposer.propose(inputs)
            except Exception:  # a failed proposer costs speed, never a request
                log.exception("proposer %s failed; decoding plainly this round", method)
                got = []
                failed.add(method)
            proposals.update({i.seq_id: p for i, p in zip(inputs, got, strict=False)})
            spent = time.perf_counter() - t_method
            call = getattr(proposer, "last_call", None)
            rec.draft_compute_s += call.compute_s if call else spent
            rec.draft_bytes += call.bytes if call else 0
            if method == "draft" and got:
                rec.draft_rows, rec.draft_k = len(inputs), max(i.k for i in inputs)
                rec.draft_model_s = spent
        rec.draft_s = time.perf_counter() - t0
        rows: list[TargetRow] = []
        num_draft: dict[str, int] = {}
        for seq in decode:
            rid = seq.req.request_id
            if rid in overlapped:
                guesses = overlapped[rid]
                a = seq.ahead
                q = (a.q_ids[: len(guesses)], a.q_probs[: len(guesses)]) \
                    if a is not None and a.q_probs is not None and guesses else None
                num_draft[rid] = len(guesses)
                rows.append(TargetRow(rid, seq.slot, seq.cached,
                                      seq.tokens[seq.cached:] + guesses, len(guesses), q, True,
                                      defer_last=True))
                continue
            prop = proposals.get(rid)
            guesses = prop.token_ids[: seq.k_now] if prop else []
            q = (prop.q_ids[: len(guesses)], prop.q_probs[: len(guesses)]) \
                if prop and prop.q_probs is not None and guesses else None
            num_draft[rid] = len(guesses)
            if seq.k_now and not guesses and seq.req.method not in failed:
                # Asked for guesses, got none (no n-gram match): for the policy this
                # opportunity failed like a rejection at the first position. A proposer
                # that failed outright is an outage, not evidence about its guesses.
                seq.spec.empty_proposals += 1
                self.totals[seq.req.method].empty_proposals += 1
            rows.append(TargetRow(rid, seq.slot, seq.cached, seq.tokens[seq.cached:] + guesses,
                                  len(guesses), q, True))
        budget = self.config.max_tokens_per_step - sum(len(r.tokens) for r in rows)
        budget = max(budget, self.config.min_prefill_chunk)
        for seq in prefill:
            if budget <= 0:
                break
            chunk = seq.tokens[seq.cached: min(seq.prompt_len, seq.cached + budget)]
            budget -= len(chunk)
            done = seq.cached + len(chunk) == seq.prompt_len
            rows.append(TargetRow(seq.req.request_id, seq.slot, seq.cached, chunk, 0, None, done))
            if done:
                seq.k_now = 0
        return rows, num_draft, windows

    def _advance(self, seq: Seq, row: TargetRow, res: TargetResult,
                 settled: tuple[int, bool, bool] | None = None) -> RequestOutput:
        """Apply one row's result. settled (overlap): the deferred token, whether the draft
        offered a head guess for it, and whether that guess was kept; the head counts as
        the round's last guess."""
        req = seq.req
        # The target's cache now holds the row's pending tokens and its kept guesses.
        seq.cached = row.start + len(row.tokens) - row.num_draft + res.num_accepted
        new = list(res.tokens)
        drafted, kept = row.num_draft, res.num_accepted
        if settled is not None:
            token, offered, accepted = settled
            new.append(token)
            drafted += int(offered)
            kept += int(accepted)
        else:
            proposer = self.proposers.get(req.method)
            if proposer is not None and row.num_draft:
                proposer.accepted(req.request_id, seq.cached)
        seq.spec.record_round(drafted, kept, len(new))
        self.totals[req.method if drafted else "none"].record_round(drafted, kept, len(new))
        reason = None
        eos_at = next((j for j, t in enumerate(new)
                       if t in self.eos_ids and not req.params.ignore_eos), None)
        if eos_at is not None:
            new, reason = new[: eos_at + 1], "stop"
        remaining = req.params.max_tokens - seq.generated
        if len(new) > remaining:  # a round can overshoot max_tokens: keep what was asked
            new, reason = new[:remaining], "length"
        elif len(new) == remaining and reason is None:
            reason = "length"
        if seq.detok is not None:
            keep = seq.detok.add(new)
            if keep is not None:
                new, reason = new[:keep], "stop"
        seq.tokens.extend(new)
        if new and seq.first_token is None:
            seq.first_token = time.monotonic()
        if reason is not None:
            return self._finish(seq, reason, new)
        return self._output(seq, new, finished=False, reason=None)

    def _output(self, seq: Seq, new: list[int], finished: bool, reason, error=None,
                kind: str | None = None):
        text = seq.detok.text if seq.detok else ""
        delta = seq.detok.delta(final=finished) if seq.detok else ""
        out = RequestOutput(seq.req.request_id, new, delta, seq.tokens[seq.prompt_len:], text,
                            finished, reason, seq.prompt_len, seq.spec, error, seq.k_now,
                            seq.req.method, kind)
        if finished and seq.req.arrival:
            now = time.monotonic()
            out.queue_s = seq.admitted - seq.req.arrival
            out.ttft_s = seq.first_token - seq.req.arrival if seq.first_token else None
            out.e2e_s = now - seq.req.arrival
        if seq.req.on_output is not None:
            seq.req.on_output(out)
        return out

    def _finish(self, seq: Seq, reason, new: list[int] | None = None,
                error: str | None = None, kind: str | None = None) -> RequestOutput:
        rid = seq.req.request_id
        if self._running.pop(rid, None) is not None:
            self._free_slots.append(seq.slot)
        self.target.end_sequence(rid)
        for p in self.proposers.values():
            p.release(rid)
        return self._output(seq, new or [], finished=True, reason=reason, error=error,
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
