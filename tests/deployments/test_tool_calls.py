"""Tool calls (deployments/tool_calls.py): tools rendered by Qwen2.5's own chat template,
replies read back in its Hermes format or as a bare JSON call, streamed text held back only
where it may be a call, and a required call enforced by a grammar: Qwen2.5-Coder-0.5B
(q4k target, int4 draft) then always calls the tool with arguments valid for its schema,
speculation on giving the same tokens as plain."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deployments.tool_calls import NamedToolChoice, ToolDef, ToolPlan, ToolStream
from specdec.engine.assemble import eos_ids_of
from specdec.engine.engine import Engine, EngineLimits
from specdec.engine.request import Request
from specdec.model.step.decoder import Decoder
from specdec.model.step.grammar import grammar_error
from specdec.model.step.sampling import SamplingParams
from specdec.pack.tokenizer import chat_ids, load_tokenizer
from specdec.spec_decode.proposers import DraftModelProposer
from specdec.spec_decode.target_runner import LocalTargetRunner

WEATHER = {"type": "object", "additionalProperties": False, "required": ["location", "unit"],
           "properties": {"location": {"type": "string", "maxLength": 40},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [ToolDef.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "Current temperature at a place.",
    "parameters": WEATHER}}),
    ToolDef.model_validate({"type": "function", "function": {
        "name": "get_time", "description": "Local time at a place.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}})]
class _Hermes:
    """A tokenizer as far as ToolPlan looks: a Hermes-style template, the tags as text."""

    chat_template = "... <tool_call></tool_call> ... {% if tools %}"

    def get_added_vocab(self) -> dict:
        return {}


HERMES = _Hermes()


def test_replies_are_read_back_as_calls_or_left_as_content():
    plan = ToolPlan(TOOLS, None, None, HERMES)
    content, calls = plan.parse('Checking.\n<tool_call>\n{"name": "get_time", "arguments": '
                                '{"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": '
                                '"get_weather", "arguments": {"location": "Oslo", "unit": '
                                '"celsius"}}\n</tool_call>')
    assert content == "Checking." and [c["function"]["name"] for c in calls] == \
        ["get_time", "get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["type"] == "function"
    # The bare object small models answer with, fenced or not.
    fenced = '```json\n{"name": "get_time", "arguments": {"city": "Lima"}}\n```'
    assert plan.parse(fenced)[1][0]["function"]["name"] == "get_time"
    # Not a call: an undeclared function, broken JSON, prose, or tool_choice none.
    for text in ('{"name": "rm_rf", "arguments": {}}', "<tool_call>{oops</tool_call>",
                 "It is sunny.", '{"a": 1}'):
        assert plan.parse(text) == (text, [])
    none = ToolPlan(TOOLS, "none", None, HERMES)
    assert not none.active and none.parse(fenced) == (fenced, [])
    with pytest.raises(ValueError, match="not among the tools"):
        ToolPlan(TOOLS, NamedToolChoice.model_validate(
            {"type": "function", "function": {"name": "nope"}}), None, HERMES)


def test_streamed_text_is_held_only_where_it_may_be_a_call():
    plan = ToolPlan(TOOLS, None, None, HERMES)
    s = ToolStream(plan)
    sent = [s.feed(t) for t in ["Let me", " look.\n<tool", "_call>\n{\"name\": \"get_time\", ",
                                "\"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"]]
    assert sent == ["Let me", " look.\n", "", ""]
    rest, calls = s.finish()
    assert rest == "" and calls[0]["function"]["name"] == "get_time"
    s = ToolStream(plan)  # prose with a "<" that is no call: all of it reaches the client
    sent = [s.feed(t) for t in ["a <", "b> c"]]
    rest, calls = s.finish()
    assert "".join(sent) + rest == "a <b> c" and not calls and sent[0] == "a "
    s = ToolStream(plan)  # JSON that is no call: held, then sent whole at the end
    assert s.feed('{"x": ') == "" and s.feed("1}") == ""
    assert s.finish() == ('{"x": 1}', [])


def test_the_template_renders_tools_and_a_returned_call(qwen_draft_path):
    tok = load_tokenizer(qwen_draft_path)
    plan = ToolPlan(TOOLS, None, None, tok)
    assert plan.hermes
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "get_weather",
                        "arguments": {"location": "Oslo", "unit": "celsius"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    text = tok.decode(chat_ids(tok, messages, plan.template_tools()))
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Oslo"' in text
    assert "<tool_response>\n-3 C\n</tool_response>" in text


@pytest.mark.real_model
def test_a_required_call_is_enforced_and_speculation_changes_no_token(qwen_draft_path):
    path = qwen_draft_path
    tok = load_tokenizer(path)
    target = Decoder.from_checkpoint(path, "q4k")
    draft = Decoder.from_checkpoint(path, "int4")
    eos = eos_ids_of(path, tok)
    asks = ["What should I wear in Reykjavik today?",
            "Tell me a joke about penguins."]  # this one would never call on its own
    named = NamedToolChoice.model_validate({"type": "function",
                                            "function": {"name": "get_weather"}})
    runs = {}
    for choice, method in (("required", "none"), ("required", "draft"), (named, "draft")):
        plan = ToolPlan(TOOLS, choice, False, tok)
        grammar = plan.grammar()
        assert grammar_error(grammar) is None
        prompts = [chat_ids(tok, [{"role": "user", "content": a}], plan.template_tools())
                   for a in asks]
        engine = Engine(LocalTargetRunner(target, 4, 1024),
                        {"draft": DraftModelProposer(draft, 4, 1024)}, tok, eos, EngineLimits())
        params = SamplingParams(temperature=0.0, max_tokens=48, grammar=grammar)
        out = engine.run([Request(f"r{i}", p, params, method, 3 if method == "draft" else 0)
                          for i, p in enumerate(prompts)])
        runs[str(choice), method] = out
        for i in range(len(asks)):
            content, calls = plan.parse(out[f"r{i}"].text)
            assert len(calls) == 1 and content is None, out[f"r{i}"].text
            name = calls[0]["function"]["name"]
            assert choice == "required" or name == "get_weather"
            schema = next(t.function.parameters for t in TOOLS if t.function.name == name)
            jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schema)
        if method == "draft":
            assert engine.totals["draft"].accepted > 0
    for i in range(len(asks)):
        assert runs["required", "draft"][f"r{i}"].token_ids == \
            runs["required", "none"][f"r{i}"].token_ids
