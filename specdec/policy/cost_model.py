"""The cost model: when speculation pays, in numbers, and what a target step and a draft
round cost as measured on the machine serving now.

When speculation pays, in numbers.

a: acceptance rate (chance a draft token is kept, assumed i.i.d. per position).
k: draft tokens per round. c: one draft step's time / one plain target step's time.
v: one verify forward (k+1 tokens per row) / one plain target step. About 1 while the
   target is memory bound (small batch); it grows as the batch becomes compute bound.

tokens per round = (1 - a^(k+1)) / (1 - a); speedup = tokens per round / (k*c + v).

What a target step and a draft round cost, as measured on the machine serving now.

Two sources: the start-up calibration (specdec/engine/calibrate.py) and the steps of live traffic.
The calibration is a prior, never the truth for good: a machine that was busy while the app
started (another build, a neighbour's job) makes every one of its steps slow, and unevenly
so (compute-bound verifies suffer more than memory-bound plain steps). So:

- costs are kept per shape (tokens in the target's forward; k and rows of a draft round),
  each shape's cost is the median of its recent live samples (outliers fall out), and live
  samples of a shape replace the calibration's samples of that shape at once;
- a shape live traffic has not run yet takes its calibration median scaled by how much the
  calibration was off at the nearest shape measured both ways (a uniformly busy start is
  corrected by the first live step of any shape);
- `last_live(shape)` says when a shape was last run for real, so the policy can probe a
  shape the batch does not run (specdec/policy/probes.py) instead of trusting its prior.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from collections.abc import Callable

import numpy as np


def expected_tokens_per_round(a: float, k: int) -> float:
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    a = max(a, 0.0)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


LIVE_PER_SHAPE = 32  # recent live samples kept per shape: a median over a short memory


class _ShapeCosts:
    """Per shape: recent live samples (with their time) and calibration samples."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.live: dict[tuple, collections.deque] = {}
        self.prior: dict[tuple, list[float]] = {}
        self.seen: dict[tuple, float] = {}  # shape -> clock() of its last live sample
        self.samples: collections.deque = collections.deque(maxlen=512)  # (shape, s), recent
        self.anchors: list[tuple] = []      # (shape..., seconds) as calibrated, for reports
        self._fixed: tuple[float, ...] | None = None
        self._solved: tuple | None = None
        self._ratios: dict[tuple, float] = {}
        self._error: tuple[int, float | None] | None = None
        self.version = 0  # bumps on every sample: callers cache per version
        # Where this model has no live shape yet, how far another model's calibration (the
        # same machine at the same time) was off: the draft borrows the target's.
        self.borrow: Callable[[], float | None] | None = None

    def _live(self, shape: tuple, seconds: float) -> None:
        self.live.setdefault(shape, collections.deque(maxlen=LIVE_PER_SHAPE)).append(seconds)
        self.seen[shape] = self.clock()
        self.samples.append((shape, seconds))
        self._changed()

    def _prior(self, shape: tuple, seconds: float) -> None:
        self.prior.setdefault(shape, []).append(seconds)
        self.anchors.append((*shape, seconds))
        self._changed()

    def _changed(self) -> None:
        self._solved = None
        self.version += 1

    def last_live(self, shape: tuple) -> float | None:
        return self.seen.get(shape)

    def effective(self) -> dict[tuple, float]:
        """Each shape's cost: its live median, else its calibration median corrected by how
        far the calibration was off at the nearest live shape (live / what the calibration
        predicts there)."""
        live = {s: statistics.median(v) for s, v in self.live.items()}
        prior = {s: statistics.median(v) for s, v in self.prior.items()}
        predict = self._prior_predictor(prior)
        ratios = {}
        for s, y in live.items():
            p = predict(s) if predict else None
            if p:
                ratios[s] = y / p
        self._ratios = ratios
        borrowed = self.borrow() if self.borrow is not None and not ratios else None
        out = dict(live)
        for s, p in prior.items():
            if s in live:
                continue
            if ratios:
                near = min(ratios, key=lambda b: self._distance(s, b))
                p *= ratios[near]
            elif borrowed:
                p *= borrowed
            out[s] = p
        return out

    def calibration_error(self) -> float | None:
        """Live cost / calibrated cost, median over the live shapes (None: nothing live).
        Asked by the draft's fit for every k the policy prices: solved once per sample."""
        if self._error is None or self._error[0] != self.version:
            self.effective()
            self._error = (self.version, statistics.median(self._ratios.values())
                           if self._ratios else None)
        return self._error[1]

    def _prior_predictor(self, prior: dict[tuple, float]):
        """What the calibration alone says a shape costs (None: it says nothing)."""
        raise NotImplementedError

    @staticmethod
    def _distance(a: tuple, b: tuple) -> float:
        # Costs scale with sizes: compare shapes on a log scale.
        return sum(abs(math.log(max(x, 1.0)) - math.log(max(y, 1.0))) for x, y in zip(a, b, strict=True))

    def report(self) -> dict:
        return {"live_shapes": len(self.live), "calibrated_shapes": len(self.prior),
                "live_samples": len(self.samples)}


