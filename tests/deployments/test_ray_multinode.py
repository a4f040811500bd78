"""Placement across a simulated multi-node cluster: target shards on two nodes, the draft
on a third; losing the draft's node mid-generation does not fail the request."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from deployments.launch import ray_engine
from specdec.engine.request import Request
from specdec.engine.spec import (
    ActorResources,
    DraftGroupSpec,
    EngineSpec,
    ModelGroupSpec,
    RuntimeSpec,
)
from specdec.model.step.sampling import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.real_model]


@pytest.fixture
def cluster(monkeypatch):
    tmp = tempfile.mkdtemp(prefix="sdcl-", dir="/tmp")
    # Cluster records its address under the default temp dir; keep even that file ours.
    monkeypatch.setenv("RAY_TMPDIR", tmp)
    os.makedirs(os.path.join(tmp, "ray"))
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "temp_dir": os.path.join(tmp, "ray"), "include_dashboard": False})
    # Custom resources stand in for GPUs: two nodes can host target shards, one the draft.
    nodes = {
        "target_a": c.add_node(num_cpus=2, resources={"target_slot": 2}),
        "target_b": c.add_node(num_cpus=2, resources={"target_slot": 1}),
        "draft": c.add_node(num_cpus=1, resources={"draft_slot": 1}),
    }
    c.wait_for_nodes()
    ray.init(address=c.address)
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def test_shards_on_two_nodes_draft_on_a_third_and_draft_node_loss(cluster, smollm2_path):
    c, nodes = cluster
    runtime = RuntimeSpec(max_slots=2, max_len=512, collective_timeout_s=10,
                            step_timeout_s=20, draft_retry_s=1.0, placement_strategy="PACK",
                            gloo_socket_ifname="lo")
    target = ModelGroupSpec(model=str(smollm2_path), tp=3, dtype="bfloat16",
                              resources=ActorResources(num_cpus=0.5,
                                                       resources={"target_slot": 1}))
    draft = DraftGroupSpec(model=str(smollm2_path), dtype="bfloat16",
                             resources=ActorResources(num_cpus=0.5,
                                                      resources={"draft_slot": 1}))
    with ray_engine(EngineSpec(target=target, draft=draft, runtime=runtime,
                               warmup=False)) as h:
        shard_nodes = [node_of(a) for a in h.target.group.actors]
        draft_node = node_of(h.draft.group.leader)
        assert set(shard_nodes) == {nodes["target_a"].node_id, nodes["target_b"].node_id}
        assert draft_node == nodes["draft"].node_id

        ids = h.tokenizer("def add(a, b):").input_ids
        first = h.engine.run([Request("a", ids, SamplingParams(temperature=0, max_tokens=16),
                                      "draft", 3)])["a"]
        assert first.finish_reason == "length" and first.spec.accepted > 0

        box = {}
        params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
        t = threading.Thread(target=lambda: box.update(h.engine.run(
            [Request("b", ids, params, "draft", 3)])), daemon=True)
        t.start()
        t0 = time.monotonic()
        while h.engine.totals["draft"].emitted < 40 and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        c.remove_node(nodes["draft"])
        t.join(timeout=180)
        assert not t.is_alive()
        out = box["b"]
        assert out.finish_reason == "length" and len(out.token_ids) == 160 and out.error is None
        assert h.draft.failures >= 1
        assert out.spec.plain_steps > 0, "after the draft was lost, rounds ran plainly"
