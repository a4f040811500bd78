"""The Ray driver `specdec serve` runs in a session of its own: `serve run CONFIG` (the same
config schema, the same local Ray or RAY_ADDRESS), with a stop that drains.

`serve run` stops on SIGINT with `serve.shutdown()`, which kills the HTTP proxies at once:
a request in flight loses its connection mid-reply. Here a SIGINT first deletes each
application the way `serve.delete` does: the proxies stay up, the replicas stop taking new
requests and finish the ones they hold (each deployment's graceful_shutdown_timeout_s),
and only then is Serve shut down and Ray with it.
"""

from __future__ import annotations

import signal
import sys
import time


def main(config_path: str) -> int:
    import ray
    import yaml
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    with open(config_path) as f:
        config = ServeDeploySchema.model_validate(yaml.safe_load(f))
    ray.init(namespace=SERVE_NAMESPACE)
    # Ray's core installs a handler that dumps the stack and aborts on SIGTERM; the parent
    # sends SIGINT, but a SIGTERM aimed at this process alone should stop it the same way.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # Started from a shell's background job (`specdec serve ... &` in a script), SIGINT
    # comes in ignored, and Python then installs no handler of its own: the parent's stop
    # would go unheard. The stop is ours to hear, whatever the shell did.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    client = serve_api.serve_start(
        http_options=config.http_options.model_dump(), proxy_location=config.proxy_location,
        grpc_options=gRPCOptions(**config.grpc_options.model_dump()),
        controller_options=config.controller_options)
    names = [app.name for app in config.applications]
    try:
        client.deploy_apps(config, _blocking=False)
        print(f"specdec: deployed {', '.join(names)} from {config_path}", flush=True)
        while True:
            time.sleep(10)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent kills on a second signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        t0 = time.monotonic()
        print("specdec: draining: no new requests, finishing those in flight", flush=True)
        for name in names:
            serve.delete(name, _blocking=True)
        print(f"specdec: drained in {time.monotonic() - t0:.1f} s; shutting down", flush=True)
        serve.shutdown()
        ray.shutdown()
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
