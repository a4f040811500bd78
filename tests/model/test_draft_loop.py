"""The draft's round as one loop (specdec/model/step/draft_loop.py) proposes what the eager
draft proposes: the same guesses and the same q, round after round with rollback, for
greedy, sampled (seeded) and mixed rows, ragged k, the confidence rule and a narrowed
vocabulary; compiled as one graph per shape without recompiling."""

from __future__ import annotations

import pytest
import torch

from specdec.model.step.decoder import Decoder
from specdec.model.step.draft_loop import LoopBuffers
from specdec.model.step.sampling import SamplingParams, seed_unseeded
from specdec.model.step.static_step import StaticDecoder
from specdec.spec_decode.proposal import ProposeInput
from specdec.spec_decode.proposers import DraftModelProposer

Q_ATOL = 1e-5  # fp32: the loop's key axis is padded, which reassociates the softmax sums

ROWS = {  # seq id -> (prompt length, k, params)
    "greedy": (7, 4, SamplingParams(temperature=0.0)),
    # Unseeded: a seeded row drafts eagerly (its guesses come from the seeded race, see
    # test_seeded_rows_draft_eagerly); both proposers get the same unseeded streams below.
    "hot": (12, 3, SamplingParams(temperature=1.3)),
    "warm": (5, 1, SamplingParams(temperature=0.7)),
}


def _pair(path, **kw) -> tuple[DraftModelProposer, DraftModelProposer]:
    model = Decoder.from_checkpoint(path, torch.float32)
    return (DraftModelProposer(model, 4, 96, **kw),
            DraftModelProposer(StaticDecoder(model), 4, 96, **kw))


def _rounds(eager: DraftModelProposer, looped: DraftModelProposer, rows=ROWS, n=4):
    """n rounds on both proposers over the same contexts: after each round every row keeps
    part of its guesses and adds a token of its own (a rejection or a bonus), so the next
    round rolls the draft's cache back. Returns how many guesses were compared."""
    g = torch.Generator().manual_seed(0)
    contexts = {s: torch.randint(3, 96, (length,), generator=g).tolist()
                for s, (length, _, _) in rows.items()}
    compared, before = 0, looped._loop.loop_rounds
    for r in range(n):
        inputs = [ProposeInput(s, list(contexts[s]), k, p) for s, (_, k, p) in rows.items()]
        seed_unseeded(11)  # each proposer's rows draw from the same streams
        want = eager.propose(inputs)
        seed_unseeded(11)
        got = looped.propose(inputs)
        for inp, w, o in zip(inputs, want, got, strict=True):
            assert o.token_ids == w.token_ids, (r, inp.seq_id)
            assert (o.q_ids is None) == (w.q_ids is None), inp.seq_id
            if w.q_ids is not None:
                assert torch.equal(o.q_ids, w.q_ids), (r, inp.seq_id)
                assert torch.allclose(o.q_probs, w.q_probs, atol=Q_ATOL), (r, inp.seq_id)
            compared += len(w.token_ids)
            keep = (r + len(inp.seq_id)) % (len(w.token_ids) + 1)
            contexts[inp.seq_id] += w.token_ids[:keep] + [int(torch.randint(3, 96, (1,),
                                                                          generator=g))]
    assert looped._loop.loop_rounds - before == n, "the looped proposer drafted eagerly"
    return compared


def test_looped_round_equals_eager_greedy_sampled_mixed_with_rollback(tiny_checkpoint):
    eager, looped = _pair(tiny_checkpoint)
    assert _rounds(eager, looped) > 20


def test_looped_round_equals_eager_greedy_draft_and_narrowed_vocabulary(tiny_llama):
    eager, looped = _pair(tiny_llama, sampling="greedy", vocab_limit=64)
    _rounds(eager, looped)


@pytest.mark.parametrize("q_top_m", [None, 5])
def test_looped_round_equals_eager_with_confidence_cut_and_top_m(tiny_llama, q_top_m):
    """The confidence rule cuts rows short of their k: the loop runs them to the batch's k
    and the host cuts them where the eager loop stopped."""
    eager, looped = _pair(tiny_llama, confidence_threshold=0.05, q_top_m=q_top_m)
    rows = {s: (n, 5, p) for s, (n, _, p) in ROWS.items()}
    compared = _rounds(eager, looped, rows)
    assert compared < 5 * len(rows) * 4, "nothing cut: the confidence threshold is too low"


