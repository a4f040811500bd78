"""Prometheus metrics of the engine replicas and the ingress (exported by Ray as ray_*).

Every series and the PromQL built on it is documented in cluster/README.md ("Metrics").
Acceptance is exported as counters so PromQL can form honest ratios over any window:
mean acceptance length = 1 + rate(accepted) / rate(rounds); alpha = rate(accepted) /
(rate(accepted) + rate(rejections)); accepted / drafted is the draft acceptance ratio, not
the papers' alpha. Per-position counters give the acceptance curve: of the rounds that
drafted a guess at position i, the share that kept guesses 1..i.
"""

from __future__ import annotations

import time

from ray.serve.metrics import Counter, Gauge, Histogram

_SECONDS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300]
_STEP = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5]


class EngineMetrics:
    def __init__(self) -> None:
        m = ("method",)
        self.requests = Counter("specdec_requests", "requests admitted", tag_keys=m)
        self.finished_requests = Counter("specdec_requests_finished", "requests finished",
                                         tag_keys=("method", "finish_reason"))
        self.failed = Counter("specdec_requests_failed", "requests failed or refused, by kind "
                              "(capacity, invalid, target_lost, internal)", tag_keys=("kind",))
        self.tokens = Counter("specdec_generated_tokens", "tokens emitted", tag_keys=m)
        self.rounds = Counter("specdec_spec_rounds", "speculative rounds", tag_keys=m)
        self.drafted = Counter("specdec_spec_drafted_tokens", "draft tokens proposed",
                               tag_keys=m)
        self.accepted = Counter("specdec_spec_accepted_tokens", "draft tokens kept",
                                tag_keys=m)
        self.rejections = Counter("specdec_spec_rejections", "rounds ending in a rejection",
                                  tag_keys=m)
        pos = ("method", "position")
        self.pos_drafted = Counter("specdec_spec_position_drafted",
                                   "rounds that drafted a guess at this position", tag_keys=pos)
        self.pos_accepted = Counter("specdec_spec_position_accepted",
                                    "rounds that kept every guess up to this position",
                                    tag_keys=pos)
        self.queue_seconds = Histogram("specdec_queue_seconds", "time waiting for a KV slot",
                                       boundaries=_SECONDS, tag_keys=m)
        self.ttft = Histogram("specdec_time_to_first_token_seconds",
                              "arrival at the engine to the first token", boundaries=_SECONDS,
                              tag_keys=m)
        self.itl = Histogram("specdec_inter_token_latency_seconds",
                             "mean time between tokens of a request after its first",
                             boundaries=[0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 1, 2],
                             tag_keys=m)
        self.e2e = Histogram("specdec_e2e_latency_seconds", "arrival at the engine to finish",
                             boundaries=_SECONDS, tag_keys=m)
        self.step_tokens = Histogram("specdec_step_tokens", "tokens per target forward",
                                     boundaries=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
        self.step_seconds = Histogram("specdec_step_seconds", "target forward time",
                                      boundaries=_STEP)
        self.draft_seconds = Histogram("specdec_draft_seconds", "draft time per step",
                                       boundaries=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                   0.5, 1, 2.5])
        self.running = Gauge("specdec_running_requests", "rows in the batch")
        self.waiting = Gauge("specdec_waiting_requests", "requests queued for a KV slot")
        self.free_slots = Gauge("specdec_free_kv_slots", "KV slots free")
        self.draft_up = Gauge("specdec_draft_up",
                              "1 when the draft group serves guesses, 0 while it is rebuilt")
        self.chosen_k = Gauge("specdec_chosen_k", "guesses per drafting row in the last step")
        # The policy's inputs, as this engine measures them.
        self.alpha = _renamed(Gauge, "specdec_policy_alpha", "specdec_router_alpha",
                              "acceptance alpha the policy uses", tag_keys=m)
        self.draft_cost_ratio = _renamed(Gauge, "specdec_policy_draft_cost_ratio",
                                         "specdec_router_draft_cost_ratio",
                                         "draft step / target step the policy uses")
        self.probes = Counter("specdec_policy_probes",
                              "probe steps: a step shape the batch did not run, measured "
                              "(verify while plain, plain while speculating)", tag_keys=("shape",))
        self.prompt_tokens = Counter("specdec_prompt_tokens", "prompt tokens of finished "
                                     "requests")
        self.cached_tokens = Counter("specdec_prefix_cache_reused_tokens", "prompt tokens "
                                     "whose K/V came from the prefix cache (hit rate: "
                                     "rate(this) / rate(specdec_prompt_tokens))")
        self.prefix_events = Counter("specdec_prefix_cache_events", "prefix cache events of "
                                     "the target: hits (requests that reused a prefix), "
                                     "copies (reused from another slot), evictions",
                                     tag_keys=("event",))
        self.held_tokens = Gauge("specdec_prefix_cache_held_tokens",
                                 "tokens whose K/V the target's slots hold")
        self._prefix_seen: dict[str, int] = {}
        # The suffix index (specdec/spec_decode/suffix.py): what it holds, where its guesses
        # came from, and the free guesses that plainly decoded rows verified.
        self.suffix_indexed = Gauge("specdec_suffix_indexed_tokens",
                                    "tokens fed to the suffix index (prompts and outputs)")
        self.suffix_proposals = Counter("specdec_suffix_proposals", "suffix proposals by "
                                        "where the guess came from: index (what other "
                                        "requests said) or context (the request's own)",
                                        tag_keys=("source",))
        self._suffix_seen: dict[str, int] = {}
        self.free_guessed = Counter("specdec_free_guessed_tokens", "the suffix index's "
                                    "guesses verified on rows decoded plainly")
        self.free_accepted = Counter("specdec_free_accepted_tokens", "free guesses kept")
        self.calibration_noisy = Gauge(
            "specdec_calibration_noisy", "1 when the start-up calibration ran on a busy or "
            "noisy machine (its costs are a prior that live steps replace)")
        self._probes_seen: dict[str, int] = {}
        self._gauges_at = 0.0

    def admitted(self, method: str) -> None:
        self.requests.inc(tags={"method": method})

    def refused(self, kind: str) -> None:
        self.failed.inc(tags={"kind": kind})

    def step(self, rec) -> None:
        self.step_tokens.observe(rec.tokens)
        self.step_seconds.observe(rec.verify_s)
        if rec.max_k:  # only steps that drafted
            self.draft_seconds.observe(rec.draft_s)
        self.chosen_k.set(rec.mean_k)

    def gauges(self, load: dict, draft_up: bool | None, policy, methods: list[str],
               force: bool = False) -> None:
        """About once a second (and at once when the engine goes idle, so running reads 0):
        a gauge set once, right after creation, can be lost before Ray's exporter sees it."""
        now = time.monotonic()
        if not force and now - self._gauges_at < 1.0:
            return
        self._gauges_at = now
        self.running.set(load["running"])
        self.waiting.set(load["waiting"])
        self.free_slots.set(load["free_slots"])
        if load["running"] == 0:
            self.chosen_k.set(0)
        if draft_up is not None:
            self.draft_up.set(1 if draft_up else 0)
        for method in methods:
            self.alpha.set(policy.acceptance.alpha(method), tags={"method": method})
        c = policy.draft_cost if policy.draft_cost is not None else policy.config.draft_cost_ratio
        self.draft_cost_ratio.set(c)
        prefix = load.get("prefix")
        if prefix is not None:
            self.held_tokens.set(prefix["held_tokens"])
            for event in ("hits", "copies", "evictions"):
                new = prefix[event] - self._prefix_seen.get(event, 0)
                if new > 0:
                    self.prefix_events.inc(new, tags={"event": event})
                    self._prefix_seen[event] = prefix[event]
        suffix = load.get("suffix")
        if suffix is not None:
            self.suffix_indexed.set(suffix["indexed_tokens"])
            for source in ("index", "context"):
                n = suffix[f"from_{source}"]
                if n > self._suffix_seen.get(source, 0):
                    self.suffix_proposals.inc(n - self._suffix_seen.get(source, 0),
                                              tags={"source": source})
                    self._suffix_seen[source] = n
        for shape, n in policy.probes.items():
            new = n - self._probes_seen.get(shape, 0)
            if new > 0:
                self.probes.inc(new, tags={"shape": shape})
                self._probes_seen[shape] = n

    def calibrated(self, calibration: dict | None) -> None:
        self.calibration_noisy.set(1 if calibration and calibration.get("noisy") else 0)

    def finished(self, out) -> None:
        m = out.method
        t = {"method": m}
        self.finished_requests.inc(tags={"method": m, "finish_reason": out.finish_reason or ""})
        if out.finish_reason == "error":
            self.failed.inc(tags={"kind": out.error_kind or "internal"})
        s = out.spec
        for counter, value in ((self.tokens, len(out.token_ids)), (self.rounds, s.rounds),
                               (self.drafted, s.drafted), (self.accepted, s.accepted),
                               (self.rejections, s.rejections)):
            if value:
                counter.inc(value, tags=t)
        for i, n in enumerate(s.drafted_per_position, 1):
            if n:
                self.pos_drafted.inc(n, tags={"method": m, "position": str(i)})
        for i, n in enumerate(s.accepted_per_position, 1):
            if n:
                self.pos_accepted.inc(n, tags={"method": m, "position": str(i)})
        if out.free_guesses:
            self.free_guessed.inc(out.free_guesses)
            if out.free_accepted:
                self.free_accepted.inc(out.free_accepted)
        self.prompt_tokens.inc(out.prompt_tokens)
        if out.cached_tokens:
            self.cached_tokens.inc(out.cached_tokens)
        if out.queue_s is not None:
            self.queue_seconds.observe(out.queue_s, tags=t)
        if out.ttft_s is not None:
            self.ttft.observe(out.ttft_s, tags=t)
            if len(out.token_ids) > 1 and out.e2e_s is not None:
                self.itl.observe((out.e2e_s - out.ttft_s) / (len(out.token_ids) - 1), tags=t)
        if out.e2e_s is not None:
            self.e2e.observe(out.e2e_s, tags=t)


