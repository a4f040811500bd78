"""A drafting row whose method and k the policy chose takes the suffix index's guesses
instead of the draft's in a round where the index offers at least k confident ones (a
copied file, a repeated answer): free, no draft forward. Where it offers fewer, they lead
the round and the draft extends them. Exact like any guess: greedy
output equals plain token for token, sampled output keeps the target's distribution; a
request that named its method or k keeps the draft every round."""

from __future__ import annotations

import collections
import dataclasses

import torch
from engine_helpers import (
    BIG_QUEUE,
    contingency_pvalue,
    first_three_counts,
    greedy,
    make_engine,
    plain_reference,
    random_prompts,
)

from specdec.engine.output import record_headed_round
from specdec.engine.planner import _head_pays, head_then_draft
from specdec.engine.request import Request
from specdec.engine.state import Seq
from specdec.spec_decode.counters import SpecCounters
from specdec.spec_decode.proposal import Proposal
from specdec.spec_decode.speculation import Speculation
from specdec.spec_decode.suffix import SuffixProposer


def _engine(target, draft, slots=8):
    engine = make_engine(target, draft, slots=slots, limits=BIG_QUEUE,
                         suffix=SuffixProposer(min_count=1, plain_rows_k=6))
    engine.choose_k = lambda eng, req, spec, running, **_: 2  # the policy's k: 2
    return engine


def test_a_repeated_answer_is_guessed_from_the_index_not_drafted(tiny_llama,
                                                                   tiny_llama_far_draft):
    prompt = random_prompts((12,), seed=41)[0]
    expected = plain_reference(tiny_llama, [prompt], 40)[0]
    engine = _engine(tiny_llama, tiny_llama_far_draft)
    first = engine.run([Request("first", prompt, greedy(40), "draft", 2)])["first"]
    again = engine.run([Request("again", prompt, greedy(40), "draft", 2)])["again"]
    assert first.token_ids == expected and again.token_ids == expected
    # The second sees its whole answer in the index: most of it verified as free guesses,
    # and far fewer draft rounds than the first needed.
    assert again.free_accepted >= 20, again
    assert again.spec.rounds < first.spec.rounds / 2, (again.spec, first.spec)


def test_a_named_method_or_k_keeps_the_draft(tiny_llama, tiny_llama_far_draft):
    prompt = random_prompts((12,), seed=42)[0]
    expected = plain_reference(tiny_llama, [prompt], 30)[0]
    for pin in ({"speculation": Speculation(method="draft")}, {"speculation": Speculation(k=2)}):
        engine = _engine(tiny_llama, tiny_llama_far_draft)
        engine.run([Request("first", prompt, greedy(30), "draft", 2)])
        again = engine.run([dataclasses.replace(
            Request("again", prompt, greedy(30), "draft", 2), **pin)])["again"]
        assert again.token_ids == expected
        assert again.free_guesses == 0 and again.spec.drafted > 0, (pin, again)


def test_rows_of_a_batch_led_by_the_index_say_what_plain_says(tiny_llama, tiny_llama_draft):
    spans = random_prompts((9, 7), seed=43)
    prompts = [spans[0] + spans[1], spans[1] + spans[0] + spans[1], spans[0] + spans[1],
               spans[1] + spans[0]]
    expected = plain_reference(tiny_llama, prompts, 32)
    engine = _engine(tiny_llama, tiny_llama_draft, slots=2)
    out = engine.run([Request(f"r{i}", p, greedy(32), "draft", 2)
                      for i, p in enumerate(prompts)])
    for i, e in enumerate(expected):
        assert out[f"r{i}"].token_ids == e, f"request {i}"
    assert engine.totals["suffix"].rounds > 0


def test_sampled_rows_led_by_the_index_keep_the_target_distribution(tiny_llama,
                                                                     tiny_llama_far_draft):
    n = 3000
    counts, engine = first_three_counts(lambda: _engine(tiny_llama, tiny_llama_far_draft),
                                        "draft", 2, n, 1.0)
    plain_counts, _ = first_three_counts(lambda: make_engine(tiny_llama, limits=BIG_QUEUE),
                                         "none", 0, n, 1.0)
    led = engine.totals["suffix"]
    assert led.drafted > n // 4 and 0 < led.accepted < led.drafted, led
    assert contingency_pvalue(counts, plain_counts) > 1e-3


