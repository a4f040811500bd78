"""The draft model as its own Ray actor group, behind the engine's `Proposer` protocol.

Its KV slots live in the actor. "How many were kept" and "sequence finished" notices ride
along with the next propose call. A lost draft never fails a request: proposals come back
empty (the engine decodes those rounds plainly) while the group is rebuilt in the
background, and speculation resumes once it is back (sequences re-prefill their context in
the new draft on their next round).
"""

from __future__ import annotations

import logging
import threading
import time

from deployments.config import DraftGroupConfig, GroupRuntimeConfig
from deployments.shard_group import GroupFailed, ShardGroup
from specdec.proposers import Proposal, ProposeInput

log = logging.getLogger(__name__)


class RayDraftProposer:
    name = "draft"

    def __init__(self, cfg: DraftGroupConfig, runtime: GroupRuntimeConfig,
                 placement_group=None, bundle_indices: list[int] | None = None) -> None:
        self.group = ShardGroup("draft", cfg, runtime, placement_group, bundle_indices,
                                extra={"sampling": cfg.sampling, "vocab_limit": cfg.vocab_limit,
                                       "confidence_threshold": cfg.confidence_threshold})
        self.runtime = runtime
        self.stats = self.group.start()
        self._accepted: dict[str, int] = {}
        self._released: list[str] = []
        self._lock = threading.Lock()
        self._rebuilding = False
        self.failures = 0

    @property
    def available(self) -> bool:
        return bool(self.group.actors) and not self._rebuilding

    def propose(self, inputs: list[ProposeInput]) -> list[Proposal]:
        if not self.available:
            return [Proposal([]) for _ in inputs]
        accepted, released = self._accepted, self._released
        self._accepted, self._released = {}, []
        try:
            return self.group.call("draft_propose", inputs, accepted, released)
        except GroupFailed as exc:
            self.failures += 1
            log.error("draft group failed (%s); decoding plainly until it is back", exc)
            self._start_rebuild()
            return [Proposal([]) for _ in inputs]

    def accepted(self, seq_id: str, valid_len: int) -> None:
        self._accepted[seq_id] = valid_len

    def release(self, seq_id: str) -> None:
        self._accepted.pop(seq_id, None)
        self._released.append(seq_id)

    def _start_rebuild(self) -> None:
        with self._lock:
            if self._rebuilding:
                return
            self._rebuilding = True
        self.group.kill()
        self._accepted, self._released = {}, []  # the new draft starts with empty slots
        threading.Thread(target=self._rebuild_loop, daemon=True, name="draft-rebuild").start()

    def _rebuild_loop(self) -> None:
        while True:
            try:
                self.stats = self.group.start()
                log.info("draft group is back")
                break
            except Exception as exc:  # noqa: BLE001 - keep trying; requests run plainly
                log.warning("draft group rebuild failed: %s; retrying", exc)
                time.sleep(self.runtime.draft_retry_s)
        with self._lock:
            self._rebuilding = False

    def shutdown(self) -> None:
        self.group.kill()
