"""`specdec`: fetch the offline models, generate, benchmark."""

from __future__ import annotations

import argparse
import sys

# specdec.linear.FORMATS, spelled out: the CLI starts without importing torch.
DTYPES = ["auto", "float32", "bfloat16", "float16", "int8", "w8a8", "int8-dynamic"]


def _models_list(args) -> int:
    from specdec import pack

    print(f"cache: {pack.cache_dir()}")
    print(f"{'name':22} {'status':10} description")
    for name, m in pack.PACK.items():
        status = "ready" if pack.is_fetched(name) else "missing"
        print(f"{name:22} {status:10} {m.description}")
    print("groups: " + ", ".join(f"{g} = {' + '.join(v)}" for g, v in pack.GROUPS.items()))
    return 0


def _models_fetch(args) -> int:
    from specdec import pack

    try:
        for name in pack.expand(args.names):
            pack.fetch(name, force=args.force, log=lambda s: print(s, file=sys.stderr))
    except pack.PackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _generate(args) -> int:
    from specdec.cli_generate import run_generate

    return run_generate(args)


def _bench_core(args) -> int:
    from specdec.bench.core import main as bench_core

    return bench_core(args)


def _bench_decode(args) -> int:
    from specdec.bench.decode import main as bench_decode

    return bench_decode(args)


def _bench_tp(args) -> int:
    from deployments.bench_tp import main as bench_tp  # needs Ray: lives in deployments/

    return bench_tp(args)


def _bench_served(args) -> int:
    from deployments.bench_served import main as bench_served  # needs Ray

    return bench_served(args)


def _bench_formats(args) -> int:
    from specdec.bench.formats import main as bench_formats

    return bench_formats(args)


def _bench_load(args) -> int:
    from specdec.bench.load import main as bench_load

    return bench_load(args)


def _bench_serve(args) -> int:
    from specdec.bench.serve import main as bench_serve

    return bench_serve(args)


def _grafana_dashboard(args) -> int:
    from deployments.dashboard import render  # the builder lives with the deployments

    text = render()
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    return 0


def _grafana_provision(args) -> int:
    from deployments.grafana_provision import ProvisionError, provision

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

    from deployments.rayservice import render

    text = render(Path(args.config))
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    return 0


