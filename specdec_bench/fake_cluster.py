"""Ray's own autoscaler on this one machine, shaped like the cluster users deploy.

The node types come from cluster/ray-cluster.yaml and the application from
serve_config.gpu.yaml (what cluster/rayservice.yaml embeds too), mapped, not copied: the same
node type names, custom resources (target_gpu, draft_gpu), min and max workers, shard
layout (tp, resources by name, placement strategy) and Serve autoscaling settings. What
cannot run here is scaled, each for a stated reason:
- GPUs are dropped: the custom resources already steer each shard to its node type, and
  the fixture models run on CPU;
- a node's CPUs are capped (a 48-CPU node would start a worker pool sized for 48 cores on
  this host) and each shard asks for a quarter of one;
- times run `time_scale` times faster (upscale and downscale delays, the autoscaler's idle
  timeout), and the per-replica load target is scaled with the slots a replica holds here.

Ray's fake multi-node provider (RAY_FAKE_CLUSTER) runs the real autoscaler (monitor.py)
and launches each "node" as a raylet of that node type's resources on this host.
`ray.cluster_utils.AutoscalingCluster` does the same but starts and stops by stopping
every Ray on the machine, other people's included; here the head is ours
(its own ports and temp dir), and at the end every process it started is ended by its
PID: the head's processes and all their descendants, the nodes the
autoscaler launched included.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import yaml

from specdec.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "cluster" / "ray-cluster.yaml"
GPU_CONFIG = ROOT / "serve_config.gpu.yaml"
HEAD_TYPE = "ray.head.default"  # the fake provider's name for the head
# Resources every node has: a node type is told by its custom ones (target_gpu, draft_gpu).
_STANDARD = ("CPU", "GPU", "memory", "object_store_memory")


@dataclasses.dataclass(frozen=True)
class Scaling:
    time_scale: float = 20.0      # delays and timeouts this many times shorter
    node_cpus: float = 2.0        # at most this many CPUs a fake node
    shard_cpus: float = 0.25      # each model shard (the fixtures need little)
    head_cpus: int = 2            # Serve's controller, proxy and ingress
    max_replicas: int = 2         # what 2 cores can hold
    max_slots: int = 4            # a replica's KV slots here
    max_len: int = 256


def node_types(cluster: dict, scaling: Scaling = Scaling()) -> dict:
    """The worker node types of a Ray cluster config, as fake nodes (see module doc)."""
    out = {}
    for name, t in cluster["available_node_types"].items():
        if name == cluster["head_node_type"]:
            continue
        res = {k: v for k, v in t.get("resources", {}).items() if k != "GPU"}
        res["CPU"] = min(res.get("CPU", 1), scaling.node_cpus)
        res["object_store_memory"] = 100 * 2**20  # shared memory is tight on small hosts
        out[name] = {"resources": res, "node_config": {},
                     "min_workers": t.get("min_workers", 0),
                     "max_workers": t.get("max_workers", cluster.get("max_workers", 1))}
    return out


def autoscaler_config(cluster: dict, gcs_address: str, scaling: Scaling = Scaling()) -> dict:
    """A complete autoscaler config for the fake provider (the defaults file that the
    provider would merge in is not shipped in Ray's wheel)."""
    idle = cluster.get("idle_timeout_minutes", 5) / scaling.time_scale
    return {
        "cluster_name": "specdec-local", "max_workers": cluster.get("max_workers", 8),
        "upscaling_speed": cluster.get("upscaling_speed", 1.0), "idle_timeout_minutes": idle,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True,
                     "gcs_address": gcs_address},
        "available_node_types": {
            HEAD_TYPE: {"resources": {"CPU": scaling.head_cpus}, "node_config": {},
                        "max_workers": 0},
            **node_types(cluster, scaling)},
        "head_node_type": HEAD_TYPE, "auth": {}, "docker": {},
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [], "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": []}


def app_args(serve_config: dict, target: Path, draft: Path, model_name: str = "tiny",
             scaling: Scaling = Scaling()) -> dict:
    """The GPU application's args with fixture models on CPU (see module doc)."""
    args = copy.deepcopy(serve_config["applications"][0]["args"])
    for role, model in (("target", target), ("draft", draft)):
        g = args[role]
        g.update(model=str(model), dtype="float32", threads=1)
        for gpu_only in ("step", "q_top_m"):
            g.pop(gpu_only, None)
        res = g.setdefault("resources", {})
        res.update(num_gpus=0, num_cpus=scaling.shard_cpus)
    runtime = args.setdefault("runtime", {})
    slots = runtime.get("max_slots", scaling.max_slots)
    runtime.update(max_slots=scaling.max_slots, max_len=scaling.max_len,
                   gloo_socket_ifname="lo")
    auto = args.setdefault("engine_autoscaling", {})
    auto["max_replicas"] = min(auto.get("max_replicas", 1), scaling.max_replicas)
    # The load that asks for another replica, as a share of a replica's slots.
    share = auto.get("target_ongoing_requests", 2) / slots
    auto["target_ongoing_requests"] = max(1.0, share * scaling.max_slots)
    for key, default in (("upscale_delay_s", 30.0), ("downscale_delay_s", 600.0)):
        auto[key] = auto.get(key, default) / scaling.time_scale
    args.update(model_name=model_name, overlap="off",
                default_max_tokens=32, max_tokens_per_step=scaling.max_len,
                replica_cpus=0.1, ingress_cpus=0.1)
    return args


