"""A static verify step reads the device once: the forward, the warp and the rejection rule
run at fixed shapes on the device, and only the verdicts come back, in one copy. On a GPU
every read is a synchronisation, so a second read would stall the host mid-step.

Reads are counted as the calls that turn a tensor's contents into host values."""

from __future__ import annotations

import contextlib

import pytest
import torch

from specdec.model.step.batch import BatchInput
from specdec.model.step.decoder import Decoder
from specdec.model.step.sampling import SamplingParams, make_generator
from specdec.model.step.static_step import StaticDecoder
from specdec.spec_decode.target_runner import TargetRow, verify_step

READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def counted_reads(monkeypatch):
    calls: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    yield calls
    monkeypatch.undo()


def _rows(vocab: int) -> tuple[list[TargetRow], dict[str, SamplingParams]]:
    g = torch.Generator().manual_seed(1)
    q_ids = torch.randperm(vocab, generator=g)[:6].repeat(3, 1).to(torch.int32)
    q_probs = torch.softmax(torch.randn(3, 6, generator=g), -1)
    rows = [TargetRow("plain", 0, 4, [9]),
            TargetRow("onehot", 1, 5, [7, 20, 21], num_draft=2, defer_last=True),
            TargetRow("q", 2, 3, [8, 30, 31, 32], num_draft=3, draft_q=(q_ids, q_probs)),
            TargetRow("greedy", 3, 6, [5, 40, 41], num_draft=2, defer_last=True)]
    params = {"plain": SamplingParams(temperature=1.0, seed=1),
              "onehot": SamplingParams(temperature=0.8, top_p=0.9, seed=2),
              "q": SamplingParams(temperature=1.2, seed=3),
              "greedy": SamplingParams(temperature=0.0)}
    return rows, params


@pytest.mark.parametrize("all_greedy", [False, True])
def test_a_static_verify_step_reads_the_device_once(tiny_llama, monkeypatch, all_greedy):
    static = StaticDecoder(Decoder.from_checkpoint(tiny_llama, torch.float32))
    cache = static.new_cache(4, 64)
    rows, params = _rows(static.cfg.vocab_size)
    if all_greedy:
        params = {s: SamplingParams(temperature=0.0) for s in params}
    gens = {s: make_generator(p.seed) for s, p in params.items()}
    static(BatchInput.build([(r.slot, 0, list(range(3, 3 + r.start))) for r in rows]), cache)
    deferred: dict = {}
    before = static.static_steps
    with counted_reads(monkeypatch) as reads:
        results = verify_step(static, cache, rows, params, gens, deferred)
    assert reads == ["tolist"], reads
    assert static.static_steps == before + 1
    assert [r.seq_id for r in results] == [r.seq_id for r in rows]
    for row, res in zip(rows, results, strict=True):
        assert len(res.tokens) == res.num_accepted + (0 if res.deferred else 1)
        assert res.num_accepted <= row.num_draft
