"""The tensor-parallel target as a `TargetRunner`: the engine calls it like the local one.

One call per step enters the group (rank 0); start/end-of-sequence notices ride along with
the next step instead of costing calls of their own. A failed step (a rank died, a
collective broke, the call timed out) tears the group down and reaches the engine at once,
which fails the requests that were in flight (503) within a second of the loss; a new group
is built in the background meanwhile (mostly weight loading: see `last_start`), new
requests are refused with 503 until it is up, and the first request after it is served by
the new group. The requests fail first so that noticing a loss never waits for a rebuild.
"""

from __future__ import annotations

import logging
import threading
import time

from deployments.actors.shard_group import GroupFailed, ShardError, ShardGroup
from specdec.engine.spec import ModelGroupSpec, RuntimeSpec
from specdec.errors import TargetLost
from specdec.model.step.sampling import SamplingParams
from specdec.spec_decode.calls import CallStats
from specdec.spec_decode.target_runner import Head, Resolved, TargetResult, TargetRow
from specdec.spec_decode.wire import pack, unpack

log = logging.getLogger(__name__)


class TargetUnavailable(TargetLost):
    pass


class RayTargetRunner:
    def __init__(self, cfg: ModelGroupSpec, runtime: RuntimeSpec,
                 placement_group=None, bundle_indices: list[int] | None = None) -> None:
        self.group = ShardGroup("target", cfg, runtime, placement_group, bundle_indices)
        self.max_slots, self.max_len = runtime.kv_slots(), runtime.max_len
        self.stats = self.group.start()
        self.vocab_size = self.stats[0]["vocab_size"]
        self._started: dict[str, SamplingParams] = {}
        self._ended: list[str] = []
        self._copies: list[tuple[int, int, int]] = []
        self.failures = 0
        self._closed = False
        self.last_call: CallStats | None = None
        self.graph_builds = 0  # the group's, as of its last reply
        self._lock = threading.Lock()
        self._rebuilding: threading.Thread | None = None
        self.down_since: float | None = None  # time.monotonic() of the loss, while down
        self.rebuild_failures = 0              # in a row; the replica is unhealthy past 3
        self.last_rebuild_s: float | None = None

    @property
    def down(self) -> str | None:
        """Why the target cannot take requests now, or None when it can."""
        if self.down_since is None:
            return None
        return (f"the target group is being rebuilt after a lost worker "
                f"({time.monotonic() - self.down_since:.0f} s so far"
                + (f", {self.rebuild_failures} failed attempts" if self.rebuild_failures
                   else "") + ")")

    def start_sequence(self, seq_id: str, params: SamplingParams) -> None:
        self._started[seq_id] = params

    def end_sequence(self, seq_id: str) -> None:
        if self._started.pop(seq_id, None) is None:
            self._ended.append(seq_id)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Rides along with the next step, done before its forward."""
        self._copies.append((src, dst, n))

    def step(self, rows: list[TargetRow]) -> list[TargetResult]:
        if self.down_since is not None:
            raise TargetUnavailable(self.down)
        started, ended, copies = self._started, self._ended, self._copies
        self._started, self._ended, self._copies = {}, [], []
        sent = pack((rows, started, ended, copies))
        reply = self._call("target_step", sent)
        results, compute_s, self.graph_builds = unpack(reply)
        self.last_call = CallStats(compute_s, len(sent) + len(reply))
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
            log.error("target group failed (%s); failing its requests now, rebuilding it "
                      "in the background", exc)
            self._start_rebuild()
            raise TargetUnavailable(str(exc)) from exc

    def _start_rebuild(self) -> None:
        with self._lock:
            if self.down_since is not None:
                return
            # Counted once per loss, as it is marked down (never seen counted but up).
            self.down_since = time.monotonic()
            self.failures += 1
        self.group.kill()
        # Sequences the engine still holds die with the group; the new one starts clean.
        self._started, self._ended, self._copies = {}, [], []
        self._rebuilding = threading.Thread(target=self._rebuild_loop, daemon=True,
                                            name="target-rebuild")
        self._rebuilding.start()

    def _rebuild_loop(self) -> None:
        while True:
            if self._closed:
                return
            try:
                self.stats = self.group.start()
                break
            except BaseException as exc:  # noqa: BLE001 - keep trying; requests get 503
                if self._closed:  # shut down meanwhile (Ray may be gone too): stop quietly
                    return
                if not isinstance(exc, Exception):
                    raise
                self.rebuild_failures += 1
                log.error("target group rebuild failed (%d): %s", self.rebuild_failures, exc)
                time.sleep(min(2.0 * self.rebuild_failures, 30.0))
        self.last_rebuild_s = time.monotonic() - self.down_since
        log.info("target group rebuilt %.1f s after the loss (%s)", self.last_rebuild_s,
                 self.group.last_start)
        self.rebuild_failures = 0
        self.down_since = None

    def wait_rebuilt(self, timeout_s: float) -> bool:
        """Block until a rebuild in progress is done (tests, shutdown)."""
        thread = self._rebuilding
        if thread is not None:
            thread.join(timeout_s)
        return self.down_since is None

    def shutdown(self) -> None:
        self._closed = True  # a rebuild in progress stops instead of outliving its owner
        self.group.kill()
