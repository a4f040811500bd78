"""Two commits of this repository, their in-process engines loaded at once, every request
sent to one then the other (the order alternating, ABBA), so the machine's drift over
minutes hits both alike: what a refactor cost, told apart from a drifting machine.

    .venv/bin/python -m specdec_bench.before_after --before 88fc271 [--after HEAD] [--repeats 3]

Each commit is exported with `git archive` into a temporary directory and run by a worker
process with that tree first on PYTHONPATH, assembled from its own serve_config.yaml. The
table gives tokens/s medians (quartiles) per config and the median of the paired ratios;
every pair's tokens are compared too (a refactor must not change them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("plain", "k3", "auto")


def _worker(config: str) -> None:
    """One tree's engine, driven over stdin: a JSON request per line, a JSON answer each."""
    try:  # the layered tree
        from specdec.engine.assemble import LocalBackend, assemble
        from specdec.engine.spec import EngineSpec
        try:  # one value for a request's speculation
            from specdec.spec_decode.speculation import Speculation
        except ImportError:  # d163c20 and older
            from specdec.policy.engine_policy import Overrides as Speculation
        try:  # the model package in three rooms
            from specdec.model.step.sampling import SamplingParams
        except ImportError:  # the flat model package (3806ec1 and older)
            from specdec.model.sampling import SamplingParams
    except ImportError:  # the flat layout before the folders were layers (88fc271 and older)
        from specdec.assemble import LocalBackend, assemble
        from specdec.engine_config import EngineSpec
        from specdec.engine_policy import Overrides as Speculation
        from specdec.sampling import SamplingParams
    import specdec

    built = assemble(EngineSpec.from_config_file(config), LocalBackend())
    tok = built.tokenizer
    modes = {"plain": Speculation(mode="off"), "k3": Speculation(mode="on", method="draft", k=3),
             "auto": Speculation(mode="auto")}
    print(json.dumps({"ready": specdec.__file__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        # Templated here, not with specdec.pack.tokenizer: an older tree may not have it.
        ids = tok.apply_chat_template([{"role": "user", "content": req["text"]}],
                                      tokenize=True, add_generation_prompt=True,
                                      return_dict=False) if req["chat"] \
            else tok(req["text"]).input_ids
        params = SamplingParams(temperature=req.get("temperature", 0.0), seed=req.get("seed"),
                                max_tokens=req["max_tokens"], ignore_eos=True)
        t = time.perf_counter()
        built.submit("ab", ids, params, modes[req["mode"]])
        done = None
        while done is None:
            done = next((o for o in built.engine.step()
                         if o.request_id == "ab" and o.finished), None)
        print(json.dumps({"tps": len(done.token_ids) / (time.perf_counter() - t),
                          "tokens": done.token_ids}), flush=True)


def _start(rev: str, root: str, config: str) -> subprocess.Popen:
    os.makedirs(root)
    archive = subprocess.run(["git", "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", config],
                            cwd=root, env=dict(os.environ, PYTHONPATH=root),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    print(rev, json.loads(proc.stdout.readline()), flush=True)
    return proc


def _ask(proc: subprocess.Popen, req: dict) -> dict:
    proc.stdin.write(json.dumps(req) + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def _table(rates: dict, revs: list[str]) -> None:
    def cell(v):
        q = statistics.quantiles(v, n=4)
        return f"{statistics.median(v):.2f} ({q[0]:.2f}-{q[2]:.2f})"

    print(f"| config | before ({revs[0]}) | after ({revs[1]}) | after / before |")
    print("|---|---|---|---|")
    for mode in MODES:
        b, a = rates[(revs[0], mode)], rates[(revs[1], mode)]
        ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
        print(f"| {mode} | {cell(b)} | {cell(a)} | {ratio:.3f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", help="the commit to compare against (required)")
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="above 0: seeded sampling, the same seed for both commits")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker)
        return 0
    if not args.before:
        ap.error("--before: the commit to compare against is required")
    from specdec_bench.prompts import PROMPT_SETS

    revs = [args.before, args.after]
    prompts = [(text, PROMPT_SETS[s][0]) for s in ("code", "chat_code")
               for text in PROMPT_SETS[s][1][:2]]
    with tempfile.TemporaryDirectory() as tmp:
        procs = {rev: _start(rev, os.path.join(tmp, str(i)), args.config)
                 for i, rev in enumerate(revs)}
        rates = {(rev, mode): [] for rev in revs for mode in MODES}
        n, differ = 0, dict.fromkeys(MODES, 0)
        for r in range(args.repeats):
            for mode in MODES:
                for text, chat in prompts:
                    order = revs if n % 2 == 0 else revs[::-1]
                    n += 1
                    req = {"text": text, "chat": chat, "mode": mode, "seed": n,
                           "max_tokens": args.max_tokens, "temperature": args.temperature}
                    got = {rev: _ask(procs[rev], req) for rev in order}
                    for rev in revs:
                        rates[(rev, mode)].append(got[rev]["tps"])
                    differ[mode] += got[revs[0]]["tokens"] != got[revs[1]]["tokens"]
                    print(f"[{n}/{args.repeats * len(MODES) * len(prompts)}] repeat {r} "
                          f"{mode}: " + ", ".join(f"{rev} {got[rev]['tps']:.2f}"
                                                  for rev in revs), flush=True)
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    _table(rates, revs)
    # Seeded sampling: plain and k3 must match pair by pair; auto may speculate in one
    # commit and not the other (the same distribution, another draw).
    print("pairs whose tokens differ: " + ", ".join(
        f"{mode} {d} of {n // len(MODES)}" for mode, d in differ.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
