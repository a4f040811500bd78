"""Incremental detokenization with stop strings.

Each step decodes only the tokens since the text last settled, with a few tokens before them
for context (vLLM's prefix and read offsets): decoding the whole output every step made a
long reply quadratic. Stop strings are searched in the new part, and text that might still
turn into a stop string or is an incomplete UTF-8 sequence is held back from the stream until
it is settled.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of text already streamed
        # Text settled for ids[:_read] (no half character at its end); the next decode
        # starts at ids[_prefix], a few tokens back, so the tokenizer sees their context.
        self._settled, self._prefix, self._read = "", 0, 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: list[int]) -> int | None:
        """Append tokens. If a stop string completes, cut the text before it and return how
        many of new_ids to keep (the tokens up to the one that completed it); else None.

        The result is what plain decoding of the same tokens gives, however many tokens a
        round adds at once: plain decoding checks after every token, so the stop that ends
        it is the first one complete after the fewest tokens, cut where it starts in that
        text (with stops "abc" and "b", tokens a, b, c: "b" completes first, text "a")."""
        before = len(self.text)
        self.ids.extend(new_ids)
        context = self._decode(self.ids[self._prefix:self._read])
        tail = self._decode(self.ids[self._prefix:])[len(context):]
        self.text = self._settled + tail
        if tail and not tail.endswith("\ufffd"):
            self._settled, self._prefix, self._read = self.text, self._read, len(self.ids)
        if not self.stop:
            return None
        longest = max(len(s) for s in self.stop)
        start = max(0, before - longest + 1)
        if self._find_stop(self.text, start) is None:
            return None
        base = len(self.ids) - len(new_ids)
        for keep in range(1, len(new_ids) + 1):  # fewest new tokens whose text holds a stop
            text = self._decode(self.ids[: base + keep])
            hit = self._find_stop(text, start)
            if hit is not None:
                self.ids = self.ids[: base + keep]
                self.text = text[:hit]
                return keep
        raise AssertionError("a stop found in the whole text is found in some prefix")

    def _find_stop(self, text: str, start: int) -> int | None:
        found = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(found) if found else None

    def delta(self, final: bool) -> str:
        """Text not streamed yet; while not final, hold back a possible stop-string prefix
        and a trailing replacement character (a multi-byte character cut in half)."""
        end = len(self.text)
        if not final:
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
            for s in self.stop:
                for n in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if self.text[end - n:end] == s[:n]:
                        end -= n
                        break
        out = self.text[self.sent:end]
        self.sent = end
        return out
