"""Serve's request router for the engine deployment: a request goes to the replica whose
prefix cache most likely holds its prompt, unless that replica is busier than the others.

With several engine replicas, a conversation's next turn only reuses its history if it
reaches the replica that served the last turn. Serve's default router (power of two
choices) picks replicas by queue length alone, so a conversation of four turns on two
replicas would hit its cache about half the time. Like Ray Serve LLM's
PrefixCacheAffinityRouter, this one remembers which prompts it sent where (per replica, the
most recent ones, as many as the replica's slots could hold) and sends a request to the
replica holding the longest prefix of its prompt; it matches token ids (the ingress has
tokenized already), in this process (no shared actor to call per request). Where no replica
holds MIN_MATCH tokens of it, or where the holder's queue is longer than the least loaded
replica's by more than `imbalance`, it falls back to power of two choices. The holder is
offered first; Serve moves on to the fallback pair when the holder's queue is full.

Each ingress replica routes with what it has seen: with several ingress replicas, a
conversation whose turns reach different ones starts over on a replica chosen by load.
"""

from __future__ import annotations

import collections
import logging

import numpy as np
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

from specdec.model.prefix_cache import common_prefix

log = logging.getLogger("ray.serve")

MIN_MATCH = 32  # tokens shared before a prefix is worth following (a chat template's head)


def prompt_ids_of(pending_request) -> np.ndarray | None:
    """The request's prompt token ids (the GenerateCall the ingress sends), or None."""
    if pending_request is None or not pending_request.args:
        return None
    ids = getattr(pending_request.args[0], "prompt_ids", None)
    return None if ids is None else np.asarray(ids, dtype=np.int64)


class PrefixAffinityRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, remembered: int = 64, imbalance: int = 4,
                         min_match: int = MIN_MATCH) -> None:
        """remembered: prompts kept per replica (about its KV slots: what it can hold);
        imbalance: how many more queued requests than the least loaded replica the holder
        may have and still be chosen."""
        self._remembered, self._imbalance, self._min_match = remembered, imbalance, min_match
        self._seen: dict = collections.defaultdict(
            lambda: collections.deque(maxlen=self._remembered))
        self.affinity_hits = 0  # requests sent to the replica holding their prefix

    def holder(self, ids: np.ndarray, candidates) -> tuple[object, int] | None:
        """The candidate that was sent the longest prefix of ids, and its length."""
        best, length = None, self._min_match - 1
        for r in candidates:
            for prompt in self._seen.get(r.replica_id, ()):
                n = common_prefix(ids, prompt)
                if n > length:
                    best, length = r, n
        return None if best is None else (best, length)

    async def _too_busy(self, replica, candidates) -> bool:
        """Whether the holder's queue is longer than the least loaded replica's by more than
        `imbalance` (queue lengths from Serve's cache, probed where it has none)."""
        cache = self._replica_queue_len_cache
        unknown = [r for r in candidates if cache.get(r.replica_id) is None]
        if unknown:
            await self._probe_queue_lens(unknown, 0)
        queues = {r.replica_id: cache.get(r.replica_id) for r in candidates}
        mine = queues.get(replica.replica_id)
        known = [q for q in queues.values() if q is not None]
        if mine is None or not known:
            return False  # nothing known: the holder, whose cache saves a prefill
        return mine > min(known) + self._imbalance

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        fallback = await super().choose_replicas(candidate_replicas, pending_request)
        ids = prompt_ids_of(pending_request)
        if ids is None or not fallback:
            return fallback
        found = self.holder(ids, candidate_replicas)
        if found is None or await self._too_busy(found[0], candidate_replicas):
            return fallback
        self.affinity_hits += 1
        return [[found[0]], *fallback]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        ids = prompt_ids_of(pending_request)
        if ids is not None and len(ids) >= self._min_match:
            self._seen[replica_id].append(ids)

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in [rid for rid in self._seen if rid not in live]:
            del self._seen[gone]  # its cache went with it
