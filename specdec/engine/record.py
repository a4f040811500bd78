"""A step's record, built once from what its phases returned: the plan (with what drafting
took), the run (the target's call, the draft's settled window) and what applying emitted.
The policy fits its costs on it, metrics export it, `bench served` breaks a request's time
down with it."""

from __future__ import annotations

import time

from specdec.engine.planner import Plan
from specdec.engine.state import StepRecord, StepRun


def record_step(plan: Plan, run: StepRun, emitted: int, t_start: float, t_apply: float,
                graph_built: bool) -> StepRecord:
    """The step's record, for the policy's cost fits, the metrics and the timeline."""
    work, win = plan.drafting, run.settled
    if plan.windows:  # overlap: how far the draft got in its window
        max_k, mean_k = win.max_k, win.mean_k
    else:
        drafted = [n for n in plan.num_draft.values() if n]
        max_k = max(plan.num_draft.values(), default=0)
        mean_k = sum(drafted) / len(drafted) if drafted else 0.0
    end = time.perf_counter()
    return StepRecord(
        rows=len(plan.rows), tokens=sum(len(r.tokens) for r in plan.rows),
        prefill_tokens=sum(len(r.tokens) for r in plan.rows
                           if r.seq_id not in plan.num_draft),
        draft_s=work.draft_s + win.draft_s, verify_s=run.verify_s,
        max_k=max_k, mean_k=mean_k,
        draft_rows=work.draft_rows, draft_k=work.draft_k, draft_model_s=work.draft_model_s,
        plan_s=work.plan_s, post_s=end - t_apply, step_s=end - t_start,
        draft_compute_s=work.draft_compute_s + win.draft_compute_s,
        target_compute_s=run.target_compute_s,
        draft_bytes=work.draft_bytes + win.draft_bytes, target_bytes=run.target_bytes,
        end=end, overlapped=plan.overlapped, resolve_s=win.resolve_s, emitted=emitted,
        draft_catchup=work.draft_catchup, draft_catchup_total=work.draft_catchup_total,
        prompt_catchup=work.prompt_catchup, prompt_catchup_rows=work.prompt_catchup_rows,
        prompt_catchup_s=work.prompt_catchup_s, graph_built=graph_built)
