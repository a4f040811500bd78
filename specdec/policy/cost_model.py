"""When speculation pays, in numbers.

a: acceptance rate (chance a draft token is kept, assumed i.i.d. per position).
k: draft tokens per round. c: one draft step's time / one plain target step's time.
v: one verify forward (k+1 tokens per row) / one plain target step. About 1 while the
   target is memory bound (small batch); it grows as the batch becomes compute bound.

tokens per round = (1 - a^(k+1)) / (1 - a); speedup = tokens per round / (k*c + v).
"""

from __future__ import annotations


def expected_tokens_per_round(a: float, k: int) -> float:
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    a = max(a, 0.0)
    return (1.0 - a ** (k + 1)) / (1.0 - a)