class IngressMetrics:
    """Every routing decision and the inputs it was made from, so a dashboard can show why
    traffic went plain or speculative (the response's spec_decode shows it per request),
    and every error answered, by status and code."""

    def __init__(self) -> None:
        self.decisions = _renamed(
            Counter, "specdec_policy_decisions", "specdec_router_decisions",
            "the policy's decisions by outcome and reason",
            tag_keys=("mode", "method", "k", "why"))
        self.expected_speedup = _renamed(
            Histogram, "specdec_policy_expected_speedup", "specdec_router_expected_speedup",
            "policy's expected goodput over plain",
            boundaries=[1.0, 1.1, 1.25, 1.5, 2, 2.5, 3, 4])
        self.expected_tokens = _renamed(
            Histogram, "specdec_policy_expected_tokens", "specdec_router_expected_tokens",
            "expected completion length used by the policy",
            boundaries=[8, 16, 32, 64, 128, 256, 512, 1024, 2048])
        self.errors = Counter("specdec_http_errors", "error responses by status and code",
                              tag_keys=("status", "code"))

    def decided(self, d: dict) -> None:
        self.decisions.inc(tags={"mode": d["mode"], "method": d["method"], "k": str(d["k"]),
                                 "why": d["why"]})
        self.expected_speedup.observe(d["expected_speedup"])
        expected = d["inputs"].get("expected_tokens")
        if expected is not None:
            self.expected_tokens.observe(expected)

    def error(self, status: int, code: str | None) -> None:
        self.errors.inc(tags={"status": str(status), "code": code or ""})


class _Both:
    """A metric under its name and under the name it had before (kept for a release, so
    dashboards and alerts built on the old name keep working; docs/metrics.md lists them)."""

    def __init__(self, new, old) -> None:
        self._metrics = (new, old)

    def set(self, *args, **kw) -> None:
        for m in self._metrics:
            m.set(*args, **kw)

    def inc(self, *args, **kw) -> None:
        for m in self._metrics:
            m.inc(*args, **kw)

    def observe(self, *args, **kw) -> None:
        for m in self._metrics:
            m.observe(*args, **kw)


def _renamed(kind, name: str, old_name: str, description: str, **kw) -> _Both:
    return _Both(kind(name, description, **kw), kind(old_name, f"{description} (old name of "
                                                               f"{name})", **kw))
