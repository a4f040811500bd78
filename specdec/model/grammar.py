"""Structured output: a request's grammar (a JSON schema, any JSON object, a GBNF or Lark
grammar, a regex) as a token mask on the target's logits, through llguidance (a Rust
matcher, on CPU, that vLLM also uses; its mask costs tens of microseconds per token and it
ships as one small wheel with no further dependencies, where xgrammar pulls triton).

Each sequence holds a matcher that has consumed the tokens emitted so far. A verified row
needs one mask per position: position j's mask is the grammar's after the emitted tokens
plus guesses 0..j-1, computed by consuming those guesses and rolling them back. The rule
then runs on the masked p, so the output follows the target's distribution restricted to
the grammar, speculative or not. A guess the grammar cannot take would be rejected at its
position (p = 0 there), so the proposal is cut before it instead (a stopping rule on
guesses already drawn: exact, and no position is verified for nothing).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import torch

GRAMMAR_KINDS = ("json_schema", "json_object", "grammar", "lark", "regex", "choice")


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: kind (GRAMMAR_KINDS) and its text (a JSON
    schema as JSON text, a GBNF or Lark grammar, a regex, a JSON list of choices)."""

    kind: str
    text: str

    def compiled(self) -> str:
        import llguidance

        if self.kind == "json_object":
            return llguidance.grammar_from("json_schema", '{"type": "object"}')
        kind = {"grammar": "gbnf", "json_schema": "json_schema"}.get(self.kind, self.kind)
        return llguidance.grammar_from(kind, self.text)


def grammar_error(spec: GrammarSpec) -> str | None:
    """Why the grammar cannot be used (None: it can), without a tokenizer."""
    import llguidance

    try:
        if spec.kind == "json_schema":
            json.loads(spec.text)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            spec.compiled())
    except (ValueError, TypeError, RuntimeError) as exc:
        return str(exc)
    return ("; ".join(messages) or "the grammar does not compile") if failed else None


@functools.cache
def _ll_tokenizer(tokenizer, n_vocab: int, eos_ids: tuple[int, ...]):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab,
                                        eos_token=list(eos_ids) or None)


class GrammarState:
    """One sequence's matcher, at the tokens emitted so far."""

    def __init__(self, spec: GrammarSpec, tokenizer, n_vocab: int,
                 eos_ids: tuple[int, ...]) -> None:
        import llguidance

        self._ll = _ll_tokenizer(tokenizer, n_vocab, tuple(sorted(eos_ids)))
        self.n_vocab = n_vocab
        self.matcher = llguidance.LLMatcher(self._ll, spec.compiled())
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error())

    def valid_prefix(self, guesses: list[int]) -> int:
        """How many of the guesses, in order, the grammar takes from here."""
        return self.matcher.validate_tokens(guesses) if guesses else 0

    def masks(self, guesses: list[int]) -> torch.Tensor:
        """Bitmasks [len(guesses) + 1, words] (int32, llguidance's layout): position j's
        allowed tokens after guesses[:j]. The matcher ends where it began."""
        import llguidance.torch as lt

        out = lt.allocate_token_bitmask(len(guesses) + 1, self.n_vocab)
        consumed = 0
        for j in range(len(guesses) + 1):
            lt.fill_next_token_bitmask(self.matcher, out, j)
            if j < len(guesses):
                if not self.matcher.consume_token(guesses[j]):
                    break  # later positions are never reached: their masks stay as filled
                consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        return out

    def accept(self, tokens: list[int]) -> None:
        """The tokens the step emitted (each allowed by its mask)."""
        for t in tokens:
            if self.matcher.is_stopped():
                break
            if not self.matcher.consume_token(t):
                raise ValueError(f"token {t} broke the grammar: {self.matcher.get_error()}")


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [n, V'] with disallowed tokens at -inf (V' may exceed the mask's vocabulary:
    the model's padding rows, never allowed)."""
    words = masks.shape[-1]
    V = logits.shape[-1]
    bits = (masks.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.reshape(masks.shape[0], words * 32)[:, :V].bool()
    if allowed.shape[-1] < V:
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[-1]))
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
