"""The cluster manifests validate against the schemas their tools use, agree with the app
configs they run, and the committed dashboard is the one the code builds."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import parse_args
from specdec_tools.dashboard import build
from specdec_tools.promql import PANELS
from specdec_tools.rayservice import render

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    return yaml.safe_load((ROOT / name).read_text())


def test_autoscaler_config_validates_against_rays_own_schema():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    cfg = load("cluster/ray-cluster.yaml")
    jsonschema.Draft7Validator(schema).validate(cfg)
    types = cfg["available_node_types"]
    gpu = load("serve_config.gpu.yaml")["applications"][0]["args"]
    # The node types carry the custom resources the GPU app's shards ask for.
    for role, custom in (("target", "target_gpu"), ("draft", "draft_gpu")):
        assert gpu[role]["resources"]["resources"] == {custom: 1}
        assert any(t["resources"].get(custom) for t in types.values())
    target_node = next(t for t in types.values() if t["resources"].get("target_gpu"))
    assert target_node["resources"]["GPU"] >= gpu["target"]["tp"]


def test_rayservice_validates_against_kuberays_crd_and_runs_the_gpu_app():
    schema = json.loads((ROOT / "cluster/schemas/rayservice-v1.schema.json").read_text())
    doc = load("cluster/rayservice.yaml")
    jsonschema.Draft7Validator(schema).validate(doc)
    spec = doc["spec"]
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    assert spec["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    serve = yaml.safe_load(spec["serveConfigV2"])
    ServeDeploySchema.model_validate(serve)                # Ray Serve's own schema
    app = serve["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    assert app["args"] == load("serve_config.gpu.yaml")["applications"][0]["args"]
    parse_args(app["args"])                                # our own validation too
    groups = spec["rayClusterConfig"]["workerGroupSpecs"]
    assert {g["groupName"] for g in groups} == {"target-gpu", "draft-gpu"}
    for g in groups:
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1
    head_ports = {p["containerPort"] for p in spec["rayClusterConfig"]["headGroupSpec"][
        "template"]["spec"]["containers"][0]["ports"]}
    assert {8000, 8080} <= head_ports                      # Serve and metrics
    # The committed file is what the generator makes from the current GPU config.
    assert (ROOT / "cluster/rayservice.yaml").read_text() == render(ROOT / "serve_config.gpu.yaml")


def test_committed_dashboard_is_the_one_built_in_code():
    committed = json.loads((ROOT / "cluster/grafana/specdec-dashboard.json").read_text())
    assert committed == build()
    exprs = [t["expr"] for p in committed["panels"] for t in p["targets"]]
    assert len(exprs) == sum(len(p.queries) for p in PANELS)
    assert {v["name"] for v in committed["templating"]["list"]} == {"application", "replica"}
    assert all('application=~"$application"' in e for e in exprs)


def test_prometheus_config_scrapes_ray_directly_and_through_its_discovery_file():
    cfg = load("cluster/prometheus.yml")
    job = cfg["scrape_configs"][0]
    assert job["static_configs"][0]["targets"]
    assert job["file_sd_configs"][0]["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]
