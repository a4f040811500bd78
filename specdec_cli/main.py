"""`specdec`: fetch the offline models, generate, benchmark."""

from __future__ import annotations

import argparse
import sys
from typing import get_args

from specdec.vocabulary import DraftSampling, OverlapMode
from specdec_cli.bench import DTYPES, add_bench


def _models_list(args) -> int:
    from specdec.pack import offline as pack

    print(f"cache: {pack.cache_dir()}")
    print(f"{'name':22} {'status':10} description")
    for name, m in pack.PACK.items():
        status = "ready" if pack.is_fetched(name) else "missing"
        print(f"{name:22} {status:10} {m.description}")
    print("groups: " + ", ".join(f"{g} = {' + '.join(v)}" for g, v in pack.GROUPS.items()))
    return 0


def _models_fetch(args) -> int:
    from specdec.pack import offline as pack

    try:
        for name in pack.expand(args.names):
            pack.fetch(name, force=args.force, log=lambda s: print(s, file=sys.stderr))
    except pack.PackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _generate(args) -> int:
    from specdec_cli.generate import run_generate

    return run_generate(args)


def _grafana_dashboard(args) -> int:
    from specdec_tools.dashboard import render  # the builder lives with the deployments

    text = render()
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    return 0


def _grafana_provision(args) -> int:
    from specdec_tools.grafana_provision import ProvisionError, provision

    if args.token:
        credential = args.token
    elif args.user and args.password:
        credential = (args.user, args.password)
    else:
        print("error: give --token TOKEN, or --user USER and --password PASSWORD",
              file=sys.stderr)
        return 2
    try:
        r = provision(args.url, credential, args.prometheus_url, args.folder)
    except ProvisionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"data source: {r.datasource}; folder: {r.folder}; dashboard: {r.dashboard}")
    print(f"dashboard at {r.url}")
    return 0


def _cluster_rayservice(args) -> int:
    from pathlib import Path

    from specdec_tools.rayservice import render

    text = render(Path(args.config))
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    return 0


def _wait_ready(args) -> int:
    from specdec_cli.wait_ready import wait_ready

    return 0 if wait_ready(args.url, args.timeout, args.parent_pid) else 1


def _serve(args) -> int:
    from specdec_cli.serve import run_serve

    return run_serve(args.config, grace_s=args.grace, announce_ready=not args.quiet)


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--target", default=None, help="pack name, checkpoint dir or hub id")
    g.add_argument("--draft", default=None, help="draft model (same tokenizer as the target)")
    g.add_argument("--config", default=None, metavar="YAML",
                   help="take the engine from an application config (serve_config.yaml): "
                        "the engine the service runs, here in this process")
    g.add_argument("--app", default=None, help="application name in --config")
    g.add_argument("--ray", action="store_true",
                   help="run the target and draft as Ray actor groups (a private local Ray)")
    g.add_argument("--draft-sampling", choices=get_args(DraftSampling),
                   default="probabilistic")
    g.add_argument("--draft-vocab-limit", type=int, default=None,
                   help="the draft guesses only among the first N token ids")
    g.add_argument("--method", choices=["draft", "ngram", "none"], default=None,
                   help="speculation method (default: draft if --draft is given, else none)")
    g.add_argument("--k", type=int, default=4, help="draft tokens per round")
    g.add_argument("--max-len", type=int, default=2048, help="context limit (KV slot size)")
    g.add_argument("--tp", type=int, default=0,
                   help="run the target as a tensor-parallel group of N Ray actors (0: in "
                        "this process)")
    g.add_argument("--draft-tp", type=int, default=1, help="tensor parallel size of the draft")
    g.add_argument("--overlap", choices=get_args(OverlapMode), default="off",
                   help="draft while the target verifies (the draft gets cores of its own)")
    g.add_argument("--target-threads", type=int, default=None,
                   help="threads per target rank (default: its share of the cores)")
    g.add_argument("--draft-threads", type=int, default=None,
                   help="the draft's threads (overlap: the cores it takes from the target)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weight format (auto: the fastest on this machine)")
    g.add_argument("--json", action="store_true", help="print a JSON record instead of text")
    g.set_defaults(func=_generate)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    models = sub.add_parser("models", help="the offline model pack").add_subparsers(
        dest="models_cmd", required=True)
    m_list = models.add_parser("list", help="pack models and whether they are fetched")
    m_list.set_defaults(func=_models_list)
    m_fetch = models.add_parser("fetch", help="download, verify and convert pack models")
    m_fetch.add_argument("names", nargs="+",
                         help="qwen-pair | smollm2 | all | a pack model name")
    m_fetch.add_argument("--force", action="store_true", help="fetch again even if present")
    m_fetch.set_defaults(func=_models_fetch)

    _add_generate(sub)
    clu = sub.add_parser("cluster", help="cluster manifests").add_subparsers(
        dest="cluster_cmd", required=True)
    c_rs = clu.add_parser("rayservice", help="the KubeRay RayService, from the GPU app config")
    c_rs.add_argument("--config", default="serve_config.gpu.yaml")
    c_rs.add_argument("--out", default="cluster/rayservice.yaml", help="path, or -")
    c_rs.set_defaults(func=_cluster_rayservice)

    graf = sub.add_parser("grafana", help="the Grafana dashboard").add_subparsers(
        dest="grafana_cmd", required=True)
    g_dash = graf.add_parser("dashboard", help="write the dashboard JSON built in code")
    g_dash.add_argument("--out", default="cluster/grafana/specdec-dashboard.json",
                        help="path, or - for standard output")
    g_dash.set_defaults(func=_grafana_dashboard)
    g_prov = graf.add_parser("provision", help="create or update the Prometheus data source "
                                               "and the dashboard in a Grafana (idempotent)")
    g_prov.add_argument("--url", required=True, help="Grafana's base URL")
    g_prov.add_argument("--token", default=None, help="a service account token")
    g_prov.add_argument("--user", default=None)
    g_prov.add_argument("--password", default=None)
    g_prov.add_argument("--prometheus-url", default="http://127.0.0.1:9090",
                        help="where Grafana reaches the Prometheus that scrapes Ray")
    g_prov.add_argument("--folder", default="specdec")
    g_prov.set_defaults(func=_grafana_provision)

    w = sub.add_parser("wait-ready", help="say when a starting service takes requests")
    w.add_argument("url", nargs="?", default="http://127.0.0.1:8000")
    w.add_argument("--timeout", type=float, default=1800.0, help="seconds (default 1800)")
    w.add_argument("--parent-pid", type=int, default=None,
                   help="stop waiting when this process exits (the `serve run` beside it)")
    w.set_defaults(func=_wait_ready)

    s = sub.add_parser("serve", help="serve a config as `serve run` does, stopped cleanly "
                                     "(requests in flight drained) by Ctrl-C, SIGTERM or "
                                     "SIGHUP, to it or to its process group")
    s.add_argument("config", nargs="?", default="serve_config.yaml")
    s.add_argument("--grace", type=float, default=90.0,
                   help="seconds a stop may take before what is left is killed (default 90, "
                        "systemd's own stop timeout; above the app's drain_timeout_s)")
    s.add_argument("--quiet", action="store_true",
                   help="do not print start-up phases and the READY line")
    s.set_defaults(func=_serve)

    add_bench(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - a CLI prints one clear line, not a traceback
        from specdec_cli.errors import USER_ERRORS

        if isinstance(exc, USER_ERRORS):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
