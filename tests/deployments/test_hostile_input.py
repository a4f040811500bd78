"""Hostile and odd input over HTTP: every malformed request gets the right 4xx naming the
field (OpenAI-shaped), a field nobody defines (a misspelling) is refused rather than
ignored, odd but legal input gets a normal answer, nothing gets a 5xx, and
the service answers a normal request afterwards. With an API key configured, /v1 routes
need it and /health tells strangers only ok / not ok. The API is fuzzed from its published
OpenAPI schema."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import httpx
import pytest
from serve_helpers import serve_app, tiny_app_args

from deployments.ingress import HEALTH_TTL_S
from deployments.launch import local_ray
from deployments.prompt_size import CHARS_PER_TOKEN

pytestmark = pytest.mark.integration

KEY = "sk-test-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
# Two more tenants (api_keys): the key above is tenant `default`'s.
BOB, CAROL = ({"authorization": f"Bearer sk-{n}-0123456789"} for n in ("bob", "carol"))
C, CH = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def base(tiny_llama, tiny_llama_draft):
    with local_ray(num_cpus=4):
        with serve_app(tiny_app_args(tiny_llama, tiny_llama_draft, api_key=KEY, api_keys={
                "bob": "sk-bob-0123456789", "carol": "sk-carol-0123456789"})) as url:
            yield url


def nested(depth: int) -> str:
    return '{"model": "tiny", "prompt": "w5", "x": ' + "[" * depth + "]" * depth + "}"


ok = {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 4}
chat = {"model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 4}

# (name, route, body (dict, or raw str/bytes), expected status, param named or None)
CASES = [
    ("invalid JSON", C, "{not json", 400, None),
    ("body is an array", C, "[1, 2]", 400, None),
    ("body is a string", C, '"hello"', 400, None),
    ("empty body", C, "", 400, None),
    ("model missing", C, {"prompt": "w5"}, 400, "model"),
    ("model wrong type", C, {**ok, "model": 123}, 400, "model"),
    ("unknown model", C, {**ok, "model": "gpt-9"}, 404, "model"),
    ("prompt missing", C, {"model": "tiny"}, 400, "prompt"),
    ("prompt a number", C, {**ok, "prompt": 5}, 400, "prompt"),
    ("prompt empty list", C, {**ok, "prompt": []}, 400, "prompt"),
    ("two prompts", C, {**ok, "prompt": ["w5", "w6"]}, 400, "prompt"),
    ("token ids", C, {**ok, "prompt": [5, 6, 7]}, 200, None),
    ("token id beyond vocab", C, {**ok, "prompt": [5, 99999]}, 400, "prompt"),
    ("negative token id", C, {**ok, "prompt": [-1, 5]}, 400, "prompt"),
    ("nested token lists", C, {**ok, "prompt": [[5, 6]]}, 400, "prompt"),
    ("max_tokens a word", C, {**ok, "max_tokens": "many"}, 400, "max_tokens"),
    ("max_tokens negative", C, {**ok, "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens zero", C, {**ok, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens 1e30", C, {**ok, "max_tokens": 1e30}, 400, "max_tokens"),
    ("max_tokens beyond context", C, {**ok, "max_tokens": 10_000}, 400, "max_tokens"),
    ("temperature a word", C, {**ok, "temperature": "hot"}, 400, "temperature"),
    ("temperature NaN", C, '{"model": "tiny", "prompt": "w5", "temperature": NaN}', 400,
     "temperature"),
    ("temperature Infinity", C, '{"model": "tiny", "prompt": "w5", "temperature": Infinity}',
     400, "temperature"),
    ("temperature negative", C, {**ok, "temperature": -1}, 400, "temperature"),
    ("top_p zero", C, {**ok, "top_p": 0}, 400, "top_p"),
    ("top_p above 1", C, {**ok, "top_p": 1.5}, 400, "top_p"),
    ("top_k negative", C, {**ok, "top_k": -1}, 400, "top_k"),
    ("seed 2**70", C, {**ok, "seed": 2**70}, 400, "seed"),
    ("seed negative (legal)", C, {**ok, "seed": -1, "temperature": 0.8}, 200, None),
    ("seed a word", C, {**ok, "seed": "abc"}, 400, "seed"),
    ("five stop strings", C, {**ok, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("empty stop string", C, {**ok, "stop": [""]}, 400, "stop"),
    ("stop a number", C, {**ok, "stop": 123}, 400, "stop"),
    ("n 17", C, {**ok, "n": 17}, 400, "n"),
    ("n 0", C, {**ok, "n": 0}, 400, "n"),
    ("stream a list", C, {**ok, "stream": [1]}, 400, "stream"),
    ("logprobs 21", C, {**ok, "logprobs": 21}, 400, "logprobs"),
    ("logprobs a word", C, {**ok, "logprobs": "many"}, 400, "logprobs"),
    ("top_logprobs on completions", C, {**ok, "top_logprobs": 2}, 400, "top_logprobs"),
    ("best_of", C, {**ok, "best_of": 2}, 400, "best_of"),
    ("logit_bias beyond vocab", C, {**ok, "logit_bias": {"99999": 10}}, 400, "logit_bias"),
    ("logit_bias (legal)", C, {**ok, "logit_bias": {"5": 10}}, 200, None),
    ("stop_token_ids beyond vocab", C, {**ok, "stop_token_ids": [5, 99999]}, 400,
     "stop_token_ids"),
    ("min_tokens above max_tokens", C, {**ok, "min_tokens": 5}, 400, "min_tokens"),
    ("penalties (legal)", C, {**ok, "presence_penalty": 1, "frequency_penalty": 0.5,
                              "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2,
                              "temperature": 0.7}, 200, None),
    ("echo", C, {**ok, "echo": True}, 400, "echo"),
    ("echo 1 (not false)", C, {**ok, "echo": 1}, 400, "echo"),
    ("unimplemented fields at off (legal)", C, {**ok, "presence_penalty": 0, "store": False,
                                                "repetition_penalty": 1.0, "logprobs": None},
     200, None),
    ("repetition_penalty 0", C, {**ok, "repetition_penalty": 0}, 400, "repetition_penalty"),
    # Found by the fuzzer (a 500: logits / 5e-324 overflowed): refused, naming the field.
    ("repetition_penalty denormal", C, {**ok, "repetition_penalty": 5e-324}, 400,
     "repetition_penalty"),
    ("temperature denormal (legal: greedy)", C, {**ok, "temperature": 5e-324}, 200, None),
    ("unknown field", C, {**ok, "foo": {"bar": 1}}, 400, "foo"),
    ("misspelt speculative", C, {**ok, "speculation": "off"}, 400, "speculation"),
    ("misspelt max_tokens", C, {**ok, "max_token": 2}, 400, "max_token"),
    ("speculative.mode unknown", C, {**ok, "speculative": {"mode": "sometimes"}}, 400,
     "speculative.mode"),
    ("speculative.k 99", C, {**ok, "speculative": {"k": 99}}, 400, "speculative.k"),
    ("speculative unknown key", C, {**ok, "speculative": {"depth": 3}}, 400,
     "speculative.depth"),
    ("NUL bytes (legal)", C, {**ok, "prompt": "w5\u0000w6"}, 200, None),
    ("lone surrogate", C, '{"model": "tiny", "prompt": "w5 \\ud800"}', 400, "prompt"),
    ("lone surrogate in stop", C, '{"model": "tiny", "prompt": "w5", "stop": ["\\udfff"]}',
     400, "stop"),
    ("10 MB body", C, json.dumps({**ok, "prompt": "w5 " * 3_500_000}), 413, None),
    ("100000 nested brackets", C, nested(100_000), 400, None),
    ("prompt beyond context", C, {**ok, "prompt": "w5 " * 300}, 400, "prompt"),
    ("messages empty", CH, {**chat, "messages": []}, 400, "messages"),
    ("top_logprobs without logprobs", CH, {**chat, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs 21", CH, {**chat, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("logprobs with top_logprobs (legal)", CH, {**chat, "logprobs": True, "top_logprobs": 2},
     200, None),
    ("message without content", CH, {**chat, "messages": [{"role": "user"}]}, 400,
     "messages.0.content"),
    ("image content part", CH, {**chat, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "w5"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400,
     "messages.0.content"),
    ("text content parts", CH, {**chat, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "w5"}, {"type": "text", "text": "w6"}]}]}, 200, None),
    ("unknown role", CH, {**chat, "messages": [{"role": "wizard", "content": "w5"}]}, 400,
     "messages.0.role"),
    ("thousands of messages", CH, {**chat, "messages": [{"role": "user", "content": "w5"}]
                                   * 3000}, 400, "messages"),
    ("tools", CH, {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools"),
    ("stream_options wrong type", C, {**ok, "stream": True, "stream_options": "yes"}, 400,
     "stream_options"),
    ("stream_options unknown key", C, {**ok, "stream": True, "stream_options": {"usage": 1}},
     400, "stream_options.usage"),
    ("message unknown field", CH, {**chat, "messages": [{"role": "user", "content": "w5",
                                                         "contnet": "w6"}]}, 400,
     "messages.0.contnet"),
    ("assistant turn sent back as returned (legal)", CH, {**chat, "messages": [
        {"role": "user", "content": "w5"},
        {"role": "assistant", "content": "w6", "refusal": None, "tool_calls": None},
        {"role": "user", "content": "w7"}]}, 200, None),
    ("message with tool calls", CH, {**chat, "messages": [
        {"role": "assistant", "content": "w6", "tool_calls": [{"id": "c1"}]}]}, 400,
     "messages.0.tool_calls.0.function"),
    ("max_completion_tokens (legal)", CH, {**chat, "max_completion_tokens": 3}, 200, None),
]


def send(client: httpx.Client, route: str, body, headers=AUTH) -> httpx.Response:
    if isinstance(body, (str, bytes)):
        return client.post(route, content=body,
                           headers={**headers, "content-type": "application/json"})
    return client.post(route, json=body, headers=headers)


@pytest.mark.parametrize("name,route,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_malformed_and_odd_requests(base, name, route, body, status, param):
    with httpx.Client(base_url=base, timeout=60) as client:
        r = send(client, route, body)
        assert r.status_code == status, (name, r.status_code, r.text[:300])
        if status != 200:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            if param:
                assert err["param"] == param, err
                assert param.split(".")[0] in err["message"], err
        # The service answers a normal request right after.
        assert send(client, C, ok).status_code == 200


def test_table_covers_at_least_forty_cases():
    assert len(CASES) >= 40


def test_other_methods_routes_and_content_types_are_refused_openai_style(base):
    with httpx.Client(base_url=base, timeout=60) as client:
        for r, status in ((client.get(C, headers=AUTH), 405),
                          (client.post("/v1/nothing", json=ok, headers=AUTH), 404),
                          (client.post(C, content=b"model=tiny", headers={
                              **AUTH, "content-type": "application/x-www-form-urlencoded"}), 400),
                          (client.post(C, content=b"\xff\xfe\x00", headers={
                              **AUTH, "content-type": "application/json"}), 400)):
            assert r.status_code == status, r.text
            assert r.json()["error"]["message"]


def test_an_oversized_chunked_body_gets_413_and_the_service_serves_on(base):
    """No Content-Length to refuse up front: the body is counted as it arrives."""
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(80):
            yield b"w5 " * 20_000  # 60 kB a chunk, 4.8 MB in all
        yield b'"}'

    with httpx.Client(base_url=base, timeout=60) as client:
        r = client.post(C, content=chunks(), headers={**AUTH,
                                                      "content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert send(client, C, ok).status_code == 200


def test_api_key_guards_v1_and_health_says_little_without_it(base):
    with httpx.Client(base_url=base, timeout=60) as client:
        for headers in ({}, {"authorization": "Bearer wrong-key-123"},
                        {"authorization": KEY}):
            for r in (client.post(C, json=ok, headers=headers),
                      client.post(CH, json=chat, headers=headers),
                      client.get("/v1/models", headers=headers)):
                assert r.status_code == 401, r.text
                assert r.json()["error"]["code"] == "invalid_api_key"
        # The key is checked before the body is read: a stranger's malformed or huge body
        # costs no parsing (it would be a 400 or 413 with the key).
        for body in (b"{not json", b"[" * 100_000, b"x" * (5 << 20)):
            r = client.post(C, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/health").json() == {"status": "ok"}
        detailed = client.get("/health", headers=AUTH).json()
        assert detailed["status"] == "ok" and "engine" in detailed
        assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny"


def test_a_prompt_beyond_any_context_is_refused_before_tokenizing(base):
    """More characters than the context could hold as tokens: refused on its length alone
    (the message counts characters, which only the check before the tokenizer does)."""
    huge = "w5 " * (128 * CHARS_PER_TOKEN // 3 + 100)
    with httpx.Client(base_url=base, timeout=60, headers=AUTH) as client:
        for route, body, param in (
                (C, {**ok, "prompt": huge}, "prompt"),
                (CH, {**chat, "messages": [{"role": "user", "content": huge}]}, "messages")):
            r = client.post(route, json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and "characters" in err["message"], err
            assert err["code"] == "context_length_exceeded"
        assert client.post(C, json=ok).status_code == 200


def test_tools_and_tool_call_arguments_count_toward_the_character_cap(base):
    """What the chat template renders besides message text (a tool's schema, an earlier
    call's arguments) is refused on its length too, before templating and tokenizing."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description":
                                                      "w5 " * 40} for i in range(300)}}
    tool = {"type": "function", "function": {"name": "f", "parameters": big}}
    call = {"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": json.dumps(big)}}
    with httpx.Client(base_url=base, timeout=60, headers=AUTH) as client:
        for body, param in (({**chat, "tools": [tool]}, "tools"),
                            ({**chat, "messages": [
                                {"role": "user", "content": "w5"},
                                {"role": "assistant", "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": "c1", "content": "w6"},
                                {"role": "user", "content": "w7"}]}, "messages")):
            r = client.post(CH, json=body)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param, r.text[:300]
            assert "characters" in err["message"], err
        assert client.post(CH, json=chat).status_code == 200


