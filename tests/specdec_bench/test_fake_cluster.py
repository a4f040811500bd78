"""The local autoscaling cluster is the deployed one, mapped: node types from
cluster/ray-cluster.yaml, the application from serve_config.gpu.yaml, only what cannot run
on this host scaled (specdec_bench/fake_cluster.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

from deployments.app import parse_args
from specdec_bench.fake_cluster import (
    CLUSTER_YAML,
    HEAD_TYPE,
    Scaling,
    app_args,
    autoscaler_config,
    load_gpu_config,
    node_types,
)

CLUSTER = yaml.safe_load(CLUSTER_YAML.read_text())
GPU = load_gpu_config()
SCALING = Scaling(time_scale=20, node_cpus=2, max_replicas=2, max_slots=4)


def test_node_types_keep_names_custom_resources_and_worker_bounds():
    types = node_types(CLUSTER, SCALING)
    source = {k: v for k, v in CLUSTER["available_node_types"].items()
              if k != CLUSTER["head_node_type"]}
    assert set(types) == set(source) == {"target-gpu", "draft-gpu"}
    for name, t in types.items():
        src = source[name]
        custom = {k: v for k, v in src["resources"].items() if k not in ("CPU", "GPU")}
        assert {k: v for k, v in t["resources"].items()
                if k not in ("CPU", "object_store_memory")} == custom
        assert "GPU" not in t["resources"] and t["resources"]["CPU"] <= 2
        assert (t["min_workers"], t["max_workers"]) == (src["min_workers"], src["max_workers"])


def test_the_autoscaler_config_is_valid_for_ray_and_its_times_scaled():
    from ray.autoscaler._private.util import validate_config

    config = autoscaler_config(CLUSTER, "127.0.0.1:1234", SCALING)
    validate_config(config)
    assert config["idle_timeout_minutes"] == CLUSTER["idle_timeout_minutes"] / 20
    assert config["available_node_types"][HEAD_TYPE]["max_workers"] == 0
    assert config["provider"]["gcs_address"] == "127.0.0.1:1234"


def test_app_args_keep_the_deployed_layout_and_autoscaling(tmp_path: Path):
    args = app_args(GPU, tmp_path / "t", tmp_path / "d", scaling=SCALING)
    src = GPU["applications"][0]["args"]
    cfg = parse_args(args)  # a valid application, as the deploy would validate it
    for role in ("target", "draft"):
        got, want = args[role], src[role]
        assert got["tp"] == want["tp"]
        assert got["resources"]["resources"] == want["resources"]["resources"]
        assert got["resources"]["num_gpus"] == 0
    assert cfg.engine.runtime.placement_strategy == src["runtime"]["placement_strategy"]
    auto, want = args["engine_autoscaling"], src["engine_autoscaling"]
    assert auto["min_replicas"] == want["min_replicas"]
    assert auto["max_replicas"] == min(want["max_replicas"], 2)
    assert auto["upscale_delay_s"] == want["upscale_delay_s"] / 20
    assert auto["downscale_delay_s"] == want["downscale_delay_s"] / 20
    # The same share of a replica's slots in flight asks for another replica.
    assert auto["target_ongoing_requests"] / 4 == \
        want["target_ongoing_requests"] / src["runtime"]["max_slots"]


def test_every_resource_a_replica_asks_for_is_offered_by_a_node_type():
    """What the application asks for and what the cluster offers agree (a renamed resource
    in one file would leave replicas pending forever)."""
    src = GPU["applications"][0]["args"]
    offered = {k: t["resources"] for k, t in CLUSTER["available_node_types"].items()}
    for role in ("target", "draft"):
        asks = src[role]["resources"]["resources"]
        (name, amount), = asks.items()
        hosts = [t for t in offered.values() if t.get(name, 0) >= amount]
        assert hosts, f"{role} asks for {name}, no node type offers it"
        # PACK keeps a replica's target ranks on one node: one node type must hold all.
        if role == "target":
            assert any(t[name] >= amount * src[role]["tp"] for t in hosts)
