"""What bench served derives from its rows: the cost shape and memory per process."""

import pytest

from specdec_bench.served_report import cost_shape, memory_rows, ratios


def _timeline(target_ms, draft_ms=0.0, guesses=0.0, emitted=1):
    return {"target_compute_ms": target_ms, "draft_compute_ms": draft_ms,
            "guesses_per_row": guesses, "emitted_per_step": emitted}


def test_cost_shape_against_the_same_systems_plain_step():
    rows = [
        {"system": "ours, served", "config": "plain", "timeline": _timeline(50.0)},
        {"system": "ours, served", "config": "speculative k=4",
         "timeline": _timeline(90.0, draft_ms=40.0, guesses=4, emitted=3.5)},
        {"system": "ours, in process", "config": "plain", "timeline": _timeline(25.0)},
        {"system": "ours, in process", "config": "speculative k=4",
         "timeline": _timeline(50.0, draft_ms=20.0, guesses=4, emitted=3)},
        {"system": "llama.cpp", "config": "plain", "tokens_per_s": 20.0},  # no timeline
    ]
    got = {(r["system"], r["config"]): r for r in cost_shape(rows)}
    spec = got[("ours, served", "speculative k=4")]
    assert spec["v"] == pytest.approx(1.8)
    assert spec["c"] == pytest.approx(40.0 / 4 / 50.0)
    assert spec["tokens_per_round"] == 3.5
    assert got[("ours, in process", "speculative k=4")]["v"] == pytest.approx(2.0)
    assert got[("ours, served", "plain")]["c"] is None
    assert ("llama.cpp", "plain") not in got


def test_memory_rows_list_every_actor_once_and_the_peer():
    memory = {"engine_replica": {"rss_mb": 900.0},
              "target-r0": {"rss_mb": 2100.0, "peak_rss_mb": 2500.0}}
    rows = [{"system": "llama.cpp", "config": "plain", "rss_GB": 1.4},
            {"system": "ours, served", "config": "plain", "memory_mb": memory},
            {"system": "ours, served", "config": "auto (policy)", "memory_mb": memory}]
    got = memory_rows(rows)
    assert [(r["system"], r["process"]) for r in got] == [
        ("llama.cpp", "llama-server (plain)"), ("ours, served", "engine_replica"),
        ("ours, served", "target-r0")]
    assert got[2]["rss_GB"] == pytest.approx(2.1)
    assert got[2]["peak_rss_GB"] == pytest.approx(2.5)


def test_ratios_name_the_peers_best_configuration():
    rows = [{"system": "llama.cpp", "config": "plain", "tokens_per_s": 20.0},
            {"system": "llama.cpp", "config": "ngram-mod", "tokens_per_s": 30.0},
            {"system": "ours, served", "config": "plain", "tokens_per_s": 10.0},
            {"system": "ours, served", "config": "auto (policy)", "tokens_per_s": 15.0}]
    got = {r["ratio"]: r["value"] for r in ratios(rows)}
    assert got["served auto / llama.cpp best (ngram-mod)"] == pytest.approx(0.5)
    assert got["served plain / llama.cpp plain"] == pytest.approx(0.5)
    assert got["served auto / served plain"] == pytest.approx(1.5)


def test_a_table_without_rows_prints_its_header(capsys):
    """bench served --paired has no per-step timelines: its cost-shape table is empty."""
    from specdec_bench.table import print_table

    print_table([], ["system", "v"], title="cost shape")
    out = capsys.readouterr().out
    assert "cost shape" in out and "system  v" in out
