"""Overlap across Ray actors: the draft actor drafts while the tensor-parallel target group
verifies. Greedy output equals plain decoding with a draft that disagrees often (TP=2
target, the draft at TP 1 and 2, continuous batching), over HTTP too; a draft killed
mid-overlap fails no request."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray
from engine_helpers import greedy, plain_reference, random_prompts
from serve_helpers import serve_app, tiny_app_args, tiny_spec

from deployments.launch import local_ray, ray_engine
from specdec.engine.request import Request

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_local():
    with local_ray(num_cpus=6):
        yield


@pytest.mark.parametrize("draft_tp", [1, 2])
def test_overlap_across_actors_equals_plain(ray_local, tiny_llama, tiny_llama_far_draft,
                                            draft_tp):
    prompts = random_prompts((5, 9, 14, 3, 7), seed=draft_tp)
    expected = plain_reference(tiny_llama, prompts, 32)
    spec = tiny_spec(tiny_llama, tiny_llama_far_draft, target={"tp": 2},
                     draft={"tp": draft_tp}, runtime={"max_slots": 3}, overlap="on")
    with ray_engine(spec) as built:
        reqs = [Request.pinned(f"r{i}", p, greedy(32), "draft", k)
                for i, (p, k) in enumerate(zip(prompts, (1, 2, 3, 4, 6), strict=True))]
        out = built.engine.run(reqs)
        for i, e in enumerate(expected):
            assert out[f"r{i}"].token_ids == e, f"request {i}"
        totals = built.engine.totals["draft"]
        assert 0 < totals.accepted < totals.drafted
        history = list(built.engine.history)
        assert any(r.overlapped and r.draft_bytes for r in history)
        assert any(r.resolve_s > 0 for r in history)


def test_draft_killed_mid_overlap_fails_no_request(ray_local, tiny_llama, tiny_llama_draft):
    prompts = random_prompts((6, 8, 10, 4), seed=3)
    expected = plain_reference(tiny_llama, prompts, 100)
    spec = tiny_spec(tiny_llama, tiny_llama_draft, target={"tp": 2}, overlap="on",
                     runtime={"draft_retry_s": 0.2})
    with ray_engine(spec) as built:
        engine = built.engine
        for i, p in enumerate(prompts):
            engine.add_request(Request.pinned(f"r{i}", p, greedy(100), "draft", 3))
        final = {}
        killed = False
        while engine.has_work():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            if not killed and sum(r.overlapped for r in engine.history) >= 5:
                ray.kill(built.draft.group.leader, no_restart=True)  # mid-run, mid-window
                killed = True
        assert killed
        for i, e in enumerate(expected):
            assert final[f"r{i}"].finish_reason == "length", final[f"r{i}"].error
            assert final[f"r{i}"].token_ids == e
        assert built.draft.failures >= 1
        # The draft comes back and overlapped speculation resumes.
        deadline = time.monotonic() + 60
        while not built.draft.available and time.monotonic() < deadline:
            time.sleep(0.2)
        assert built.draft.available
        engine.history.clear()
        again = engine.run([Request.pinned("again", prompts[0], greedy(24), "draft", 3)])["again"]
        assert again.token_ids == expected[0][:24]
        assert any(r.overlapped and r.draft_bytes for r in engine.history)


def test_overlap_over_http_equals_plain(ray_local, tiny_llama, tiny_llama_far_draft):
    args = tiny_app_args(tiny_llama, tiny_llama_far_draft, overlap="on",
                         default_max_tokens=40)
    args["target"]["tp"] = 2
    with serve_app(args) as url, httpx.Client(base_url=url, timeout=120) as c:
        results = {}

        def ask(prompt, mode):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0,
                    "ignore_eos": True,
                    "speculative": {"mode": "off"} if mode == "off" else
                    {"mode": "on", "method": "draft", "k": 4}}
            results[(prompt, mode)] = c.post("/v1/completions", json=body).json()

        prompts = ("w5 w17 w33 w8", "w40 w41 w42 w43 w44 w45", "w90", "w7 w7 w7")
        # Concurrent speculative requests: rows at different states in one batch.
        threads = [threading.Thread(target=ask, args=(p, "on")) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p in prompts:
            ask(p, "off")
            on, off = results[(p, "on")], results[(p, "off")]
            assert on["choices"][0]["text"] == off["choices"][0]["text"], p
        drafted = sum(results[(p, "on")]["spec_decode"]["drafted"] for p in prompts)
        accepted = sum(results[(p, "on")]["spec_decode"]["accepted"] for p in prompts)
        assert 0 < accepted < drafted
        timeline = c.get("/health").json()["engine"]["timeline"]
        assert timeline.get("overlapped_steps", 0) > 0, timeline
