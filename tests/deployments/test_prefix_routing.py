"""Prefix affinity across engine replicas (deployments/prefix_router.py): with two replicas
of the fixture models, every turn of a conversation reaches the replica that holds its
history (and reports it cached), and requests for a prefix whose holder is busy spread to
the other replica, all served."""

from __future__ import annotations

import concurrent.futures
import time
import types

import httpx
import numpy as np
import pytest
from ray.serve._private.request_router.common import ReplicaQueueLengthCache
from serve_helpers import serve_app, tiny_app_args

from deployments import prefix_router
from deployments.launch import local_ray
from deployments.prefix_router import PrefixAffinityRouter, prompt_ids_of


def _router(**kw) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # the state, not Serve's
    router.initialize_state(**kw)
    return router


def _request(ids, rid="r", tenant=None):
    return types.SimpleNamespace(args=(types.SimpleNamespace(prompt_ids=ids, tenant=tenant),),
                                 metadata=types.SimpleNamespace(internal_request_id=rid))


def test_the_holder_is_the_replica_sent_the_longest_prefix():
    router = _router(remembered=2, min_match=4)
    a, b = (types.SimpleNamespace(replica_id=n) for n in ("a", "b"))
    router.on_request_routed(_request(list(range(10))), "a", None)
    router.on_request_routed(_request(list(range(6)) + [99, 98]), "b", None)
    assert router.holder(np.arange(12), [a, b]) == (a, 10)
    assert router.holder(np.array([0, 1, 2, 50]), [a, b]) is None   # below min_match
    # Bounded: the oldest prompt of a replica is forgotten.
    for i in range(2):
        router.on_request_routed(_request([7] * 8 + [i]), "a", None)
    assert router.holder(np.arange(12), [a, b]) == (b, 6)
    assert prompt_ids_of(None) is None


def test_a_prefix_is_followed_only_within_its_tenant():
    """The engine's caches are partitioned by tenant: another tenant's prompt is no reason
    to go to a replica (and where it goes must not depend on what others sent)."""
    router = _router(min_match=4)
    a, b = (types.SimpleNamespace(replica_id=n) for n in ("a", "b"))
    router.on_request_routed(_request(list(range(10)), tenant="key:alice"), "a", None)
    assert router.holder(np.arange(12), [a, b], "key:alice") == (a, 10)
    assert router.holder(np.arange(12), [a, b], "key:bob") is None
    assert router.holder(np.arange(12), [a, b]) is None


def test_a_burst_counts_toward_the_holders_queue_before_serve_hears_of_it():
    """Serve's cached queue lengths are overwritten by probes and acceptances that lag the
    requests on their way; the router's own count of what it sent keeps a burst from all
    reading an empty queue."""
    router = _router(imbalance=4)
    router._replica_queue_len_cache = ReplicaQueueLengthCache()
    a, b = (types.SimpleNamespace(replica_id=n) for n in ("a", "b"))
    for r in (a, b):
        router._replica_queue_len_cache.update(r.replica_id, 0)  # what a probe reported
    sent = []
    for i in range(5):
        assert not router.too_busy(a, [a, b]), i
        req = types.SimpleNamespace(args=(), metadata=types.SimpleNamespace(
            internal_request_id=f"r{i}"))
        router.on_request_routed(req, "a", None)
        sent.append(req)
    assert router.queue_lengths([a, b]) == {"a": 5, "b": 0}
    assert router.too_busy(a, [a, b])
    router._replica_queue_len_cache.update("b", 3)  # Serve knows of other ingresses' work
    assert not router.too_busy(a, [a, b])
    for req in sent[:3]:
        router.on_request_completed("a", req.metadata.internal_request_id)
    router._replica_queue_len_cache.update("b", 0)
    assert router.queue_lengths([a, b]) == {"a": 2, "b": 0}
    assert not router.too_busy(a, [a, b])
    # Nothing stays counted for good: a request reported done before Serve's routed
    # callback, one chosen but never sent (cancelled while waiting), one never reported.
    quick = types.SimpleNamespace(args=(), metadata=types.SimpleNamespace(
        internal_request_id="quick"))
    router.on_request_completed("b", "quick")
    router.on_request_routed(quick, "b", None)
    router._in_flight["cancelled"] = ("b", time.monotonic() - prefix_router.TENTATIVE_S - 1,
                                      False)
    router._in_flight["lost"] = ("a", time.monotonic() - prefix_router.IN_FLIGHT_S - 1, True)
    assert router.queue_lengths([a, b]) == {"a": 2, "b": 0}




@pytest.fixture(scope="module")
def base(tiny_llama, tiny_llama_draft):
    args = tiny_app_args(tiny_llama, tiny_llama_draft,
                         engine_autoscaling={"min_replicas": 2, "max_replicas": 2},
                         engine_routing="prefix_affinity",
                         runtime={"max_len": 256})  # room for the long replies below
    with local_ray(num_cpus=6):
        with serve_app(args) as url:
            yield url


def _words(seed: int, n: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(f"w{x}" for x in rng.integers(5, 90, n))


def _complete(base, prompt: str, **body) -> dict:
    with httpx.Client(base_url=base, timeout=120) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                            "max_tokens": 8, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.integration
def test_each_turn_reaches_the_replica_holding_its_history(base):
    replicas = set()
    for conv in range(10):
        history = _words(conv, 40)
        served = []
        for turn in range(3):
            history += " " + _words(100 * conv + turn, 5)
            r = _complete(base, history)
            served.append(r["spec_decode"]["replica"])
            if turn:
                assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 40, (conv, turn)
            history += " " + r["choices"][0]["text"]
        assert len(set(served)) == 1, served
        replicas.add(served[0])
    # Conversations with nothing in common spread by load: each first turn is a fair coin
    # between two idle replicas, so all ten on one would happen once in 512 runs.
    assert len(replicas) == 2


@pytest.mark.integration
def test_a_busy_holder_sends_the_overflow_to_the_other_replica(base):
    prefix = _words(7, 40)
    holder = _complete(base, prefix)["spec_decode"]["replica"]

    # Replies long enough that the holder's queue builds while the rest still arrive through
    # the ingress: with short ones a slow machine finishes each before the next comes, and
    # the holder, never busy, rightly takes them all.
    def one(i):
        return _complete(base, prefix + " " + _words(1000 + i, 3), max_tokens=200,
                         ignore_eos=True, speculative={"mode": "off"})

    with concurrent.futures.ThreadPoolExecutor(14) as pool:
        out = list(pool.map(one, range(14)))
    served = [r["spec_decode"]["replica"] for r in out]
    assert served.count(holder) >= 4 and len(set(served)) == 2, served
