"""OpenAI-compatible request and response schemas, and OpenAI-shaped errors.

The routes declare these models, so /openapi.json publishes them (client generators and
fuzzers see the real API) and FastAPI validates every body before a route runs. Errors are
OpenAI-shaped: {"error": {"message", "type", "param", "code"}}, 4xx naming the field.

Input is checked here so that nothing a client sends can reach a model shard as a value it
chokes on (a seed beyond 64 bits once took the whole target group down): numbers in their
ranges, text that is valid Unicode, only the content kinds we implement. Fields OpenAI
defines but this server does not implement are refused with a 400 naming the field when
given a non-default value (never silently ignored); fields OpenAI does not define are
ignored, as vLLM does, except the `speculative` extension.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specdec.model.sampling import SEED_MAX, SEED_MIN

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
    mode: Literal["auto", "on", "off"] = "auto"
    k: int | None = Field(None, ge=1, le=16)
    method: Literal["draft", "ngram"] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_TOKENS_CAP)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOverride = Field(default_factory=SpeculativeOverride)
    # vLLM's extension: generate exactly max_tokens (benchmarks, fixed-length tests).
    ignore_eos: bool = False
    user: str | None = Field(None, max_length=256)
    # Defined by OpenAI, not implemented here: refused unless left at their defaults.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: Any = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported")
        return v

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

    @model_validator(mode="after")
    def _unsupported(self):
        # Values that mean "off" for each unimplemented field.
        off = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
               "logit_bias": (None, {}), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
               "best_of": (None, 1), "echo": (False,), "suffix": (None, ""),
               "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
               "response_format": (None, {"type": "text"})}
        for name, values in off.items():
            if getattr(self, name) not in values:
                raise ValueError(f"{name} is not supported by this server")
        return self

    def max_new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. prompt: text, a list of one text, or token ids."""

    prompt: str | list[str] | list[int] = Field(
        description="one prompt: text, [text], or a list of token ids")

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = Field(None, max_length=256)

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if isinstance(v, str):
            return _text(v, "content")
        parts = []
        for i, part in enumerate(v):
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content[{i}].type: {kind!r} content parts are not "
                                 "supported by this server (text only)")
            parts.append(TextPart.model_validate(part))
        return parts

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=100_000)


# ---- responses (documented in /openapi.json) ---------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecDecode(BaseModel):
    """This server's extension: what the engine decided for the request and what it got."""

    model_config = ConfigDict(extra="allow")
    mode: str
    method: str
    k: int
    reason: str
    rounds: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    mean_acceptance_length: float | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    spec_decode: SpecDecode


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    spec_decode: SpecDecode


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


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
    return (f"{param}: {msg}" if param else msg), param
