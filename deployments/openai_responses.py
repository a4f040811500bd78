"""OpenAI-compatible response schemas, as the routes declare them: /openapi.json publishes
them, so client generators and fuzzers see the real API."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens whose K/V came from the prefix "
                               "cache (not computed for this request).")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


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
    logprobs: dict | None = Field(None, description=(
        "With `logprobs` asked: tokens, token_logprobs, top_logprobs, text_offset."))
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
    content: str | None
    tool_calls: list[dict] | None = Field(None, description=(
        "The calls the reply makes (finish_reason tool_calls): id, type, function "
        "{name, arguments (JSON text)}"))


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict | None = Field(None, description=(
        "With `logprobs` asked: content, a list of {token, logprob, bytes, top_logprobs}."))
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
