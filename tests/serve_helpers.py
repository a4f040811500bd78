"""A served application on tiny fixture models, for tests that need HTTP and Ray Serve
but not a real model: it starts in seconds and generates in milliseconds."""

from __future__ import annotations

import contextlib
import os
import re

import httpx
from ray import serve

from deployments.app import build_app
from specdec.engine.spec import EngineSpec
from specdec.ports import free_port


def tiny_app_args(target, draft, **extra) -> dict:
    shard = {"dtype": "float32", "threads": 1, "resources": {"num_cpus": 0.25}}
    args = {"model_name": "tiny", "target": {"model": str(target), **shard},
            "draft": {"model": str(draft), **shard},
            "runtime": {"max_slots": 8, "max_len": 128, "gloo_socket_ifname": "lo",
                        "collective_timeout_s": 10, "step_timeout_s": 20,
                        "draft_retry_s": 0.5},
            "max_waiting": 16, "default_max_tokens": 16, "replica_cpus": 0.1,
            "ingress_cpus": 0.1, "warmup": False}
    for key, value in extra.items():
        args[key] = {**args[key], **value} if isinstance(value, dict) and key in args \
            else value
    return args


@contextlib.contextmanager
def serve_app(args: dict, name: str = "tiny"):
    """Serve the app on a free port of a running Ray (see deployments.launch.local_ray);
    yields its base URL, deletes it after."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(args), name=name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.delete(name)
        serve.shutdown()


@contextlib.contextmanager
def env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


RUNTIME = {"max_slots": 8, "max_len": 128, "gloo_socket_ifname": "lo"}


def tiny_spec(target_path, draft_path, target=None, draft=None, runtime=None,
              **kw) -> EngineSpec:
    shard = {"dtype": "float32", "threads": 1, "resources": {"num_cpus": 0.25}}
    return EngineSpec.model_validate({
        "target": {"model": str(target_path), **shard, **(target or {})},
        "draft": {"model": str(draft_path), **shard, **(draft or {})},
        "runtime": {**RUNTIME, **(runtime or {})}, "warmup": False, **kw})


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Prometheus text -> {(name, labels): value} for our series."""
    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        m = re.match(r"^(ray_specdec_\w+)\{(.*)\} (\S+)$", line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def sum_of(series: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in series.items() if n == name and set(labels.items()) <= ls)
