"""OpenAI-compatible request and response schemas, and OpenAI-shaped errors.

The routes declare these models, so /openapi.json publishes them (client generators and
fuzzers see the real API) and FastAPI validates every body before a route runs. Errors are
OpenAI-shaped: {"error": {"message", "type", "param", "code"}}, 4xx naming the field.

Input is checked here so that nothing a client sends can reach a model shard as a value it
chokes on (a seed beyond 64 bits once took the whole target group down): numbers in their
ranges, text that is valid Unicode, only the content kinds we implement. Nothing a client
sends is silently ignored: a field nobody defines is refused as OpenAI refuses it
("Unrecognized request argument supplied: <field>", 400), so a misspelt `speculatve` or
`max_token` fails loudly instead of running with defaults; a field OpenAI (or vLLM, for
sampling) defines but this server does not implement is accepted only at the value that
means "off", and refused with a 400 naming it otherwise.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from deployments.structured_output import ResponseFormat, StructuredOutputs, grammar_of
from deployments.tool_calls import ToolCall, ToolChoice, ToolDef
from specdec.model.step.sampling import (
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    SEED_MAX,
    SEED_MIN,
)
from specdec.vocabulary import ProposerMethod, SpecMode

MAX_TOKENS_CAP = 1 << 20
_SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code,
                              self.headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content={"error": {
        "message": message, "type": type_, "param": param, "code": code}})


def _text(v: str, what: str) -> str:
    """Text must be encodable Unicode: a lone UTF-16 surrogate (JSON "\\ud800") is not."""
    if _SURROGATE.search(v):
        raise ValueError(f"{what} holds a lone UTF-16 surrogate, which is not valid Unicode "
                         "text (encode the character as a pair, or send token ids)")
    return v


class SpeculativeOverride(BaseModel):
    """Per-request control of speculation (extension field `speculative`)."""

    model_config = ConfigDict(extra="forbid")
    mode: SpecMode = "auto"
    k: int | None = Field(None, ge=1, le=16)
    method: ProposerMethod | None = None


MAX_CHOICES = 16  # choices per request (n): each holds a slot of its own


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    # OpenAI pads stream chunks against length side channels when true; chunks here are
    # unpadded either way, which the client's choice does not make less safe than asked.
    include_obfuscation: bool = True


# Defined by OpenAI or by vLLM's sampling extensions, not implemented here: each accepted
# only at the values that mean "off" (what a client library sends when the user set nothing).
UNIMPLEMENTED_OFF: dict[str, tuple] = {
    "best_of": (None, 1),
    "echo": (False,), "suffix": (None, ""), "functions": (None, []),
    "function_call": (None, "none", "auto"), "store": (None, False), "metadata": (None, {}),
    "service_tier": (None, "auto", "default"), "modalities": (None, ["text"]),
    "prediction": (None,), "audio": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "prompt_cache_key": (None,), "safety_identifier": (None,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
}


def _unimplemented(cls, v, info: ValidationInfo):
    # `True == 1` in Python: compare types too, so `echo: 1` or `min_tokens: false` is not
    # taken for an "off" it does not spell.
    off = UNIMPLEMENTED_OFF[info.field_name]
    if not any(v == o and type(v) is type(o) for o in off):
        raise ValueError(f"{info.field_name} is not supported by this server (accepted "
                         f"only as {' or '.join(json.dumps(o) for o in off)})")
    return v


# One field per UNIMPLEMENTED_OFF entry, typed loosely so that any value reaches the check,
# which names the field whatever the client sent; defaulting to its first "off".
_Unimplemented = create_model(
    "_Unimplemented", __config__=ConfigDict(extra="forbid"),
    __validators__={"_unimplemented": field_validator(*UNIMPLEMENTED_OFF)(_unimplemented)},
    **{name: (Any, off[0]) for name, off in UNIMPLEMENTED_OFF.items()})


class _SamplingFields(_Unimplemented):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_TOKENS_CAP)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description=(
        "Choices to generate from the prompt, each sampled (and speculating) on its own."))
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOverride = Field(default_factory=SpeculativeOverride)
    # vLLM's extension: generate exactly max_tokens (benchmarks, fixed-length tests).
    ignore_eos: bool = False
    # Sampling controls (OpenAI's penalties and logit_bias; vLLM's min_p,
    # repetition_penalty, min_tokens, stop_token_ids), applied to the target's logits.
    presence_penalty: float = Field(0.0, ge=-2, le=2, strict=True)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, strict=True)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=10, strict=True)
    min_p: float = Field(0.0, ge=0, le=1, strict=True)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_CAP, strict=True)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    logit_bias: dict[str, float] | None = Field(None, max_length=1024, description=(
        "token id (as a string, OpenAI's way) -> a bias in -100..100 added to its logit"))

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, bias in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of {key} must be in -100..100")
        return v

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(b)) for k, b in (self.logit_bias or {}).items()))
    user: str | None = Field(None, max_length=256)
    # Structured output (deployments/structured_output.py): a mask on the target's logits.
    response_format: ResponseFormat | None = Field(None, description=(
        "text, json_object (any JSON object) or json_schema (a reply valid for the schema)"))
    structured_outputs: StructuredOutputs | None = Field(None, description=(
        "vLLM's extension: one of json (a schema), regex, choice, grammar (GBNF or Lark)"))

    def grammar(self):
        """(GrammarSpec or None, the field that asked for it); ValueError when both
        response_format and structured_outputs constrain the reply."""
        return grammar_of(self.response_format, self.structured_outputs)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > 1000 for s in stops):
            raise ValueError("stop sequences must be at most 1000 characters")
        return [_text(s, "stop") for s in stops]

    def max_new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. prompt: text, a list of one text, or token ids."""

    prompt: str | list[str] | list[int] = Field(
        description="one prompt: text, [text], or a list of token ids")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "Report each token's log-probability and this many most likely alternatives "
        "(the target's raw distribution: before temperature, top_k and top_p)."))

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if all(isinstance(x, str) for x in v):
                if len(v) != 1:
                    raise ValueError("only one prompt per request is supported")
                v = v[0]
        return _text(v, "prompt") if isinstance(v, str) else v


