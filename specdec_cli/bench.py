"""`specdec bench`: the benchmarks' command lines. Each imports its benchmark only when run,
so the CLI starts without torch or Ray."""

from __future__ import annotations

from typing import get_args

from specdec.vocabulary import FORMATS as DTYPES
from specdec.vocabulary import SpecMode, StepMode


def _run(benchmark: str):
    """The handler of `specdec bench <name>`: imports specdec_bench.<name> (torch, and Ray for
    some) only when that benchmark runs."""

    def handler(args) -> int:
        import importlib

        return importlib.import_module(f"specdec_bench.{benchmark}").main(args)

    return handler


_bench_core, _bench_decode, _bench_tp, _bench_served, _bench_formats, _bench_load, \
    _bench_serve, _bench_chat, _bench_repeat = map(_run, ("core", "decode", "tp", "served",
                                                          "formats", "load", "serve", "chat",
                                                          "repeat"))


def _args_core(bench) -> None:
    b_core = bench.add_parser("core", help="plain decoding: our core vs transformers generate")
    b_core.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-1.5b"])
    b_core.add_argument("--dtype", default="auto", choices=DTYPES)
    b_core.add_argument("--max-tokens", type=int, default=64)
    b_core.add_argument("--repeats", type=int, default=3)
    b_core.add_argument("--json", metavar="PATH", default=None)
    b_core.set_defaults(func=_bench_core)


def _args_decode(bench) -> None:
    b_dec = bench.add_parser("decode", help="speculative vs plain, ours vs transformers")
    b_dec.add_argument("--target", default="qwen2.5-coder-1.5b")
    b_dec.add_argument("--draft", default="qwen2.5-coder-0.5b")
    b_dec.add_argument("--dtype", default="auto", choices=DTYPES)
    b_dec.add_argument("--max-tokens", type=int, default=128)
    b_dec.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5, 6])
    b_dec.add_argument("--ngram-k", type=int, default=4)
    b_dec.add_argument("--batch", type=int, default=1)
    b_dec.add_argument("--device", default="cpu", help="cpu or cuda")
    b_dec.add_argument("--step", default="eager",
                       choices=get_args(StepMode),
                       help="how both models run each forward (captured: CUDA graphs)")
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


def _args_serve(bench) -> None:
    b_srv = bench.add_parser("serve", help="concurrency sweep against the running service")
    b_srv.add_argument("--url", default="http://127.0.0.1:8000")
    b_srv.add_argument("--model", default="qwen2.5-coder-1.5b")
    b_srv.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    b_srv.add_argument("--policies", nargs="+", default=["plain", "speculative", "auto"],
                       choices=["plain", "speculative", "auto"])
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


def _args_served(bench) -> None:
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


def _args_chat(bench) -> None:
    b_ch = bench.add_parser(
        "chat", help="what chat users send: a conversation resending its history, long "
                     "prompts, memory; ours served beside llama-server")
    b_ch.add_argument("--config", default="serve_config.yaml",
                      help="the application config to serve (as users get it)")
    b_ch.add_argument("--modes", nargs="+", default=["auto", "off", "on"],
                      choices=get_args(SpecMode), help="our speculative modes")
    b_ch.add_argument("--peer-spec", nargs="*", default=["ngram-mod"],
                      help="llama-server --spec-type modes beside its plain (draft-simple "
                           "loads the draft)")
    b_ch.add_argument("--sizes", type=int, nargs="+", default=[0, 512, 1024, 1800],
                      help="prompt sizes in tokens (0: a short prompt)")
    b_ch.add_argument("--max-tokens", type=int, default=128)
    b_ch.add_argument("--repeats", type=int, default=2)
    b_ch.add_argument("--threads", type=int, default=None, help="llama-server's threads")
    b_ch.add_argument("--no-peer", action="store_true")
    b_ch.add_argument("--json", metavar="PATH", default=None)
    b_ch.set_defaults(func=_bench_chat)


def _args_repeat(bench) -> None:
    b_rp = bench.add_parser(
        "repeat", help="workloads whose output repeats what was seen (an edit, a follow-up, "
                       "similar requests) and mixed prompts; ours served beside llama-server")
    b_rp.add_argument("--config", default="serve_config.yaml",
                      help="the application config to serve (as users get it)")
    b_rp.add_argument("--modes", nargs="+", default=["off", "draft", "suffix", "auto"],
                      choices=["off", "draft", "suffix", "auto"],
                      help="our modes, each on a freshly deployed application")
    b_rp.add_argument("--peer-spec", nargs="*",
                      default=["draft-simple", "ngram-mod", "ngram-cache"],
                      help="llama-server --spec-type modes beside its plain")
    b_rp.add_argument("--max-tokens", type=int, default=128,
                      help="per reply (edit and follow-up: 4x; mixed: half)")
    b_rp.add_argument("--repeats", type=int, default=1)
    b_rp.add_argument("--threads", type=int, default=None, help="llama-server's threads")
    b_rp.add_argument("--json", metavar="PATH", default=None)
    b_rp.set_defaults(func=_bench_repeat)


def _args_load(bench) -> None:
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


def _args_formats(bench) -> None:
    b_fm = bench.add_parser("formats", help="weight formats against an fp32 reference of "
                            "the same GGUF weights, beside llama.cpp's computation")
    b_fm.add_argument("--model", default="qwen2.5-coder-1.5b")
    b_fm.add_argument("--formats", nargs="+",
                      default=["q4k", "int8", "int4", "int8-dynamic", "float16"])
    b_fm.add_argument("--prompts", type=int, default=8)
    b_fm.add_argument("--prompt-tokens", type=int, default=96)
    b_fm.add_argument("--tokens", type=int, default=64)
    b_fm.add_argument("--threads", type=int, default=2)
    b_fm.add_argument("--no-peer", dest="peer", action="store_false",
                      help="skip llama.cpp (built by `make peer`)")
    b_fm.add_argument("--json", help="also write the rows here")
    b_fm.set_defaults(func=_bench_formats)


def _args_tp(bench) -> None:
    b_tp = bench.add_parser("tp", help="tensor-parallel group overhead and memory per shard")
    b_tp.add_argument("--model", default="qwen2.5-coder-1.5b")
    b_tp.add_argument("--dtype", default="auto", choices=DTYPES)
    b_tp.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    b_tp.add_argument("--threads", type=int, default=2, help="CPU threads shared by the ranks")
    b_tp.add_argument("--steps", type=int, default=20)
    b_tp.add_argument("--json", metavar="PATH", default=None)
    b_tp.set_defaults(func=_bench_tp)


def add_bench(sub) -> None:
    """`specdec bench ...`: every benchmark's arguments."""
    bench = sub.add_parser("bench", help="benchmarks that print tables").add_subparsers(
        dest="bench_cmd", required=True)
    _args_core(bench)
    _args_decode(bench)
    _args_serve(bench)
    _args_served(bench)
    _args_chat(bench)
    _args_repeat(bench)
    _args_load(bench)
    _args_formats(bench)
    _args_tp(bench)
