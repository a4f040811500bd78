"""Prompts refused on their size in characters, before the chat template and the tokenizer
spend time on them (a 3.9 MB prompt took 2 s to tokenize, and other requests waited)."""

from __future__ import annotations

import json

from deployments.openai_api import APIError

CHARS_PER_TOKEN = 64  # no token of any vocabulary here is longer


def check_chars(n_chars: int, param: str, max_len: int) -> None:
    """Refuse a prompt that cannot fit the context whatever its tokens."""
    limit = max_len * CHARS_PER_TOKEN
    if n_chars > limit:
        raise APIError(400, f"{param} has {n_chars} characters; the context of "
                            f"{max_len} tokens cannot hold more than about {limit}",
                       param=param, code="context_length_exceeded")


def check_template_chars(body, max_len: int) -> None:
    """The cap over everything the chat template renders: message text, the arguments of
    earlier tool calls and the tools' schemas (each could carry megabytes)."""
    messages = sum(len(m.text()) + sum(len(c.function.arguments) for c in m.tool_calls or ())
                   for m in body.messages)
    tools = sum(len(json.dumps(t.function.parameters or {})) +
                len(t.function.description or "") for t in body.tools or ())
    check_chars(messages + tools, "tools" if tools > messages else "messages", max_len)
