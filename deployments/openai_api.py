"""OpenAI-compatible request schemas and error bodies.

Fields OpenAI defines but this server does not implement are refused with a 400 naming the
field when given a non-default value (never silently ignored); fields OpenAI does not define
are ignored, as vLLM does, except the `speculative` extension.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_TOKENS_CAP = 1 << 20


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": type_, "param": param, "code": code}})


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
    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOverride = Field(default_factory=SpeculativeOverride)
    # vLLM's extension: generate exactly max_tokens (benchmarks, fixed-length tests).
    ignore_eos: bool = False
    # Defined by OpenAI, not implemented here: refused unless left at their defaults.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    best_of: int | None = None
    echo: bool = False

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
        return stops

    @model_validator(mode="after")
    def _unsupported(self):
        # Values that mean "off" for each unimplemented field.
        off = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
               "logit_bias": (None, {}), "logprobs": (None, False, 0), "best_of": (None, 1),
               "echo": (False,)}
        for name, values in off.items():
            if getattr(self, name) not in values:
                raise ValueError(f"{name} is not supported by this server")
        return self

    def max_new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int]

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if all(isinstance(x, str) for x in v):
                if len(v) != 1:
                    raise ValueError("only one prompt per request is supported")
                return v[0]
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        if not v:
            raise ValueError("messages must not be empty")
        return v


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic errors -> one readable message and the offending field's dotted name."""
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x not in ("body",)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    return (f"{param}: {msg}" if param else msg), param
