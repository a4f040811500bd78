"""Speculation counters, per request and per engine.

Mean acceptance length = tokens emitted per speculative round = 1 + accepted / rounds (the
corrected or bonus token counts). accepted / drafted is reported as "draft acceptance
ratio": it is NOT the paper's per-token rate alpha, because guesses after a rejection are
drafted but can never be kept.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecCounters:
    rounds: int = 0            # speculative rounds (k >= 1)
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0        # rounds that ended in a rejection (not a full acceptance)
    empty_proposals: int = 0   # rounds that asked for guesses and got none (ran plainly)
    plain_steps: int = 0       # steps that emitted one token without a proposal
    emitted: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    drafted_per_position: list[int] = dataclasses.field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0

    def record_round(self, num_draft: int, num_accepted: int, emitted: int) -> None:
        self.emitted += emitted
        if num_draft == 0:
            self.plain_steps += 1
            return
        self.rounds += 1
        self.drafted += num_draft
        self.accepted += num_accepted
        self.rejections += int(num_accepted < num_draft)
        for counts, n in ((self.drafted_per_position, num_draft),
                          (self.accepted_per_position, num_accepted)):
            if len(counts) < num_draft:
                counts.extend([0] * (num_draft - len(counts)))
            for i in range(n):
                counts[i] += 1

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.accepted / self.rounds if self.rounds else None

    @property
    def policy_trials(self) -> int:
        """Tested guesses (up to each round's first rejection) plus empty proposals, which
        the policy must count as failures or a proposer that rarely proposes looks good."""
        return self.accepted + self.rejections + self.empty_proposals

    @property
    def alpha_estimate(self) -> float | None:
        """Per-token acceptance: kept / tested, a guess being tested only up to the first
        rejection of its round."""
        trials = self.accepted + self.rejections
        return self.accepted / trials if trials else None

    @property
    def draft_acceptance_ratio(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def per_position_acceptance(self) -> list[float]:
        """Chance position i was kept given it was drafted (conditional, position by position)."""
        return [a / d if d else 0.0
                for a, d in zip(self.accepted_per_position, self.drafted_per_position,
                                strict=False)]

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
            "plain_steps": self.plain_steps, "empty_proposals": self.empty_proposals,
            "emitted": self.emitted,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_ratio": self.draft_acceptance_ratio,
            "alpha_estimate": self.alpha_estimate,
            "per_position_acceptance": self.per_position_acceptance(),
            "draft_s": round(self.draft_s, 4), "verify_s": round(self.verify_s, 4),
        }