def test_a_policy_probe_runs_the_draft_rounds_it_probes(tiny_llama, tiny_llama_far_draft):
    """A probe times the draft's round at some k: rounds the index led would time nothing
    (review finding), so no row is led while the policy probes."""
    prompt = random_prompts((12,), seed=44)[0]
    expected = plain_reference(tiny_llama, [prompt], 30)[0]
    engine = _engine(tiny_llama, tiny_llama_far_draft)
    engine.run([Request("first", prompt, greedy(30), "draft", 2)])
    led = engine.totals["suffix"].rounds
    # As the policy does: choose_k plans the step's probe (here every other step), and
    # the engine asks whether it probes after choosing k.
    probe = {}

    def choose_k(eng, req, spec, running, **_):
        probe["now"] = eng.steps % 2 == 1
        return 2

    engine.choose_k, engine.probing = choose_k, lambda: probe.get("now")
    drafted: list[tuple[bool, int]] = []
    engine.on_step.append(lambda rec: drafted.append((probe.get("now"), rec.draft_rows)))
    again = engine.run([Request("again", prompt, greedy(30), "draft", 2)])["again"]
    assert again.token_ids == expected
    probed = [rows for now, rows in drafted if now]
    assert probed and all(rows == 1 for rows in probed), drafted
    assert engine.totals["suffix"].rounds > led  # led between the probes


def test_the_overlap_chooser_sees_steps_the_index_led(tiny_llama, tiny_llama_far_draft):
    """overlap auto compares sequential and overlapped steps; a sequential step whose rows
    the index all led is speculative too (and only sequential steps can be led)."""
    prompt = random_prompts((12,), seed=45)[0]
    engine = make_engine(tiny_llama, tiny_llama_far_draft, slots=2, limits=BIG_QUEUE,
                         suffix=SuffixProposer(min_count=1, plain_rows_k=6), overlap="auto")
    engine.choose_k = lambda eng, req, spec, running, **_: 2
    engine.overlap.chooser.block = 10_000  # sequential steps only: the index may lead
    engine.run([Request("first", prompt, greedy(30), "draft", 2)])
    seen, before = engine.overlap.chooser.steps[False], engine.steps
    engine.run([Request("again", prompt, greedy(30), "draft", 2)])
    observed = engine.overlap.chooser.steps[False] - seen
    steps = list(engine.history)[-(engine.steps - before):]
    drafted = sum(1 for r in steps if r.draft_rows)
    assert engine.totals["suffix"].rounds > 0 and not any(r.overlapped for r in steps)
    assert observed > drafted, (observed, drafted)


def test_tenants_partition_the_index_and_the_prefix_caches_and_say_the_same(
        tiny_llama, tiny_llama_far_draft):
    prompt = random_prompts((12,), seed=44)[0]
    expected = plain_reference(tiny_llama, [prompt], 40)[0]
    engine = make_engine(tiny_llama, tiny_llama_far_draft, slots=8, limits=BIG_QUEUE,
                         suffix=SuffixProposer(min_count=1, plain_rows_k=6))
    engine.choose_k = lambda eng, req, spec, running, **_: 2

    def ask(rid, tenant):
        req = dataclasses.replace(Request(rid, prompt, greedy(40), "draft", 2), tenant=tenant)
        return engine.run([req])[rid]

    reused = engine.proposers["draft"].prefixes.stats  # the draft's own prefix cache
    first = ask("first", "alice")
    before = (reused.lookups, reused.tokens_reused)
    bob = ask("bob", "bob")
    bobs_draft = (reused.lookups - before[0], reused.tokens_reused - before[1])
    alice = ask("alice", "alice")
    assert first.token_ids == bob.token_ids == alice.token_ids == expected
    # Bob's request never sees Alice's answer: no more free guesses than her first had
    # (its own context only), drafted as hers was; her own repeat is guessed from the index.
    # Bob's request goes exactly as Alice's first did, as if she had never sent it: the
    # same free guesses (the counters a response reports), the same rounds.
    assert (bob.free_guesses, bob.free_accepted, bob.spec.rounds, bob.spec.drafted) == \
        (first.free_guesses, first.free_accepted, first.spec.rounds, first.spec.drafted)
    assert alice.free_accepted >= 20 and alice.spec.rounds < bob.spec.rounds / 2, (alice, bob)
    # The target's prefix cache: Bob's prompt, Alice's exactly, reuses none of her K/V (the
    # client would see it as cached_tokens); her own repeat reuses all but its last token.
    assert bob.cached_tokens == 0 and alice.cached_tokens == len(prompt) - 1, (bob, alice)
    # The draft's cache likewise (its catch-up of the prompt included): Bob's sequence
    # started there and reused nothing of Alice's.
    assert bobs_draft == (1, 0), bobs_draft


