"""The draft model as its own Ray actor group, behind the engine's `Proposer` protocol.

Its KV slots and its copies of the sequences' contexts live in the actor: per round only
what changed crosses (specdec/spec_decode/wire.py), and "sequence finished" notices ride along with the
next call. A lost draft never fails a request: proposals come back empty (the engine
decodes those rounds plainly) while the group is rebuilt in the background, and speculation
resumes once it is back (sequences re-send their context to the new draft).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np

from deployments.actors.shard_group import GroupFailed, ShardError, ShardGroup
from specdec.engine.spec import DraftGroupSpec, RuntimeSpec
from specdec.model.step.prefix_cache import common_prefix
from specdec.spec_decode.calls import CallStats
from specdec.spec_decode.proposal import Proposal, ProposeInput
from specdec.spec_decode.wire import ContextSender, pack, unpack

log = logging.getLogger(__name__)


class DraftUnavailable(RuntimeError):
    """No guesses this round: the engine decodes it plainly and counts nothing against the
    draft's acceptance."""


class RayDraftProposer:
    name = "draft"

    def __init__(self, cfg: DraftGroupSpec, runtime: RuntimeSpec,
                 placement_group=None, bundle_indices: list[int] | None = None) -> None:
        self.group = ShardGroup("draft", cfg, runtime, placement_group, bundle_indices,
                                extra={"sampling": cfg.sampling, "vocab_limit": cfg.vocab_limit,
                                       "confidence_threshold": cfg.confidence_threshold,
                                       "q_top_m": cfg.q_top_m,
                                       "prefix_cache": runtime.prefix_cache})
        self.runtime = runtime
        self.stats = self.group.start()
        self.vocab_size = self.stats[0]["vocab_size"]  # its embedding rows
        self.sender = ContextSender()
        self._released: list[str] = []
        # What the draft actor's slots hold, as far as this side can tell: the contexts it
        # was sent, live and recently released (as many as it has slots), with their
        # tenants. For pricing a first round's catch-up only; the actor decides its own
        # reuse (within a tenant, as this does).
        self._recent: collections.deque = collections.deque(maxlen=runtime.kv_slots())
        self._tenants: dict[str, str | None] = {}  # live sequence -> its tenant
        self.prefix_stats: dict | None = None
        self._stats_base: dict = {}
        self._lock = threading.Lock()
        self._rebuilding = False
        self.failures = 0
        self.last_call: CallStats | None = None
        self.graph_builds = 0  # the group's, as of its last reply
        self.overlaps = True
        self._closed = False
        self._window_id = 0

    @property
    def available(self) -> bool:
        return bool(self.group.actors) and not self._rebuilding

    def propose(self, inputs: list[ProposeInput]) -> list[Proposal]:
        ref, sent = self._submit("draft_propose", inputs)
        return self._result(ref, sent)

    def start_window(self, inputs: list[ProposeInput]) -> _RayWindow:
        """Overlap (specdec/spec_decode/overlap.py): the draft actor drafts until stopped, while the
        engine's thread waits on the target group."""
        self._window_id += 1
        ref, sent = self._submit("draft_window", inputs, self._window_id)
        return _RayWindow(self, ref, sent, self._window_id)

    def _submit(self, method: str, inputs: list[ProposeInput], *extra):
        self.last_call = None
        if not self.available:
            raise DraftUnavailable("the draft group is being rebuilt")
        deltas = self.sender.encode(inputs)
        for i in inputs:
            self._tenants[i.seq_id] = i.tenant
        released, self._released = self._released, []
        blob = pack((deltas, released))
        try:
            ref = self.group.submit(method, blob, *extra)
        except GroupFailed as exc:
            self._lost(exc)
        return ref, len(blob)

    def _result(self, ref, sent_bytes: int) -> list[Proposal]:
        try:
            reply = self.group.get(ref, "draft")
        except (GroupFailed, ShardError) as exc:
            self._lost(exc)
        proposals, compute_s, self.graph_builds, stats = unpack(reply)
        if stats is not None:
            self.prefix_stats = stats
        self.last_call = CallStats(compute_s, sent_bytes + len(reply))
        return proposals

    def _lost(self, exc: Exception):
        # Its copies of the contexts may be half-updated: start from a fresh draft.
        log.error("draft group failed (%s); decoding plainly until it is back", exc)
        self._start_rebuild()
        raise DraftUnavailable(str(exc)) from exc

    def probe(self) -> None:
        """Health check between requests: a draft that died while nobody asked it for
        guesses is noticed (and rebuilt) here rather than on the next speculative round."""
        if self.available and not self.group.answers():
            log.error("draft group does not answer; rebuilding")
            self._start_rebuild()

    def accepted(self, seq_id: str, valid_len: int) -> None:
        """Nothing to send: the draft sees from the next context which guesses were kept."""

    def release(self, seq_id: str) -> None:
        """The sequence ended: the actor frees it with the next call, if it was ever sent
        (a request that never drafted leaves nothing to release there)."""
        sent = self.sender.sent(seq_id)
        tenant = self._tenants.pop(seq_id, None)
        if sent is None:
            return
        self._recent.append((tenant, np.asarray(sent, dtype=np.int64)))
        self.sender.forget(seq_id)
        self._released.append(seq_id)

    def forget_prefix_stats(self) -> None:
        """Counters from here on (the actor's run on: reported relative to now)."""
        self._stats_base = dict(self.prefix_stats or {})

    def prefix_report(self) -> dict | None:
        if self.prefix_stats is None:
            return None
        base = self._stats_base
        out = {k: v - base.get(k, 0) if isinstance(v, int) and k != "held_tokens" else v
               for k, v in self.prefix_stats.items()}
        out["hit_rate"] = round(out["tokens_reused"] / out["prompt_tokens"], 4) \
            if out.get("prompt_tokens") else None
        return out

    def held_prefix(self, context: list[int], tenant: str | None = None) -> int:
        """The longest prefix of `context` among the contexts of `tenant` the actor was sent
        (live, and the last ones released): about what its prefix cache will reuse."""
        ids = np.asarray(context, dtype=np.int64)
        held = [np.asarray(self.sender.sent(s), dtype=np.int64)
                for s, t in list(self._tenants.items())
                if t == tenant and self.sender.sent(s) is not None]
        held += [h for t, h in list(self._recent) if t == tenant]
        return max((common_prefix(ids, h) for h in held), default=0)

    def _start_rebuild(self) -> None:
        with self._lock:
            if self._rebuilding:
                return
            # Counted once per loss, and only once it is marked down: a reader never sees
            # a failure counted while the draft still reads as available.
            self._rebuilding = True
            self.failures += 1
        self.group.kill()
        self.sender.reset()  # the new draft holds no context: the next call sends it all
        self._released = []
        self._recent.clear()  # nor anything in its cache
        self.prefix_stats, self._stats_base = None, {}  # its counters start again
        threading.Thread(target=self._rebuild_loop, daemon=True, name="draft-rebuild").start()

    def _rebuild_loop(self) -> None:
        while not self._closed:
            try:
                self.stats = self.group.start()
                log.info("draft group is back")
                break
            except BaseException as exc:  # noqa: BLE001 - keep trying; requests run plainly
                if self._closed:  # shut down meanwhile (Ray may be gone too): stop quietly
                    return
                if not isinstance(exc, Exception):
                    raise
                log.warning("draft group rebuild failed: %s; retrying", exc)
                time.sleep(self.runtime.draft_retry_s)
        if self._closed:  # a group started just as we shut down: not ours to keep
            self.group.kill()
        with self._lock:
            self._rebuilding = False

    def shutdown(self) -> None:
        self._closed = True  # a rebuild in progress stops instead of outliving its owner
        self.group.kill()


class _RayWindow:
    """A draft window running in the draft actor (see RayDraftProposer.start_window)."""

    def __init__(self, proposer: RayDraftProposer, ref, sent, window_id: int) -> None:
        self.proposer, self.ref, self.sent, self.window_id = proposer, ref, sent, window_id

    def stop(self) -> None:
        group = self.proposer.group
        if group.actors:
            # The control thread marks it; the compute thread stops before its next forward.
            try:
                group.leader.stop_window.remote(self.window_id)
            except Exception:  # noqa: BLE001 - a dead actor: result() reports it
                pass

    def result(self) -> list[Proposal]:
        return self.proposer._result(self.ref, self.sent)
