"""Honest readiness: while the engine replica starts (shard actors, weights, warm-up,
calibration) every route answers 503 with Retry-After and what it waits for; the moment
/v1/models first answers 200, a request is served at once."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from ray import serve
from serve_helpers import tiny_app_args

from deployments.app import build_app
from deployments.launch import local_ray
from specdec.ports import free_port

pytestmark = pytest.mark.integration


def test_ready_means_a_request_is_served_at_once(tiny_llama, tiny_llama_draft):
    args = tiny_app_args(tiny_llama, tiny_llama_draft, warmup=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with local_ray(num_cpus=4):
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        deployed = threading.Thread(target=serve.run, args=(build_app(args),),
                                    kwargs={"name": "ready", "route_prefix": "/"}, daemon=True)
        t0 = time.monotonic()
        deployed.start()
        refusals, health_refusals = [], []
        try:
            with httpx.Client(base_url=base, timeout=30) as client:
                while True:
                    assert time.monotonic() - t0 < 180, "the app did not become ready"
                    try:
                        r = client.get("/v1/models")
                    except httpx.TransportError:  # the proxy is not listening yet
                        time.sleep(0.05)
                        continue
                    if r.status_code == 200:
                        break
                    if r.headers.get("content-type", "").startswith("application/json") \
                            and "error" in r.json():  # ours (not the proxy's own 503)
                        refusals.append(r)
                        h = client.get("/health")
                        if h.status_code == 503:
                            health_refusals.append(h)
                    time.sleep(0.05)
                ready_at = time.monotonic()
                sent = time.monotonic()
                got = client.post("/v1/completions", json={
                    "model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 8,
                    "speculative": {"mode": "on"}})
                took = time.monotonic() - sent
            assert got.status_code == 200, got.text
            assert got.json()["spec_decode"]["rounds"] > 0
            # Served at once: start-up work (seconds here) is not in this request's time.
            assert took < 2.0, f"first request took {took:.1f}s after ready"
            # Before it was ready the router said so, with what it waited for.
            assert refusals, "never saw a 503 while the engine was starting"
            for r in refusals:
                err = r.json()["error"]
                assert r.status_code == 503 and r.headers["retry-after"]
                assert err["code"] == "engine_starting" and err["message"].startswith(
                    "not ready: ")
            phases = {r.json()["error"]["message"] for r in refusals}
            assert any("the engine is starting: " in m for m in phases) or any(
                "no engine replica is serving yet" in m for m in phases)
            assert all(h.json()["status"] == "starting" for h in health_refusals)
            print(f"\nready {ready_at - t0:.1f}s after deploy; first request {took:.2f}s; "
                  f"{len(refusals)} 503s meanwhile, e.g. {sorted(phases)[:3]}")
        finally:
            deployed.join(timeout=180)
            serve.delete("ready")
            serve.shutdown()
