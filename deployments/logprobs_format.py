"""The engine's log-probabilities (per token: its own and its top alternatives, as token ids)
in OpenAI's two shapes: chat's `logprobs.content` (token, logprob, bytes, top_logprobs) and
completions' legacy `logprobs` (tokens, token_logprobs, top_logprobs, text_offset).

A token's text is its own decoding; its bytes are its exact bytes where the tokenizer is
byte-level (a token may hold part of a character, which decodes to U+FFFD but whose bytes
join with the next token's), else the UTF-8 of its text.
"""

from __future__ import annotations

import functools


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (Qwen, SmolLM, Llama 3 use it): each byte is drawn as
    one printable character; the printable bytes as themselves, the rest shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shift)] = b
            shift += 1
    return chars


_BYTE_OF = _byte_level_alphabet()


class LogprobFormat:
    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._text)
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self._tok.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        piece = self._tok.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(c in _BYTE_OF for c in piece):
            return [_BYTE_OF[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.text(token_id), "logprob": logprob,
                "bytes": self.bytes(token_id)}

    def chat(self, token_ids: list[int], logprobs: list | None) -> dict | None:
        """chat.completion(.chunk) choice `logprobs`: {"content": [...], "refusal": None}."""
        if logprobs is None:
            return None
        return {"content": [{**self._entry(t, lp),
                             "top_logprobs": [self._entry(i, a) for i, a in alts]}
                            for t, (lp, alts) in zip(token_ids, logprobs, strict=True)],
                "refusal": None}

    def completion(self, token_ids: list[int], logprobs: list | None,
                   offset: int = 0) -> dict | None:
        """text_completion choice `logprobs`; offset: characters of this choice's text
        before these tokens (a stream's earlier chunks)."""
        if logprobs is None:
            return None
        texts = [self.text(t) for t in token_ids]
        offsets = []
        for s in texts:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": texts, "token_logprobs": [lp for lp, _ in logprobs],
                "top_logprobs": [{self.text(i): a for i, a in alts} for _, alts in logprobs],
                "text_offset": offsets}
