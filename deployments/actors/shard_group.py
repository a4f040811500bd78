"""Start, call and tear down one tensor-parallel group of `ModelShard` actors."""

from __future__ import annotations

import logging
import time
import uuid

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.actors.shard import ModelShard
from specdec.engine.spec import ModelGroupSpec, RuntimeSpec

log = logging.getLogger(__name__)


class GroupFailed(RuntimeError):
    """A rank died, a collective broke or a call timed out; the group must be rebuilt."""


class ShardError(RuntimeError):
    """The call raised inside rank 0 while every rank stayed up: a failed step, not a lost
    group (the group keeps serving; the step's requests fail)."""


class ShardGroup:
    def __init__(self, role: str, cfg: ModelGroupSpec, runtime: RuntimeSpec,
                 placement_group: PlacementGroup | None = None,
                 bundle_indices: list[int] | None = None, extra: dict | None = None) -> None:
        self.role, self.cfg, self.runtime = role, cfg, runtime
        self.pg, self.bundles = placement_group, bundle_indices
        self.extra = {"step": cfg.step, **(extra or {})}
        self.actors: list = []
        self.followers: list = []
        self.stats: list[dict] = []
        self.generation = 0  # how many times the group was (re)built
        # Where the last start's time went (s): processes up, ranks joined with weights
        # loaded (load_s: the slowest rank's weight load), in all.
        self.last_start: dict[str, float] = {}
        self._uid = uuid.uuid4().hex[:8]

    @property
    def leader(self):
        return self.actors[0]

    def _options(self, rank: int) -> dict:
        res = self.cfg.resources
        # Named so operators (and tests) can find a replica's shards: specdec-<role>-<id>-r<rank>
        opts: dict = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus,
                      "resources": res.resources or None, "max_restarts": 0,
                      "name": f"specdec-{self.role}-{self._uid}-g{self.generation}-r{rank}"}
        # OpenMP reads its thread count from the environment on Ray's executor threads:
        # set it there, or a fractional-CPU actor computes on one thread (see shard.py).
        threads = str(self.cfg.threads_per_rank())
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        if self.runtime.gloo_socket_ifname:
            env["GLOO_SOCKET_IFNAME"] = self.runtime.gloo_socket_ifname
        opts["runtime_env"] = {"env_vars": env}
        if self.pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=self.bundles[rank] if self.bundles else -1)
        return opts

    def start(self) -> list[dict]:
        t0 = time.monotonic()
        world = self.cfg.tp
        threads = self.cfg.threads_per_rank()
        # Create every rank before waiting on any: ranks block in setup until all join.
        self.actors = [ModelShard.options(**self._options(r)).remote(
            self.role, self.cfg.model, self.cfg.dtype, r, world, self.runtime.kv_slots(),
            self.runtime.max_len, threads, self.extra) for r in range(world)]
        try:
            ip, port = ray.get(self.leader.address.remote(), timeout=self.runtime.init_timeout_s)
            t_up = time.monotonic()
            init = f"tcp://{ip}:{port}"
            self.stats = ray.get([a.setup.remote(init, self.runtime.collective_timeout_s)
                                  for a in self.actors], timeout=self.runtime.init_timeout_s)
        except Exception as exc:
            self.kill()
            raise GroupFailed(f"{self.role} group did not start: {exc}") from exc
        self.followers = [a.follow.remote() for a in self.actors[1:]]
        self.generation += 1
        done = time.monotonic()
        self.last_start = {"process_s": round(t_up - t0, 2), "setup_s": round(done - t_up, 2),
                           "load_s": round(max(s.get("load_s", 0.0) for s in self.stats), 2),
                           "total_s": round(done - t0, 2)}
        log.info("%s group of %d ready in %.1fs (%s)", self.role, world, done - t0,
                 self.last_start)
        return self.stats

    def call(self, method: str, *args, timeout: float | None = None):
        return self.get(self.submit(method, *args), method, timeout)

    def submit(self, method: str, *args):
        """Start a call on rank 0 without waiting (get() it later)."""
        if not self.actors:
            raise GroupFailed(f"{self.role} group is not running")
        return getattr(self.leader, method).remote(*args)

    def get(self, ref, method: str, timeout: float | None = None):
        """The result of a submitted call; errors sorted as a failed call (ShardError) or a
        lost group (GroupFailed)."""
        try:
            return ray.get(ref, timeout=timeout or self.runtime.step_timeout_s)
        except ray.exceptions.RayTaskError as exc:
            # The method raised. If every rank is still up (no follower loop ended, the
            # leader answers), the group is intact; else a collective broke under it.
            if self.alive() and self.answers():
                raise ShardError(f"{self.role} {method} raised: "
                                 f"{type(exc.cause).__name__}: {exc.cause}") from exc
            raise GroupFailed(f"{self.role} group failed: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:  # actor death, timeout: fatal
            raise GroupFailed(f"{self.role} group failed: {type(exc).__name__}: {exc}") from exc

    def answers(self, timeout_s: float = 10.0) -> bool:
        """Every rank is up: no follower loop ended, and the leader answers a ping."""
        if not self.actors or not self.alive():
            return False
        try:
            ray.get(self.leader.pid.remote(), timeout=timeout_s)
            return True
        except Exception:  # noqa: BLE001
            return False

    def alive(self) -> bool:
        if not self.actors:
            return False
        ready, _ = ray.wait(self.followers, timeout=0) if self.followers else ([], [])
        # A follower's loop only returns if the group broke (or was stopped).
        return not ready

    def kill(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors, self.followers = [], []