class FakeCluster:
    """A head of our own with the autoscaler, on its own ports and temp dir; the driver
    connected. Use as a context manager."""

    def __init__(self, cluster: dict | None = None, scaling: Scaling = Scaling()) -> None:
        self.cluster = cluster or yaml.safe_load(CLUSTER_YAML.read_text())
        self.scaling = scaling
        self.tmp = tempfile.mkdtemp(prefix="sdfake-", dir="/tmp")
        self._head = None
        self._saved_env: dict[str, str | None] = {}

    def __enter__(self) -> FakeCluster:
        import ray
        import ray._private.services as services
        from ray.cluster_utils import Cluster

        # The monitor (the autoscaler) inherits these from this process: the fake provider
        # refuses to run without the first; the second makes it look every second.
        # The third: every node exports its metrics each second (for a Prometheus beside).
        for key, value in (("RAY_FAKE_CLUSTER", "1"), ("AUTOSCALER_UPDATE_INTERVAL_S", "1"),
                           ("RAY_metrics_report_interval_ms", "1000"),
                           ("RAY_TMPDIR", self.tmp)):  # even Ray's address file stays ours
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        port = free_port()
        config = autoscaler_config(self.cluster, f"{services.get_node_ip_address()}:{port}",
                                   self.scaling)
        path = Path(self.tmp) / "autoscaler.json"
        path.write_text(json.dumps(config))
        os.makedirs(Path(self.tmp) / "ray")
        try:
            self._head = Cluster(initialize_head=True, head_node_args={
                "num_cpus": self.scaling.head_cpus, "gcs_server_port": port,
                "temp_dir": str(Path(self.tmp) / "ray"), "include_dashboard": False,
                "dashboard_port": free_port(), "dashboard_agent_listen_port": 0,
                "autoscaling_config": str(path)})
            ray.init(address=self._head.address,
                     runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}})
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def nodes(self) -> dict[str, int]:
        """Alive nodes by type (the custom resource each worker type carries)."""
        import ray

        worker_types = {name: [k for k in t["resources"] if k not in _STANDARD]
                        for name, t in node_types(self.cluster, self.scaling).items()}
        count: dict[str, int] = {}
        for n in ray.nodes():
            if not n["Alive"]:
                continue
            kind = next((name for name, keys in worker_types.items()
                         if any(k in n["Resources"] for k in keys)), "head")
            count[kind] = count.get(kind, 0) + 1
        return count

    def metrics_addresses(self) -> list[str]:
        """Each alive node's metrics export address: what Ray's head writes into the file
        cluster/prometheus.yml discovers nodes by (the head's dashboard, which writes it,
        is not started here)."""
        import ray

        return [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes()
                if n["Alive"] and n.get("MetricsExportPort")]

    def __exit__(self, *exc) -> None:
        import ray

        try:
            # Taken before the head goes: its processes and all their descendants (the
            # nodes the autoscaler launched are its monitor's children, started without a
            # reaper, and outlive it; Ray's workers rename themselves, so a command line
            # does not tell them).
            ours = self._head_descendants()
            try:
                ray.shutdown()
                if self._head is not None:
                    self._head.shutdown()
            finally:
                _end(ours)
        finally:
            for key, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _head_descendants(self) -> list:
        import psutil

        if self._head is None:
            return []
        out = []
        for infos in self._head.head_node.all_processes.values():
            for info in infos:
                try:
                    p = psutil.Process(info.process.pid)
                    out += [p, *p.children(recursive=True)]
                except psutil.Error:
                    pass
        return out


def _end(procs: list, wait_s: float = 5.0) -> None:
    """Terminate, then kill, what is still alive of `procs` (processes this cluster
    started), each by its PID."""
    import psutil

    me = os.getpid()
    procs = [p for p in procs if p.pid != me]
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=wait_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


def load_gpu_config() -> dict:
    return yaml.safe_load(GPU_CONFIG.read_text())
