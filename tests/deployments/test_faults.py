"""Faults injected into a running app by killing real processes, found by their actor
names: the draft under load, the router replica (a target shard mid-request: see
test_serve_app, where requests are long enough to be caught). Plus a short load run: every
accepted request completes, refusals carry Retry-After, the queue drains. Timings are
printed (pytest -s) for the reliability report."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import ray
from serve_helpers import serve_app, tiny_app_args

from deployments.ingress import HEALTH_TTL_S
from deployments.launch import local_ray
from specdec_bench.load import run_load

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def base(tiny_llama, tiny_llama_draft):
    with local_ray(num_cpus=4):
        with serve_app(tiny_app_args(tiny_llama, tiny_llama_draft)) as url:
            yield url


def actors(prefix: str) -> list[dict]:
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)]


def kill(prefix: str) -> str:
    """Kill the newest live actor whose name starts with prefix; return its name."""
    found = actors(prefix)
    assert found, f"no actor named {prefix}*"
    a = found[-1]
    ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
    return a["name"]


def complete(base, **body) -> httpx.Response:
    with httpx.Client(base_url=base, timeout=120) as c:
        return c.post("/v1/completions", json={"model": "tiny", "prompt": "w5 w6 w7",
                                               "max_tokens": 12, **body})


REMEMBERED = "w40 w41 w42 w43 w44 w45 w46 w47 w48 w49 w50 w51"


def draft_prefix(base) -> dict:
    time.sleep(HEALTH_TTL_S + 0.1)  # /health answers from a state at most this old
    engine = httpx.get(f"{base}/health", timeout=30).json()["engine"]
    return engine["prefix_cache"]["draft"]


def test_killing_the_draft_under_load_fails_nothing_and_speculation_returns(base):
    async def load():
        # Speculation forced on: the tiny draft is as large as its target, so the policy
        # alone would rarely ask it for anything.
        return await run_load(base, "tiny", clients=6, duration_s=25, lengths=[8, 24, 48],
                              speculative={"mode": "on", "method": "draft", "k": 3})

    for _ in range(2):  # held by the draft about to be killed
        complete(base, prompt=REMEMBERED, speculative={"mode": "on", "method": "draft", "k": 3})
    assert draft_prefix(base)["tokens_reused"] > 0
    box = {}
    t = threading.Thread(target=lambda: box.update(asyncio.run(load())))
    t.start()
    time.sleep(5)
    killed = kill("specdec-draft-")
    killed_at = time.monotonic()
    back_after = None
    while back_after is None and time.monotonic() - killed_at < 60:
        health = httpx.get(f"{base}/health", timeout=30).json()["engine"]
        if health["draft_failures"] >= 1 and "draft" in health["methods"]:
            back_after = time.monotonic() - killed_at
        time.sleep(0.2)
    t.join()
    report = box
    assert report["failed"] == 0, report["failures"]
    assert report["completed"] > 20
    assert back_after is not None and back_after < 30, "the draft did not come back"
    # And requests speculate with it again.
    r = complete(base, speculative={"mode": "on", "method": "draft", "k": 3}).json()
    assert r["spec_decode"]["method"] == "draft" and r["spec_decode"]["rounds"] > 0, r
    # Its prefix cache went with it: the new draft computes a prompt the old one held
    # (nothing reused), then holds it for the next request.
    reused = []
    for _ in range(2):
        before = draft_prefix(base)
        complete(base, prompt=REMEMBERED, speculative={"mode": "on", "method": "draft", "k": 3})
        after = draft_prefix(base)
        assert after["lookups"] == before["lookups"] + 1
        reused.append(after["tokens_reused"] - before["tokens_reused"])
    assert reused[0] == 0 and reused[1] > 0, reused
    print(f"\ndraft {killed} killed under load: 0 failed of {report['completed']}; "
          f"the draft was back {back_after:.1f}s after the kill")


def test_killing_the_router_replica_serve_restarts_it(base):
    name = kill("SERVE_REPLICA::tiny#Ingress")
    killed_at = time.monotonic()
    while True:
        try:
            if complete(base).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() - killed_at < 120, "service did not come back"
        time.sleep(0.5)
    print(f"\nrouter replica {name} killed: serving again after "
          f"{time.monotonic() - killed_at:.1f}s")
    assert any(a["name"] != name for a in actors("SERVE_REPLICA::tiny#Ingress"))


def test_load_beyond_capacity_refuses_with_retry_after_and_drains(base):
    # 40 clients against 8 slots + 16 queued: some are told to come back, none fails.
    report = asyncio.run(run_load(base, "tiny", clients=40, duration_s=20,
                                  lengths=[16, 48, 96]))
    assert report["failed"] == 0, report["failures"]
    assert report["refused_503"] > 0 and report["refused_without_retry_after"] == 0
    assert report["queue_drained_s"] is not None
    assert report["completed"] > 40
    print(f"\n40 clients x 20 s: {report['completed']} completed, {report['refused_503']} "
          f"refused with Retry-After, 0 failed; drained in {report['queue_drained_s']:.1f}s")
