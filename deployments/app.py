"""`build_app(args)`: serve_config.yaml's import path. The args are validated by pydantic
here, at deploy time, so a bad config fails with a message naming the field."""

from __future__ import annotations

import os

from pydantic import ValidationError
from ray import serve

from deployments.actors.placement import bundles_for
from deployments.app_config import AppArgs
from deployments.engine_server import EngineServer
from deployments.ingress import Ingress
from specdec.errors import ConfigError


def parse_args(args: dict) -> AppArgs:
    try:
        return AppArgs.model_validate(args or {})
    except ValidationError as exc:
        # The engine's keys are written flat in the YAML: name them as written.
        lines = [f"  {'.'.join(str(x) for x in _as_written(e['loc'])) or '(root)'}: "
                 f"{e['msg']}" for e in exc.errors()]
        raise ConfigError("invalid specdec application args:\n" + "\n".join(lines)) from None


def _as_written(loc: tuple) -> tuple:
    return loc[1:] if loc[:1] == ("engine",) else loc


def build_app(args: dict):
    cfg = parse_args(args)
    cfg.keys(os.environ)  # a set but empty or shared key fails the deploy, not later
    bundles, _, _ = bundles_for(cfg.engine, replica_cpus=cfg.replica_cpus)
    auto = cfg.engine_autoscaling
    routing = {}
    if cfg.engine_routing == "prefix_affinity":
        routing["request_router_config"] = {
            "request_router_class": "deployments.prefix_router:PrefixAffinityRouter",
            # About as many prompts per replica as its slots hold conversations.
            "request_router_kwargs": {"remembered": 2 * cfg.engine.runtime.kv_slots()}}
    engine = serve.deployment(EngineServer, name="Engine").options(
        ray_actor_options={"num_cpus": cfg.replica_cpus},
        placement_group_bundles=bundles,
        placement_group_strategy=cfg.engine.runtime.placement_strategy,
        max_ongoing_requests=cfg.engine_max_ongoing(),
        autoscaling_config={
            "min_replicas": auto.min_replicas, "max_replicas": auto.max_replicas,
            "target_ongoing_requests": auto.target_ongoing_requests,
            "upscale_delay_s": auto.upscale_delay_s,
            "downscale_delay_s": auto.downscale_delay_s},
        health_check_period_s=10, health_check_timeout_s=60, **routing,
        # A replica being stopped finishes what it holds; checked every half second, so a
        # drained replica goes at once.
        graceful_shutdown_timeout_s=cfg.drain_timeout_s, graceful_shutdown_wait_loop_s=0.5,
    ).bind(cfg.engine.model_dump(), cfg.replica_cpus)
    return Ingress.options(num_replicas=cfg.ingress_replicas,
                          max_ongoing_requests=cfg.ingress_max_ongoing_requests,
                          # Outlives the engine's drain: a request the engine could not
                          # finish in time is answered with an error, not cut off.
                          graceful_shutdown_timeout_s=cfg.drain_timeout_s + 15,
                          graceful_shutdown_wait_loop_s=0.5,
                          ray_actor_options={"num_cpus": cfg.ingress_cpus}).bind(
        engine, cfg.model_dump())