class StepCostModel(_ShapeCosts):
    """Step time as a function of the tokens in the target's forward.

    Costs are read from the per-shape points themselves (joined by straight segments), not
    from one line: a target is memory bound for a few tokens and compute bound beyond (a
    roofline), so one line through both regions overrates small steps and underrates large
    verifies. The verify cost v of adding k tokens per row is the ratio of step times with
    and without them."""

    def observe(self, tokens: int, seconds: float) -> None:
        self._live((float(tokens),), seconds)

    def calibrate(self, tokens: int, seconds: float) -> None:
        self._prior((float(tokens),), seconds)

    def points(self) -> list[tuple[float, float]]:
        """(tokens, seconds) per token count, ascending, never cheaper for more tokens:
        noise between neighbouring counts must not make a verify look cheaper than the
        plain step it extends."""
        if self._solved is None:
            pts, top = [], 0.0
            for (x,), y in sorted(self.effective().items()):
                top = max(top, y)
                pts.append((x, top))
            self._solved = (pts, _line(pts))
        return self._solved[0]

    def fit(self) -> tuple[float, float] | None:
        """A line a + b * tokens through the points (reported; the slope past the last)."""
        if self._fixed is not None:
            return self._fixed
        self.points()
        return self._solved[1]

    def step_seconds(self, tokens: float) -> float | None:
        if self._fixed is not None:
            return self._fixed[0] + self._fixed[1] * tokens
        pts = self.points()
        if len(pts) < 2 or self.fit() is None:
            return None
        xs = [x for x, _ in pts]
        if tokens <= xs[0]:
            return pts[0][1]
        if tokens >= xs[-1]:
            # Beyond the largest step seen: on at the steeper of the last segment's slope
            # and the line's (costs per token only grow once compute bound).
            (x0, y0), (x1, y1) = pts[-2], pts[-1]
            slope = max((y1 - y0) / (x1 - x0), self.fit()[1])
            return y1 + slope * (tokens - x1)
        i = int(np.searchsorted(xs, tokens))
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def verify_cost(self, base_tokens: float, extra_tokens: float) -> float:
        base = self.step_seconds(base_tokens)
        if base is None:
            return 1.0  # memory-bound assumption until measured
        return self.step_seconds(base_tokens + extra_tokens) / max(base, 1e-9)

    def effective(self) -> dict[tuple, float]:
        """As for every shape, except that a calibrated count with live counts on both
        sides is left out: the live points around it say more than a prior known to be
        off, and one stale point would otherwise lift every count after it (costs never
        fall with more tokens)."""
        out = super().effective()
        live = sorted(x for (x,) in self.live)
        if len(live) >= 2:
            lo, hi = live[0], live[-1]
            for (x,) in list(out):
                if (x,) not in self.live and lo < x < hi:
                    del out[(x,)]
        return out

    def last_live_at(self, tokens: float) -> float | None:
        return self.last_live((float(tokens),))

    def _prior_predictor(self, prior):
        """The calibration's points joined by segments (flat beyond their ends)."""
        if not prior:
            return None
        pts = sorted((x, y) for (x,), y in prior.items())
        xs, ys = [x for x, _ in pts], [y for _, y in pts]
        return lambda shape: float(np.interp(shape[0], xs, ys))