def test_every_kind_of_grammar_is_capped_before_it_compiles(base):
    """A choice list, a regex and a grammar past the cap are refused on their length alone
    (compiling one costs in proportion), naming the field."""
    long = "w5 " * 70_000
    with httpx.Client(base_url=base, timeout=60, headers=AUTH) as client:
        for field, value in (("choice", ["w5 w6 " * 40] * 1000), ("regex", long),
                             ("grammar", f'root ::= "{long}"')):
            r = client.post(C, json={**ok, "structured_outputs": {field: value}})
            err = r.json()["error"]
            assert r.status_code == 400, r.text[:300]
            assert err["param"] == f"structured_outputs.{field}", err
            assert "characters" in err["message"], err


def test_health_asks_the_engine_at_most_once_a_second(base):
    with httpx.Client(base_url=base, timeout=60, headers=AUTH) as client:
        first = client.get("/health").json()["engine"]["time"]
        assert client.get("/health").json()["engine"]["time"] == first
        time.sleep(HEALTH_TTL_S + 0.1)
        assert client.get("/health").json()["engine"]["time"] > first


def test_openapi_names_only_the_served_model(base, tiny_llama):
    text = httpx.get(f"{base}/openapi.json", timeout=30).text
    assert '"tiny"' in text and str(tiny_llama) not in text