class TextPart(BaseModel):
    """The one content part this server implements."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _valid(cls, v: str) -> str:
        return _text(v, "text")


# Fields a message OpenAI returned carries, so a client that sends an assistant turn back
# as it got it: accepted when empty, refused when they hold something (audio).
MESSAGE_EMPTY_FIELDS = ("function_call", "refusal", "audio", "annotations")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = Field(None, validate_default=True)
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=256)
    function_call: Any = None
    refusal: Any = None
    audio: Any = None
    annotations: Any = None

    @field_validator(*MESSAGE_EMPTY_FIELDS)
    @classmethod
    def _empty(cls, v, info: ValidationInfo):
        if v not in (None, []):
            raise ValueError(f"{info.field_name} is not supported by this server (text "
                             "messages and tool calls only)")
        return v

    @field_validator("content")
    @classmethod
    def _content(cls, v, info: ValidationInfo):
        if v is None and info.data.get("role") != "assistant":
            raise ValueError("Field required")
        if v is None or isinstance(v, str):
            return v if v is None else _text(v, "content")
        parts = []
        for i, part in enumerate(v):
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content[{i}].type: {kind!r} content parts are not "
                                 "supported by this server (text only)")
            parts.append(TextPart.model_validate(part))
        return parts

    @model_validator(mode="after")
    def _roles(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant "
                             "message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it (tool call arguments as objects)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=100_000)
    logprobs: bool | None = Field(False, description=(
        "Report each token's log-probability (the target's raw distribution: before "
        "temperature, top_k and top_p)."))
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "With logprobs: this many most likely alternatives per token."))
    tools: list[ToolDef] | None = Field(None, max_length=128, description=(
        "Functions the model may call, rendered by its chat template (one that supports "
        "tools); calls come back in message.tool_calls"))
    tool_choice: ToolChoice | None = Field(None, description=(
        "none, auto (the default with tools), required, or {type: function, function: "
        "{name}}: required and named calls are enforced by a grammar"))
    parallel_tool_calls: bool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):
            raise ValueError("requires logprobs to be true")
        return v

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages through the model's
    template, to the token ids the engine would be given."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=100_000,
                                               validate_default=True)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    # The functions a chat request would list: the template renders them into the prompt.
    tools: list[ToolDef] | None = Field(None, max_length=128)
    # Not read: a chat request's body may be sent here as it is.
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("prompt")
    @classmethod
    def _valid(cls, v):
        return None if v is None else _text(v, "prompt")

    @field_validator("messages")
    @classmethod
    def _one_of(cls, v, info: ValidationInfo):
        if (v is None) == (info.data.get("prompt") is None):
            raise ValueError("give either prompt or messages")
        return v


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape): token ids to text."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, max_length=256)
    tokens: list[int] = Field(max_length=1_000_000)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic errors -> one readable message and the offending field's dotted name."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    # Union members show up in the location (prompt.str, prompt.list[int]): not fields.
    loc = [str(x) for x in first.get("loc", ()) if x != "body"
           and not re.fullmatch(r"(str|int|float|bool|none|list\[.*\]|dict\[.*\])", str(x))]
    msg = first.get("msg", "invalid request").removeprefix("Value error, ")
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        # OpenAI's own words for a field it does not define.
        return f"Unrecognized request argument supplied: {param}", param
    return (f"{param}: {msg}" if param else msg), param
