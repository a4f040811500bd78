"""Suffix speculation: guesses from what this replica has already seen, across requests.

Code assistants and agents re-emit spans they have seen: the file being edited, the last
answer, the same boilerplate in request after request. Prompt lookup (NgramProposer) finds
them only in the request's own context; this looks in every recent prompt and output too,
as llama.cpp's ngram-mod pool and SuffixDecoding (Arctic Inference, vLLM's `suffix`) do.

The index is a fixed-size hash table from an n-gram (n = min_n..max_n) to the token that
followed its latest occurrence and how many times in a row that token followed it. A guess
chains lookups: the context's last n tokens give the next token, which extends the context
for the next lookup, while the entry is confident (seen at least `min_count` times, or
the n-gram is long) and the chain is no longer than `spec_factor` times the matched n
(a long match earns long guesses, a short one a few: Arctic's max_spec_factor). Memory is
the table's (16 bytes a slot, 2^20 slots by default: 16 MB), whatever the traffic; new
entries overwrite old ones, so old requests fade on their own.

Exact regardless: a guess is a one-hot proposal under the rejection rule, so what the
index holds (another request's text, a hash collision) changes how many tokens a round
keeps, never which tokens come out.

Partitioned by tenant: each tenant has the table to itself in effect: its n-gram hashes
are salted with a keyed hash of its name (the key a secret of the replica's), so a lookup
for one tenant never matches what another fed (it would take a 64-bit hash collision, and
even that would only cost speed). Without that, how many guesses a round made and kept
(reported to the client) would tell one tenant whether another sent an n-gram. Requests
without a tenant (a deployment with one) share the unsalted table. Tenants share the
table's memory, so the bound stays the same, and one tenant's traffic can evict another's
entries (speed, not text).
"""

from __future__ import annotations

import hashlib
import secrets

import numpy as np

from specdec.spec_decode.proposal import ALONE, Proposal, ProposeInput
from specdec.spec_decode.proposers import NgramProposer

_P = np.uint64(0x9E3779B97F4A7C15)  # an odd multiplier: the polynomial hash's base
# A match this long is trusted after one occurrence (shorter ones need min_count), and is
# what free guesses for plainly decoding rows require.
SURE_N = 4