def test_openapi_publishes_the_request_and_response_models(base):
    spec = httpx.get(f"{base}/openapi.json", timeout=30).json()
    for route, model in ((C, "CompletionRequest"), (CH, "ChatCompletionRequest")):
        body = spec["paths"][route]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"].endswith(model)
    schemas = spec["components"]["schemas"]
    assert {"CompletionResponse", "ChatCompletionResponse", "ErrorResponse"} <= set(schemas)
    assert "seed" in schemas["CompletionRequest"]["properties"]


def test_fuzzing_from_the_schema_finds_no_server_error(base):
    """At least 200 generated cases per operation, valid and invalid: no 5xx, no dropped
    connection (schemathesis counts both as failures)."""
    exe = str(sys.prefix) + "/bin/schemathesis"
    run = subprocess.run(
        [exe, "run", f"{base}/openapi.json", "--checks", "not_a_server_error",
         "--max-examples", "200", "--mode", "all", "-H", f"Authorization: Bearer {KEY}",
         "--include-path-regex", "^/v1/", "--request-timeout", "60",
         "--no-color", "--suppress-health-check", "all"],
        capture_output=True, text=True, timeout=1500)
    out = run.stdout + run.stderr
    print(out[-3000:])
    assert run.returncode == 0, out[-4000:]
    with httpx.Client(base_url=base, timeout=60) as client:
        assert send(client, C, ok).status_code == 200