def test_top_k_rows_draft_eagerly(tiny_llama):
    eager, looped = _pair(tiny_llama)
    rows = {"cut": (6, 3, SamplingParams(temperature=1.0, top_k=5))}
    inputs = [ProposeInput(s, list(range(3, 3 + n)), k, p) for s, (n, k, p) in rows.items()]
    seed_unseeded(3)
    want = eager.propose(inputs)[0].token_ids
    seed_unseeded(3)
    assert looped.propose(inputs)[0].token_ids == want
    assert looped._loop.loop_rounds == 0


def test_seeded_rows_draft_eagerly(tiny_llama):
    """A seeded row's guesses are the seeded race's winners (specdec/model/step/seeded.py), the
    same whichever path drafts them: the loop leaves such rows to the eager step."""
    eager, looped = _pair(tiny_llama)
    inputs = [ProposeInput("seeded", list(range(3, 9)), 3,
                           SamplingParams(temperature=0.9, seed=5))]
    assert looped.propose(inputs)[0].token_ids == eager.propose(inputs)[0].token_ids
    assert looped._loop.loop_rounds == 0


def test_padded_rows_writing_a_real_slot_are_caught(tiny_llama, monkeypatch):
    """The wrong shortcut (the loop's padded rows writing slot 0, a live sequence's, not
    the scratch slot) must break the equality: three rows pad to a bucket of four."""
    init = LoopBuffers.__init__

    def leaky(self, shape, vocab, scratch, device):
        init(self, shape, vocab, 0, device)

    monkeypatch.setattr(LoopBuffers, "__init__", leaky)
    eager, looped = _pair(tiny_llama)
    with pytest.raises(AssertionError):
        _rounds(eager, looped)


def test_compiled_loop_is_one_graph_per_shape_without_recompiling(tiny_llama):
    """fullgraph=True: a graph break raises. Rounds of one shape (rows bucket, key bucket,
    k) compile once however their contents and positions move; a new k compiles again."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    model = Decoder.from_checkpoint(tiny_llama, torch.float32)
    eager = DraftModelProposer(model, 4, 96, sampling="greedy")
    looped = DraftModelProposer(StaticDecoder(model, compile=True, backend=counter), 4, 96,
                                sampling="greedy")
    rows = {"a": (6, 3, SamplingParams(temperature=0.0)),
            "b": (9, 3, SamplingParams(temperature=0.0))}
    static = looped._loop
    _rounds(eager, looped, rows, n=4)
    # One graph per catch-up step bucket (the prefill, then queries of 1 or 2) and one per
    # loop shape: the rounds of a shape share theirs.
    assert len(static.loop_buffers) == 1 and static.loop_rounds == 4
    frames = counter.frame_count
    assert frames == len(static._buffers) + len(static.loop_buffers), frames
    _rounds(eager, looped, rows, n=3)
    assert counter.frame_count == frames, "a round of a shape already seen recompiled"
    rows = {s: (n, 2, p) for s, (n, _, p) in rows.items()}
    _rounds(eager, looped, rows, n=1)
    assert counter.frame_count > frames  # k = 2: a new loop shape


def test_inductor_compiled_loop_equals_eager(tiny_llama):
    """The real compiler (inductor's generated C++ on CPU) over a sampled round. Prompts
    longer than a static query, so their prefill runs eager and only the loop compiles."""
    torch._dynamo.reset()
    model = Decoder.from_checkpoint(tiny_llama, torch.float32)
    eager = DraftModelProposer(model, 4, 96)
    looped = DraftModelProposer(StaticDecoder(model, compile=True), 4, 96)
    rows = {"hot": (12, 3, SamplingParams(temperature=1.0)),
            "greedy": (14, 3, SamplingParams(temperature=0.0))}
    _rounds(eager, looped, rows, n=1)


def test_a_one_rank_group_drafts_in_loops_a_wider_one_step_by_step(tiny_llama):
    """The draft as a Ray actor drives its model through the group's leader: alone on its
    rank it runs the loop; with followers (who could not follow a loop) it does not."""
    from types import SimpleNamespace

    from specdec.model.step.draft_loop import loop_decoder
    from specdec.model.step.parallel import Group, LeaderDecoder

    model = Decoder.from_checkpoint(tiny_llama, torch.float32)
    static = StaticDecoder(Group(0, 1, "tcp://127.0.0.1:1", "cpu", 10).attach(model))
    leader = LeaderDecoder(static, SimpleNamespace(world=1), static.new_cache(4, 96))
    looped = DraftModelProposer(leader, 4, 96)
    assert looped._loop is static
    _rounds(DraftModelProposer(model, 4, 96), looped, n=2)
    assert loop_decoder(LeaderDecoder(static, SimpleNamespace(world=2), leader.cache)) is None
