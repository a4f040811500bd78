"""Autoscaling end to end, on Ray's own autoscaler (the fake multi-node provider: each node
a raylet on this host) with the node types of cluster/ray-cluster.yaml and the application
of serve_config.gpu.yaml, fixture models on CPU, times scaled down (benchmarks/autoscale.py
runs the same scenario as a demo). Start: the autoscaler launches the minimum nodes and the
application becomes ready; load: a second engine replica starts, the autoscaler launches a
node for its draft, both replicas serve; idle: the replica and then its node go away. No
request fails, none is lost, throughout."""

from __future__ import annotations

import pytest

from benchmarks.autoscale import first_speculation_after_first_serve, run
from benchmarks.fake_cluster import Scaling

pytestmark = pytest.mark.integration


def test_scale_up_under_load_and_back_down_when_idle_losing_nothing():
    # 40x faster than deployed: upscale 0.75 s, downscale 7.5 s, node idle timeout 15 s.
    report = run(clients=6, max_tokens=32, load_s=150, idle_s=180,
                 scaling=Scaling(time_scale=40))
    ev = report.events
    for name in ("second replica running", "both replicas serving", "back to one replica"):
        assert name in ev, (name, ev)
    assert any(k.startswith("nodes back to the minimum") for k in ev), ev
    counts = report.counts()
    assert counts["failed"] == 0 and counts["sent"] == counts["succeeded"] + \
        counts["refused_503"], counts
    assert counts["succeeded"] >= 50, counts
    # Every call answered (none lost): each recorded call has its status.
    assert all(c.status in (200, 503) for c in report.calls)
    # The autoscaler launched a node for the second replica's draft, and took it back.
    min_drafts = report.min_nodes.get("draft-gpu", 0)
    assert max(s["nodes"].get("draft-gpu", 0) for s in report.samples) == min_drafts + 1
    assert report.samples[-1]["nodes"].get("draft-gpu", 0) == min_drafts
    # Both replicas served under load, and the new one speculated within seconds.
    serving = report.replicas_serving("load")
    assert len(serving) == 2 and min(serving.values()) >= 3, serving
    assert all(s <= 10 for s in first_speculation_after_first_serve(report).values())
    # Requests sent while the replica and the node went away all succeeded.
    idle = [c for c in report.calls if c.phase == "idle"]
    assert idle and all(c.status == 200 for c in idle)
    # Scale-up within node start + model load + 30 s of the load beginning.
    assert ev["second replica running"] - ev["load: 6 clients"] < 90, ev
