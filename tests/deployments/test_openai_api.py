"""The request schemas alone (no Ray): a field nobody defines is refused with OpenAI's
words and named, an unimplemented field is accepted only at its "off" value, and what
official clients send when the user set nothing passes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.openai_api import (
    UNIMPLEMENTED_OFF,
    ChatCompletionRequest,
    CompletionRequest,
    validation_message,
)

OK = {"model": "m", "prompt": "hi"}


def refusal(model, body) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return validation_message(e.value.errors())


@pytest.mark.parametrize("field", ["speculation", "max_token", "temprature", "foo"])
def test_a_field_nobody_defines_is_refused_and_named(field):
    msg, param = refusal(CompletionRequest, {**OK, field: 1})
    assert param == field
    assert msg == f"Unrecognized request argument supplied: {field}"


def test_nested_unknown_fields_are_named_by_their_path():
    assert refusal(CompletionRequest, {**OK, "speculative": {"mode": "off", "kk": 2}})[1] \
        == "speculative.kk"
    assert refusal(CompletionRequest, {**OK, "stream_options": {"usage": True}})[1] \
        == "stream_options.usage"
    chat = {"model": "m", "messages": [{"role": "user", "content": "x", "contnet": "y"}]}
    assert refusal(ChatCompletionRequest, chat)[1] == "messages.0.contnet"


@pytest.mark.parametrize("field", sorted(UNIMPLEMENTED_OFF))
def test_unimplemented_fields_pass_at_off_and_are_refused_otherwise(field):
    for off in UNIMPLEMENTED_OFF[field]:
        CompletionRequest.model_validate({**OK, field: off})
    msg, param = refusal(CompletionRequest, {**OK, field: "on"})
    assert param == field and "not supported" in msg


@pytest.mark.parametrize("field,value", [("echo", 1), ("min_tokens", False),
                                         ("presence_penalty", False), ("store", 0),
                                         ("min_p", "0.5"), ("min_tokens", 1.5)])
def test_a_value_equal_to_off_but_of_another_type_is_refused(field, value):
    assert refusal(CompletionRequest, {**OK, field: value})[1] == field


def test_what_the_openai_client_sends_back_for_an_assistant_turn_passes():
    ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "refusal": None, "tool_calls": None,
         "function_call": None, "audio": None, "annotations": []},
        {"role": "user", "content": "c"}], "stream_options": {"include_usage": True,
                                                              "include_obfuscation": False}})
    msg, param = refusal(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "assistant", "content": "b", "tool_calls": [{"id": "c1"}]}]})
    # A tool call without its function: refused, naming the missing field.
    assert param == "messages.0.tool_calls.0.function" and "required" in msg


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("repetition_penalty", 0),
    ("repetition_penalty", 11), ("min_p", 1.2), ("min_tokens", -1),
    ("logit_bias", {"5": 101}), ("logit_bias", {"w5": 1}), ("stop_token_ids", ["a"])])
def test_sampling_controls_out_of_range_are_refused_and_named(field, value):
    assert refusal(CompletionRequest, {**OK, field: value})[1].split(".")[0] == field


def test_sampling_controls_in_range_pass():
    r = CompletionRequest.model_validate({**OK, "presence_penalty": 1, "frequency_penalty": 0.5,
                                          "repetition_penalty": 1.2, "min_p": 0.05,
                                          "min_tokens": 3, "stop_token_ids": [7],
                                          "logit_bias": {"50256": -100, "7": 2.5}})
    assert r.logit_bias_pairs() == ((7, 2.5), (50256, -100.0))
