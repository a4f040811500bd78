"""What the policy learns from served requests: acceptance per method (and its curve per
position), and how long replies run per prompt length. The decision (decide.py) reads them;
they know nothing of costs or loads."""

from __future__ import annotations

from specdec.policy.settings import PolicySettings


class AcceptanceTracker:
    """Per-token acceptance alpha per method: every drafted position up to and including the
    first rejection is one Bernoulli trial (later guesses were never tested). Exponentially
    decayed: older trials weigh less (half-life in trials, see PolicySettings)."""

    def __init__(self, config: PolicySettings) -> None:
        self.config = config
        self.trials: dict[str, float] = {}
        self.kept: dict[str, float] = {}
        self.pos_drafted: dict[str, list[float]] = {}
        self.pos_kept: dict[str, list[float]] = {}

    def observe(self, method: str, accepted: int, rejections: int,
                accepted_per_position: list[int] = (),
                drafted_per_position: list[int] = ()) -> None:
        """accepted guesses and rounds that ended in a rejection (each one more trial); per
        position i, rounds that drafted a guess there and rounds that kept guesses 1..i."""
        new_trials = accepted + rejections
        keep = 0.5 ** (new_trials / self.config.acceptance_half_life) \
            if self.config.acceptance_half_life else 1.0
        self.trials[method] = keep * self.trials.get(method, 0.0) + new_trials
        self.kept[method] = keep * self.kept.get(method, 0.0) + accepted
        for counts, new in ((self.pos_drafted.setdefault(method, []), drafted_per_position),
                            (self.pos_kept.setdefault(method, []), accepted_per_position)):
            counts.extend([0.0] * (len(new) - len(counts)))
            for i in range(len(counts)):
                counts[i] = keep * counts[i] + (new[i] if i < len(new) else 0)

    def curve(self, method: str, k_max: int) -> list[float]:
        """r_i, i = 1..k_max: the chance that a round keeps its first i guesses. Measured per
        position where rounds reached it, shrunk toward alpha^i (the i.i.d. model) with the
        prior's weight, and never rising with i. Acceptance is bursty (easy stretches, hard
        ones), so the measured curve falls off differently from alpha^i."""
        a = self.alpha(method)
        w = self.config.prior_weight
        drafted = self.pos_drafted.get(method, [])
        kept = self.pos_kept.get(method, [])
        out, prev = [], 1.0
        for i in range(1, k_max + 1):
            d = drafted[i - 1] if i <= len(drafted) else 0
            n = kept[i - 1] if i <= len(kept) else 0
            r = min(prev, (n + w * a ** i) / (d + w))
            out.append(r)
            prev = r
        return out

    def alpha(self, method: str) -> float:
        prior = dict(self.config.acceptance_prior).get(method, 0.5)
        w = self.config.prior_weight
        return (self.kept.get(method, 0.0) + prior * w) / (self.trials.get(method, 0.0) + w)


class LengthEstimator:
    """Completion length of finished requests, per prompt-length bucket (running mean)."""

    def __init__(self, config: PolicySettings) -> None:
        self.config = config
        self.sum: dict[int, float] = {}
        self.count: dict[int, int] = {}

    def bucket(self, prompt_tokens: int) -> int:
        for i, edge in enumerate(self.config.length_buckets):
            if prompt_tokens <= edge:
                return i
        return len(self.config.length_buckets)

    def observe(self, prompt_tokens: int, completion_tokens: int) -> None:
        b = self.bucket(prompt_tokens)
        self.sum[b] = self.sum.get(b, 0.0) + completion_tokens
        self.count[b] = self.count.get(b, 0) + 1

    def expected(self, prompt_tokens: int, max_tokens: int, has_stop: bool) -> float:
        b = self.bucket(prompt_tokens)
        if self.count.get(b):
            learned = self.sum[b] / self.count[b]
            return min(max_tokens, learned)
        # Nothing learned yet: a stop string usually ends a reply early.
        return max_tokens * (0.5 if has_stop else 1.0)
