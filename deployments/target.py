"""The tensor-parallel target as a `TargetRunner`: the engine calls it like the local one.

One call per step enters the group (rank 0); start/end-of-sequence notices ride along with
the next step instead of costing calls of their own. A failed step (a rank died, a
collective broke, the call timed out) tears the group down and builds a new one before the
error reaches the engine, which then fails the requests that were in flight; the next
request finds a working group.
"""

from __future__ import annotations

import logging

from deployments.shard_group import GroupFailed, ShardError, ShardGroup
from specdec.engine_config import ModelGroupConfig, RuntimeConfig
from specdec.request import TargetLost
from specdec.sampling import SamplingParams
from specdec.target_runner import Head, Resolved, TargetResult, TargetRow
from specdec.wire import CallStats, payload_bytes

log = logging.getLogger(__name__)


class TargetUnavailable(TargetLost):
    pass


class RayTargetRunner:
    def __init__(self, cfg: ModelGroupConfig, runtime: RuntimeConfig,
                 placement_group=None, bundle_indices: list[int] | None = None) -> None:
        self.group = ShardGroup("target", cfg, runtime, placement_group, bundle_indices)
        self.max_slots, self.max_len = runtime.max_slots, runtime.max_len
        self.stats = self.group.start()
        self.vocab_size = self.stats[0]["vocab_size"]
        self._started: dict[str, SamplingParams] = {}
        self._ended: list[str] = []
        self.failures = 0
        self.last_call: CallStats | None = None

    def start_sequence(self, seq_id: str, params: SamplingParams) -> None:
        self._started[seq_id] = params

    def end_sequence(self, seq_id: str) -> None:
        if self._started.pop(seq_id, None) is None:
            self._ended.append(seq_id)

    def step(self, rows: list[TargetRow]) -> list[TargetResult]:
        if not self.group.actors:
            self._rebuild()
        started, ended = self._started, self._ended
        self._started, self._ended = {}, []
        results, compute_s = self._call("target_step", rows, started, ended)
        self.last_call = CallStats(compute_s, payload_bytes((rows, started, ended))
                                   + payload_bytes(results))
        return results

    def resolve(self, heads: dict[str, Head | None]) -> dict[str, Resolved]:
        """Overlap: the deferred positions of the last step (held on rank 0)."""
        return self._call("target_resolve", heads)

    def _call(self, method: str, *args):
        try:
            return self.group.call(method, *args)
        except ShardError as exc:  # the step failed; the group is intact and keeps serving
            raise RuntimeError(str(exc)) from exc
        except GroupFailed as exc:
            self.failures += 1
            log.error("target group failed (%s); rebuilding", exc)
            self.group.kill()
            try:
                self._rebuild()
            except Exception as rebuild_exc:  # noqa: BLE001 - tried again on the next step
                log.error("target group rebuild failed: %s", rebuild_exc)
            raise TargetUnavailable(str(exc)) from exc

    def _rebuild(self) -> None:
        self.stats = self.group.start()

    def shutdown(self) -> None:
        self.group.kill()
