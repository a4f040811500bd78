"""A step never makes the host wait for the device in its middle: its host inputs cross in
non-blocking copies, and its results come back in one read (tests/device_crossings.py runs
the step on a stand-in device and records every crossing). On a GPU a synchronous copy or a
read is a stall of the stream, and a step of a few milliseconds has room for none."""

from __future__ import annotations

import pytest
import torch
from device_crossings import Crossings

from specdec.model.step.batch import BatchInput
from specdec.model.step.decoder import Decoder
from specdec.model.step.host_copy import longs_to_device, to_device_all
from specdec.model.step.parallel import decode_batch, encode_batch
from specdec.model.step.sampling import SamplingParams, make_generator
from specdec.model.step.static_step import StaticDecoder
from specdec.spec_decode.proposal import ProposeInput
from specdec.spec_decode.proposers import DraftModelProposer
from specdec.spec_decode.target_runner import Head, TargetRow, resolve_heads, verify_step

DEV = "meta"


@pytest.fixture(scope="module")
def meta_model(tiny_llama):
    return Decoder.from_checkpoint(tiny_llama, torch.float32, DEV)


def _decoder(model: Decoder, step: str):
    return model if step == "eager" else StaticDecoder(model)


def _warm(model, cache) -> None:
    # First forwards build per-cache tables (rotary): once, not per step.
    model(BatchInput.build([(s, 0, [3, 4, 5]) for s in range(4)], DEV), cache)


@pytest.mark.parametrize("step", ["eager", "static"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_decode_step_waits_for_nothing(meta_model, step, rows):
    model = _decoder(meta_model, step)
    cache = model.new_cache(4, 64)
    _warm(model, cache)
    with Crossings() as seen:
        batch = BatchInput.build([(s, 3, [7]) for s in range(rows)], DEV)
        model(batch, cache)
    assert seen.reads == [] and seen.sync_copies == [], (seen.reads, seen.sync_copies)
    # The batch's six index vectors and the logit positions: one copy each.
    assert len(seen.async_copies) == 2, seen.async_copies


def _verify_rows(vocab: int, q_device: str) -> list[TargetRow]:
    g = torch.Generator().manual_seed(1)
    q_ids = torch.randperm(vocab, generator=g)[:6].repeat(3, 1).to(torch.int32)
    q = (q_ids.to(q_device), torch.softmax(torch.randn(3, 6, generator=g), -1).to(q_device))
    return [TargetRow("plain", 0, 4, [9]),
            TargetRow("onehot", 1, 5, [7, 20, 21], num_draft=2, defer_last=True),
            TargetRow("q", 2, 3, [8, 30, 31, 32], num_draft=3, draft_q=q),
            TargetRow("greedy", 3, 6, [5, 40, 41], num_draft=2, defer_last=True)]


@pytest.mark.parametrize("step", ["eager", "static"])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "sampled, q on the device"])
def test_a_verify_step_reads_once_and_never_copies_synchronously(meta_model, step, mode):
    model = _decoder(meta_model, step)
    cache = model.new_cache(4, 64)
    _warm(model, cache)
    rows = _verify_rows(model.cfg.vocab_size, DEV if mode.endswith("device") else "cpu")
    params = {"plain": SamplingParams(temperature=1.0, seed=1),
              "onehot": SamplingParams(temperature=0.8, top_p=0.9, seed=2),
              "q": SamplingParams(temperature=1.2, seed=3),
              "greedy": SamplingParams(temperature=0.0)}
    if mode == "greedy":
        params = {s: SamplingParams(temperature=0.0) for s in params}
    gens = {s: make_generator(p.seed) for s, p in params.items()}
    with Crossings() as seen:
        verify_step(model, cache, rows, params, gens, {})
    assert seen.reads == ["tolist"], seen.reads
    assert seen.sync_copies == [], seen.sync_copies


@pytest.mark.parametrize("step", ["eager", "static"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_round_never_copies_synchronously(meta_model, step, temperature):
    """The looped round (static) reads once; the eager round once per guess, by design.
    (Seeded sampled rows draft eagerly: their race is not part of the loop.)"""
    draft = DraftModelProposer(_decoder(meta_model, step), 4, 64)
    k = 3
    inputs = [ProposeInput(f"r{s}", list(range(3, 20)), k,
                           SamplingParams(temperature=temperature)) for s in range(2)]
    with Crossings():  # the prefill (its reads return zeros, like every read here)
        draft.propose(inputs)
    with Crossings() as seen:
        draft.propose(inputs)
    assert seen.sync_copies == [], seen.sync_copies
    assert seen.reads == (["cpu"] if step == "static" else ["tolist"] * k), seen.reads


def test_settling_deferred_positions_reads_once_per_row(meta_model):
    vocab = meta_model.cfg.vocab_size
    p = torch.zeros(vocab, device=DEV)
    q_ids, q_probs = torch.arange(4, dtype=torch.int32), torch.full((4,), 0.25)
    heads = {"a": Head(2, None, None), "b": Head(3, q_ids, q_probs), "c": None}
    deferred = {s: p for s in heads}
    gens = {s: make_generator(i) for i, s in enumerate(heads)}
    params = {s: SamplingParams(temperature=1.0, seed=i) for i, s in enumerate(heads)}
    with Crossings() as seen:
        resolve_heads(heads, deferred, params, gens)
    assert seen.reads == ["tolist"] * 3 and seen.sync_copies == [], (seen.reads,
                                                                      seen.sync_copies)


def test_a_leader_sends_its_followers_the_batch_without_reading_the_device():
    rows = [(2, 5, [11, 12, 13]), (0, 9, [14])]
    batch = BatchInput.build(rows, DEV)
    with Crossings() as seen:
        payload = encode_batch(batch)
    assert seen.reads == [] and seen.sync_copies == []
    back = decode_batch(payload, "cpu")
    assert back.slot_list == [2, 0] and back.starts == [5, 9] and back.query_lens == [3, 1]
    assert back.token_ids.tolist() == [11, 12, 13, 14]


def test_host_values_cross_in_one_copy_per_dtype_and_keep_shape_and_order():
    parts = [torch.arange(6).view(2, 3), torch.tensor([0.5, 0.25]), torch.tensor([7]),
             torch.tensor([True, False])]
    with Crossings() as seen:
        on_dev = to_device_all(parts, DEV)
        longs = longs_to_device([[1, 2], [], [3]], DEV)
    assert [t.shape for t in on_dev] == [t.shape for t in parts]
    assert [t.dtype for t in on_dev] == [t.dtype for t in parts]
    assert [t.numel() for t in longs] == [2, 0, 1]
    assert len(seen.async_copies) == 3 + 1 and seen.sync_copies == []
    # On the host they are the values themselves, split back in order.
    assert [t.tolist() for t in to_device_all(parts, "cpu")] == [t.tolist() for t in parts]
    assert [t.tolist() for t in longs_to_device([[1, 2], [], [3]], "cpu")] == [[1, 2], [], [3]]
