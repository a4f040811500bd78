"""Where a step's time goes, from the engine's step records (see engine.StepRecord)."""

from __future__ import annotations

import statistics


def timeline_summary(records) -> dict:
    """Median milliseconds per part of a step over recent steps, and bytes per step: where
    a step's time goes (engine bookkeeping, the draft call, the target call) and how much
    of each call is the call itself rather than compute in the actor."""
    if not records:
        return {}
    drafting = [r for r in records if r.max_k] or records
    overlapped = [r for r in records if r.overlapped]

    def med(f, among=records) -> float:
        return round(1000 * statistics.median(f(r) for r in among), 2)

    return {
        "steps": len(records),
        "step_ms": med(lambda r: r.step_s),
        "plan_ms": med(lambda r: r.plan_s),
        # Over the steps that drafted (others have none to show).
        "draft_call_ms": med(lambda r: r.draft_s, drafting),
        "draft_compute_ms": med(lambda r: r.draft_compute_s, drafting),
        "target_call_ms": med(lambda r: r.verify_s),
        "target_compute_ms": med(lambda r: r.target_compute_s),
        "post_ms": med(lambda r: r.post_s),
        "gap_ms": round(1000 * statistics.median(
            [b.end - b.step_s - a.end for a, b in zip(records, records[1:], strict=False)]
            or [0.0]), 2),
        "draft_bytes": statistics.median(r.draft_bytes for r in drafting),
        "target_bytes": statistics.median(r.target_bytes for r in records),
        # Guesses per drafting row (overlap: how far the draft got while the target ran),
        # tokens the decode rows emitted per step.
        "guesses_per_row": round(statistics.median(r.mean_k for r in drafting), 2),
        "emitted_per_step": statistics.median(r.emitted for r in records),
        # Overlap: steps where the draft worked during the target's step, and the small
        # call settling each such step's last position.
        "overlapped_steps": sum(1 for r in records if r.overlapped),
        "resolve_ms": med(lambda r: r.resolve_s, overlapped) if overlapped else 0.0,
    }
