"""The router's costs are measured at start-up, and the engine teaches its policy in one
process exactly as served (tiny fixture models, in process)."""

from __future__ import annotations

import torch

from specdec.engine.assemble import LocalBackend, assemble
from specdec.engine.spec import EngineSpec
from specdec.model.step.sampling import SamplingParams
from specdec.spec_decode.speculation import Speculation


def spec_of(target, draft, warmup: bool) -> EngineSpec:
    shard = {"dtype": "float32", "threads": 1, "resources": {"num_cpus": 0}}
    return EngineSpec.model_validate({
        "target": {"model": str(target), **shard}, "draft": {"model": str(draft), **shard},
        "runtime": {"max_slots": 4, "max_len": 128}, "warmup": warmup})


def run_one(built, rid: str, wanted: Speculation) -> None:
    built.submit(rid, [5, 17, 33, 8, 21], SamplingParams(temperature=0.0, max_tokens=12,
                                                          ignore_eos=True), wanted)
    while built.engine.has_work():
        built.engine.step()


def test_start_up_calibrates_costs_but_learns_no_acceptance(tiny_llama, tiny_llama_draft):
    threads = torch.get_num_threads()
    try:
        with assemble(spec_of(tiny_llama, tiny_llama_draft, True), LocalBackend()) as built:
            runs = built.calibration["runs"]
            assert {(r["rows"], r["method"]) for r in runs} == {
                (1, "none"), (1, "draft"), (4, "none"), (4, "draft")}
            assert {r["k"] for r in runs if r["method"] == "draft"} == {2, 6}
            policy = built.policy
            # Every calibration step is an anchor; nothing of it is left in the engine.
            assert len(policy.step_cost.anchors) == sum(r["steps"] for r in runs)
            # Draft rounds at both k (and shorter last rounds where max_tokens cut them);
            # a row's first round, which prefilled the draft with the prompt, is not one.
            ks = {a[0] for a in policy.draft_round_cost.anchors}
            assert {2.0, 6.0} <= ks <= {1.0, 2.0, 3.0, 4.0, 5.0, 6.0}
            assert len(policy.draft_round_cost.anchors) < sum(
                r["steps"] for r in runs if r["method"] == "draft")
            assert policy.step_cost.fit() is not None
            assert policy.draft_round_cost.fit() is not None
            # What a catch-up costs per token: the long prompt's run, its one sample (the
            # grid's short prompts ride along too few tokens per row to be one).
            assert any(r.get("catchup") for r in runs)
            assert len(policy.catchup_cost.prior) == len(
                [r for r in runs if r.get("catchup")]) and not policy.catchup_cost.live
            assert not policy.step_cost.samples and not policy.acceptance.trials
            assert built.engine.steps == 0 and not built.engine.history
            assert not policy.lengths.count
            # Served traffic then teaches it as usual.
            run_one(built, "a", Speculation(mode="on", method="draft", k=3))
            assert policy.step_cost.samples and policy.acceptance.trials["draft"] > 0
            # Cut at max_tokens: it says nothing about how long replies run by themselves.
            assert not policy.lengths.count
    finally:
        torch.set_num_threads(threads)


def test_the_engine_teaches_its_policy_in_one_process(tiny_llama, tiny_llama_draft):
    """The in-process engine (the CLI, bench served's in-process rows) learns from its steps
    and finished requests the same way the served replica does: it is the same engine."""
    threads = torch.get_num_threads()
    try:
        with assemble(spec_of(tiny_llama, tiny_llama_draft, False), LocalBackend()) as built:
            policy = built.policy
            assert built.calibration is None and not policy.step_cost.anchors
            run_one(built, "a", Speculation(mode="on", method="draft", k=2))
            run_one(built, "b", Speculation(mode="off"))
            assert len(policy.step_cost.samples) == built.engine.steps
            assert policy.draft_round_cost.samples
            assert policy.acceptance.trials["draft"] > 0
            assert not policy.lengths.count  # both cut at max_tokens (see test_policy)
    finally:
        torch.set_num_threads(threads)
