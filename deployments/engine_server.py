"""The `Engine` Serve deployment: one replica = one engine assembled by specdec.engine.assemble
with the Ray backend (target group + draft in the replica's placement group; bundle 0 hosts
the replica itself), its batching loop on a thread of its own. Requests stream back as
async generators. The replica decides each request's speculation from its own load (see
specdec/policy/engine_policy.py) and reports the decision with the first chunk."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

from ray import serve
from ray.util import get_current_placement_group

from deployments.actors.draft import RayDraftProposer
from deployments.actors.procinfo import rss_mb
from deployments.actors.ray_backend import RayBackend
from deployments.actors.target import RayTargetRunner
from deployments.contract import Decided, GenerateCall, Refused, Tokens
from deployments.metrics import EngineMetrics
from deployments.priority import background_priority, thread_cpu_s
from deployments.startup import StartupReporter
from specdec.engine.assemble import assemble
from specdec.engine.spec import EngineSpec
from specdec.engine.timeline import timeline_summary
from specdec.engine.watchdog import Watchdog
from specdec.errors import CapacityError, EngineError, ErrorKind, TargetDown

log = logging.getLogger("ray.serve")
# A grammar that takes longer than this to compile is refused (400); the replica's first
# also builds the tokenizer's index for grammars (~3 s for a 151k vocabulary).
GRAMMAR_COMPILE_S = 10.0
# Grammars waiting for (or in) the compiler beyond this many: the next is refused (503).
GRAMMAR_QUEUE = 4



class EngineServer:
    def __init__(self, config: dict, replica_cpus: float = 0.0) -> None:
        spec = EngineSpec.model_validate(config)
        pg = get_current_placement_group()
        # Warm-up and calibration run inside assemble(): the replica is not a replica (Serve
        # routes nothing to it, `serve status` is not RUNNING) before they are done, and
        # meanwhile the ingress answers 503 with the phase reported here.
        ctx = serve.get_replica_context()
        self.replica_tag = ctx.replica_tag  # reported with every decision (which replica served)
        startup = StartupReporter(ctx.app_name, ctx.replica_tag)
        try:
            self.built = assemble(spec, RayBackend(pg, replica_cpus if pg is not None else None),
                                  on_phase=startup.phase)
        finally:
            startup.done()
        self.started_s = time.time() - startup.started
        log.info("engine replica ready to serve, %.0f s after it started", self.started_s)
        self.engine, self.policy = self.built.engine, self.built.policy
        # The Ray backend always builds a target group; the draft is a group, the in-process
        # n-gram proposer, or absent.
        assert isinstance(self.built.target, RayTargetRunner)
        self.target: RayTargetRunner = self.built.target
        draft = self.built.draft
        self.draft_group: RayDraftProposer | None = (
            draft if isinstance(draft, RayDraftProposer) else None)
        self.metrics = EngineMetrics()
        self.metrics.calibrated(self.built.calibration)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, bool]] = {}
        # Grammars compile on one thread of their own, off the loop that delivers every
        # stream's tokens: a flood of large grammars queues behind itself, on one core.
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(1, "grammar")
        self._grammar_jobs: list[concurrent.futures.Future] = []
        self._wake = threading.Event()
        self._stop = False
        self.watchdog = Watchdog(spec.runtime.watchdog_limit_s())
        self._thread = threading.Thread(target=self._loop, daemon=True, name="engine-loop")
        self._thread.start()

    # ---- the batching loop (its own thread) ------------------------------------------------

    def _loop(self) -> None:
        was_busy = False
        while not self._stop:
            self.watchdog.beat()
            if not self.engine.has_work():
                self._publish_gauges(force=was_busy)  # idle: running back to 0 at once
                was_busy = False
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            was_busy = True
            before = self.engine.steps
            try:
                self.engine.step()  # outputs reach _deliver through each request's callback
            except Exception:  # never let the loop die: the next step starts clean
                log.exception("engine step raised")
                continue
            if self.engine.steps != before:  # (the policy observes through the engine)
                self.metrics.step(self.engine.history[-1])
            self._publish_gauges()

    def _publish_gauges(self, force: bool = False) -> None:
        draft = self.built.draft
        load = self.engine.load()
        stats = self.engine.prefixes.stats
        load["prefix"] = {"hits": stats.hits, "copies": stats.copies,
                          "evictions": stats.evictions,
                          "held_tokens": self.engine.prefixes.held_tokens()}
        load["suffix"] = self._suffix_report()
        self.metrics.gauges(load, draft.available if draft is not None else None,
                            self.policy, self.built.methods(), force)

    def _deliver(self, out) -> None:
        if out.finished:
            self.metrics.finished(out)
        entry = self._queues.get(out.request_id)
        if entry is None:
            return
        loop, queue, stream = entry
        if not stream and not out.finished:
            # A whole response is sent once: every chunk crossing to the ingress and on is
            # CPU taken from the next step's forward on a small machine.
            return
        chunk = Tokens(text=out.new_text if stream else out.text,
                       token_ids=out.new_token_ids if stream else out.token_ids,
                       finished=out.finished, finish_reason=out.finish_reason,
                       prompt_tokens=out.prompt_tokens, completion_tokens=len(out.token_ids),
                       k=out.k, cached_tokens=out.cached_tokens,
                       spec={**out.spec.as_dict(), "free_guesses": out.free_guesses,
                             "free_accepted": out.free_accepted} if out.finished else None,
                       error=out.error, error_kind=out.error_kind,
                       logprobs=out.new_logprobs if stream else out.logprobs)
        loop.call_soon_threadsafe(queue.put_nowait, chunk)

    async def _check_grammar(self, call: GenerateCall) -> object:
        """Compile the request's grammar on the grammar thread (once per grammar text: it
        is cached, so a request's other choices and later requests only look it up) and
        return its start matcher. Refused when GRAMMAR_QUEUE grammars already wait (503),
        or when its compile itself runs past GRAMMAR_COMPILE_S (400); one that has not
        started when its request goes is taken off the queue."""
        field = call.grammar_field or "response_format"
        self._grammar_jobs = [j for j in self._grammar_jobs if not j.done()]
        if len(self._grammar_jobs) >= GRAMMAR_QUEUE:
            raise CapacityError("the grammar compiler is busy with other requests' grammars; "
                                "retry shortly")
        # The compiling thread and its CPU time when the compile began: the compile's own
        # work is what is bounded, not its wait in the queue or for a busy CPU.
        began: list[tuple[int, float]] = []

        def compile_it():
            background_priority()
            began.append((threading.get_ident(), time.thread_time()))
            return self.built.engine.check_grammar(call.params.grammar, field)

        job = self._grammar_pool.submit(compile_it)
        self._grammar_jobs.append(job)
        waiting = asyncio.wrap_future(job)
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(waiting), 0.25)
                except TimeoutError:
                    if began and thread_cpu_s(began[0][0]) - began[0][1] > GRAMMAR_COMPILE_S:
                        # It finishes on its thread and is cached: the same grammar again
                        # is quick.
                        raise EngineError(f"{field}: the grammar took more than "
                                          f"{GRAMMAR_COMPILE_S:.0f} s to compile; simplify it",
                                          param=field) from None
        finally:
            job.cancel()  # takes it off the queue only if it never started

    # ---- the API the ingress calls ----------------------------------------------------------

    async def generate(self, call: GenerateCall):
        """Yields Decided (or Refused, and nothing more), then Tokens as they are accepted
        (stream) or one Tokens with the whole output; the last one has finished=True."""
        rid = call.request_id
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (loop, queue, call.stream)
        try:
            try:
                start = None
                if call.params.grammar is not None:
                    start = await self._check_grammar(call)
                req, decision = self.built.submit(rid, call.prompt_ids, call.params,
                                                  call.speculative, self._deliver, call.tenant,
                                                  start)
            except EngineError as exc:
                kind = ErrorKind.TARGET_DOWN if isinstance(exc, TargetDown) else \
                    ErrorKind.CAPACITY if isinstance(exc, CapacityError) else ErrorKind.INVALID
                self.metrics.refused(kind)
                yield Refused(kind, str(exc), exc.param)
                return
            yield Decided({**decision.as_dict(), "replica": self.replica_tag})
            self.metrics.admitted(decision.method)  # a standby request counts as plain
            self._wake.set()
            while True:
                chunk = await queue.get()
                if chunk.finished:
                    # Time inside the engine replica, so callers can tell HTTP/Serve overhead.
                    chunk.engine_s = time.perf_counter() - started
                yield chunk
                if chunk.finished:
                    return
        finally:
            # Reached on normal completion and when the client went away (cancellation):
            # an unfinished request is aborted so its KV slot is freed.
            if self._queues.pop(rid, None) is not None:
                self.engine.abort(rid)
                self._wake.set()

    async def ready(self) -> bool:
        """Answers only once the constructor is done: weights loaded, warmed up, costs
        calibrated. The ingress asks before it reports the service ready."""
        return True

    async def load(self) -> dict:
        load = self.engine.load()
        methods = self.built.methods()
        load.update(self.policy.report(methods))
        draft = self.draft_group
        load.update({
            "methods": methods,
            "target_failures": self.target.failures,
            "target_down": self.target.down,
            "target_last_rebuild_s": self.target.last_rebuild_s,
            "target_last_start": self.target.group.last_start,
            "draft_last_start": draft.group.last_start if draft is not None else None,
            "draft_failures": draft.failures if draft is not None else 0,
            "timeline": timeline_summary(list(self.engine.history)[-32:]),
            # The start-up calibration, as a prior: how noisy it was, how long it took.
            "calibration": {k: v for k, v in (self.built.calibration or {}).items()
                            if k != "runs"} or None,
            "started_s": round(self.started_s, 1),
            "memory_mb": await self._memory(),
            "prefix_cache": self._prefix_cache(),
            "suffix": self._suffix_report(),
            "time": time.time(),
        })
        return load

    def _prefix_cache(self) -> dict:
        """The prefix cache's state and counters, target and draft (docs/metrics.md)."""
        engine, runtime = self.engine, self.built.spec.runtime
        held = engine.prefixes.held_tokens() + sum(s.held() for s in
                                                   list(engine.scheduler.running.values()))
        draft = self.built.draft
        report = getattr(draft, "prefix_report", None)
        return {
            "enabled": runtime.prefix_cache, "kv_slots": runtime.kv_slots(),
            "max_running": runtime.max_slots, "max_len": runtime.max_len,
            "kv_cache_mb": {"target": _kv_mb(self.target.stats),
                            "draft": _kv_mb(self.draft_group.stats)
                            if self.draft_group is not None else None},
            "target": {**engine.prefixes.stats.as_dict(), "held_tokens": held},
            "draft": report() if report is not None else None,
        }

    def _suffix_report(self) -> dict | None:
        """The suffix index's size and where its guesses came from (docs/metrics.md)."""
        suffix = self.engine.proposers.get("suffix")
        return suffix.report() if suffix is not None else None

    async def _memory(self) -> dict:
        """RSS of this replica and of every shard actor (by name), now and at peak."""
        out = {"engine_replica": {"rss_mb": rss_mb()}}
        groups = [self.target.group] + ([self.draft_group.group] if self.draft_group else [])
        named = [(f"{g.role}-r{r}", a) for g in groups for r, a in enumerate(g.actors)]
        try:
            got = await asyncio.wait_for(
                asyncio.gather(*(a.memory.remote() for _, a in named)), timeout=2)
            out.update({name: m for (name, _), m in zip(named, got, strict=True)})
        except Exception:  # noqa: BLE001 - a shard being rebuilt: report what answered
            pass
        return out

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("engine loop died")
        if self.draft_group is not None:
            self.draft_group.probe()  # a lost draft costs speed, not health: rebuild, stay up
        stalled = self.watchdog.stalled(self.engine.has_work())
        if stalled is not None:
            raise RuntimeError(f"engine loop made no progress for {stalled:.0f}s with work "
                               "waiting")
        target = self.target
        if target.rebuild_failures >= 3:
            # A rebuild in progress is not a failure (requests get 503 meanwhile); one that
            # keeps failing is: Serve then replaces this replica whole.
            raise RuntimeError(f"target group could not be rebuilt: {target.down}")

    def __del__(self) -> None:
        self._stop = True




def _kv_mb(stats: list[dict] | None) -> float | None:
    """A group's KV cache, all ranks (MB), from what its shards reported at setup."""
    if not stats:
        return None
    return round(sum(r.get("kv_cache_mb", 0.0) for r in stats), 1)
