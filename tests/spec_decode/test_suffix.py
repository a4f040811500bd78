"""The suffix index and proposer (specdec/spec_decode/suffix.py): matching across requests,
the guess length following the match, the latest occurrence winning, bounded memory with
old entries overwritten, and a sequence fed incrementally indexing what it would whole."""

from __future__ import annotations

import numpy as np

from specdec.model.step.sampling import SamplingParams
from specdec.spec_decode.proposal import ProposeInput
from specdec.spec_decode.suffix import SuffixIndex, SuffixProposer, ngram_hashes

GREEDY = SamplingParams(temperature=0.0)


def test_hashes_depend_on_order_and_length():
    a = ngram_hashes(np.array([5, 6, 7, 8]), 2)
    assert len(a) == 3 and len(set(a.tolist())) == 3
    assert ngram_hashes(np.array([6, 5]), 2)[0] != a[0]
    assert ngram_hashes(np.array([5, 6]), 3).size == 0
    # The same tokens at another order never share an entry.
    assert ngram_hashes(np.array([5, 6, 7]), 3)[0] != ngram_hashes(np.array([5, 6]), 2)[0]


def test_another_requests_output_is_guessed_as_far_as_the_match_earns():
    index = SuffixIndex(min_n=2, max_n=6)
    earlier = list(range(100, 160))
    index.feed(earlier)
    # A new request ending with 6 tokens of it: guesses continue it, up to 2 x 6 tokens.
    guesses, n = index.lookup([1, 2, 3] + earlier[10:16], k=20, spec_factor=2.0)
    assert n == 6 and guesses == earlier[16:28]
    # With only 2 tokens matched (seen once, below min_count for short n-grams): nothing.
    assert index.lookup([9, 9] + earlier[30:32], k=8, min_count=2) == ([], 0)
    # ... but a 2-gram seen twice is trusted, for 2 x 2 tokens.
    index.feed([7, 8, 42, 43, 44, 45, 46])
    index.feed([7, 8, 42, 43, 44, 45, 46])
    assert index.lookup([1, 7, 8], k=8, min_count=2) == ([42, 43, 44, 45], 2)


def test_the_latest_occurrence_wins_and_old_entries_are_overwritten():
    index = SuffixIndex(min_n=3, max_n=3, bits=4)  # 16 slots: collisions certain
    index.feed([1, 2, 3, 10])
    assert index.lookup([1, 2, 3], k=1) == ([10], 3)
    index.feed([1, 2, 3, 11])
    assert index.lookup([1, 2, 3], k=1) == ([11], 3)
    for s in range(50):  # a flood of other text through a table this small
        index.feed(list(range(200 + s * 7, 200 + s * 7 + 7)))
    assert index.keys.nbytes == 16 * 8 and index.fed_tokens == 6 + 50 * 6  # bounded
    assert np.count_nonzero(index.keys) <= 16


def test_feeding_in_pieces_indexes_what_feeding_whole_does():
    rng = np.random.default_rng(0)
    seq = rng.integers(3, 50, 60).tolist()  # few entries in many slots: no collisions
    whole, parts = SuffixIndex(2, 5), SuffixIndex(2, 5)
    whole.feed(seq)
    fed = 0
    for end in (7, 8, 30, 31, 60):
        parts.feed(seq[:end], fed)
        fed = end
    assert np.array_equal(whole.keys, parts.keys) and np.array_equal(whole.next, parts.next)


def test_the_proposer_takes_the_longer_match_of_its_own_context_and_the_index():
    p = SuffixProposer(min_n=2, max_n=6, min_count=1)
    done = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]
    p.propose([ProposeInput("a", done, 0, GREEDY)])          # request a's text is indexed
    p.release("a")
    # Request b repeats a's text after a prompt of its own: guessed from the index.
    b = [5, 6, 7] + done[:6]
    assert p.propose([ProposeInput("b", b, 4, GREEDY)])[0].token_ids == done[6:10]
    assert p.stats["from_index"] == 1
    # Its own context matching longer than the index does: prompt lookup wins.
    own = [9, 8, 7, 6, 5, 4, 3, 21, 9, 8, 7, 6, 5, 4]
    assert p.propose([ProposeInput("c", own, 3, GREEDY)])[0].token_ids == [3, 21, 9]
    # Not shared: only the request's own context.
    alone = SuffixProposer(min_n=2, max_n=6, min_count=1, shared=False)
    alone.propose([ProposeInput("a", done, 0, GREEDY)])
    assert alone.propose([ProposeInput("b", b, 4, GREEDY)])[0].token_ids == []


def test_forgetting_empties_the_index_and_a_running_row_is_fed_again_whole():
    p = SuffixProposer(min_n=2, max_n=6, min_count=1)
    done = list(range(300, 320))
    p.propose([ProposeInput("a", done, 0, GREEDY)])
    assert p.index.lookup(done[:6], k=4)[0] == done[6:10]
    p.forget()
    assert p.index.fed_tokens == 0 and p.index.lookup(done[:6], k=4) == ([], 0)
    # Row a keeps running: its next round feeds its whole context, not only the new token.
    p.propose([ProposeInput("a", done + [999], 0, GREEDY)])
    assert p.index.fed_tokens == len(done)
    assert p.index.lookup(done[:6], k=4)[0] == done[6:10]


def test_a_tenant_guesses_only_from_its_own_requests():
    p = SuffixProposer(min_n=2, max_n=6, min_count=1, plain_rows_k=6)
    done = list(range(400, 420))
    # Alice's finished request, observed as the engine does (whatever method served it).
    p.observe("a", done, "alice")
    p.release("a")
    follow = [5, 6, 7] + done[:6]
    ask = lambda rid, who, k=4: ProposeInput(rid, follow, k, GREEDY, tenant=who)  # noqa: E731
    # Alice's next request continues her text; Bob's, with the same context, gets nothing
    # from her (the salted hashes never meet), nor does a request of no tenant.
    assert p.propose([ask("b", "alice")])[0].token_ids == done[6:10]
    assert p.propose([ask("c", "bob")])[0].token_ids == []
    assert p.propose([ask("d", None)])[0].token_ids == []
    # Free guesses (plainly decoding rows) follow the same partition.
    assert p.propose_confident([ask("e", "alice")])[0].token_ids == done[6:10]
    assert p.propose_confident([ask("f", "bob")])[0].token_ids == []
    # Bob's own text is his: once fed, he is guessed from it.
    p.observe("h", [1, 2] + done, "bob")
    assert p.propose([ask("i", "bob")])[0].token_ids == done[6:10]
    p.forget()
    assert p.propose([ask("j", "alice")])[0].token_ids == []
    # No tenant (a deployment with one) is a partition of its own, shared by all such
    # requests, and no tenant's lookups reach it.
    p.observe("k", done, None)
    assert p.propose([ask("l", None)])[0].token_ids == done[6:10]
    assert p.propose([ask("m", "alice")])[0].token_ids == []
    # A request that is its own tenant (it names nobody) reads and feeds nothing: its
    # entries could never be read by another request.
    fed = p.index.fed_tokens
    assert p.propose([ask("n", "alone:n")])[0].token_ids == []
    p.observe("n", [7, 7] + done, "alone:n")
    assert p.index.fed_tokens == fed
