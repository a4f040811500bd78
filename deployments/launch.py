"""Run the engine in this process with the target and draft as Ray actor groups
(`specdec generate --tp N`, benchmarks, tests): a private local Ray with its own temp dir
and ports, and a placement group for the groups."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from deployments.actors.placement import bundles_for
from deployments.actors.ray_backend import RayBackend
from specdec.engine.assemble import AssembledEngine, assemble
from specdec.engine.spec import EngineSpec
from specdec.ports import free_port

# Ray Serve's own upkeep, slowed down for small machines: its controller's control loop and
# the replicas' metric exports run every 0.1 s by default, a visible share of a few cores,
# and the engine's OpenMP regions stall whenever one of their threads is preempted. `make serve`
# sets the same (docs/tuning-cpu.md).
# And Ray starts its worker processes (our target and draft shards among them) at nice 15:
# beside anything at the default priority (a build, a test run) the shards then get a few
# percent of a core each and a start-up does not finish. Serving is the machine's job here:
# its workers compete at the default priority.
QUIET_SERVE_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1",
                   "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
                   "RAY_worker_niceness": "0"}




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
