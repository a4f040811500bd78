"""Plain decode as the context grows: ours (the engine of the application config, in
process, `mode: off`) beside llama.cpp's `llama-bench -d DEPTH` on the same GGUF file.

    .venv/bin/python -m specdec_bench.context_decode [--depths 0 512 1024 1800] [--repeats 3]

Each depth is measured for both, taking turns depth by depth and repeat by repeat, so a
machine that drifts over minutes moves both alike. Ours: a prompt of DEPTH tokens (a
frozen copy of one of this repository's modules) prefilled, then `--tokens` greedy tokens;
decode tokens/s is taken after the first token (the engine's step, sampling and
detokenizing included). llama.cpp: llama-bench's tg at that depth (the model's forward
only). What llama.cpp's decode keeps as the context grows, ours must keep too: the K/V
read per token grows with it, and nothing else should.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from specdec.progress import Progress
from specdec_bench.in_process import decode_one
from specdec_bench.table import median, print_table, write_json

ROOT = Path(__file__).resolve().parents[1]
# A frozen copy of one of our modules (bench chat pastes it too): the prompt must not change
# when the module does.
SOURCE = "specdec_bench/chat_files/decide.py.txt"


def _ours(built, tok, depth: int, tokens: int, label: str) -> float:
    from specdec.model.step.sampling import SamplingParams
    from specdec.spec_decode.speculation import Speculation

    text = f"# {label}\n" + (ROOT / SOURCE).read_text() * 4
    ids = tok(text).input_ids[: max(depth, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return decode_one(built, label, ids, params, Speculation(mode="off"))[1]


def _llama(exe: Path, gguf: Path, depth: int, tokens: int, threads: int) -> float:
    out = subprocess.run([str(exe), "-m", str(gguf), "-t", str(threads), "-p", "0",
                          "-n", str(tokens), "-d", str(depth), "-r", "1", "-o", "json"],
                         capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout)[0]["avg_ts"]


def main(argv=None) -> int:
    from specdec.engine.assemble import LocalBackend, assemble
    from specdec.engine.spec import EngineSpec
    from specdec.model.checkpoint.gguf_file import gguf_in
    from specdec.pack import hub
    from specdec_bench.llama_peer import llama_bin

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "serve_config.yaml"))
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 512, 1024, 1800])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    spec = EngineSpec.from_config_file(args.config)
    gguf = gguf_in(hub.resolve(spec.target.model))
    exe = llama_bin("llama-bench")
    if exe is None or gguf is None:
        raise SystemExit("llama-bench is not built (make peer) or the target has no GGUF file")
    threads = spec.target.threads_per_rank()
    built = assemble(spec, LocalBackend())
    tok = built.tokenizer
    ours: dict[int, list[float]] = {d: [] for d in args.depths}
    peer: dict[int, list[float]] = {d: [] for d in args.depths}
    progress = Progress("context decode", total=2 * args.repeats * len(args.depths),
                        unit=" runs")
    for rep in range(args.repeats):
        for i, depth in enumerate(args.depths):
            order = ("ours", "llama") if (rep + i) % 2 == 0 else ("llama", "ours")  # ABBA
            for system in order:
                if system == "ours":
                    ours[depth].append(_ours(built, tok, depth, args.tokens,
                                             f"run {rep} depth {depth}"))
                else:
                    peer[depth].append(_llama(exe, gguf, depth, args.tokens, threads))
                progress.advance()
    progress.close()
    built.close()
    rows = []
    for depth in args.depths:
        o, p = median(ours[depth]), median(peer[depth])
        rows.append({"context": depth, "ours_tps": round(o, 2), "llama_tps": round(p, 2),
                     "ours_vs_llama": round(o / p, 2),
                     "ours_vs_own_short": round(o / median(ours[args.depths[0]]), 2),
                     "llama_vs_own_short": round(p / median(peer[args.depths[0]]), 2)})
    print_table(rows, ["context", "ours_tps", "llama_tps", "ours_vs_llama",
                       "ours_vs_own_short", "llama_vs_own_short"],
                title=f"plain decode tokens/s after a context of N tokens, {args.tokens} tokens, "
                      f"medians of {args.repeats} (ours: {args.config}, in process; llama.cpp: "
                      f"llama-bench -d N, {threads} threads)")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
