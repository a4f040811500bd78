"""`specdec generate`: the one-shot command line, in process, on the tiny fixture pair."""

from __future__ import annotations

import json

from specdec_cli.main import main


def test_generate_streams_then_reports_and_speculation_matches_plain(tiny_llama,
                                                                     tiny_llama_draft,
                                                                     capsys):
    common = ["generate", "--target", str(tiny_llama), "--prompt", "w5 w6 w7 w8",
              "--max-tokens", "12", "--dtype", "float32", "--max-len", "128"]
    assert main(common + ["--method", "none", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(common + ["--draft", str(tiny_llama_draft), "--k", "3", "--json"]) == 0
    spec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plain["completion_tokens"] > 0 and plain["method"] == "none"
    assert spec["method"] == "draft" and spec["spec_decode"]["drafted"] > 0, spec
    assert spec["token_ids"] == plain["token_ids"]  # greedy: speculative == plain
    # Without --json the text streams as it is generated.
    assert main(common + ["--method", "none"]) == 0
    assert plain["text"] in capsys.readouterr().out
