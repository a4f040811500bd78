"""Tool calls: the request's `tools` rendered by the model's own chat template, and the
reply's tool calls read back from the format that template asks for.

Templates in the Hermes style (Qwen2.5, Hermes, many others) ask for each call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; vLLM's `hermes` parser
and llama.cpp read the same. Small models also answer with the bare JSON object (often in
a ```json fence) instead: a reply that is nothing but such an object, naming a declared
tool, is read as that call too. `tool_choice` "required" or a named function is enforced
rather than hoped for: a grammar (specdec/model/step/grammar.py) that admits only calls of the
allowed tools with arguments valid for their schemas, so a forced call always parses, and
speculation keeps the target's distribution under it like any other grammar.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.model.step.grammar import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class _Named(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: _Named


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(BaseModel):
    """A call in an assistant message the client sends back."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict:
        # Templates render the arguments with `tojson`: they expect the object, not text.
        try:
            args = json.loads(self.function.arguments)
        except ValueError:
            args = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": args}}


def supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


class ToolRequestError(ValueError):
    """A request's tools this model cannot serve; param: the field to name."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def tool_plan(body, tokenizer, model_name: str) -> ToolPlan | None:
    """What a chat request's tools mean for this model (None: it has none)."""
    template = getattr(tokenizer, "chat_template", None)
    carries = any(m.tool_calls or m.role == "tool" for m in body.messages)
    if (body.tools or carries) and not supports_tools(template):
        field = "tools" if body.tools else "messages"
        raise ToolRequestError(f"{field}: the model {model_name!r} has a chat template "
                               "without tool support", field)
    if not body.tools:
        if body.tool_choice not in (None, "none", "auto"):
            raise ToolRequestError("tool_choice needs tools", "tool_choice")
        return None
    try:
        return ToolPlan(body.tools, body.tool_choice, body.parallel_tool_calls, tokenizer)
    except ValueError as exc:
        raise ToolRequestError(f"tool_choice {exc}", "tool_choice") from exc


class ToolPlan:
    """What a chat request's tools mean for its prompt, its grammar and its reply."""

    def __init__(self, tools: list[ToolDef], choice: ToolChoice | None,
                 parallel: bool | None, tokenizer) -> None:
        self.tools = tools
        self.names = [t.function.name for t in tools]
        self.choice = choice if choice is not None else "auto"
        # Several calls in one reply: read back unless the client said no; a forced call
        # admits several only when asked outright (a small model repeats a call it is
        # made to write until the tokens run out).
        self.parallel = parallel is not False
        self.forced_parallel = parallel is True
        self.hermes = OPEN in (getattr(tokenizer, "chat_template", None) or "")
        # A grammar names the tags as the tokens the model writes them with: where they are
        # added tokens (Qwen2.5's), text "<tool_call>" spelt byte by byte is not them.
        self.tags = [_as_token(tokenizer, t) for t in (OPEN, CLOSE)]
        if isinstance(self.choice, NamedToolChoice) and self.choice.function.name \
                not in self.names:
            raise ValueError(f"names the function {self.choice.function.name!r}, which is "
                             f"not among the tools ({', '.join(self.names)})")

    @property
    def active(self) -> bool:
        """Calls may come back (tool_choice is not "none")."""
        return self.choice != "none" and bool(self.tools)

    def template_tools(self) -> list[dict] | None:
        # Listed even under "none" (as vLLM does): the conversation may hold calls of them.
        return [{"type": "function", "function": t.function.model_dump(exclude_none=True)}
                for t in self.tools]

    def grammar(self) -> GrammarSpec | None:
        """For "required" or a named function: only calls of the allowed tools."""
        if self.choice in ("none", "auto"):
            return None
        allowed = [t for t in self.tools if isinstance(self.choice, str)
                   or t.function.name == self.choice.function.name]
        call = {"anyOf": [{
            "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": t.function.name},
                           "arguments": t.function.parameters or {"type": "object"}}}
            for t in allowed]}
        block = f'{self.tags[0]} "\\n" call "\\n" {self.tags[1]}' if self.hermes else "call"
        more = f'("\\n" {block})*' if self.forced_parallel else ""
        return GrammarSpec("lark", f"start: {block} {more}\ncall: %json {json.dumps(call)}\n")

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a whole reply; no calls: the text is all content."""
        if not self.active:
            return text, []
        blocks = _BLOCK.findall(text)
        if blocks:
            calls = [self._call(b) for b in blocks]
            if all(calls):
                content = text[: text.index(OPEN)].strip()
                return content or None, calls
            return text, []
        body = text.strip()
        fenced = _FENCE.match(body)
        body = fenced.group(1) if fenced else body
        try:
            value = json.loads(body)
        except ValueError:
            return text, []
        items = value if isinstance(value, list) and self.parallel else [value]
        calls = [self._call_obj(v) for v in items]
        return (None, calls) if calls and all(calls) else (text, [])

    def _call(self, block: str) -> dict | None:
        try:
            return self._call_obj(json.loads(block))
        except ValueError:
            return None

    def _call_obj(self, obj) -> dict | None:
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args)}}


class ToolStream:
    """A streamed reply's text with tool calls held back: content streams as it comes,
    except text that may be a tool call (from a `<tool_call>` on, or a reply opening like a
    JSON object or a fence), held until the end decides: calls, or content after all."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.sent, self.held = plan, "", ""

    def feed(self, text: str) -> str:
        """Text to send now."""
        self.held += text
        if self.sent == "" and _may_open_json(self.held):
            return ""
        cut = self.held.find(OPEN)
        if cut < 0:  # keep back a tail that may still become "<tool_call>"
            cut = len(self.held) - _partial_open(self.held)
        out, self.held = self.held[:cut], self.held[cut:]
        self.sent += out
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content still to send, tool calls) at the end of the reply."""
        content, calls = self.plan.parse(self.sent + self.held)
        if calls:
            return "", calls
        held, self.held = self.held, ""
        return held, []


def _as_token(tokenizer, tag: str) -> str:
    """The grammar's name for a tag: its token (<[id]>) where the tokenizer has it as one
    added token, else its text."""
    vocab = getattr(tokenizer, "get_added_vocab", dict)()
    return f"<[{vocab[tag]}]>" if tag in vocab else json.dumps(tag)


def _may_open_json(text: str) -> bool:
    s = text.lstrip()
    return s == "" or s.startswith(("{", "[", "```")) or "```".startswith(s)


def _partial_open(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of "<tool_call>"."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