def _wait_ready(args) -> int:
    from specdec.wait_ready import wait_ready

    return 0 if wait_ready(args.url, args.timeout, args.parent_pid) else 1


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

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--target", default=None, help="pack name, checkpoint dir or hub id")
    g.add_argument("--draft", default=None, help="draft model (same tokenizer as the target)")
    g.add_argument("--config", default=None, metavar="YAML",
                   help="take the engine from an application config (serve_config.yaml): "
                        "the engine the service runs, here in this process")
    g.add_argument("--app", default=None, help="application name in --config")
    g.add_argument("--ray", action="store_true",
                   help="run the target and draft as Ray actor groups (a private local Ray)")
    g.add_argument("--draft-sampling", choices=["probabilistic", "greedy"],
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
    g.add_argument("--overlap", choices=["off", "on", "auto"], default="off",
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

    bench = sub.add_parser("bench", help="benchmarks that print tables").add_subparsers(
        dest="bench_cmd", required=True)
    b_core = bench.add_parser("core", help="plain decoding: our core vs transformers generate")
    b_core.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-1.5b"])
    b_core.add_argument("--dtype", default="auto", choices=DTYPES)
    b_core.add_argument("--max-tokens", type=int, default=64)
    b_core.add_argument("--repeats", type=int, default=3)
    b_core.add_argument("--json", metavar="PATH", default=None)
    b_core.set_defaults(func=_bench_core)
    b_dec = bench.add_parser("decode", help="speculative vs plain, ours vs transformers")
    b_dec.add_argument("--target", default="qwen2.5-coder-1.5b")
    b_dec.add_argument("--draft", default="qwen2.5-coder-0.5b")
    b_dec.add_argument("--dtype", default="auto", choices=DTYPES)
    b_dec.add_argument("--max-tokens", type=int, default=128)
    b_dec.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5, 6])
    b_dec.add_argument("--ngram-k", type=int, default=4)
    b_dec.add_argument("--batch", type=int, default=1)
    b_dec.add_argument("--device", default="cpu", help="cpu or cuda")
    b_dec.add_argument("--draft-vocab-limit", type=int, default=None,
                       help="the draft guesses only among the first N token ids")
    b_dec.add_argument("--draft-confidence", type=float, nargs="*", default=[],
                       help="also run the draft with this early-stop confidence threshold")
    b_dec.add_argument("--confidence-k", type=int, default=8,
                       help="k cap of the --draft-confidence rows")
    b_dec.add_argument("--sets", nargs="+", default=["code", "prose", "chat_code"])
    b_dec.add_argument("--prompts-per-set", type=int, default=2)
    b_dec.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    b_dec.add_argument("--costs", action="store_true", help="also measure c and v")
    b_dec.add_argument("--json", metavar="PATH", default=None)
    b_dec.set_defaults(func=_bench_decode)
    b_srv = bench.add_parser("serve", help="concurrency sweep against the running service")
    b_srv.add_argument("--url", default="http://127.0.0.1:8000")
    b_srv.add_argument("--model", default="qwen2.5-coder-1.5b")
    b_srv.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    b_srv.add_argument("--policies", nargs="+", default=["plain", "speculative", "router"],
                       choices=["plain", "speculative", "router"])
    b_srv.add_argument("--k", type=int, default=4, help="k of the static speculative policy")
    b_srv.add_argument("--requests-per-client", type=int, default=4)
    b_srv.add_argument("--repeats", type=int, default=1,
                       help="runs of each policy per level (rotated order; medians)")
    b_srv.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7],
                       help="sweeps to run: greedy (0) and sampled")
    b_srv.add_argument("--max-tokens", type=int, nargs="+", default=[16, 64, 128])
    b_srv.add_argument("--peer", action="store_true",
                       help="also send every level to llama.cpp's llama-server on the "
                            "target's GGUF file (built by `make peer`)")
    b_srv.add_argument("--peer-slots", type=int, default=8,
                       help="llama-server's parallel slots (-np)")
    b_srv.add_argument("--peer-threads", type=int, default=None,
                       help="llama-server's threads (default: every core)")
    b_srv.add_argument("--config", default="serve_config.yaml",
                       help="the application config whose target GGUF the peer runs")
    b_srv.add_argument("--json", metavar="PATH", default=None)
    b_srv.add_argument("--plot", metavar="PNG", default=None)
    b_srv.set_defaults(func=_bench_serve)
    b_sd = bench.add_parser(
        "served", help="one client: transformers, our engine in process, the served app")
    b_sd.add_argument("--config", default="serve_config.yaml",
                      help="the application config to assemble and to serve")
    b_sd.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5],
                      help="static k rows (in process and served)")
    b_sd.add_argument("--max-tokens", type=int, default=96)
    b_sd.add_argument("--sets", nargs="+", default=["code", "chat_code"])
    b_sd.add_argument("--prompts-per-set", type=int, default=3)
    b_sd.add_argument("--repeats", type=int, default=2)
    b_sd.add_argument("--hf-dtypes", nargs="+", default=["bfloat16", "float32"],
                      help="dtypes to run transformers in (its defaults and its best)")
    b_sd.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    b_sd.add_argument("--no-peer", action="store_true",
                      help="skip the llama.cpp rows (they run when `make peer` has built it)")
    b_sd.add_argument("--paired", action="store_true",
                      help="measure in process and served alternately, request by request "
                           "(both engines loaded), so drift of the machine cancels in "
                           "their ratio")
    b_sd.add_argument("--split", action="store_true",
                      help="also one core each for target and draft: sequential vs overlapped")
    b_sd.add_argument("--json", metavar="PATH", default=None)
    b_sd.set_defaults(func=_bench_served)
    b_ld = bench.add_parser("load", help="many streaming clients for a while: failures, "
                                         "latency, memory, queue drain")
    b_ld.add_argument("--url", default="http://127.0.0.1:8000")
    b_ld.add_argument("--model", default="qwen2.5-coder-1.5b")
    b_ld.add_argument("--clients", type=int, default=32)
    b_ld.add_argument("--duration", type=float, default=120.0, help="seconds of sending")
    b_ld.add_argument("--max-tokens", type=int, nargs="+", default=[16, 48, 96])
    b_ld.add_argument("--api-key", default=None)
    b_ld.add_argument("--json", metavar="PATH", default=None)
    b_ld.set_defaults(func=_bench_load)
    b_fm = bench.add_parser("formats", help="weight formats against an fp32 reference of "
                            "the same GGUF weights, beside llama.cpp's computation")
    b_fm.add_argument("--model", default="qwen2.5-coder-1.5b")
    b_fm.add_argument("--formats", nargs="+",
                      default=["float16", "int8", "w8a8", "int8-dynamic"])
    b_fm.add_argument("--prompts", type=int, default=8)
    b_fm.add_argument("--prompt-tokens", type=int, default=96)
    b_fm.add_argument("--tokens", type=int, default=64)
    b_fm.add_argument("--threads", type=int, default=2)
    b_fm.add_argument("--no-peer", dest="peer", action="store_false",
                      help="skip llama.cpp (built by `make peer`)")
    b_fm.add_argument("--json", help="also write the rows here")
    b_fm.set_defaults(func=_bench_formats)

    b_tp = bench.add_parser("tp", help="tensor-parallel group overhead and memory per shard")
    b_tp.add_argument("--model", default="qwen2.5-coder-1.5b")
    b_tp.add_argument("--dtype", default="auto", choices=DTYPES)
    b_tp.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    b_tp.add_argument("--threads", type=int, default=2, help="CPU threads shared by the ranks")
    b_tp.add_argument("--steps", type=int, default=20)
    b_tp.add_argument("--json", metavar="PATH", default=None)
    b_tp.set_defaults(func=_bench_tp)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - a CLI prints one clear line, not a traceback
        from specdec.errors import USER_ERRORS

        if isinstance(exc, USER_ERRORS):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
