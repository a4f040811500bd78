"""The request fields that ask for structured output, and the grammar each one means.

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}) and vLLM's
`structured_outputs` extension ({"json" | "regex" | "choice" | "grammar"}: at most one), on
completions and chat alike, as vLLM serves them. Each becomes a GrammarSpec the engine
turns into a token mask (specdec/model/step/grammar.py); a grammar that does not compile is a
400 naming the field it came from.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specdec.model.step.grammar import GrammarSpec

MAX_GRAMMAR_CHARS = 200_000  # a schema or grammar larger than this is not a reply format
MAX_CHOICES = 1024


class JsonSchemaFormat(BaseModel):
    """OpenAI's json_schema: the schema, its name; `strict` is honoured either way (the
    mask enforces the schema whatever it says)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's extension: exactly one of a JSON schema, a regex, a list of choices, a
    grammar (GBNF as llama.cpp writes it, or Lark)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    # The matcher holds every choice in one parser row (llguidance caps a row at 2000
    # items: a longer list would compile and then fail at its first token).
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("json_", "regex", "choice", "grammar")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar")
        return self


def grammar_of(response_format: ResponseFormat | None,
               structured: StructuredOutputs | None) -> tuple[GrammarSpec | None, str]:
    """The request's grammar (None: free text) and the field that asked for it."""
    if structured is not None:
        if response_format is not None and response_format.type != "text":
            raise ValueError("response_format and structured_outputs both constrain the "
                             "reply: give one")
        s = structured
        if s.json_ is not None:
            text = s.json_ if isinstance(s.json_, str) else json.dumps(s.json_)
            return sized(GrammarSpec("json_schema", text), "structured_outputs.json"), \
                "structured_outputs.json"
        if s.regex is not None:
            return sized(GrammarSpec("regex", s.regex), "structured_outputs.regex"), \
                "structured_outputs.regex"
        if s.choice is not None:
            return sized(GrammarSpec("choice", json.dumps(s.choice)),
                          "structured_outputs.choice"), "structured_outputs.choice"
        # llama.cpp's GBNF has rules `name ::= ...`; Lark writes `name: ...`.
        kind = "grammar" if "::=" in s.grammar else "lark"
        return sized(GrammarSpec(kind, s.grammar), "structured_outputs.grammar"), \
            "structured_outputs.grammar"
    if response_format is None or response_format.type == "text":
        return None, "response_format"
    if response_format.type == "json_object":
        return GrammarSpec("json_object", ""), "response_format"
    schema = response_format.json_schema.schema_
    # No schema given: any JSON value would do, but a reply format means an object.
    text = json.dumps(schema if schema is not None else {"type": "object"})
    field = "response_format.json_schema.schema"
    return sized(GrammarSpec("json_schema", text), field), field


class GrammarFieldError(ValueError):
    """A grammar refused before compiling it, and the request field that gave it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def sized(spec: GrammarSpec, field: str) -> GrammarSpec:
    """Every kind of grammar is capped (a schema, a regex, a choice list as JSON, a grammar,
    the forced tool call's): compiling it costs in proportion."""
    if len(spec.text) > MAX_GRAMMAR_CHARS:
        raise GrammarFieldError(f"{field}: the grammar has {len(spec.text)} characters; at "
                                f"most {MAX_GRAMMAR_CHARS}", field)
    return spec
