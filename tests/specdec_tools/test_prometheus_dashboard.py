"""A real Prometheus, started with the project's cluster/prometheus.yml pointed at a test
app's Ray metrics port: after traffic, every query of every panel of the committed Grafana
dashboard parses and returns data, and the acceptance counts in Prometheus are exactly the
ones the responses reported in spec_decode."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from serve_helpers import env, serve_app, tiny_app_args

from deployments.launch import local_ray
from specdec.ports import free_port
from specdec_bench.prometheus import instantiate, query

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stack(tiny_llama, tiny_llama_draft, tmp_path_factory):
    prometheus = shutil.which("prometheus")
    assert prometheus, "Prometheus is installed by `make test` (Debian package prometheus)"
    metrics_port, prom_port = free_port(), free_port()
    tmp = tmp_path_factory.mktemp("prom")
    with env(RAY_metrics_report_interval_ms=1000), \
            local_ray(num_cpus=4, metrics_export_port=metrics_port):
        cfg = yaml.safe_load((ROOT / "cluster/prometheus.yml").read_text())
        cfg["global"]["scrape_interval"] = "1s"
        job = cfg["scrape_configs"][0]
        job["static_configs"][0]["targets"] = [f"127.0.0.1:{metrics_port}"]
        # Ray writes its discovery file in its session's temp dir: ours, not /tmp/ray.
        session = Path(ray._private.worker._global_node.get_temp_dir_path())
        job["file_sd_configs"][0]["files"] = [str(session / "prom_metrics_service_discovery.json")]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        proc = subprocess.Popen([prometheus, f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            args = tiny_app_args(tiny_llama, tiny_llama_draft)
            with serve_app(args) as base:
                yield base, f"http://127.0.0.1:{prom_port}"
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def test_every_panel_returns_data_and_acceptance_agrees_with_responses(stack):
    base, prom = stack
    deadline = time.monotonic() + 60
    while not any(t["health"] == "up" for t in httpx.get(
            f"{prom}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]):
        assert time.monotonic() < deadline, "Prometheus never scraped Ray's metrics port"
        time.sleep(1)

    def one(i: int) -> dict:
        spec = [{"mode": "on", "method": "draft", "k": 3}, {"mode": "off"},
                {"mode": "auto"}][i % 3]
        with httpx.Client(base_url=base, timeout=120) as c:
            r = c.post("/v1/completions", json={
                "model": "tiny", "prompt": f"w{5 + i % 40} w7 w9", "max_tokens": 12 + i % 20,
                "temperature": 0.0 if i % 2 else 0.8, "seed": i, "speculative": spec})
            return {"status": r.status_code, "body": r.json()}

    # Twice the engine's capacity at once: some are refused (503), which the failure
    # panels count; an unknown model is a 404.
    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        results = list(pool.map(one, range(48)))
    # Then one at a time, each prompt twice: the second is served from the prefix cache.
    results += [one(i) for i in range(48, 60) for _ in range(2)]
    assert httpx.post(f"{base}/v1/completions", json={"model": "nope", "prompt": "w5"},
                      timeout=30).status_code == 404
    ok = [r["body"] for r in results if r["status"] == 200]
    assert len(ok) > 20 and any(r["status"] == 503 for r in results)
    # Requests that ran with the draft: admitted speculative, or admitted plain on standby
    # for it (they speculate when the batch does, or in a probe step).
    spec = [r["spec_decode"] for r in ok if "draft" in (r["spec_decode"]["method"],
                                                          r["spec_decode"].get("standby"))]
    accepted = sum(s["accepted"] for s in spec)
    rounds = sum(s["rounds"] for s in spec)
    assert accepted > 0 and rounds > 0

    # Counters reach Prometheus within a few seconds (report interval 1 s, scrape 1 s).
    want = {"accepted": accepted, "rounds": rounds}
    deadline = time.monotonic() + 60
    while True:
        got = {name: sum(float(s["value"][1]) for s in query(
            prom, f'ray_specdec_spec_{series}_total{{method="draft"}}'))
            for name, series in (("accepted", "accepted_tokens"), ("rounds", "rounds"))}
        if got == want:
            break
        assert time.monotonic() < deadline, f"Prometheus {got} != responses {want}"
        time.sleep(1)

    dashboard = json.loads((ROOT / "cluster/grafana/specdec-dashboard.json").read_text())
    empty = []
    deadline = time.monotonic() + 60
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = instantiate(target["expr"])
            while not query(prom, expr):
                if time.monotonic() > deadline:
                    empty.append(f"{panel['title']}: {target['expr']}")
                    break
                time.sleep(1)
    assert not empty, "panels without data:\n" + "\n".join(empty)