def _cached(client, headers, context: list[int], true_first: bool) -> list[int]:
    """Per probe `context[:m] + [c, z]` (c the true next token or a wrong one, in the order
    asked), the prompt tokens the response reports cached."""
    seen = []
    for m in (20, 40):  # inside the victim's prompt, inside its reply
        pair = [context[m], 3 + (context[m] - 3 + 7) % 93]
        for c in pair if true_first else pair[::-1]:
            r = client.post(C, headers=headers, json={
                "model": "tiny", "prompt": context[:m] + [c, 95], "max_tokens": 1})
            assert r.status_code == 200, r.text
            seen.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return seen


def test_a_tenant_learns_nothing_of_anothers_prompt_or_reply_from_response_bodies(base):
    """Tenants by API key. Alice (the `default` key) sends a prompt and gets a reply; Bob
    and Carol probe them with a true next token against a wrong one, inside the prompt and
    inside the reply, in either order. The `cached_tokens` they get back follow from their
    own requests alone: the first probe of a context reuses nothing, each later one what
    the tenant's own earlier probe left, whichever candidate is the true one. Alice's own
    probes find her tokens (the channel exists within a tenant). The suffix index's
    partition is tested on the engine (tests/engine/test_suffix_leads.py)."""
    prompt = random.Random(53).sample(range(3, 95), 32)  # distinct tokens, no 95 among them
    with httpx.Client(base_url=base, timeout=60) as client:
        r = client.post(C, headers=AUTH, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 24, "ignore_eos": True,
            "logprobs": 1, "speculative": {"mode": "off"}})  # plain requests are indexed too
        assert r.status_code == 200, r.text
        words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 96)}}
        context = prompt + [words[t] for t in r.json()["choices"][0]["logprobs"]["tokens"]]
        assert len(context) == 56, context
        own = _cached(client, AUTH, context, true_first=True)  # before slots are reused
        bob = _cached(client, BOB, context, true_first=True)
        carol = _cached(client, CAROL, context, true_first=False)
    # Each is what the tenant's own probes left: Carol's third probe continues her second
    # (the true token at 20) by one token more than Bob's (a wrong one there).
    assert bob == [0, 20, 20, 40] and carol == [0, 20, 21, 40], (bob, carol)
    assert own == [21, 20, 41, 40], own  # her true next tokens: one more than the wrong
