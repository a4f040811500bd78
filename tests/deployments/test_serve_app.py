"""The Serve application over real HTTP: OpenAI-compatible routes (httpx and the official
openai client), speculation on equals off under greedy decoding, errors, overload,
disconnects, concurrency. SmolLM2 (fp32) is target and draft, so this runs in minutes."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import time

import httpx
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field
from ray import serve
from serve_helpers import scrape, sum_of

from deployments.app import build_app, parse_args
from deployments.ingress import HEALTH_TTL_S
from deployments.launch import local_ray
from specdec.errors import ConfigError
from specdec.pack.tokenizer import load_tokenizer
from specdec.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.real_model]

MODEL = "smol"




def app_args(smollm2_path) -> dict:
    shard = {"model": str(smollm2_path), "dtype": "float32", "threads": 1,
             "resources": {"num_cpus": 0.25}}
    return {"model_name": MODEL, "target": dict(shard, tp=1), "draft": dict(shard),
            "runtime": {"max_slots": 8, "max_len": 512, "gloo_socket_ifname": "lo"},
            "max_waiting": 16, "default_max_tokens": 32, "replica_cpus": 0.1,
            "ingress_cpus": 0.1,
            # Tenants by the OpenAI `user` field, as a deployment behind a gateway that sets
            # it would run: the prefix caches and the suffix index partitioned by it.
            "tenancy": "user"}


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(smollm2_path, metrics_port):
    port = free_port()
    # Metrics reach the export port within ~1 s instead of ~10 s.
    old = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = "1000"
    try:
        with local_ray(num_cpus=4, metrics_export_port=metrics_port):
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(app_args(smollm2_path)), name="specdec", route_prefix="/")
            base = f"http://127.0.0.1:{port}"
            with httpx.Client(base_url=base, timeout=120) as client:
                yield client, base
            serve.shutdown()
    finally:
        if old is None:
            os.environ.pop("RAY_metrics_report_interval_ms", None)
        else:
            os.environ["RAY_metrics_report_interval_ms"] = old


def complete(client, **body):
    body = {"model": MODEL, "user": "tests", **body}  # one tenant unless a test names one
    return client.post("/v1/completions", json=body)


def test_models_and_health(server):
    client, _ = server
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["engine"]["free_slots"] >= 0


def test_greedy_speculation_on_equals_off(server, smollm2_path):
    client, _ = server
    tok = load_tokenizer(smollm2_path)
    for prompt in ("def fibonacci(n):", "The three laws of robotics are"):
        off = complete(client, prompt=prompt, max_tokens=40, temperature=0,
                       speculative={"mode": "off"}).json()
        on = complete(client, prompt=prompt, max_tokens=40, temperature=0,
                      speculative={"mode": "on", "method": "draft", "k": 4}).json()
        auto = complete(client, prompt=prompt, max_tokens=40, temperature=0).json()
        assert "choices" in on, on
        assert on["choices"][0]["text"] == off["choices"][0]["text"] == auto["choices"][0]["text"]
        assert off["spec_decode"]["mode"] == "plain" and off["spec_decode"]["rounds"] == 0
        assert on["spec_decode"]["mode"] == "speculative" and on["spec_decode"]["k"] == 4
        assert on["spec_decode"]["accepted"] > 0  # self-draft: nearly everything is kept
        assert "reason" in auto["spec_decode"] and "inputs" in auto["spec_decode"]
        n = len(tok(prompt).input_ids)
        # The same prompt a second time: all of it but its last token comes from the cache.
        assert on["usage"] == {"prompt_tokens": n, "completion_tokens": 40,
                               "total_tokens": n + 40,
                               "prompt_tokens_details": {"cached_tokens": n - 1}}


def test_a_conversation_is_served_from_its_cached_history(server):
    """The official client replays a conversation, each turn resending the whole history:
    every later turn reports the earlier turns as cached prompt tokens, as OpenAI's usage
    does, and /health counts the reuse."""
    _, base = server
    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    cached, prompts = [], []
    for question in ("What is a list in Python?", "And a tuple?", "Which is faster?"):
        messages.append({"role": "user", "content": question})
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                           temperature=0, user="tests")
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        prompts.append(r.usage.prompt_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    assert cached[0] < prompts[0]
    # Each later turn: all of the last turn's prompt at least came from the cache.
    assert cached[1] >= prompts[0] and cached[2] >= prompts[1], (cached, prompts)
    time.sleep(HEALTH_TTL_S + 0.1)  # /health answers from a state at most this old
    prefix = httpx.get(f"{base}/health", timeout=30).json()["engine"]["prefix_cache"]
    assert prefix["enabled"] and prefix["target"]["hits"] >= 2
    assert prefix["kv_cache_mb"]["target"] > 0


def test_chat_on_equals_off(server):
    client, _ = server
    msgs = [{"role": "user", "content": "Name three fruits."}]
    bodies = [{"model": MODEL, "messages": msgs, "max_tokens": 24, "temperature": 0,
               "speculative": s} for s in ({"mode": "off"}, {"mode": "on", "method": "ngram"})]
    off, on = (client.post("/v1/chat/completions", json=b).json() for b in bodies)
    assert off["choices"][0]["message"]["content"] == on["choices"][0]["message"]["content"]
    assert off["choices"][0]["message"]["role"] == "assistant"


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population_millions: int = Field(ge=0, le=100)


def test_structured_output_with_the_openai_clients_parse(server):
    """The openai client's own structured-output call with a pydantic model: a reply the
    model parses, the same with speculation on and off; a regex and a choice through vLLM's
    structured_outputs; a schema that cannot compile is a 400 naming its field."""
    client, base = server
    oc = OpenAI(base_url=f"{base}/v1", api_key="unused")
    msgs = [{"role": "user", "content": "Tell me about Paris as JSON."}]
    replies = [oc.chat.completions.parse(model=MODEL, messages=msgs, response_format=City,
                                         temperature=0, max_tokens=80,
                                         extra_body={"speculative": s})
               for s in ({"mode": "off"}, {"mode": "on", "method": "draft", "k": 3})]
    off, on = (r.choices[0] for r in replies)
    assert off.finish_reason == "stop" and isinstance(off.message.parsed, City)
    assert on.message.content == off.message.content
    assert replies[1].spec_decode["rounds"] > 0
    for body, valid in (
            ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
             lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
            ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
            ({"response_format": {"type": "json_object"}},
             lambda t: isinstance(json.loads(t), dict))):
        r = client.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "A phone number? Reply {} if unsure."}],
            "speculative": {"mode": "on", "method": "ngram"}, **body}).json()
        assert valid(r["choices"][0]["message"]["content"]), (body, r)
    bad = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": msgs, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "nonsense"}}}}}})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "response_format.json_schema.schema"
    both = client.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "response_format": {"type": "json_object"},
        "structured_outputs": {"regex": "a+"}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "structured_outputs"
    # Too large to be a reply format: named as the field it came in.
    huge = {"type": "object", "description": "x" * 200_001}
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": msgs, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": huge}}})
    assert r.status_code == 400 and \
        r.json()["error"]["param"] == "response_format.json_schema.schema", r.text
    # Compiles alone, not against this vocabulary (a token id it lacks): a 400 from the
    # engine naming the field, not a lost engine's 503.
    r = client.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "structured_outputs": {"grammar": "start: <[99999999]>"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.grammar", \
        r.text
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                "max_tokens": 2}).status_code == 200


def test_tools_on_a_model_whose_template_has_none_are_a_400_naming_the_field(server):
    client, _ = server
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "tool support" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


def test_openai_client_streaming_and_not(server):
    _, base = server
    oc = OpenAI(base_url=f"{base}/v1", api_key="unused")
    full = oc.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=20,
                                 temperature=0)
    parts = [c.choices[0].text for c in oc.completions.create(
        model=MODEL, prompt="def add(a, b):", max_tokens=20, temperature=0, stream=True)
        if c.choices]
    assert "".join(parts) == full.choices[0].text and len(parts) > 1
    chat = oc.chat.completions.create(model=MODEL, max_tokens=16, temperature=0,
                                      messages=[{"role": "user", "content": "Say hello."}])
    stream = list(oc.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Say hello."}]))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content
    assert stream[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_sse_wire_format_ends_with_done(server):
    client, _ = server
    with client.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 8, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    # ignore_eos fixes the count: a sampled continuation may otherwise end early on EOS.
    assert last["usage"]["completion_tokens"] == 8 and last["choices"] == []
    finals = [json.loads(ln[len("data: "):]) for ln in lines[:-2]]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body,status,param", [
    ("{not json", 400, None),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
    ({"prompt": "word " * 600, "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x", "n": 17}, 400, "n"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "speculative": {"mode": "sometimes"}}, 400, "speculative.mode"),
    ({"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ({"prompt": "x", "logprobs": 30}, 400, "logprobs"),
])
def test_bad_requests_get_openai_errors_naming_the_field(server, body, status, param):
    client, _ = server
    if isinstance(body, str):
        r = client.post("/v1/completions", content=body,
                        headers={"content-type": "application/json"})
    else:
        r = client.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param and param.split(".")[0] in err["message"]


def test_empty_messages_rejected(server):
    client, _ = server
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_sixteen_concurrent_mixed_requests(server, smollm2_path):
    client, base = server
    tok = load_tokenizer(smollm2_path)
    prompts = [f"Write item number {i} of a shopping list:" for i in range(16)]
    specs = [{"mode": m} for m in ("on", "off", "auto", "on")] * 4

    def one(i):
        with httpx.Client(base_url=base, timeout=300) as c:
            return c.post("/v1/completions", json={
                "model": MODEL, "prompt": prompts[i], "max_tokens": 12 + i,
                "temperature": 0.7, "seed": i,
                "speculative": specs[i]}).json()

    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        outs = list(ex.map(one, range(16)))
    for i, o in enumerate(outs):
        assert "usage" in o, o
        usage = o["usage"]
        assert usage["prompt_tokens"] == len(tok(prompts[i]).input_ids)
        if o["choices"][0]["finish_reason"] == "length":
            assert usage["completion_tokens"] == 12 + i
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_seeded_request_gives_the_same_tokens_every_time(server):
    """The same seeded sampled request: speculation off, on and auto, again, and beside six
    other requests speculating with their own seeds: the same text each time."""
    client, base = server
    body = {"prompt": "The river carried", "max_tokens": 48, "temperature": 0.9,
            "seed": 1234, "ignore_eos": True}
    texts = [complete(client, **body, speculative=s).json()["choices"][0]["text"]
             for s in ({"mode": "off"}, {"mode": "on", "method": "draft", "k": 3},
                       {"mode": "auto"}, {"mode": "on", "method": "draft", "k": 2})]

    def one(i):
        with httpx.Client(base_url=base, timeout=300) as c:
            extra = {} if i else body
            return c.post("/v1/completions", json={
                "model": MODEL, "prompt": f"Item {i} of a list:", "max_tokens": 40,
                "temperature": 0.8, "seed": 7 + i, **extra,
                "speculative": {"mode": "on", "method": "draft", "k": 3}}).json()

    with concurrent.futures.ThreadPoolExecutor(7) as ex:
        busy = list(ex.map(one, range(7)))
    texts.append(busy[0]["choices"][0]["text"])
    assert len(set(texts)) == 1 and len(texts[0]) > 20, texts


def test_a_second_similar_request_speculates_from_the_first_ones_output(server):
    """Suffix speculation: a reply, once given, is guessed for the next request of the same
    user that asks for it (here the same prompt) from the replica's index, token-identical
    to plain; another user's identical request is not guessed from it (tenancy: user)."""
    client, _ = server
    body = {"prompt": "List the planets of the solar system in order:", "max_tokens": 40,
            "temperature": 0, "ignore_eos": True}
    suffix = {"mode": "on", "method": "suffix", "k": 6}
    first = complete(client, **body, user="alice", speculative={"mode": "off"}).json()
    bob = complete(client, **body, user="bob", speculative=suffix).json()
    again = complete(client, **body, user="alice", speculative=suffix).json()
    assert again["choices"][0]["text"] == bob["choices"][0]["text"] == \
        first["choices"][0]["text"]
    sd = again["spec_decode"]
    assert sd["method"] == "suffix" and sd["accepted"] >= 20, sd
    # Bob's guesses come from his own context only: far fewer kept.
    assert bob["spec_decode"]["accepted"] < sd["accepted"] / 2, (bob["spec_decode"], sd)
    time.sleep(HEALTH_TTL_S + 0.1)
    suffix = client.get("/health").json()["engine"]["suffix"]
    assert suffix["from_index"] >= 1 and suffix["indexed_tokens"] > 40, suffix


