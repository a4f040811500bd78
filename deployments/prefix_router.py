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

A queue's length is the larger of Serve's cached figure and this router's own count of the
requests it sent there that have not finished, counted from the moment it chooses: Serve's
figure is overwritten by each probe and each acceptance (a replica's count lags the requests
on their way to it), so a burst routed within a few milliseconds all read the same short
queue and all went to the holder.

Each ingress replica routes with what it has seen: with several ingress replicas, a
conversation whose turns reach different ones starts over on a replica chosen by load.
"""

from __future__ import annotations

import collections
import logging
import time

import numpy as np
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

from specdec.model.step.prefix_cache import common_prefix

log = logging.getLogger("ray.serve")

MIN_MATCH = 32  # tokens shared before a prefix is worth following (a chat template's head)
# A request chosen for a replica but never sent (cancelled while it waited) is forgotten
# after TENTATIVE_S; one sent is counted at most IN_FLIGHT_S (a Serve that never reports a
# completion must not leave a replica looking busy for good).
TENTATIVE_S = 30.0
IN_FLIGHT_S = 900.0


def prompt_ids_of(pending_request) -> np.ndarray | None:
    """The request's prompt token ids (the GenerateCall the ingress sends), or None."""
    if pending_request is None or not pending_request.args:
        return None
    ids = getattr(pending_request.args[0], "prompt_ids", None)
    return None if ids is None else np.asarray(ids, dtype=np.int64)


def tenant_of(pending_request) -> str | None:
    """The request's tenant: a replica's cache holds a prefix for that tenant only."""
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], "tenant", None)


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
        # internal request id -> (replica it was sent or is about to be sent to, since when,
        # whether Serve confirmed it), until Serve reports it done
        self._in_flight: dict[str, tuple[object, float, bool]] = {}
        # Requests reported done, lately (a completion can come before the routed callback,
        # which must not count the request again), oldest first.
        self._done: set[str] = set()
        self._done_order: collections.deque = collections.deque()

    def holder(self, ids: np.ndarray, candidates, tenant: str | None = None
               ) -> tuple[object, int] | None:
        """The candidate that was sent the longest prefix of ids by `tenant` (the engine's
        caches are partitioned by tenant), and its length."""
        best, length = None, self._min_match - 1
        for r in candidates:
            for owner, prompt in self._seen.get(r.replica_id, ()):
                if owner != tenant:
                    continue
                n = common_prefix(ids, prompt)
                if n > length:
                    best, length = r, n
        return None if best is None else (best, length)

    def queue_lengths(self, candidates) -> dict:
        """Per candidate, the larger of Serve's cached queue length and the requests this
        router sent there that have not finished (None where neither is known)."""
        now = time.monotonic()
        for rid, (_, since, routed) in list(self._in_flight.items()):
            if now - since > (IN_FLIGHT_S if routed else TENTATIVE_S):
                del self._in_flight[rid]
        sent = collections.Counter(replica for replica, _, _ in self._in_flight.values())
        cache = self._replica_queue_len_cache
        out = {}
        for r in candidates:
            cached, mine = cache.get(r.replica_id), sent.get(r.replica_id, 0)
            out[r.replica_id] = None if cached is None and not mine else max(cached or 0, mine)
        return out

    def too_busy(self, replica, candidates) -> bool:
        """Whether the holder's queue is longer than the least loaded replica's by more than
        `imbalance`."""
        queues = self.queue_lengths(candidates)
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
        found = self.holder(ids, candidate_replicas, tenant_of(pending_request))
        if found is None:
            return fallback
        cache = self._replica_queue_len_cache
        unknown = [r for r in candidate_replicas if cache.get(r.replica_id) is None]
        if unknown:
            await self._probe_queue_lens(unknown, 0)
        # From here to the return nothing awaits: the check and the count it leaves for the
        # next request routed in the same burst are one step.
        if self.too_busy(found[0], candidate_replicas):
            return fallback
        self.affinity_hits += 1
        self._in_flight[_request_id(pending_request)] = (found[0].replica_id, time.monotonic(),
                                                         False)
        return [[found[0]], *fallback]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        rid = _request_id(pending_request)
        if rid not in self._done:  # (done already: nothing of it is in flight)
            self._in_flight[rid] = (replica_id, time.monotonic(), True)  # where it really went
        ids = prompt_ids_of(pending_request)
        if ids is not None and len(ids) >= self._min_match:
            self._seen[replica_id].append((tenant_of(pending_request), ids))

    def on_request_completed(self, replica_id, internal_request_id) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        # Also called for a request the holder refused: Serve routes it again (and that
        # attempt goes uncounted, a rare miss where a leak would last).
        self._in_flight.pop(internal_request_id, None)
        self._done.add(internal_request_id)
        self._done_order.append(internal_request_id)
        if len(self._done_order) > 4096:
            self._done.discard(self._done_order.popleft())

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in [rid for rid in self._seen if rid not in live]:
            del self._seen[gone]  # its cache went with it
        self._in_flight = {k: v for k, v in self._in_flight.items() if v[0] in live}


def _request_id(pending_request) -> str:
    return pending_request.metadata.internal_request_id
