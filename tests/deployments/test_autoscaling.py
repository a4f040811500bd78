"""Autoscaling end to end, on Ray's own autoscaler (the fake multi-node provider: each node
a raylet on this host) with the node types of cluster/ray-cluster.yaml and the application
of serve_config.gpu.yaml, fixture models on CPU, times scaled down (specdec_bench/autoscale.py
runs the same scenario as a demo). Start: the autoscaler launches the minimum nodes and the
application becomes ready; load: a second engine replica starts, the autoscaler launches a
node for its draft, both replicas serve; idle: the replica drains and then its node goes
away, a request in flight on it answered in full. No request fails, none is lost,
throughout; Prometheus and the Grafana dashboard show both replicas under load."""

from __future__ import annotations

import pytest
import yaml

from specdec_bench.autoscale import first_speculation_after_first_serve, run, served_through_drain
from specdec_bench.fake_cluster import CLUSTER_YAML, Scaling

pytestmark = pytest.mark.integration

CLUSTER = yaml.safe_load(CLUSTER_YAML.read_text())


def test_scale_up_under_load_and_back_down_when_idle_losing_nothing():
    # 40x faster than deployed: upscale 0.75 s, downscale 7.5 s, node idle timeout 15 s.
    # Idle requests of 736 tokens (max_len 768): long enough that one is in flight on the
    # extra replica when it begins to drain, whatever the poll's 0.05 s resolution.
    report = run(clients=6, max_tokens=32, load_s=150, idle_s=180,
                 scaling=Scaling(time_scale=40, max_len=768))
    ev = report.events
    for name in ("second replica running", "both replicas serving", "back to one replica"):
        assert name in ev, (name, ev)
    assert any(k.startswith("nodes back to the minimum") for k in ev), ev
    # Nothing failed and nothing was lost: every request got an answer (a 200, or a 503
    # with Retry-After), none timed out or broke off.
    counts = report.counts()
    assert counts["failed"] == 0 and counts["succeeded"] >= 50, counts
    # The minimum is what cluster/ray-cluster.yaml asks for; the autoscaler launched a node
    # for the second replica's draft, and took it back.
    draft_min = CLUSTER["available_node_types"]["draft-gpu"]["min_workers"]
    assert report.min_nodes.get("draft-gpu") == draft_min
    assert max(s["nodes"].get("draft-gpu", 0) for s in report.samples) >= draft_min + 1
    assert report.samples[-1]["nodes"].get("draft-gpu", 0) == draft_min
    assert report.samples[-1]["running"] == 1
    # Both replicas served under load, and the new one speculated within seconds.
    serving = report.replicas_serving("load")
    assert len(serving) == 2 and min(serving.values()) >= 3, serving
    assert all(s <= 10 for s in first_speculation_after_first_serve(report).values())
    # Requests sent while the replica drained and its node went away: all answered 200,
    # and at least one was in flight on the draining replica when its drain began.
    gone, through = served_through_drain(report)
    idle = [c for c in report.calls if c.phase == "idle"]
    assert gone is not None and idle and all(c.status == 200 for c in idle)
    assert "drain began" in ev and through >= 1, (ev, through)
    # Prometheus (cluster/prometheus.yml, following the nodes) and the committed dashboard
    # show both replicas: its replica variable, every batch panel series, tokens by replica
    # (the metric's replica tag is the one the responses name).
    dash = report.dashboard
    assert dash, "Prometheus never answered the dashboard's queries"
    assert set(serving) <= set(dash["replica_variable"]), (dash, serving)
    assert all(set(serving) <= set(replicas) for replicas in dash["batch_panel"]), dash
    assert all(dash["tokens_by_replica"].get(r, 0) > 0 for r in serving), dash
    # A second serving replica within node start + model load (the first replica's, up to
    # ready) + 30 s of the load beginning.
    ready = next(v for k, v in ev.items() if k.startswith("ready"))
    assert ev["second replica running"] - ev["load: 6 clients"] < ready + 30, ev
