"""The engine: continuous batching of plain and speculative requests over one target.

Each step: admit waiting requests into free KV slots; ask the proposers for this round's
guesses (one batched call per proposer); run ONE target forward over the ragged batch
(decode rows 1 token, speculative rows 1 + k, prefill chunks with what budget is left);
apply stop rules to what the rejection sampler kept; stream it; tell the proposers how much
was kept. Requests join and leave between steps.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable

from specdec.metrics import SpecCounters
from specdec.proposers import ProposeInput, Proposer
from specdec.request import CapacityError, EngineError, Request, RequestOutput, TargetLost
from specdec.stop import Detokenizer
from specdec.target_runner import TargetResult, TargetRow, TargetRunner

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_tokens_per_step: int = 512   # prefill chunks fill what decode rows leave of this
    min_prefill_chunk: int = 32      # so a prefill advances even under a full decode batch
    max_waiting: int = 256           # queued requests beyond this are refused (overload)


@dataclasses.dataclass
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


@dataclasses.dataclass
class _Seq:
    req: Request
    slot: int
    tokens: list[int]
    prompt_len: int
    cached: int = 0                  # tokens in the target's KV cache
    detok: Detokenizer | None = None
    spec: SpecCounters = dataclasses.field(default_factory=SpecCounters)
    k_now: int = 0
    finished: bool = False

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


KChooser = Callable[["Engine", Request, SpecCounters, int], int]


class Engine:
    def __init__(self, target: TargetRunner, proposers: dict[str, Proposer] | None = None,
                 tokenizer=None, eos_ids: Iterable[int] = (),
                 config: EngineConfig | None = None, choose_k: KChooser | None = None) -> None:
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
        self._running: dict[str, _Seq] = {}
        self._free_slots = list(range(target.max_slots - 1, -1, -1))
        self.totals: dict[str, SpecCounters] = collections.defaultdict(SpecCounters)
        self.history: collections.deque[StepRecord] = collections.deque(maxlen=256)
        self.steps = 0

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
        recent = list(self.history)[-16:]
        n = max(len(recent), 1)
        return {
            "running": len(self._running), "waiting": waiting,
            "free_slots": len(self._free_slots),
            "tokens_per_step": sum(r.tokens for r in recent) / n,
            "prefill_tokens_per_step": sum(r.prefill_tokens for r in recent) / n,
            "step_s": sum(r.step_s for r in recent) / n,
        }

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step. Whatever goes wrong inside fails the requests it held, with the reason,
        and leaves the engine clean for the next step: never a half-changed state to retry
        on, never a request left waiting for a step that will not come."""
        outputs: list[RequestOutput] = []
        self._apply_aborts(outputs)
        self._admit()
        if not self._running:
            return outputs
        try:
            self._step(outputs)
        except TargetLost as exc:
            log.error("target failed: %s", exc)
            self._fail_all(outputs, f"target failed: {exc}", "target_lost")
        except Exception as exc:  # a bug: fail this step's requests, keep serving
            log.exception("engine step failed")
            self._fail_all(outputs, f"internal error in the engine step "
                                    f"({type(exc).__name__}: {exc})", "internal")
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

    def _step(self, outputs: list[RequestOutput]) -> None:
        t_start = time.perf_counter()
        rec = StepRecord(0, 0, 0.0, 0.0)
        rows, num_draft = self._plan(rec)
        t0 = time.perf_counter()
        results = self.target.step(rows)
        t1 = time.perf_counter()
        rec.verify_s = t1 - t0
        call = getattr(self.target, "last_call", None)
        rec.target_compute_s = call.compute_s if call else rec.verify_s
        rec.target_bytes = call.bytes if call else 0
        rec.rows, rec.tokens = len(rows), sum(len(r.tokens) for r in rows)
        rec.prefill_tokens = sum(len(r.tokens) for r in rows if r.seq_id not in num_draft)
        rec.max_k = max(num_draft.values(), default=0)
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
            outputs.append(self._advance(seq, row, by_id[row.seq_id]))
        rec.end = time.perf_counter()
        rec.post_s, rec.step_s = rec.end - t1, rec.end - t_start
        self.history.append(rec)

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
            seq = _Seq(req, self._free_slots.pop(), list(req.prompt_ids), len(req.prompt_ids))
            if self.tokenizer is not None:
                seq.detok = Detokenizer(self.tokenizer, req.params.stop)
            self.target.start_sequence(req.request_id, req.params)
            self._running[req.request_id] = seq

    def _k_for(self, seq: _Seq, pending: int) -> int:
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
        remaining = req.params.max_tokens - seq.generated
        room = self.target.max_len - seq.cached - pending
        return max(0, min(k, remaining - 1, room))

    def _plan(self, rec: StepRecord) -> tuple[list[TargetRow], dict[str, int]]:
        """This step's target rows, and the number of guesses of each decode row. Fills the
        planning and drafting parts of rec."""
        t_plan = time.perf_counter()
        decode = [s for s in self._running.values() if s.cached >= s.prompt_len]
        prefill = [s for s in self._running.values() if s.cached < s.prompt_len]
        asks: dict[str, list[ProposeInput]] = collections.defaultdict(list)
        for seq in decode:
            seq.k_now = self._k_for(seq, len(seq.tokens) - seq.cached)
            if seq.k_now:
                asks[seq.req.method].append(
                    ProposeInput(seq.req.request_id, seq.tokens, seq.k_now, seq.req.params))
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
        return rows, num_draft

    def _advance(self, seq: _Seq, row: TargetRow, res: TargetResult) -> RequestOutput:
        req = seq.req
        seq.cached = row.start + len(row.tokens) - row.num_draft + res.num_accepted
        proposer = self.proposers.get(req.method)
        if proposer is not None and row.num_draft:
            proposer.accepted(req.request_id, seq.cached)
        seq.spec.record_round(row.num_draft, res.num_accepted, len(res.tokens))
        self.totals[req.method if row.num_draft else "none"].record_round(
            row.num_draft, res.num_accepted, len(res.tokens))
        new = list(res.tokens)
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
        if reason is not None:
            return self._finish(seq, reason, new)
        return self._output(seq, new, finished=False, reason=None)

    def _output(self, seq: _Seq, new: list[int], finished: bool, reason, error=None,
                kind: str | None = None):
        text = seq.detok.text if seq.detok else ""
        delta = seq.detok.delta(final=finished) if seq.detok else ""
        out = RequestOutput(seq.req.request_id, new, delta, seq.tokens[seq.prompt_len:], text,
                            finished, reason, seq.prompt_len, seq.spec, error, seq.k_now,
                            seq.req.method, kind)
        if seq.req.on_output is not None:
            seq.req.on_output(out)
        return out

    def _finish(self, seq: _Seq, reason, new: list[int] | None = None,
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