def test_overload_gets_503_and_service_recovers(server):
    client, base = server

    def one(i):
        with httpx.Client(base_url=base, timeout=300) as c:
            return c.post("/v1/completions", json={"model": MODEL, "prompt": f"Count {i}:",
                                                   "max_tokens": 60}).status_code

    with concurrent.futures.ThreadPoolExecutor(40) as ex:
        codes = list(ex.map(one, range(40)))
    assert 503 in codes and 200 in codes and set(codes) <= {200, 503}
    assert complete(client, prompt="still there?", max_tokens=4).status_code == 200


def test_client_disconnect_frees_its_slot(server):
    client, base = server
    with httpx.Client(base_url=base, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "Tell a long story:", "max_tokens": 400,
                "ignore_eos": True, "stream": True, "speculative": {"mode": "off"}}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 3:
                    break  # leave mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if client.get("/health").json()["engine"]["running"] == 0:
            return
        time.sleep(0.5)
    raise AssertionError("the abandoned request kept its slot")


def test_lost_target_gives_503_then_serves_again(server):
    import ray

    client, base = server
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("specdec-target-")]
    assert names, "no target shard actors found"
    latest = max(names, key=lambda n: int(n.split("-g")[1].split("-")[0]))
    ns = next(a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"] == latest)
    box = {}

    def long_request():
        with httpx.Client(base_url=base, timeout=300) as c:
            box["r"] = c.post("/v1/completions", json={
                "model": MODEL, "prompt": "Write a very long essay:", "max_tokens": 400,
                "ignore_eos": True, "speculative": {"mode": "off"}})

    import threading

    remembered = "Remember this sentence, please:"
    for _ in range(2):
        held = complete(client, prompt=remembered, max_tokens=4).json()["usage"]
    assert held["prompt_tokens_details"]["cached_tokens"] > 0
    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while client.get("/health").json()["engine"]["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    ray.kill(ray.get_actor(latest, namespace=ns), no_restart=True)
    killed_at = time.monotonic()
    t.join(timeout=200)
    ended_s = time.monotonic() - killed_at
    r = box["r"]
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "engine_unavailable" and r.headers["retry-after"]
    # Failed at once, not after the group's rebuild.
    assert ended_s < 5, f"the request took {ended_s:.1f}s to fail"
    # Until the new group is up: 503 saying why, then served by the new group.
    statuses = []
    while True:
        got = complete(client, prompt="back again?", max_tokens=4)
        statuses.append(got.status_code)
        if got.status_code == 200:
            break
        assert got.status_code == 503 and got.headers["retry-after"], got.text
        assert "being rebuilt" in got.json()["error"]["message"]
        assert time.monotonic() - killed_at < 120, "the target was not rebuilt in 120 s"
        time.sleep(0.2)
    time.sleep(HEALTH_TTL_S + 0.1)
    load = client.get("/health").json()["engine"]
    assert load["target_down"] is None and load["target_last_rebuild_s"] > 0
    # The new group's slots hold nothing of what the old one held: no reuse is claimed.
    usage = complete(client, prompt=remembered, max_tokens=4).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    print(f"\ntarget shard {latest} killed mid-request: 503 after {ended_s:.1f}s, serving "
          f"again {time.monotonic() - killed_at:.1f}s after the kill ({statuses.count(503)} "
          f"requests refused meanwhile; rebuild {load['target_last_start']})")


def test_decisions_and_acceptance_reach_prometheus(server, metrics_port):
    client, _ = server
    on = complete(client, prompt="def add(a, b):", max_tokens=24, temperature=0,
                  speculative={"mode": "on", "method": "draft", "k": 3}, user="ops").json()
    off = complete(client, prompt="def add(a, b):", max_tokens=24, temperature=0,
                   speculative={"mode": "off"}, user="ops").json()
    assert on["spec_decode"]["accepted"] > 0 and off["spec_decode"]["rounds"] == 0
    # The reply is in the suffix index now: asked again, it is guessed from there.
    sx = complete(client, prompt="def add(a, b):", max_tokens=24, temperature=0,
                  speculative={"mode": "on", "method": "suffix", "k": 6}, user="ops").json()
    assert sx["spec_decode"]["accepted"] > 0

    # Series reach the export port about a second late: wait for all of them.
    want = {
        "speculative decision": lambda s: sum_of(s, "ray_specdec_policy_decisions_total",
                                                 mode="speculative", method="draft", k="3",
                                                 why="request") >= 1,
        "plain decision": lambda s: sum_of(s, "ray_specdec_policy_decisions_total",
                                           mode="plain", why="request") >= 1,
        "accepted tokens": lambda s: sum_of(s, "ray_specdec_spec_accepted_tokens_total",
                                            method="draft") >= on["spec_decode"]["accepted"],
        "draft alpha": lambda s: sum_of(s, "ray_specdec_policy_alpha", method="draft") > 0,
        "step times": lambda s: sum_of(s, "ray_specdec_step_seconds_count") > 0,
        "suffix guesses": lambda s: sum_of(s, "ray_specdec_spec_accepted_tokens_total",
                                           method="suffix") >= sx["spec_decode"]["accepted"],
        "suffix from index": lambda s: sum_of(s, "ray_specdec_suffix_proposals_total",
                                              source="index") >= 1,
        "suffix size": lambda s: sum_of(s, "ray_specdec_suffix_indexed_tokens") >= 48,
    }
    deadline = time.monotonic() + 30
    while missing := [name for name, ok in want.items() if not ok(scrape(metrics_port))]:
        assert time.monotonic() < deadline, f"never exported: {missing}"
        time.sleep(1)


def test_bench_serve_sweeps_the_three_policies(server, tmp_path):
    import subprocess
    import sys

    _, base = server
    out = tmp_path / "serve.json"
    done = subprocess.run(
        [sys.executable, "-m", "specdec_cli.main", "bench", "serve", "--url", base,
         "--model", MODEL,
         "--clients", "1", "2", "--requests-per-client", "1", "--max-tokens", "12", "--k", "3",
         "--temperatures", "0", "0.7", "--repeats", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    levels = {(r["policy"], r["clients"]): r for r in rows
              if "policy" in r and r["temperature"] == 0}
    assert set(levels) == {(p, c) for p in ("plain", "speculative", "auto") for c in (1, 2)}
    sampled = [r for r in rows if r.get("temperature") == 0.7]
    assert len(sampled) == 6 and all(r["errors"] == 0 for r in sampled)
    assert levels[("speculative", 1)]["predicted_speedup"] > 0
    assert levels[("speculative", 1)]["measured_speedup"] > 0
    for (_, clients), r in levels.items():
        assert r["errors"] == 0 and r["requests"] == clients and r["output_tokens_per_s"] > 0
        assert r["ttft_p50_s"] > 0 and r["itl_p50_ms"] > 0
    assert levels[("plain", 2)]["speculative_share"] == 0
    assert levels[("plain", 2)]["speculated_share"] == 0
    assert levels[("speculative", 2)]["speculative_share"] == 1
    assert levels[("speculative", 2)]["speculated_share"] == 1  # 12 tokens: rounds ran
    assert levels[("speculative", 2)]["k_mean"] == 3
    overhead = next(r["overhead"] for r in rows if "overhead" in r)
    assert overhead["http_latency_p50_ms"] > overhead["engine_p50_ms"] > 0
    assert "whole sweep" in done.stdout
    # Two runs per policy and level, in rotated order, summarised by their median.
    runs = next(r["runs"] for r in rows if "runs" in r and isinstance(r["runs"], list))
    assert len(runs) == 2 * 2 * 2 * 3
    first = [(x["policy"], x["repeat"]) for x in runs
             if x["temperature"] == 0 and x["clients"] == 1]
    assert first == [("plain", 0), ("speculative", 0), ("auto", 0),
                     ("speculative", 1), ("auto", 1), ("plain", 1)]
    for (policy, clients), r in levels.items():
        mine = sorted(x["output_tokens_per_s"] for x in runs if x["temperature"] == 0
                      and x["policy"] == policy and x["clients"] == clients)
        assert r["runs"] == 2 and r["output_tokens_per_s"] == pytest.approx(sum(mine) / 2)
        assert r["spread"] == pytest.approx((mine[1] - mine[0]) / r["output_tokens_per_s"])


def test_bad_config_fails_at_deploy_time_naming_the_field(smollm2_path):
    args = app_args(smollm2_path)
    args["target"] = dict(args["target"], tp=0)
    with pytest.raises(ConfigError, match=r"target\.tp"):
        parse_args(args)
    args = app_args(smollm2_path)
    args["runtime"]["max_slot"] = 4
    with pytest.raises(ConfigError, match=r"runtime\.max_slot: Extra inputs"):
        build_app(args)
