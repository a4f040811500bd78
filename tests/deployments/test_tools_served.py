"""Tool calling over HTTP with the official openai client, OpenAI's own function-calling
example: the model calls get_weather, the client runs it and sends the result back as a
tool message, the model answers. Qwen2.5-Coder-0.5B (its template has tools) as target
(q4k) and draft (int4). Streamed calls arrive as tool_calls deltas; a model whose template
has no tools refuses them with a 400 naming the field (test_serve_app)."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI
from serve_helpers import serve_app

from deployments.launch import local_ray

pytestmark = [pytest.mark.integration, pytest.mark.real_model]

MODEL = "qwen-tools"
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get current temperature for a given location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string",
                             "description": "City and country e.g. Bogotá, Colombia"}
            },
            "required": ["location"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}]


def get_weather(location: str) -> str:
    return f"It is 14 degrees Celsius in {location}."


@pytest.fixture(scope="module")
def client(qwen_draft_path):
    shard = {"model": str(qwen_draft_path), "threads": 1, "resources": {"num_cpus": 0.25}}
    args = {"model_name": MODEL, "target": {**shard, "dtype": "q4k"},
            "draft": {**shard, "dtype": "int4"},
            "runtime": {"max_slots": 4, "max_len": 1024, "gloo_socket_ifname": "lo"},
            "max_waiting": 16, "default_max_tokens": 64, "replica_cpus": 0.1,
            "ingress_cpus": 0.1, "warmup": False}
    with local_ray(num_cpus=4):
        with serve_app(args, name="tools") as url:
            yield OpenAI(base_url=f"{url}/v1", api_key="unused")


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_the_openai_function_calling_example(client, tool_choice):
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    completion = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                tool_choice=tool_choice, temperature=0,
                                                extra_body={"speculative": {"mode": "on"}})
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    tool_call = choice.message.tool_calls[0]
    args = json.loads(tool_call.function.arguments)
    assert tool_call.function.name == "get_weather" and "Paris" in args["location"]
    result = get_weather(args["location"])
    messages.append(choice.message)  # sent back as the client got it
    messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": result})
    completion_2 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                  tool_choice="none", temperature=0)
    # tool_choice none: text only, whatever the model writes (a 0.5B model may well
    # write another call; what it says is the model's business, not the API's).
    answer = completion_2.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")
    # The call and its result reached the prompt: the second turn's is longer by them.
    grew = completion_2.usage.prompt_tokens - completion.usage.prompt_tokens
    assert grew >= 20, (completion.usage, completion_2.usage)
    # /tokenize renders the same conversation exactly as the chat route did.
    sent = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    counted = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": sent,
                                                   "tools": TOOLS}, timeout=60).json()
    assert counted["count"] == completion_2.usage.prompt_tokens, counted


def test_a_streamed_call_arrives_as_tool_call_deltas(client):
    messages = [{"role": "user", "content": "Weather in Lima?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           tool_choice="required", temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                 tool_choice="required", temperature=0,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in (d.tool_calls or [])]
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    want = whole.choices[0].message.tool_calls[0].function
    assert calls[0].function.name == want.name
    assert json.loads(calls[0].function.arguments) == json.loads(want.arguments)
    assert not "".join(d.content or "" for d in deltas)  # nothing leaked as text


def test_a_tool_schema_the_grammar_cannot_use_is_a_400_naming_tools(client):
    bad = [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "required": ["x"],
                                    "properties": {"x": {"type": "string", "pattern": "[a-"}}}}}]
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    r = httpx.post(f"{base}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": bad,
        "tool_choice": "required"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
