"""Structured output: a request's grammar (a JSON schema, any JSON object, a GBNF or Lark
grammar, a regex) as a token mask on the target's logits, through llguidance (a Rust
matcher, on CPU, that vLLM also uses; its mask costs tens of microseconds per token and it
ships as one small wheel with no further dependencies, where xgrammar pulls triton).

Each sequence holds a matcher that has consumed the tokens emitted so far. A verified row
needs one mask per position: position j's mask is the grammar's after the emitted tokens
plus guesses 0..j-1, computed by consuming those guesses and rolling them back. The rule
then runs on the masked p, so the output follows the target's distribution restricted to
the grammar, speculative or not. A guess the grammar cannot take is verified too and
rejected at its position (p = 0 there), which draws from the residual max(0, p - q) as the
rule says; the guesses after it are dropped (see guesses_and_masks). The masks are
worked out on a copy of the matcher, never by consuming and rolling back on the sequence's
own: a guess that drives a parser into a limit would otherwise stop it for good.

A grammar is compiled once per text: the compiled form and a matcher at its start (the
costly part with a large vocabulary, seconds for a big choice list or schema) are cached,
and each sequence's matcher is a copy of that one (microseconds), however many requests
or choices (`n`) name the same grammar.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading

import torch

GRAMMAR_KINDS = ("json_schema", "json_object", "grammar", "lark", "regex", "choice")
# Large lexemes (a long choice, a big alternation) are worked out when first reached
# instead of all at once when the matcher is built: building one for a 4096-item choice
# list took 6 s with them precomputed, 0.15 s without.
_LIMITS = {"precompute_large_lexemes": False}


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: kind (GRAMMAR_KINDS) and its text (a JSON
    schema as JSON text, a GBNF or Lark grammar, a regex, a JSON list of choices)."""

    kind: str
    text: str

    def compiled(self) -> str:
        return _compiled(self.kind, self.text)


@functools.lru_cache(maxsize=256)
def _compiled(kind: str, text: str) -> str:
    import llguidance

    if kind == "json_object":
        return llguidance.grammar_from("json_schema", '{"type": "object"}')
    kind = {"grammar": "gbnf", "json_schema": "json_schema"}.get(kind, kind)
    return llguidance.grammar_from(kind, text)


@functools.lru_cache(maxsize=256)
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


_copying = threading.Lock()  # one copy of a cached matcher at a time


@functools.lru_cache(maxsize=64)
def _matcher_at_start(spec: GrammarSpec, ll) -> object:
    """The grammar's matcher before any token, built once per grammar and tokenizer; a
    grammar that does not compile against the tokenizer raises ValueError (not cached)."""
    import llguidance

    # log_level 0: a refused guess is routine here, not a warning for the log.
    matcher = llguidance.LLMatcher(ll, spec.compiled(), log_level=0,
                                   limits=llguidance.LLParserLimits(**_LIMITS))
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    return matcher


class GrammarState:
    """One sequence's matcher, at the tokens emitted so far."""

    def __init__(self, spec: GrammarSpec, tokenizer, n_vocab: int,
                 eos_ids: tuple[int, ...], start: object | None = None) -> None:
        """start: the grammar's matcher at the start, when the caller holds it (compiled
        when the request was checked); else it is looked up, or built, here."""
        self.n_vocab = n_vocab
        if start is None:
            start = _matcher_at_start(spec, _ll_tokenizer(tokenizer, n_vocab,
                                                          tuple(sorted(eos_ids))))
        self.start = start
        with _copying:
            self.matcher = start.deep_copy()

    def guesses_and_masks(self, guesses: list[int]) -> tuple[int, torch.Tensor]:
        """How many of the guesses to verify (n), and the bitmasks of the positions that
        verify them, [n + 1, words] (int32, llguidance's layout): position j's allowed
        tokens after guesses[:j]. The guesses the grammar takes in order are kept, and so is
        the first one it refuses: verified, it is rejected with certainty (its masked p is
        0) and the position draws from the rejection rule's residual max(0, p - q), as the
        rule requires; cutting it off and drawing from p instead would favour the tokens
        the draft also guessed whenever q is not one-hot. Nothing after it can be reached;
        the position after it gets a copy of its mask (finite, never read). Worked out on a
        copy of the matcher (microseconds): the sequence's own only ever sees emitted
        tokens, so a guess that drives the parser into a limit or an error cannot spoil
        it."""
        import llguidance.torch as lt

        m = self.matcher.deep_copy()
        out = lt.allocate_token_bitmask(len(guesses) + 1, self.n_vocab)
        lt.fill_next_token_bitmask(m, out, 0)
        n = 0
        for g in guesses:
            n += 1
            if m.is_stopped() or not m.consume_token(g):
                out[n] = out[n - 1]  # refused: verified and rejected, nothing beyond
                break
            lt.fill_next_token_bitmask(m, out, n)
        return n, out[: n + 1]

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
