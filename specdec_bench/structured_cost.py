"""What a JSON schema costs: decode tokens/s of the application config's engine (in
process), greedy, with and without a schema on the reply, plain (`mode: off`), as the
policy decides (`auto`, what users get) and speculative (`on`: the draft at k 3); beside
llama-server on the same GGUF file, plain and with its draft, with and without the same
schema (its `json_schema` field), in the same run.

    .venv/bin/python -m specdec_bench.structured_cost [--tokens 96] [--repeats 3] [--no-peer]

A schema costs a mask per verified position (llguidance, on CPU) and cuts a proposal at
the first guess the grammar refuses; it also changes the text (JSON rather than prose), so
a row's speed with a schema is set beside the same server's speed without one on the same
prompts. The variants take turns prompt by prompt and repeat by repeat.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from specdec.progress import Progress
from specdec_bench.in_process import decode_one
from specdec_bench.table import median, print_table, write_json

ROOT = Path(__file__).resolve().parents[1]
# Every repeat asks about someone new, and the suffix index is emptied before each run: the
# same ask answered again would let `auto` guess the reply from the previous variant's (the
# same greedy text), a speed no user sees.
SUBJECTS = ["a pirate captain", "your favourite programmer", "a retired astronaut",
            "a village baker", "a chess grandmaster", "a lighthouse keeper", "a jazz drummer",
            "a marine biologist", "a medieval blacksmith", "a startup founder",
            "a mountain guide", "a school librarian", "a racing cyclist", "a beekeeper",
            "an opera singer"]
PER_REPEAT = 3


def _asks(repeats: int) -> list[list[str]]:
    """PER_REPEAT asks per repeat, none asked twice (a number told apart past 15)."""
    out = []
    for n in range(repeats * PER_REPEAT):
        who = SUBJECTS[n % len(SUBJECTS)] + (f" number {n // len(SUBJECTS) + 1}"
                                             if n >= len(SUBJECTS) else "")
        out.append(f"Describe {who} as a JSON object: a name, an age and a few hobbies.")
    return [out[r * PER_REPEAT:(r + 1) * PER_REPEAT] for r in range(repeats)]
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "hobbies": {"type": "array", "maxItems": 4,
                                     "items": {"type": "string", "maxLength": 30}}}}


def _ours(built, ids, label: str, mode: str, schema: bool, tokens: int) -> tuple[float, bool]:
    from specdec.model.step.grammar import GrammarSpec
    from specdec.model.step.sampling import SamplingParams
    from specdec.spec_decode.speculation import Speculation

    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA)) if schema else None
    params = SamplingParams(temperature=0.0, max_tokens=tokens, grammar=grammar)
    over = {"off": Speculation(mode="off"), "auto": Speculation(),
            "on": Speculation(mode="on", method="draft", k=3)}[mode]
    suffix = built.engine.proposers.get("suffix")
    if suffix is not None:
        suffix.forget()  # the other variants just answered this ask: a reply no user has seen
    done, tps = decode_one(built, label, ids, params, over)
    valid = True
    if schema:
        import jsonschema

        try:
            jsonschema.validate(json.loads(done.text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            valid = False
    return tps, valid


def _peer(target: Path, draft: Path | None, prompts, tokens, threads, progress):
    from specdec_bench.llama_peer import LlamaServer

    rows = []
    configs = [("llama-server plain", [])]
    if draft is not None:
        configs.append(("llama-server draft-simple (defaults)",
                        ["--spec-type", "draft-simple", "-md", str(draft), "-td", str(threads)]))
    for name, extra in configs:
        got = {False: [], True: []}
        with LlamaServer(target, extra, threads) as server:
            server.complete(prompts[0][0], 8)  # warm: first-call allocations
            for rep, asks in enumerate(prompts):
                for i, ids in enumerate(asks):
                    for schema in ((False, True) if (rep + i) % 2 == 0 else (True, False)):
                        body = {"json_schema": SCHEMA} if schema else {}
                        r = server.complete(ids, tokens, **body)
                        got[schema].append(r["timings"]["predicted_per_second"])
                        progress.advance()
        rows.append(_row(name, got[False], got[True]))
    return rows


def _row(name: str, without: list[float], with_schema: list[float], valid=None) -> dict:
    a, b = median(without), median(with_schema)
    return {"server": name, "tps_without": round(a, 2), "tps_schema": round(b, 2),
            "schema_vs_without": round(b / a, 3), "valid_replies": valid}


def main(argv=None) -> int:
    from specdec.engine.assemble import LocalBackend, assemble
    from specdec.engine.spec import EngineSpec
    from specdec.model.checkpoint.gguf_file import gguf_in
    from specdec.pack import hub

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "serve_config.yaml"))
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    spec = EngineSpec.from_config_file(args.config)
    built = assemble(spec, LocalBackend())
    prompts = [[built.tokenizer.apply_chat_template(
        [{"role": "user", "content": a}], tokenize=True, add_generation_prompt=True,
        return_dict=False) for a in asks] for asks in _asks(args.repeats)]
    variants = [(m, s) for m in ("off", "auto", "on") for s in (False, True)]
    got: dict = {v: [] for v in variants}
    valid = {m: 0 for m in ("off", "auto", "on")}
    target = gguf_in(hub.resolve(spec.target.model))
    draft = gguf_in(hub.resolve(spec.draft.model)) if spec.draft else None
    from specdec_bench.llama_peer import llama_bin

    peer = not args.no_peer and llama_bin() is not None and target is not None
    total = args.repeats * PER_REPEAT * (len(variants) + (4 if peer else 0))
    progress = Progress("structured output cost", total=total, unit=" runs")
    _ours(built, prompts[0][0], "warm-grammar", "off", True, 4)  # the tokenizer's index, once
    n = 0
    for rep, asks in enumerate(prompts):
        for i, ids in enumerate(asks):
            order = variants if (rep + i) % 2 == 0 else variants[::-1]
            for mode, schema in order:
                tps, ok = _ours(built, ids, f"r{n}", mode, schema, args.tokens)
                got[mode, schema].append(tps)
                valid[mode] += ok and schema
                n += 1
                progress.advance()
    built.close()
    runs = args.repeats * PER_REPEAT
    rows = [_row(f"ours {m}", got[m, False], got[m, True], f"{valid[m]}/{runs}")
            for m in ("off", "auto", "on")]
    if peer:
        threads = spec.target.threads or os.cpu_count() or 2
        rows += _peer(target, draft, prompts, args.tokens, threads, progress)
    progress.close()
    on, off = rows[2], rows[0]
    print_table(rows, ["server", "tps_without", "tps_schema", "schema_vs_without",
                       "valid_replies"],
                title=f"decode tokens/s with a JSON schema and without, greedy, {args.tokens} "
                f"tokens at most, medians of {runs} runs")
    print(f"speculation's gain (on / off): {on['tps_without'] / off['tps_without']:.2f} "
          f"without a schema, {on['tps_schema'] / off['tps_schema']:.2f} with one")
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
