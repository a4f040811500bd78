"""When speculation pays, in numbers.

a: acceptance rate (chance a draft token is kept, assumed i.i.d. per position).
k: draft tokens per round. c: one draft step's time / one plain target step's time.
v: one verify forward (k+1 tokens per row) / one plain target step. About 1 while the
   target is memory bound (small batch); it grows as the batch becomes compute bound.

tokens per round = (1 - a^(k+1)) / (1 - a); speedup = tokens per round / (k*c + v).
"""

from __future__ import annotations

from collections.abc import Callable


def expected_tokens_per_round(a: float, k: int) -> float:
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    a = max(a, 0.0)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_speedup(a: float, k: int, c: float, v: float = 1.0) -> float:
    """Goodput relative to plain decoding (1.0 = break-even); k = 0 is plain itself."""
    if k <= 0:
        return 1.0
    return expected_tokens_per_round(a, k) / (k * c + v)


def acceptance_from_mean_length(mean_len: float, k: int) -> float:
    """Invert tokens-per-round for a (bisection): what a per-position rate would explain
    an observed mean acceptance length at this k."""
    mean_len = min(max(mean_len, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if expected_tokens_per_round(mid, k) < mean_len:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def best_k(a: float, c: float, k_max: int,
           verify_cost: Callable[[int], float] | float = 1.0) -> tuple[int, float]:
    """The k in 0..k_max with the highest expected speedup, and that speedup.

    verify_cost(k) gives v for a round of k drafts (a constant means v does not grow with k).
    Returns (0, 1.0) when no k beats plain decoding.
    """
    best = (0, 1.0)
    for k in range(1, k_max + 1):
        v = verify_cost(k) if callable(verify_cost) else verify_cost
        s = expected_speedup(a, k, c, v)
        if s > best[1]:
            best = (k, s)
    return best
