"""Prometheus metrics of the engine replicas (exported by Ray as ray_specdec_*).

Acceptance is exported as counters so PromQL can form honest ratios over any window:
mean acceptance length = 1 + rate(accepted) / rate(rounds); draft acceptance ratio =
rate(accepted) / rate(drafted) (not the paper's alpha); alpha = rate(accepted) /
(rate(accepted) + rate(rejections)).
"""

from __future__ import annotations

import time

from ray.serve.metrics import Counter, Gauge, Histogram


class EngineMetrics:
    def __init__(self) -> None:
        tags = ("method",)
        self.requests = Counter("specdec_requests", "requests admitted", tag_keys=tags)
        self.finished_requests = Counter("specdec_requests_finished", "requests finished",
                                         tag_keys=("method", "finish_reason"))
        self.tokens = Counter("specdec_generated_tokens", "tokens emitted", tag_keys=tags)
        self.rounds = Counter("specdec_spec_rounds", "speculative rounds", tag_keys=tags)
        self.drafted = Counter("specdec_spec_drafted_tokens", "draft tokens proposed",
                               tag_keys=tags)
        self.accepted = Counter("specdec_spec_accepted_tokens", "draft tokens kept",
                                tag_keys=tags)
        self.rejections = Counter("specdec_spec_rejections", "rounds ending in a rejection",
                                  tag_keys=tags)
        self.step_tokens = Histogram("specdec_step_tokens", "tokens per target forward",
                                     boundaries=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
        self.step_seconds = Histogram("specdec_step_seconds", "target forward time",
                                      boundaries=[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                                  2.5, 5])
        self.draft_seconds = Histogram("specdec_draft_seconds", "draft time per step",
                                       boundaries=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                   0.5, 1, 2.5])
        self.running = Gauge("specdec_running_requests", "rows in the batch")
        # The policy's inputs, as this engine measures them (names kept from when the
        # router held them).
        self.alpha = Gauge("specdec_router_alpha", "acceptance alpha the policy uses",
                           tag_keys=("method",))
        self.draft_cost_ratio = Gauge("specdec_router_draft_cost_ratio",
                                      "draft step / target step the policy uses")
        self._inputs_at = 0.0

    def admitted(self, method: str) -> None:
        self.requests.inc(tags={"method": method})

    def step(self, rec) -> None:
        self.step_tokens.observe(rec.tokens)
        self.step_seconds.observe(rec.verify_s)
        if rec.max_k:  # only steps that drafted
            self.draft_seconds.observe(rec.draft_s)
        self.running.set(rec.rows)

    def policy_inputs(self, policy, methods: list[str]) -> None:
        """Refreshed about once a second: a gauge set once, right after it is created, can
        be lost before Ray's exporter knows it."""
        now = time.monotonic()
        if now - self._inputs_at < 1.0:
            return
        self._inputs_at = now
        for method in methods:
            self.alpha.set(policy.acceptance.alpha(method), tags={"method": method})
        c = policy.draft_cost if policy.draft_cost is not None else policy.config.draft_cost_ratio
        self.draft_cost_ratio.set(c)

    def finished(self, out) -> None:
        m = out.method
        t = {"method": m}
        self.finished_requests.inc(tags={"method": m, "finish_reason": out.finish_reason or ""})
        s = out.spec
        for counter, value in ((self.tokens, len(out.token_ids)), (self.rounds, s.rounds),
                               (self.drafted, s.drafted), (self.accepted, s.accepted),
                               (self.rejections, s.rejections)):
            if value:
                counter.inc(value, tags=t)


class RouterMetrics:
    """Every routing decision and the inputs it was made from, so a dashboard can show why
    traffic went plain or speculative (the response's spec_decode shows it per request)."""

    def __init__(self) -> None:
        self.decisions = Counter(
            "specdec_router_decisions", "routing decisions by outcome and reason",
            tag_keys=("mode", "method", "k", "why"))
        self.expected_speedup = Histogram(
            "specdec_router_expected_speedup", "policy's expected goodput over plain",
            boundaries=[1.0, 1.1, 1.25, 1.5, 2, 2.5, 3, 4])
        self.expected_tokens = Histogram(
            "specdec_router_expected_tokens", "expected completion length used by the policy",
            boundaries=[8, 16, 32, 64, 128, 256, 512, 1024, 2048])

    def decided(self, d: dict) -> None:
        self.decisions.inc(tags={"mode": d["mode"], "method": d["method"], "k": str(d["k"]),
                                 "why": d["why"]})
        self.expected_speedup.observe(d["expected_speedup"])
        expected = d["inputs"].get("expected_tokens")
        if expected is not None:
            self.expected_tokens.observe(expected)
