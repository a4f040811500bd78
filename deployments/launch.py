"""Run the engine in this process with the target and draft as Ray actor groups
(`specdec generate --tp N`, benchmarks, tests): a private local Ray with its own temp dir
and ports, and a placement group for the groups."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from deployments.placement import bundles_for
from deployments.ray_backend import RayBackend
from specdec.assemble import AssembledEngine, assemble
from specdec.engine_config import EngineSpec

# Ray Serve's own upkeep, slowed down for small machines. Its controller runs a control loop
# every 0.1 s and replicas export metrics every 0.1 s: 16% of a core on an idle 2-core box,
# which slowed the engine's OpenMP regions (2 threads on 2 cores stall whenever either is
# preempted) by 15-20% (in-process engine beside an idle app: 8.1 -> 6.8 tokens/s). At 1 s
# the upkeep is 9% and the engine kept its speed. `make serve` sets the same.
# And Ray starts its worker processes (our target and draft shards among them) at nice 15:
# on a machine shared with anything at the default priority (a build, a test run) the
# shards then get about 3% of a core each, so a start-up that takes 90 s quiet had not
# finished its calibration after 5 minutes beside two CPU-bound processes. Serving is the
# machine's job here: its workers compete at the default priority.
QUIET_SERVE_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1",
                   "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
                   "RAY_worker_niceness": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_ray(num_cpus: int, metrics_export_port: int | None = None, quiet_serve: bool = False):
    """A Ray of our own: never joins or stops anyone else's cluster. With a metrics port,
    Prometheus text (ray_specdec_* included) is served on it. quiet_serve: Serve's upkeep
    at the intervals `make serve` uses (QUIET_SERVE_ENV)."""
    if quiet_serve:
        for key, value in QUIET_SERVE_ENV.items():
            os.environ.setdefault(key, value)
    tmp = tempfile.mkdtemp(prefix="sdray-", dir="/tmp")
    # The dashboard process runs even when its UI is off: give it a port of its own.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _temp_dir=tmp,
             dashboard_port=free_port(), _metrics_export_port=metrics_export_port,
             log_to_driver=False, runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}})
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def ray_engine(spec: EngineSpec, placement_timeout_s: float = 120.0):
    """An assembled engine whose target and draft run as actor groups in one placement
    group of a running Ray (see local_ray); everything is torn down on exit."""
    bundles, _, _ = bundles_for(spec)
    pg = placement_group(bundles, strategy=spec.runtime.placement_strategy)
    try:
        ray.get(pg.ready(), timeout=placement_timeout_s)
        built: AssembledEngine = assemble(spec, RayBackend(pg))
        with built:
            yield built
    finally:
        remove_placement_group(pg)
