"""The prefix cache's bookkeeping: which slot a new sequence takes, how much of it is reused,
what is copied and what is evicted (specdec/model/step/prefix_cache.py)."""

from __future__ import annotations

import numpy as np

from specdec.model.step.prefix_cache import COPY_MIN_TOKENS, PrefixCache, common_prefix


def test_common_prefix():
    a = np.array([1, 2, 3, 4])
    assert common_prefix(a, np.array([1, 2, 9])) == 2
    assert common_prefix(a, a[:3]) == 3
    assert common_prefix(a, np.array([], dtype=np.int64)) == 0
    assert common_prefix(a, np.array([7])) == 0


def test_a_miss_then_a_hit_in_the_same_slot_leaving_the_last_token_to_compute():
    pc = PrefixCache(4)
    first = pc.choose([5, 6, 7], free=[0, 1, 2, 3])
    assert first.reuse == 0 and first.copy_from is None
    pc.release(first.slot, [5, 6, 7, 8, 9])          # prompt + output
    again = pc.choose([5, 6, 7, 8, 9, 10], free=[0, 1, 2, 3])
    assert again.slot == first.slot and again.reuse == 5
    # The whole prompt held: the last token is still computed (its logits are the output).
    pc.release(again.slot, [5, 6, 7, 8, 9, 10])
    same = pc.choose([5, 6, 7, 8, 9, 10], free=[0, 1, 2, 3])
    assert same.reuse == 5
    assert pc.stats.hits == 2 and pc.stats.tokens_reused == 10 and pc.stats.lookups == 3


def test_the_longest_prefix_wins_and_a_miss_evicts_the_least_recently_used():
    pc = PrefixCache(3)
    for slot, held in enumerate([[1, 2, 3], [1, 2, 3, 4, 5], [9, 9]]):
        pc.choose([0], free=[slot])
        pc.release(slot, held)
    assert pc.choose([1, 2, 3, 4, 5, 6], free=[0, 1, 2]).slot == 1
    # A miss takes the slot used longest ago (slot 0), evicting what it held.
    miss = pc.choose([42, 43], free=[0, 2])
    assert miss.slot == 0 and miss.reuse == 0 and miss.evicted == 3
    assert pc.stats.evictions == 1


def test_a_prefix_held_by_a_running_slot_is_copied_when_worth_it():
    pc = PrefixCache(3)
    system = list(range(100, 100 + 3 * COPY_MIN_TOKENS))
    running = {0: np.array(system + [7, 8])}
    c = pc.choose(system + [1, 2], free=[1, 2], running=running)
    assert c.copy_from == 0 and c.reuse == len(system) and c.slot in (1, 2)
    assert pc.stats.copies == 1
    # A few tokens are not worth a copy: computed instead.
    short = {0: np.array([100, 101, 102])}
    assert pc.choose([100, 101, 102, 5, 6], free=[2], running=short).copy_from is None


def test_the_same_short_prompt_again_is_cached_without_costing_a_conversation():
    """A repeated prompt shorter than a worthwhile copy still finds all but its last token
    (copied into the empty slot, the conversation kept); and the slot given up keeps in
    place whatever prefix it holds itself."""
    pc = PrefixCache(2)
    pc.choose([0], free=[0])
    conversation = [5, 6, 7, 8, 9, 10] + list(range(200, 240))
    pc.release(0, conversation)
    again = pc.choose([5, 6, 7, 8, 9, 10], free=[0, 1])
    assert (again.slot, again.reuse, again.copy_from) == (1, 5, 0)
    pc.release(1, [5, 6, 7, 8, 9, 10, 11])
    # The only free slot holds a prefix of less than half its content: given up, it keeps
    # that prefix in place (nothing to copy from).
    c = pc.choose(conversation[:20] + [1], free=[0])
    assert (c.slot, c.reuse, c.copy_from) == (0, 20, None)


def test_a_prefilling_sequence_finds_what_another_computed_meanwhile():
    pc = PrefixCache(2)
    prompt = list(range(3 * COPY_MIN_TOKENS))
    assert pc.source(prompt, 0, {0: np.array(prompt[:COPY_MIN_TOKENS - 1])}) is None
    assert pc.source(prompt, 0, {0: np.array(prompt[:2 * COPY_MIN_TOKENS])}) == \
        (0, 2 * COPY_MIN_TOKENS)
    # Never the whole prompt: its last token's logits are computed.
    assert pc.source(prompt, 0, {1: np.array(prompt + [5])}) == (1, len(prompt) - 1)


def test_turned_off_or_cleared_it_reuses_nothing():
    off = PrefixCache(2, enabled=False)
    off.release(0, [1, 2, 3])
    assert off.choose([1, 2, 3, 4], free=[0, 1]).reuse == 0
    pc = PrefixCache(2)
    pc.release(0, [1, 2, 3])
    pc.clear()
    assert pc.choose([1, 2, 3, 4], free=[0, 1]).reuse == 0
    assert pc.held_tokens() == 0


def test_a_few_shared_tokens_never_cost_another_conversation_its_slot():
    """Two conversations share a chat template's head; the second takes an empty slot
    instead of overwriting the first one's history to save those tokens."""
    pc = PrefixCache(3)
    head = [1, 2, 3]
    first = pc.choose(head + [10] * 40, free=[0, 1, 2])
    pc.release(first.slot, head + [10] * 60)
    second = pc.choose(head + [20] * 40, free=[0, 1, 2])
    assert second.slot != first.slot and second.reuse == 0
    pc.release(second.slot, head + [20] * 60)
    again = pc.choose(head + [10] * 70, free=[0, 1, 2])
    assert again.slot == first.slot and again.reuse == 63


def test_tenants_reuse_and_copy_only_their_own_slots():
    """A slot remembers whose tokens it holds: another tenant's identical prompt reuses
    nothing of it, held free or running, in place or by copy; the same tenant's does. No
    tenant (a deployment with one) shares with no tenant."""
    pc = PrefixCache(4)
    prompt = list(range(100, 100 + 3 * COPY_MIN_TOKENS))
    first = pc.choose(prompt, free=[0, 1, 2, 3], tenant="alice")
    running = {first.slot: np.array(prompt)}
    bob = pc.choose(prompt, free=[1, 2, 3], running=running, tenant="bob")
    assert (bob.reuse, bob.copy_from) == (0, None)
    alice = pc.choose(prompt, free=[2, 3], running=running, tenant="alice")
    assert (alice.reuse, alice.copy_from) == (len(prompt) - 1, first.slot)
    pc.release(first.slot, prompt)
    # Held by a free slot now: Bob's next try finds nothing in place either.
    again = pc.choose(prompt + [7], free=[first.slot, 3], tenant="bob")
    assert again.reuse == 0 and again.copy_from is None
    # A prefilling sequence copies only from its own tenant's running slots.
    assert pc.source(prompt + [1], 0, {alice.slot: np.array(prompt)}, tenant="bob") is None
    assert pc.source(prompt + [1], 0, {alice.slot: np.array(prompt)},
                     tenant="alice") == (alice.slot, len(prompt))
    shared = PrefixCache(2)
    shared.choose(prompt, free=[0, 1])
    shared.release(0, prompt)
    assert shared.choose(prompt, free=[0, 1]).reuse == len(prompt) - 1
