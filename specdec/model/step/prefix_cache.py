"""Which tokens each KV slot holds, so that context is paid for once.

A finished sequence's K/V stay in its slot until the slot is needed again (least recently
used first). A new sequence takes the free slot holding the longest prefix of its tokens, if
it continues most of what that slot holds, and computes only the rest (llama-server's slot
choice, `cache_prompt`). Beyond that, a prefix held by any other slot, in use or not (a
conversation's other branch, the same system prompt being served right now) is copied into
the new sequence's slot: a copy of n tokens' K/V costs
milliseconds where recomputing them costs a prefill. vLLM and SGLang share such prefixes
block by block without copying; here a slot is one contiguous run of positions (what the
static and captured steps and the token-attention kernel read), so a shared prefix is
copied once instead of referenced.

Exact by construction: a slot's entries at positions 0..n-1 are the K/V of exactly the n
tokens recorded for it (only positions a forward wrote from those tokens, never a guess the
target rejected: the owner records the tokens its cache holds), and a token's K/V depend
only on the tokens before it. Reusing them is recomputing them, minus the work.

Partitioned by tenant: each slot remembers whose sequence it holds, and a sequence reuses or
copies only what its own tenant's sequences left (None: a deployment with one tenant, where
everyone shares). How much of a prompt was reused is reported to the client
(`cached_tokens`), so sharing across tenants would tell one whether another's prompt or
reply continues as a probe guesses.

This is bookkeeping only: the caller owns the cache and does the copy (KVCache.copy_prefix).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

# A prefix held elsewhere is copied only when it beats what the chosen slot holds by this
# many tokens: below that, recomputing a few tokens costs about what the copy does.
COPY_MIN_TOKENS = 16
# A free slot is continued in place only by a sequence that shares at least this share of
# what it holds (llama-server's --slot-prompt-similarity, 0.5 by default, is the same idea).
IN_PLACE_SHARE = 0.5


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclasses.dataclass
class Choice:
    slot: int
    reuse: int                      # tokens whose K/V the slot will hold before computing
    copy_from: int | None = None    # copy positions [0, reuse) from this slot first
    evicted: int = 0                # tokens of the slot's old content overwritten


@dataclasses.dataclass
class PrefixStats:
    lookups: int = 0       # sequences started
    hits: int = 0          # ... that reused at least one token
    prompt_tokens: int = 0
    tokens_reused: int = 0
    copies: int = 0        # reuses copied from another slot
    evictions: int = 0     # held contents overwritten by an unrelated sequence

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["hit_rate"] = round(self.tokens_reused / self.prompt_tokens, 4) \
            if self.prompt_tokens else None
        return out


class PrefixCache:
    """The tokens held by each of `num_slots` slots. Running slots are the caller's (it
    passes their current contents when it asks); free slots keep what their last sequence
    left until they are taken."""

    def __init__(self, num_slots: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self._held: list[np.ndarray] = [np.zeros(0, dtype=np.int64) for _ in range(num_slots)]
        self._used: list[int] = [0] * num_slots
        self._tenant: list[str | None] = [None] * num_slots  # whose tokens each slot holds
        self._clock = itertools.count(1)
        self.stats = PrefixStats()

    def held(self, slot: int) -> np.ndarray:
        return self._held[slot]

    def held_tokens(self) -> int:
        """Tokens kept by free slots (a running slot's own count lives with its sequence)."""
        return int(sum(len(h) for h in self._held))

    def tenant_of(self, slot: int) -> str | None:
        return self._tenant[slot]

    def choose(self, tokens, free: list[int], running: dict[int, np.ndarray] | None = None,
               tenant: str | None = None) -> Choice:
        """A free slot for a new sequence of `tokens` sent by `tenant`, and how much of them
        it starts with (only from that tenant's slots). running: slot -> the tokens its
        cache holds now, for the slots in use. At least the last token is always left to
        compute (its logits are the first output)."""
        if not free:
            raise ValueError("no free slot")
        ids = np.asarray(tokens, dtype=np.int64)
        cap = max(len(ids) - 1, 0)
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(ids)
        # The slot to give up when nothing held is continued in place: an empty one first,
        # else the one used longest ago (never used: the lowest first).
        lru = min(free, key=lambda s: (len(self._held[s]) > 0, self._used[s], s))
        if not self.enabled or cap == 0:
            return self._take(Choice(lru, 0), ids, tenant)
        free_own = [s for s in free if self._tenant[s] == tenant]
        running_own = {s: h for s, h in (running or {}).items() if self._tenant[s] == tenant}
        # In place: a free slot whose content this sequence mostly continues (a
        # conversation's next turn). Taking one that only shares a few tokens (a chat
        # template's head) would throw away another conversation to save those few.
        best, reuse = lru, 0
        for s in free_own:
            n = min(common_prefix(ids, self._held[s]), cap)
            continues = n >= IN_PLACE_SHARE * len(self._held[s])
            if continues and (n > reuse or (n == reuse and n and self._used[s] > self._used[best])):
                best, reuse = s, n
        # Elsewhere: any slot, running or free, whose prefix is worth a copy.
        source, copied = None, 0
        for s, held in [*((f, self._held[f]) for f in free_own), *running_own.items()]:
            n = min(common_prefix(ids, held), cap)
            if n > copied:
                source, copied = s, n
        if source == lru and copied > reuse:
            # The slot given up holds the longest prefix itself: keeping that much of it costs
            # nothing more than giving it up.
            return self._take(Choice(lru, copied), ids, tenant)
        # A copy pays when it saves enough tokens, or when it is all of the prompt but its
        # last token (the same prompt again: what users expect to see as cached).
        worth = copied >= reuse + COPY_MIN_TOKENS or (copied == cap and copied > reuse)
        if source is not None and worth:
            # Into the slot given up: its content is the one least likely to be asked for.
            return self._take(Choice(lru, copied, copy_from=source), ids, tenant)
        if reuse == 0:
            return self._take(Choice(lru, 0), ids, tenant)
        return self._take(Choice(best, reuse), ids, tenant)

    def source(self, tokens, have: int, slots: dict[int, np.ndarray],
               tenant: str | None = None) -> tuple[int, int] | None:
        """A slot of `tenant`'s among `slots` (slot -> tokens it holds) holding a prefix of
        `tokens` longer than `have` by COPY_MIN_TOKENS or more, and its length (capped at
        all but the last token): where a sequence still prefilling can copy instead of
        compute."""
        if not self.enabled:
            return None
        ids = np.asarray(tokens, dtype=np.int64)
        cap = max(len(ids) - 1, 0)
        best = None
        for s, held in slots.items():
            if self._tenant[s] != tenant:
                continue
            n = min(common_prefix(ids, held), cap)
            if n >= have + COPY_MIN_TOKENS and (best is None or n > best[1]):
                best = (s, n)
        return best

    def copied(self, n_more: int) -> None:
        """A running sequence took n_more tokens by copy (see source)."""
        self.stats.copies += 1
        self.stats.tokens_reused += n_more

    def _take(self, choice: Choice, ids: np.ndarray, tenant: str | None) -> Choice:
        old = self._held[choice.slot]
        kept = choice.reuse if choice.copy_from is None else 0
        if len(old) > kept:
            choice.evicted = len(old) - kept
            if kept == 0:
                self.stats.evictions += 1
        if choice.reuse:
            self.stats.hits += 1
            self.stats.tokens_reused += choice.reuse
            self.stats.copies += choice.copy_from is not None
        self._held[choice.slot] = np.zeros(0, dtype=np.int64)  # in use: the caller's now
        self._used[choice.slot] = next(self._clock)
        self._tenant[choice.slot] = tenant
        return choice

    def release(self, slot: int, tokens) -> None:
        """A sequence left `slot`; its cache holds the K/V of exactly `tokens` at positions
        0.. (pass [] when that is not known: after a failed step)."""
        self._held[slot] = np.asarray(tokens, dtype=np.int64) if self.enabled else \
            np.zeros(0, dtype=np.int64)
        self._used[slot] = next(self._clock)

    def clear(self) -> None:
        """The cache behind the slots was lost (a rebuilt worker): nothing is held."""
        for s in range(len(self._held)):
            self._held[s] = np.zeros(0, dtype=np.int64)