def _headed_engine(target, draft, slots=8, offered=2, k=4):
    """The index offers at most `offered` guesses where the policy's k is `k`: a round it
    leads takes its guesses first and the draft's after them."""
    engine = make_engine(target, draft, slots=slots, limits=BIG_QUEUE,
                         suffix=SuffixProposer(min_count=1, plain_rows_k=offered))
    engine.choose_k = lambda eng, req, spec, running, **_: k
    return engine


def test_the_draft_extends_fewer_guesses_than_k_and_output_says_what_plain_says(
        tiny_llama, tiny_llama_far_draft):
    prompt = random_prompts((12,), seed=46)[0]
    expected = plain_reference(tiny_llama, [prompt], 40)[0]
    engine = _headed_engine(tiny_llama, tiny_llama_far_draft)
    first = engine.run([Request("first", prompt, greedy(40), "draft", 4)])["first"]
    before = engine.steps
    asked: list[int] = []
    engine.on_step.append(lambda rec: asked.append(rec.draft_k))
    again = engine.run([Request("again", prompt, greedy(40), "draft", 4)])["again"]
    assert first.token_ids == expected and again.token_ids == expected
    # The second finds its answer in the index two guesses at a time: the draft is asked
    # only for the other two of the round's four, and both proposers' guesses are kept.
    assert engine.steps > before and 2 in asked and again.free_accepted >= 10, (asked, again)
    assert again.spec.accepted > 0 and engine.totals["draft"].rounds > first.spec.rounds


def test_rows_of_a_batch_headed_by_the_index_say_what_plain_says(tiny_llama, tiny_llama_draft):
    spans = random_prompts((9, 7), seed=47)
    prompts = [spans[0] + spans[1], spans[1] + spans[0] + spans[1], spans[0] + spans[1],
               spans[1] + spans[0]]
    expected = plain_reference(tiny_llama, prompts, 32)
    engine = _headed_engine(tiny_llama, tiny_llama_draft, slots=2, offered=1, k=3)
    out = engine.run([Request(f"r{i}", p, greedy(32), "draft", 3)
                      for i, p in enumerate(prompts)])
    for i, e in enumerate(expected):
        assert out[f"r{i}"].token_ids == e, f"request {i}"
    assert engine.totals["suffix"].rounds > 0 and engine.totals["draft"].rounds > 0


def test_sampled_rows_headed_by_the_index_keep_the_target_distribution(tiny_llama,
                                                                       tiny_llama_far_draft):
    """One guess the index's (one-hot q) and one the draft's, drawn after it (its own q):
    the first three tokens keep the target's distribution, although the index, fed the
    earlier requests' sampled replies, often guesses wrong. (With the draft's q rows put
    before the index's, so each guess is verified against another position's q, this
    fails.)"""
    n = 3000
    counts, engine = first_three_counts(
        lambda: _headed_engine(tiny_llama, tiny_llama_far_draft, offered=1, k=2),
        "draft", 2, n, 1.0)
    plain_counts, _ = first_three_counts(lambda: make_engine(tiny_llama, limits=BIG_QUEUE),
                                         "none", 0, n, 1.0)
    headed, drafted = engine.totals["suffix"], engine.totals["draft"]
    assert headed.drafted > n // 4 and 0 < headed.accepted < headed.drafted, headed
    assert drafted.drafted > n // 8 and 0 < drafted.accepted < drafted.drafted, drafted
    assert contingency_pvalue(counts, plain_counts) > 1e-3


