"""The `Engine` Serve deployment: one replica = one target group + one draft, placed
through the replica's placement group (bundle 0 hosts the replica itself), with the engine's
batching loop on a thread of its own. Requests stream back as async generators."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid

from ray.util import get_current_placement_group

from deployments.app_config import EngineAppConfig
from deployments.draft import RayDraftProposer
from deployments.metrics import EngineMetrics
from deployments.placement import bundles_for
from deployments.target import RayTargetRunner
from specdec.build import eos_ids_of
from specdec.engine import Engine, EngineConfig
from specdec.generate import load_tokenizer
from specdec.hub import resolve
from specdec.policy import (
    AcceptanceTracker,
    DraftCostModel,
    Load,
    PolicyConfig,
    StepCostModel,
    revisit,
)
from specdec.proposers import NgramProposer, check_same_tokenizer
from specdec.request import CapacityError, EngineError, Request
from specdec.sampling import SamplingParams

log = logging.getLogger("ray.serve")


class EngineServer:
    def __init__(self, config: dict) -> None:
        cfg = EngineAppConfig.model_validate(config)
        self.cfg = cfg
        target_path = resolve(cfg.target.model)
        if cfg.draft is not None:
            check_same_tokenizer(target_path, resolve(cfg.draft.model))
        pg = get_current_placement_group()
        _, t_idx, d_idx = bundles_for(cfg.target, cfg.draft, replica_bundle={})
        self.target = RayTargetRunner(cfg.target, cfg.runtime, pg, t_idx if pg else None)
        self.draft = RayDraftProposer(cfg.draft, cfg.runtime, pg, d_idx if pg else None) \
            if cfg.draft is not None else None
        tok = load_tokenizer(target_path)
        proposers = {"ngram": NgramProposer(cfg.ngram_min, cfg.ngram_max)}
        if self.draft is not None:
            proposers["draft"] = self.draft
        self.policy = PolicyConfig(**cfg.policy.model_dump())
        self.acceptance = AcceptanceTracker(self.policy)
        self.draft_cost: float | None = None
        self.step_cost = StepCostModel()
        self.draft_round_cost = DraftCostModel()
        self.engine = Engine(self.target, proposers, tok, eos_ids_of(target_path, tok),
                             EngineConfig(max_tokens_per_step=cfg.max_tokens_per_step,
                                          max_waiting=cfg.max_waiting),
                             choose_k=self._choose_k)
        self.metrics = EngineMetrics()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="engine-loop")
        self._thread.start()

    # ---- the batching loop (its own thread) ------------------------------------------------

    def _loop(self) -> None:
        while not self._stop:
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception:  # never let the loop die: the next step starts clean
                log.exception("engine step raised")
            if self.engine.history:
                rec = self.engine.history[-1]
                self.step_cost.observe(rec.tokens, rec.verify_s)
                self.draft_round_cost.observe(rec.draft_k, rec.draft_rows, rec.draft_model_s)
                self._observe_draft_cost(rec)
                self.metrics.step(rec)

    def _observe_draft_cost(self, rec) -> None:
        """c = the draft's time per guess / one plain target step, as a moving average (for
        display and as the policy's fallback until the draft's round cost is fitted). A
        step's draft time covers draft_k sequential draft forwards (rows are batched)."""
        if not rec.draft_model_s or not rec.draft_k:
            return
        fit = self.step_cost.fit()
        plain_step = (fit[0] + fit[1] * max(rec.rows, 1)) if fit else rec.verify_s
        c = rec.draft_model_s / rec.draft_k / max(plain_step, 1e-6)
        self.draft_cost = c if self.draft_cost is None else 0.9 * self.draft_cost + 0.1 * c
        self.policy = dataclasses.replace(self.policy, draft_cost_ratio=self.draft_cost)

    def _choose_k(self, engine: Engine, req: Request, spec, running: int) -> int:
        load = engine.load()
        k = revisit(self.policy, req.method, req.k, spec.policy_trials,
                    spec.accepted, spec.rounds, self.acceptance.alpha(req.method),
                    Load(load["running"], load["waiting"], max(load["tokens_per_step"], 1.0)),
                    self.step_cost, self.draft_round_cost,
                    self.acceptance.curve(req.method, self.policy.k_max))
        return k

    def _deliver(self, out) -> None:
        entry = self._queues.get(out.request_id)
        if out.finished:
            self._observe_finished(out)
        if entry is None:
            return
        loop, queue = entry
        chunk = {"text": out.new_text, "token_ids": out.new_token_ids, "finished": out.finished,
                 "finish_reason": out.finish_reason, "error": out.error,
                 "prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.token_ids),
                 "k": out.k, "spec": out.spec.as_dict() if out.finished else None}
        loop.call_soon_threadsafe(queue.put_nowait, chunk)

    def _observe_finished(self, out) -> None:
        if out.method != "none":
            s = out.spec
            # An empty proposal was a chance at position 1 that failed, like a rejection.
            drafted = list(s.drafted_per_position) or [0]
            drafted[0] += s.empty_proposals
            self.acceptance.observe(out.method, s.accepted, s.rejections + s.empty_proposals,
                                    s.accepted_per_position, drafted)
        self.metrics.finished(out)

    # ---- the API the router calls ----------------------------------------------------------

    async def generate(self, payload: dict):
        """payload: prompt_ids, params (SamplingParams fields), method, k, fixed_k.
        Yields chunks as tokens are accepted; the last one has finished=True."""
        rid = payload.get("request_id") or uuid.uuid4().hex
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (loop, queue)
        params = SamplingParams(**payload["params"])
        req = Request(rid, payload["prompt_ids"], params, payload.get("method", "none"),
                      int(payload.get("k", 0)), self._deliver, bool(payload.get("fixed_k")))
        try:
            try:
                self.engine.add_request(req)
            except CapacityError as exc:
                yield {"error": str(exc), "error_kind": "capacity", "finished": True}
                return
            except EngineError as exc:
                yield {"error": str(exc), "error_kind": "invalid", "finished": True}
                return
            self.metrics.admitted(req.method)
            self._wake.set()
            while True:
                chunk = await queue.get()
                if chunk["finished"]:
                    # Time inside the engine replica, so callers can tell HTTP/Serve overhead.
                    chunk["engine_s"] = time.perf_counter() - started
                yield chunk
                if chunk["finished"]:
                    return
        finally:
            # Reached on normal completion and when the client went away (cancellation):
            # an unfinished request is aborted so its KV slot is freed.
            if self._queues.pop(rid, None) is not None:
                self.engine.abort(rid)
                self._wake.set()

    def load(self) -> dict:
        load = self.engine.load()
        fit = self.step_cost.fit()
        load.update({
            "alpha": {m: self.acceptance.alpha(m) for m in self.engine.proposers},
            "acceptance_curve": {m: self.acceptance.curve(m, self.policy.k_max)
                                 for m in self.engine.proposers},
            "methods": sorted(m for m in self.engine.proposers
                              if m != "draft" or (self.draft and self.draft.available)),
            "step_cost_fit": fit, "draft_cost_ratio": self.draft_cost,
            "draft_round_fit": self.draft_round_cost.fit(),
            "target_failures": self.target.failures,
            "draft_failures": self.draft.failures if self.draft else 0,
            "time": time.time(),
        })
        return load

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("engine loop died")
        if not self.target.group.actors:
            raise RuntimeError("target group is down and could not be rebuilt")

    def __del__(self) -> None:
        self._stop = True