def _line(pts: list[tuple[float, float]]) -> tuple[float, float] | None:
    if len(pts) < 2:
        return None
    x = np.array([p[0] for p in pts])
    y = np.array([p[1] for p in pts])
    b, a = np.polyfit(x, y, 1)
    return (max(float(a), 1e-6), max(float(b), 0.0))


class DraftCostModel(_ShapeCosts):
    """Draft time of one round as d0 + k * (e0 + e1 * rows), least squares over the per-shape
    costs (shape = k, rows).

    d0 is paid once per round whatever k is (the call into the draft, catching its cache up
    with the tokens the target added); e0 + e1 * rows is one batched draft forward, run k
    times in sequence. A flat c * k misses d0 and so under-rates longer drafts."""

    def observe(self, k: int, rows: int, seconds: float) -> None:
        if k > 0 and rows > 0:
            self._live((float(k), float(rows)), seconds)

    def calibrate(self, k: int, rows: int, seconds: float) -> None:
        if k > 0 and rows > 0:
            self._prior((float(k), float(rows)), seconds)

    def fit(self) -> tuple[float, float, float] | None:
        if self._fixed is not None:
            return self._fixed
        borrowed = self.borrow() if self.borrow is not None and not self.live else None
        if self._solved is None or self._solved[1] != borrowed:
            self._solved = (_draft_fit(self.effective()), borrowed)
        return self._solved[0]

    def _prior_predictor(self, prior):
        """The calibration's own fit."""
        fit = _draft_fit(prior)
        if fit is None:
            return None
        d0, e0, e1 = fit
        return lambda shape: d0 + shape[0] * (e0 + e1 * shape[1])

    def round_seconds(self, k: int, rows: int) -> float | None:
        fit = self.fit()
        if fit is None:
            return None
        d0, e0, e1 = fit
        return d0 + k * (e0 + e1 * rows)


def _draft_fit(costs: dict[tuple, float]) -> tuple[float, float, float] | None:
    """d0, e0, e1 by least squares over shape costs {(k, rows): seconds}."""
    pts = [(k, rows, y) for (k, rows), y in costs.items()]
    if len(pts) < 3 or len({k for k, _, _ in pts}) < 2:
        # Fewer shapes than parameters, or one k only: the fixed and the per-guess
        # parts cannot be told apart.
        return None
    k = np.array([s[0] for s in pts])
    rows = np.array([s[1] for s in pts])
    y = np.array([s[2] for s in pts])
    x = np.stack([np.ones_like(k), k, k * rows], axis=1)
    if len(set(rows.tolist())) < 2:
        x = x[:, :2]  # one batch size only: no slope in rows
    coef = np.linalg.lstsq(x, y, rcond=None)[0].tolist() + [0.0]
    return (max(coef[0], 0.0), max(coef[1], 1e-6), max(coef[2], 0.0))


class CatchupCost:
    """What the draft pays to catch up on context it has not seen (a prompt, or what a row
    decoded plainly), per token: the draft's time in a round that first caught up, beyond
    what the round itself costs (DraftCostModel), over the tokens it caught up on. The
    start-up calibration runs one such round; live rounds replace it, the median of the
    recent ones."""

    def __init__(self) -> None:
        self.live: collections.deque = collections.deque(maxlen=LIVE_PER_SHAPE)
        self.prior: list[float] = []

    def observe(self, tokens: int, seconds: float, round_seconds: float | None,
                anchor: bool = False) -> None:
        if tokens <= 0 or round_seconds is None:
            return
        per_token = max(seconds - round_seconds, 0.0) / tokens
        (self.prior if anchor else self.live).append(per_token)

    def seconds(self, tokens: int) -> float | None:
        """Seconds to catch up on `tokens` tokens, or None while nothing was measured."""
        samples = self.live or self.prior
        if not samples or tokens <= 0:
            return None if not samples else 0.0
        return tokens * statistics.median(samples)

    def report(self) -> dict:
        per = self.seconds(1000)
        return {"ms_per_1000_tokens": None if per is None else round(1000 * per, 1),
                "live_samples": len(self.live)}
