"""bench repeat's table: a system's tokens/s over a workload group (its items summed, the
median over repeats) and its ratio to the llama-server plain of its own block."""

from __future__ import annotations

from specdec_bench.repeat import summarize


def _row(block, system, workload, tokens, seconds, rep=0):
    return {"block": block, "system": system, "workload": workload, "tokens": tokens,
            "seconds": seconds, "rep": rep}


def test_ratios_are_against_the_plain_peer_of_the_same_block():
    rows = [_row("ours off", "ours off", "edit", 100, 4.0),
            _row("ours off", "llama-server plain", "edit", 100, 5.0),
            _row("ours auto", "ours auto", "edit", 100, 1.0),
            _row("ours auto", "llama-server plain", "edit", 100, 10.0),  # a slow minute
            _row("llama-server", "llama-server plain", "edit", 100, 4.0),
            _row("llama-server", "llama-server ngram-mod", "edit", 100, 2.0)]
    table = {(r["system"], r["workload"]): r for r in summarize(rows)}
    assert table[("ours off", "edit")]["vs_llama_plain"] == 1.25
    assert table[("ours auto", "edit")]["vs_llama_plain"] == 10.0
    assert table[("llama-server ngram-mod", "edit")]["vs_llama_plain"] == 2.0
    assert table[("llama-server plain", "edit")]["tps"] == 25.0   # its own block's only
    assert sum(1 for s, _ in table if s == "llama-server plain") == 1


def test_items_of_a_group_are_summed_and_repeats_take_the_median():
    rows = [_row("b", "ours draft", "mixed code t=0.0", 60, 2.0),
            _row("b", "ours draft", "mixed prose t=0.0", 20, 2.0),        # 80 / 4 s
            _row("b", "ours draft", "mixed code t=0.7", 50, 5.0),
            _row("b", "ours draft", "similar", 10, 1.0, rep=0),
            _row("b", "ours draft", "similar", 30, 1.0, rep=1),
            _row("b", "ours draft", "similar", 50, 1.0, rep=2)]
    table = {(r["system"], r["workload"]): r for r in summarize(rows)}
    assert table[("ours draft", "mixed greedy")]["tps"] == 20.0
    assert table[("ours draft", "mixed sampled")]["tps"] == 10.0
    assert table[("ours draft", "similar")]["tps"] == 30.0
    assert table[("ours draft", "similar")]["vs_llama_plain"] is None
