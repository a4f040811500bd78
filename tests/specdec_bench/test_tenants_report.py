"""The reports of the hostile-tenant and served before/after benchmarks, on made-up rows:
bits from guess accuracy, paired ratios and reply identity."""

from __future__ import annotations

import pytest

from specdec_bench.served_before_after import _summary
from specdec_bench.tenants import bits_per_100


def test_bits_follow_the_guess_accuracy():
    assert bits_per_100(20, 20) == 50.0 and bits_per_100(0, 20) == 50.0  # always told apart
    assert bits_per_100(10, 20) == 0.0  # a coin
    assert 0 < bits_per_100(14, 20) < bits_per_100(18, 20) < 50


def _row(workload, item, mode, system, e2e, text="x"):
    return {"workload": workload, "item": item, "mode": mode, "system": system,
            "tokens": 96, "e2e": e2e, "ttft": 0.5, "text": text}


def test_the_summary_pairs_each_request_with_its_twin_and_the_peer_beside_it():
    rows = []
    for item, (before, after) in enumerate([(10.0, 8.0), (12.0, 12.0)]):
        rows += [_row("fresh prompt", item, "off", "B", before),
                 _row("fresh prompt", item, "off", "A", after, "x" if item else "y"),
                 _row("fresh prompt", item, "off", "llama-server plain", 6.0)]
    for turn in (1, 2):
        rows += [_row(f"chat turn {turn}", turn, "auto", s, 9.6)
                 for s in ("B", "A", "llama-server plain")]
    table = {(r["workload"], r["mode"]): r for r in _summary(rows, "B", "A")}
    fresh = table["fresh prompt", "off"]
    assert fresh["requests"] == 2 and fresh["identical"] == "1/2"
    assert fresh["after/before (paired)"] == pytest.approx((1.25 + 1.0) / 2)
    assert fresh["before/llama"] == pytest.approx((0.6 + 0.5) / 2)
    chat = table["chat", "auto"]  # the turns of a conversation are one workload
    assert chat["requests"] == 2 and chat["after/before (paired)"] == 1.0
