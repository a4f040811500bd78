"""Run the engine in this process with the target and draft as Ray actor groups
(`specdec generate --tp N`, tests): a private local Ray with its own temp dir and ports."""

from __future__ import annotations

import contextlib
import shutil
import tempfile

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from deployments.config import DraftGroupConfig, GroupRuntimeConfig, ModelGroupConfig
from deployments.draft import RayDraftProposer
from deployments.placement import bundles_for
from deployments.target import RayTargetRunner
from specdec.build import eos_ids_of
from specdec.engine import Engine, EngineConfig
from specdec.generate import load_tokenizer
from specdec.hub import resolve
from specdec.proposers import NgramProposer, check_same_tokenizer


@contextlib.contextmanager
def local_ray(num_cpus: int, metrics_export_port: int | None = None):
    """A Ray of our own: never joins or stops anyone else's cluster. With a metrics port,
    Prometheus text (ray_specdec_* included) is served on it."""
    import socket

    tmp = tempfile.mkdtemp(prefix="sdray-", dir="/tmp")
    with socket.socket() as s:  # the dashboard process runs even when its UI is off
        s.bind(("127.0.0.1", 0))
        dashboard_port = s.getsockname()[1]
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _temp_dir=tmp,
             dashboard_port=dashboard_port, _metrics_export_port=metrics_export_port,
             log_to_driver=False, runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}})
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


class RayEngineHandle(contextlib.AbstractContextManager):
    """An Engine whose target and draft run as Ray actor groups in one placement group."""

    def __init__(self, target: ModelGroupConfig, draft: DraftGroupConfig | None,
                 runtime: GroupRuntimeConfig, engine_config: EngineConfig | None = None,
                 placement_timeout_s: float = 120.0) -> None:
        target_path = resolve(target.model)
        if draft is not None:
            check_same_tokenizer(target_path, resolve(draft.model))
        bundles, t_idx, d_idx = bundles_for(target, draft)
        self.pg = placement_group(bundles, strategy=runtime.placement_strategy)
        ray.get(self.pg.ready(), timeout=placement_timeout_s)
        self.target = RayTargetRunner(target, runtime, self.pg, t_idx)
        self.draft = RayDraftProposer(draft, runtime, self.pg, d_idx) if draft else None
        self.tokenizer = load_tokenizer(target_path)
        proposers = {"ngram": NgramProposer()}
        if self.draft is not None:
            proposers["draft"] = self.draft
        self.engine = Engine(self.target, proposers, self.tokenizer,
                             eos_ids_of(target_path, self.tokenizer), engine_config)

    def close(self) -> None:
        self.target.shutdown()
        if self.draft is not None:
            self.draft.shutdown()
        remove_placement_group(self.pg)

    def __exit__(self, *exc) -> None:
        self.close()


def generate_with_ray(args, method: str, k: int, run) -> int:
    """`specdec generate --tp N`: a private local Ray, the target as N shard actors and the
    draft as its own group, torn down after the one request."""
    import time

    n_actors = args.tp + (args.draft_tp if method == "draft" else 0)
    runtime = GroupRuntimeConfig(max_slots=1, max_len=args.max_len, gloo_socket_ifname="lo")
    target = ModelGroupConfig(model=args.target, tp=args.tp, dtype=args.dtype)
    draft = DraftGroupConfig(model=args.draft, tp=args.draft_tp, dtype=args.dtype) \
        if method == "draft" else None
    with local_ray(num_cpus=max(n_actors, 2)):
        t0 = time.perf_counter()
        with RayEngineHandle(target, draft, runtime) as h:
            return run(h.engine, h.tokenizer, time.perf_counter() - t0)