def tenant_salt(tenant: str, key: bytes) -> int:
    """A tenant's salt for the index's n-gram hashes (nonzero), keyed by the replica's
    secret: knowing another tenant's name does not tell where its entries lie."""
    digest = hashlib.blake2b(tenant.encode(), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little") or 1


def ngram_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """Hash of every n-gram of tokens (len - n + 1 of them), order-sensitive, salted by n so
    that different orders never share an entry."""
    m = len(tokens) - n + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    t = tokens.astype(np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):  # wrapping uint64 arithmetic is the point
        h = np.full(m, np.uint64(n) * np.uint64(0x632BE59BD9B4E019), dtype=np.uint64)
        for j in range(n):
            h = h * _P + t[j:j + m]
        return h ^ (h >> np.uint64(29))


class SuffixIndex:
    """n-gram -> (next token, times in a row) over everything fed to it, bounded."""

    def __init__(self, min_n: int = 2, max_n: int = 8, bits: int = 20) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("suffix n-gram sizes need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self.mask = (1 << bits) - 1
        self.keys = np.zeros(1 << bits, dtype=np.uint64)      # 0: empty
        self.next = np.zeros(1 << bits, dtype=np.int32)
        self.count = np.zeros(1 << bits, dtype=np.int32)
        self.fed_tokens = 0

    def clear(self) -> None:
        """Forget everything fed (the table keeps its size)."""
        self.keys[:] = 0
        self.next[:] = 0
        self.count[:] = 0
        self.fed_tokens = 0

    def feed(self, tokens, start: int = 0, salt: int = 0) -> None:
        """Learn the tokens at positions >= start of a sequence (its earlier tokens were fed
        before): every n-gram ending before such a token now predicts it. `salt`: the
        tenant's (0: the replica's shared scope)."""
        arr = np.asarray(tokens, dtype=np.int64)
        start = max(start, 1)
        if start >= len(arr):
            return
        self.fed_tokens += len(arr) - start
        for n in range(self.min_n, self.max_n + 1):
            first = max(start - n, 0)        # n-grams [i, i+n) predicting arr[i+n] >= start
            window = arr[first:len(arr) - 1]
            if len(window) < n:
                continue
            h = ngram_hashes(window, n) ^ np.uint64(salt)
            h[h == 0] = 1                    # 0 marks an empty slot
            follow = arr[first + n:]
            slots = (h & np.uint64(self.mask)).astype(np.int64)
            # In order, so that the latest occurrence of an n-gram wins (numpy's fancy
            # assignment keeps the last write for a repeated slot).
            same = (self.keys[slots] == h) & (self.next[slots] == follow)
            counts = np.where(same, self.count[slots] + 1, 1).astype(np.int32)
            self.keys[slots] = h
            self.next[slots] = follow.astype(np.int32)
            self.count[slots] = counts

    def lookup(self, context, k: int, spec_factor: float = 2.0, min_count: int = 1,
               sure_n: int = SURE_N, salt: int = 0) -> tuple[list[int], int]:
        """Up to k guesses chained from the longest n-gram of the context's tail that the
        index knows, and that n (0: none)."""
        if k <= 0:
            return [], 0
        tail = [int(t) for t in np.asarray(context, dtype=np.int64)[-self.max_n:]]
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            guesses = self._chain(tail, n, min(k, max(1, int(spec_factor * n))), min_count,
                                  sure_n, salt)
            if guesses:
                return guesses, n
        return [], 0

    def _chain(self, tail: list[int], n: int, limit: int, min_count: int,
               sure_n: int, salt: int) -> list[int]:
        seq, out = list(tail), []
        while len(out) < limit:
            h = (int(ngram_hashes(np.asarray(seq[-n:], dtype=np.int64), n)[0]) ^ salt) or 1
            slot = h & self.mask
            if int(self.keys[slot]) != h:
                break
            if n < sure_n and int(self.count[slot]) < min_count:
                break
            token = int(self.next[slot])
            out.append(token)
            seq.append(token)
        return out


class SuffixProposer(NgramProposer):
    """Guesses from the request's own context (prompt lookup, as `ngram`) or from the
    replica's index of recent prompts and outputs, whichever matches the longer n-gram."""

    name = "suffix"

    def __init__(self, min_n: int = 2, max_n: int = 8, bits: int = 20,
                 spec_factor: float = 2.0, min_count: int = 2, shared: bool = True,
                 plain_rows_k: int = 0) -> None:
        super().__init__(min_n, max_n)
        self.index = SuffixIndex(min_n, max_n, bits)
        self.spec_factor, self.min_count, self.shared = spec_factor, min_count, shared
        self._salt_key = secrets.token_bytes(16)  # this replica's; the index is its own
        self.plain_rows_k = plain_rows_k  # free guesses a plainly decoding row may verify
        self._fed: dict[str, tuple[list[int], int]] = {}  # seq -> (context, tokens fed)
        self.stats = {"proposals": 0, "from_index": 0, "from_context": 0, "guesses": 0,
                      "free_guesses": 0}

    def propose(self, inputs: list[ProposeInput]) -> list[Proposal]:
        out = []
        for i in inputs:
            self._remember(i.seq_id, i.context, i.tenant)
            out.append(Proposal(self.guess(i.context, i.k, i.tenant)))
        return out

    def _salt(self, tenant: str | None) -> int | None:
        """The index scope a request reads and feeds: 0 the shared one (no tenant), a
        tenant's salt, or None (no index: the request's own context only; also for a
        request that is its own tenant, whose entries nobody could ever read)."""
        if not self.shared or (tenant is not None and tenant.startswith(ALONE)):
            return None
        return 0 if tenant is None else tenant_salt(tenant, self._salt_key)

    def propose_confident(self, inputs: list[ProposeInput]) -> list[Proposal]:
        """Guesses only from a match of at least SURE_N tokens, for rows that decode
        plainly (free guesses): from the index, which holds the request's own context too
        (cheap: no pass over the context), or from the context alone when not shared."""
        out = []
        for i in inputs:
            self._remember(i.seq_id, i.context, i.tenant)
            salt = self._salt(i.tenant)
            if salt is not None:
                guesses, n = self.index.lookup(i.context, i.k, self.spec_factor,
                                               self.min_count, salt=salt)
            else:
                guesses, n = self._own(i.context, i.k)
            out.append(Proposal(guesses if n >= SURE_N else []))
            self.stats["free_guesses"] += len(out[-1].token_ids)
        return out

    def guess(self, context: list[int], k: int, tenant: str | None = None) -> list[int]:
        self.stats["proposals"] += 1
        own, own_n = self._own(context, k)
        salt = self._salt(tenant)
        shared, shared_n = (self.index.lookup(context, k, self.spec_factor, self.min_count,
                                              salt=salt)
                            if salt is not None else ([], 0))
        if shared_n > own_n or (shared_n == own_n and len(shared) > len(own)):
            self.stats["from_index"] += bool(shared)
            best = shared
        else:
            self.stats["from_context"] += bool(own)
            best = own
        self.stats["guesses"] += len(best)
        return best

    def _own(self, context: list[int], k: int) -> tuple[list[int], int]:
        """Prompt lookup with the matched n, its guesses as long as the match earns."""
        arr = np.asarray(context, dtype=np.int64)
        L = len(arr)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
            hits = np.flatnonzero((windows == arr[L - n:]).all(axis=1))
            if hits.size:
                s = int(hits[-1])
                limit = min(k, max(1, int(self.spec_factor * n)))
                return arr[s + n: s + n + limit].tolist(), n
        return [], 0

    def _remember(self, seq_id: str, context: list[int], tenant: str | None = None) -> None:
        """Feed the index what the sequence added since it was last seen (a running
        request's context only grows by tokens the target kept), in the request's scope."""
        salt = self._salt(tenant)
        if salt is None:
            return
        old, fed = self._fed.get(seq_id, ([], 0))
        keep = min(fed, len(context))
        if keep and (len(old) < keep or old[keep - 1] != context[keep - 1]):
            keep = 0  # rewritten (never expected): feed it again whole
        self.index.feed(context, keep, salt)
        self._fed[seq_id] = (context, len(context))

    def observe(self, seq_id: str, tokens: list[int], tenant: str | None = None) -> None:
        """A finished request's prompt and output, whatever method served it: the index
        learns what it has not yet (a plain request's whole text), in its tenant's scope."""
        self._remember(seq_id, list(tokens), tenant)

    def release(self, seq_id: str) -> None:
        self._fed.pop(seq_id, None)

    def forget(self) -> None:
        """Empty the replica's index: running sequences are fed again whole at their next
        round, so they keep their own context."""
        self.index.clear()
        self._fed.clear()

    def report(self) -> dict:
        return {**self.stats, "indexed_tokens": self.index.fed_tokens,
                "table_mb": round((self.index.keys.nbytes + self.index.next.nbytes
                                   + self.index.count.nbytes) / 2**20, 1)}
