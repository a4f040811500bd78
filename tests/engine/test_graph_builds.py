"""A step that compiles or captures a new bucket's graph is marked, and the policy does not
price its shape from it: that step's time is the build (seconds for a compile, tens of ms
for a capture against a step of a few), and taken as a shape's first price it would keep the
policy off that shape until something else probed it."""

from __future__ import annotations

import dataclasses

import pytest
from engine_helpers import BIG_QUEUE, greedy, load, random_prompts

from specdec.engine.engine import Engine, StepRecord
from specdec.engine.request import Request
from specdec.model.step.static_step import StaticDecoder, graph_builds
from specdec.policy.engine_policy import EnginePolicy
from specdec.policy.settings import PolicySettings
from specdec.spec_decode.proposers import DraftModelProposer
from specdec.spec_decode.target_runner import LocalTargetRunner


def _engine(target_path, draft_path, compile: bool) -> Engine:
    # backend="eager": dynamo traces each bucket's graph (a real build, counted as one)
    # without inductor's code generation, so the test stays quick.
    def step(path):
        return StaticDecoder(load(path), compile=compile, backend="eager")

    # Without the prefix cache: the same requests again must do the same work (the cache
    # would turn their prefills into one-token steps, other buckets).
    return Engine(LocalTargetRunner(step(target_path), 4, 128),
                  {"draft": DraftModelProposer(step(draft_path), 4, 128, prefix_cache=False)},
                  None, (), dataclasses.replace(BIG_QUEUE, prefix_cache=False))


def _run(engine: Engine, prefix: str) -> list[StepRecord]:
    records: list[StepRecord] = []
    engine.on_step.append(records.append)
    prompts = random_prompts([9, 14])
    engine.run([Request.pinned(f"{prefix}{i}", p, greedy(10), "draft", 2)
                for i, p in enumerate(prompts)])
    engine.on_step.remove(records.append)
    return records


def test_steps_that_build_a_graph_are_marked_and_repeats_of_their_buckets_are_not(
        tiny_llama, tiny_llama_draft):
    engine = _engine(tiny_llama, tiny_llama_draft, compile=True)
    first = _run(engine, "a")
    builds = graph_builds(engine.target) + graph_builds(engine.proposers["draft"])
    marked = [r for r in first if r.graph_built]
    # The first step the draft runs in (it takes in the prompt beside the target's
    # prefill) builds the graphs; later steps of the run reuse them or build a new
    # bucket's (each marked step built at least one).
    assert marked and marked[0] is next(r for r in first if r.draft_rows or r.prompt_catchup)
    assert len(marked) <= builds
    assert any(not r.graph_built for r in first)
    # The same requests again run the same buckets: nothing is built, nothing is marked.
    again = _run(engine, "b")
    assert graph_builds(engine.target) + graph_builds(engine.proposers["draft"]) == builds
    assert not any(r.graph_built for r in again)


def test_a_static_step_without_compile_builds_nothing(tiny_llama, tiny_llama_draft):
    engine = _engine(tiny_llama, tiny_llama_draft, compile=False)
    records = _run(engine, "a")
    assert graph_builds(engine.target) == 0 and not any(r.graph_built for r in records)


@pytest.mark.parametrize("built", [False, True])
def test_the_policy_learns_no_cost_from_a_step_that_built_a_graph(built):
    policy = EnginePolicy(PolicySettings())
    rec = StepRecord(rows=2, tokens=6, draft_s=0.02, verify_s=1.5, draft_rows=2, draft_k=2,
                     draft_model_s=0.02, step_s=1.55, graph_built=built)
    policy.observe_step(rec)
    step, draft = policy.step_cost.effective(), policy.draft_round_cost.effective()
    if built:
        assert step == {} and draft == {} and policy.draft_cost is None
    else:
        assert step and draft and policy.draft_cost is not None