def test_a_headed_proposal_puts_one_hot_q_at_the_indexs_guesses_and_the_drafts_after():
    drafted = Proposal([7, 9], torch.tensor([[7, 3, 1], [9, 4, 2]]),
                       torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.4, 0.0]]))
    p = head_then_draft([11, 12], drafted)
    assert p.token_ids == [11, 12, 7, 9]
    assert p.q_ids[:2, 0].tolist() == [11, 12] and p.q_probs[:2].sum(-1).tolist() == [1, 1]
    assert p.q_probs[:2, 0].tolist() == [1, 1]
    assert torch.equal(p.q_ids[2:], drafted.q_ids) and torch.equal(p.q_probs[2:], drafted.q_probs)
    assert head_then_draft([11], Proposal([7])).q_probs is None  # all one-hot
    assert head_then_draft([11], None).token_ids == [11]  # the draft failed: the index's


def test_a_headed_rounds_guesses_count_for_their_own_proposers():
    def headed(kept, drafted=4, head=2):
        seq = Seq(Request("r", [1, 2], greedy(8), "draft", 4), 0, [1, 2], 2)
        totals = collections.defaultdict(SpecCounters)
        record_headed_round(seq, totals, head, drafted, kept, kept + 1)
        return seq, totals

    seq, totals = headed(kept=3)  # both of the index's kept, one of the draft's two
    assert (seq.free.drafted, seq.free.accepted) == (2, 2)
    assert (seq.spec.drafted, seq.spec.accepted, seq.spec.rejections) == (2, 1, 1)
    assert totals["suffix"].accepted == 2 and totals["draft"].accepted == 1
    assert seq.free.emitted + seq.spec.emitted == 4
    seq, totals = headed(kept=1)  # rejected among the index's: the draft's never tried
    assert (seq.free.drafted, seq.free.accepted, seq.spec.rounds) == (2, 1, 0)
    assert totals["draft"].rounds == 0


def test_the_index_heads_a_draft_round_only_while_it_is_kept_as_often_as_the_draft():
    seq = Seq(Request("r", [1, 2], greedy(8), "draft", 4), 0, [1, 2], 2)
    assert _head_pays(seq)  # untried: tried
    for _ in range(4):
        seq.spec.record_round(3, 3, 4)  # the draft: 12 of 12 kept
        seq.free.record_round(2, 1, 2)  # the index: 4 of 8 tried kept
    assert not _head_pays(seq)
    for _ in range(40):
        seq.free.record_round(2, 2, 2)
    assert not _head_pays(seq)  # 84 of 88: still under the draft's 12 of 12
    seq.spec.record_round(3, 0, 1)
    assert _head_pays(seq)  # 12 of 13 against 84 of 88


def test_free_guesses_stop_when_under_half_of_those_tested_are_kept(tiny_llama):
    engine = make_engine(tiny_llama, limits=BIG_QUEUE,
                         suffix=SuffixProposer(min_count=1, plain_rows_k=12))
    seq = Seq(Request("r", [1, 2], greedy(64), "none", 0), 0, [1, 2], 2)
    assert engine._k_free(seq, 1) == 12
    for _ in range(3):  # 12 guesses a round, the 4th rejected: 9 of 12 tested kept
        seq.free.record_round(12, 3, 4)
    assert engine._k_free(seq, 1) == 12  # (3 of 12 verified: not a failing index)
    for _ in range(4):
        seq.free.record_round(12, 0, 1)  # rejected at once: 9 of 16 tested
    assert engine._k_free(seq, 1) == 12
    seq.free.record_round(12, 0, 1)
    seq.free.record_round(12, 0, 1)  # 9 of 18: half
    assert engine._k_free(seq, 1) == 12
    seq.free.record_round(12, 0, 1)  # 9 of 19: under half
    assert engine._k_free(seq, 1) == 0
